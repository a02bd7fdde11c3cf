"""Prepare and unprepare of ResourceClaims on this node: the work behind the kubelet's calls.

Flow position: plugin/ (gRPC) -> here -> cdi.py (spec files) + checkpoint.py (state).

Prepare of one claim (spec C.7, nvidia-compat.md "Checkpoint"):
1. Validate what the kubelet sent (the UID is a UUID, so it can safely name a file).
2. Hold the claim's lock; a claim already ``PrepareCompleted`` (with its spec on disk) returns the
   recorded answer without side effects (idempotent).
3. GET the ResourceClaim; refuse it when the UID differs, it is not allocated, or it is allocated
   to another node. Keep only results of our driver; every device must be one we have.
4. Decode our opaque configs (class configs, then claim configs; later wins) strictly; refuse a
   config this driver cannot carry out (time slicing of a MIG device; MPS without daemons, with
   admin access, or limits that do not fit the devices) rather than ignore it.
5. When a full GPU's config asks for a time-slice interval: record ``PrepareStarted`` (durably,
   refusing a device another claim holds, admin access aside, or an interval other than the one
   another claim on the GPU asks for), then set the GPU's time slice (timeslice.py); a failure
   rolls the claim back.
6. When devices ask for MPS: record ``PrepareStarted`` (durably), then start the claim's MPS
   control daemon (mps.py, mpsdaemon.py: compute mode, directories, tmpfs, Deployment, answer,
   limits); a failure rolls the claim back, daemon included.
7. A consumable share (an allocation result with ``shareID``, shares.py) is checked against
   what this node publishes; the first share of a device this process prepares records
   ``PrepareStarted`` and has the ShareEnforcer (mpsshares.py) start the device's shared MPS
   daemon.
8. Dynamic MIG devices (``--mig-mode=dynamic``): refuse a GPU with instances no record names,
   record ``PrepareStarted`` (durably), create each device's instance (instances.py); a
   failure rolls the claim back, its instances destroyed (docs/plugin.md "Dynamic MIG").
9. Write the CDI spec (with the driver files of the devices' ``driverCapabilities``; MPS
   devices also get the daemon's client env and mounts; one CDI device per share, with its MPS
   limits), record ``PrepareCompleted`` (with the same checks: shares of a device must fit it
   together); answer one Device per result.

Unprepare drops the claim from the checkpoint, then removes its spec, then sets the time slice of
GPUs it asked one of back to Default (or to what another claim on it asks) and stops its MPS
daemon; a claim with dynamic MIG devices has its spec removed, then its instances destroyed, then
its record dropped; an unknown claim succeeds. ``reconcile`` repairs what a crash, a reboot or a
damaged checkpoint left behind, time slices, MPS daemons (it adopts the daemons of prepared
claims at start and removes those of no claim) and MIG instances included.

Errors of one claim never fail the others: ``prepare_batch``/``unprepare_batch`` return a
per-claim outcome, and independent claims of a batch run concurrently.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal, Protocol

from dra_driver import cdi
from dra_driver.devices import gpu_device_name, mig_device_name, whole_gpu_offered
from dra_driver.errors import (
    CdiError,
    CheckpointError,
    ClaimFetchFailed,
    ClaimNotFound,
    ConfigDecodeError,
    ConfigNotSupported,
    DeviceConflict,
    DraError,
    ForeignMigInstances,
    KubeError,
    MigFailed,
    MpsFailed,
    PrepareError,
    ShareEnforcementFailed,
    TimeSliceFailed,
)
from dra_driver.fsutil import fsync_dir
from dra_driver.gpus.info import GpuInfo, Inventory, MigInstance
from dra_driver.mig import instances
from dra_driver.mig.modeswitch import MARKS_DIRECTORY, MigOffMarks
from dra_driver.prepare.checkpoint import (
    PREPARE_COMPLETED,
    PREPARE_STARTED,
    Checkpoint,
    ClaimLocks,
    ClaimRecord,
    Claims,
    Phase,
    PreparedDevice,
)
from dra_driver.sharing import mps, shares, timeslice

if TYPE_CHECKING:
    from dra_driver.prepare import deviceconfig
    from dra_driver.sharing.mpsdaemon import MpsDaemons

log = logging.getLogger(__name__)

_UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


class ClaimSource(Protocol):
    """Where ResourceClaims come from (kube.KubeClient in production)."""

    def get_resource_claim(self, *, namespace: str, name: str) -> dict[str, Any] | None:
        """The claim as v1-shaped JSON, or None when it does not exist."""
        ...


@dataclass(frozen=True)
class ClaimRef:
    """A claim as the kubelet names it in NodePrepareResources/NodeUnprepareResources."""

    namespace: str
    name: str
    uid: str


@dataclass(frozen=True)
class DeviceTarget:
    """A device of ours that a claim can be allocated: a full GPU, an existing MIG device, or
    (``--mig-mode=dynamic``) a MIG placement, whose instance (``mig``) may not exist yet, or the
    whole GPU of a partitionable GPU (``leaves_mig``: prepared out of MIG mode)."""

    name: str
    type: Literal["gpu", "mig"]
    gpu: GpuInfo
    mig: MigInstance | None = None
    dynamic: instances.DynamicSlot | None = None  # a dynamic MIG device: created on prepare
    leaves_mig: bool = False  # the whole GPU of a GPU in dynamic MIG mode

    @property
    def partitioned(self) -> bool:
        """Whether it is a device of a partitionable GPU (it consumes shared counters): a
        placement or the whole GPU. Such a device is never shared (shares.shareable)."""
        return self.dynamic is not None or self.leaves_mig

    def nodes(self, files: cdi.DriverFiles) -> tuple[cdi.DeviceNode, ...]:
        if self.mig is None:
            return cdi.gpu_nodes(files, minor=self.gpu.minor)
        return cdi.mig_nodes(
            files,
            parent_minor=self.gpu.minor,
            gpu_instance_id=self.mig.gpu_instance_id,
            compute_instance_id=self.mig.compute_instance_id,
        )


def device_targets(
    inventory: Inventory,
    mig_mode: Literal["static", "dynamic"] = "static",
    static_gpus: frozenset[str] = frozenset(),
) -> dict[str, DeviceTarget]:
    """Every device name of this node that a claim may be allocated, with what it is.

    Same names as devices.node_devices publishes: full GPUs not in MIG mode, existing MIG
    devices of GPUs in MIG mode; with ``mig_mode`` dynamic, a GPU in MIG mode offers instead
    every placement of every GPU-instance profile (an instance that exists
    is the dynamic device of its name, so a re-discovery never adds a second one) and, where
    devices.whole_gpu_offered says so, the whole GPU, which prepare takes out of MIG mode
    (docs/plugin.md "Dynamic MIG"). ``static_gpus`` (GPU device
    names): GPUs in MIG mode that stay static in dynamic mode because they have MIG devices the
    driver did not create (dynamicmig.ManagedMig.left_static): their existing MIG devices are
    targets, as published.
    """
    targets: dict[str, DeviceTarget] = {}
    for gpu in inventory.gpus:
        if not gpu.mig_enabled:
            name = gpu_device_name(gpu.minor)
            targets[name] = DeviceTarget(name, "gpu", gpu)
            continue
        if mig_mode == "dynamic" and gpu_device_name(gpu.minor) not in static_gpus:
            existing = {
                mig_device_name(
                    parent_minor=gpu.minor,
                    profile=mig.profile.name,
                    profile_id=mig.profile.profile_id,
                    placement_start=mig.placement.start,
                ): mig
                for mig in gpu.mig_instances
            }
            if whole_gpu_offered(gpu):
                name = gpu_device_name(gpu.minor)
                targets[name] = DeviceTarget(name, "gpu", gpu, leaves_mig=True)
            for name, slot in instances.dynamic_slots(gpu).items():
                targets[name] = DeviceTarget(name, "mig", gpu, existing.get(name), slot)
            continue
        for mig in gpu.mig_instances:
            name = mig_device_name(
                parent_minor=gpu.minor,
                profile=mig.profile.name,
                profile_id=mig.profile.profile_id,
                placement_start=mig.placement.start,
            )
            targets[name] = DeviceTarget(name, "mig", gpu, mig)
    return targets


@dataclass(frozen=True)
class _TargetSet:
    """One version of what prepare accepts: the devices, what a spec says of each (made once:
    the same for every claim that gets it) and the driver files their nodes were made from.
    Never changed once built; Preparer.set_targets replaces it whole."""

    targets: Mapping[str, DeviceTarget]
    spec_devices: Mapping[str, cdi.ClaimDevice]
    files: cdi.DriverFiles

    @classmethod
    def build(cls, targets: Mapping[str, DeviceTarget], files: cdi.DriverFiles) -> _TargetSet:
        return cls(
            targets=MappingProxyType(dict(targets)),
            spec_devices=MappingProxyType(
                {
                    name: cdi.ClaimDevice(name=name, nodes=t.nodes(files))
                    for name, t in targets.items()
                    if t.dynamic is None  # its nodes are those of the instance prepare makes
                }
            ),
            files=files,
        )


@dataclass(frozen=True)
class _Planned:
    """One allocation result of our driver, checked and with its effective config."""

    request: str
    target: DeviceTarget
    pool: str
    share_id: str | None
    admin_access: bool
    config: deviceconfig.DeviceConfig | None  # None: no opaque config applies (the default)
    share: shares.Share | None = None  # a consumable share (shareID) of a shareable device

    @property
    def cdi_name(self) -> str:
        """The device's name in the claim's CDI spec: one CDI device per share."""
        if self.share is None:
            return self.target.name
        return shares.share_device_name(self.target.name, self.share.share_id)

    @property
    def capabilities(self) -> frozenset[str]:
        if self.config is None:
            return cdi.DEFAULT_CAPABILITIES
        from dra_driver.prepare.deviceconfig import driver_capabilities  # noqa: PLC0415

        return driver_capabilities(self.config)

    def config_json(self) -> dict[str, Any]:
        if self.config is None:
            return default_config_json(self.target.type)
        from dra_driver.prepare.deviceconfig import to_json  # noqa: PLC0415

        return to_json(self.config)

    @functools.cached_property
    def interval(self) -> str | None:
        """The time-slice interval this device's config asks for (full GPUs only), or None
        (read from the config as the checkpoint records it, once per planned device)."""
        if self.config is None or self.target.type != "gpu":
            return None
        return timeslice.recorded_interval(self.config_json())

    @functools.cached_property
    def mps_config(self) -> dict[str, Any] | None:
        """The mpsConfig this device's config asks for (``{}``: MPS without limits), or None."""
        if self.config is None:
            return None
        return mps.recorded_config(self.config_json())


# deviceconfig is imported where it is used (the ``noqa: PLC0415`` lines), so it is loaded with
# the first claim that carries an opaque config of ours: building its pydantic models (and
# pydantic's plugin scan of every installed distribution) costs the idle agent about 0.2 MiB,
# and most claims carry no opaque config. A device no config applies to gets the default one,
# recorded as deviceconfig.to_json(deviceconfig.default_for(type)) would give it (a test holds
# the two equal).
_DEFAULT_CONFIG_KINDS = {"gpu": "GpuConfig", "mig": "MigDeviceConfig"}


def default_config_json(device_type: str) -> dict[str, Any]:
    """The recorded form of the config a device gets when no opaque config applies."""
    return {"apiVersion": "resource.nvidia.com/v1beta1", "kind": _DEFAULT_CONFIG_KINDS[device_type]}


# What failed, as a short fixed label (the ``error_type`` of the error metrics); the first
# class that matches wins, so subclasses come before their base.
_ERROR_TYPES: tuple[tuple[type[DraError], str], ...] = (
    (ClaimNotFound, "claim_not_found"),
    (ClaimFetchFailed, "api_error"),
    (DeviceConflict, "device_conflict"),
    (TimeSliceFailed, "timeslice"),
    (ShareEnforcementFailed, "share"),
    (MpsFailed, "mps"),
    (MigFailed, "mig"),
    (ConfigDecodeError, "config"),
    (PrepareError, "invalid_claim"),
    (CdiError, "cdi"),
    (CheckpointError, "checkpoint"),
)
ERROR_TYPES = tuple(label for _, label in _ERROR_TYPES)


def error_type(exc: DraError) -> str:
    """The ``error_type`` of a claim's failure: one of ``ERROR_TYPES``."""
    for cls, label in _ERROR_TYPES:
        if isinstance(exc, cls):
            return label
    raise TypeError(f"no error type for {type(exc).__name__}")  # a new class needs a label


@dataclass(frozen=True)
class Outcome:
    """Result of one claim in a batch: its devices, or the error that refused it and what kind
    of error that was (``error_type``, one of ``ERROR_TYPES``)."""

    devices: tuple[PreparedDevice, ...] = ()
    error: str = ""
    error_type: str = ""


def validate_ref(ref: ClaimRef, *, need_names: bool = True) -> None:
    """Refuse a claim reference that could not have come from the API server."""
    if not _UUID.match(ref.uid):
        raise PrepareError(f"claim UID {ref.uid!r} is not a lowercase UUID")
    if need_names:
        if not _DNS_LABEL.match(ref.namespace):
            raise PrepareError(f"claim namespace {ref.namespace!r} is not a valid namespace name")
        if len(ref.name) > 253 or not _DNS_SUBDOMAIN.match(ref.name):
            raise PrepareError(f"claim name {ref.name!r} is not a valid object name")


class Preparer:
    """Prepares and unprepares claims; safe to call from many threads and two processes."""

    def __init__(
        self,
        *,
        driver_name: str,
        node_name: str,
        cdi_vendor: str,
        targets: Mapping[str, DeviceTarget],
        files: cdi.DriverFiles,
        specs: cdi.CdiSpecDir,
        checkpoint: Checkpoint,
        locks: ClaimLocks,
        claims: ClaimSource,
        max_parallel_claims: int = 16,
        timeslicer: timeslice.TimeSlicer | None = None,
        consumable_shares: shares.SharesMode = shares.DISABLED,
        share_enforcer: shares.ShareEnforcer | None = None,
        mps_daemons: MpsDaemons | None = None,
        mig: instances.DynamicMig | None = None,
    ) -> None:
        self.driver_name = driver_name
        self.node_name = node_name
        self.cdi_vendor = cdi_vendor
        self._current = _TargetSet.build(targets, files)
        self._spec_encoder = cdi.ClaimSpecEncoder(vendor=cdi_vendor, files=files)
        self.specs = specs
        self.checkpoint = checkpoint
        self.locks = locks
        self.claims = claims
        self._pool = ThreadPoolExecutor(max_workers=max_parallel_claims, thread_name_prefix="claim")
        # Separate from _pool: a claim running in _pool waits on its spec's fsync. One thread:
        # it is used only while a single prepare is in flight (_sync_spec).
        self._spec_writes = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cdi-sync")
        self._in_flight = 0
        self._in_flight_lock = threading.Lock()
        # claim uid -> the pods its status.reservedFor named when prepare or reconcile last read
        # it (for telemetry: which pod holds a device). Costs no request of its own.
        self._pods: dict[str, tuple[str, ...]] = {}
        # Time slices (None: claims asking for one are refused). _slices: GPU uuid -> the
        # interval this process set or found there since it started (absent: unknown). One lock
        # for every change, so that a GPU is set to what the checkpoint says at that moment.
        # A file per GPU uuid in _slice_marks: "its time slice may not be Default", created
        # (durably) before a non-default interval is set, removed once Default is set again: a
        # crash between a claim's removal and the restore still leaves a trace reconcile sees.
        self._timeslicer = timeslicer
        self._slices: dict[str, str] = {}
        self._slice_lock = threading.Lock()
        self._slice_marks = checkpoint.path.parent / "timeslice"
        # MPS control daemons, one per claim that asks for MPS (None: such claims are refused).
        # _mps_adopted: the daemons of prepared claims were adopted since this process started.
        self._mps = mps_daemons
        self._mps_adopted = False
        # Dynamic MIG (None: static; dynamic devices are then never targets). The marks of GPUs
        # taken out of MIG mode for a whole-GPU claim (migoff.py); _mig_mode_lock serialises
        # every MIG mode change with the look at the claims that decides it.
        self._mig = mig
        self.mig_off = MigOffMarks(checkpoint.path.parent / MARKS_DIRECTORY)
        self._mig_mode_lock = threading.Lock()
        # Consumable shares (shares.py): the devices this node publishes as shareable, and the
        # enforcer that runs a device's shared MPS daemon (None: shares are refused). Under
        # _share_lock: the devices whose daemon this process acquired, and the shared devices
        # of each claim being prepared now (a daemon is released only when no recorded claim
        # and no prepare in flight has a share of its device).
        self._shares_mode = consumable_shares
        if share_enforcer is None and mps_daemons is not None:
            from dra_driver.sharing.mpsshares import MpsShareEnforcer  # noqa: PLC0415 - MPS only

            share_enforcer = MpsShareEnforcer(mps_daemons, self._mps_device_by_uuid)
        self._share_enforcer = share_enforcer
        self._share_lock = threading.Lock()
        self._share_running: set[str] = set()
        self._share_claims: dict[str, frozenset[str]] = {}

    @property
    def targets(self) -> Mapping[str, DeviceTarget]:
        """The devices prepare accepts now (read-only; replaced whole by set_targets)."""
        return self._current.targets

    @property
    def files(self) -> cdi.DriverFiles:
        """The driver files the current targets' device nodes were made from."""
        return self._current.files

    def set_targets(self, targets: Mapping[str, DeviceTarget], files: cdi.DriverFiles) -> None:
        """Make ``targets`` the devices prepare accepts (after a re-discovery changed them).

        The new version, device nodes included, is built first and then swapped in with one
        assignment: a prepare, a reconcile pass or a scrape reads the old devices or the new
        ones, never a mix, and no lock is taken on the prepare path. ``files`` may differ from
        the current files only in ``mig_cap_minors`` (re-read because a driver reload renumbers
        the capability nodes); the edits every spec shares stay those the specs were made with.
        Claims already prepared keep their specs, and one holding a device that is gone can
        still be unprepared (unprepare needs no target).
        """
        current = self._current.files
        if replace(files, mig_cap_minors=current.mig_cap_minors) != current:
            raise ValueError("set_targets: only the MIG capability minors of the files may change")
        self._current = _TargetSet.build(targets, files)

    def missing_devices(self) -> list[tuple[ClaimRecord, tuple[str, ...]]]:
        """``PrepareCompleted`` claims holding devices this node no longer has (by the current
        targets), each with those device names; read from the checkpoint, so claims another
        instance prepared count too."""
        targets = self._current.targets
        missing = []
        for record in self.checkpoint.snapshot().values():
            if record.phase != PREPARE_COMPLETED:
                continue
            gone = tuple(sorted({d.device for d in record.devices} - targets.keys()))
            if gone:
                missing.append((record, gone))
        return missing

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._spec_writes.shutdown(wait=True, cancel_futures=True)
        if self._mig is not None:
            self._mig.backend.close()

    # -- batches -----------------------------------------------------------------------------

    def prepare_batch(self, refs: Sequence[ClaimRef]) -> dict[str, Outcome]:
        """Prepare every claim; one outcome per distinct UID, claims handled concurrently."""
        return self._batch(refs, self._prepare_outcome)

    def unprepare_batch(self, refs: Sequence[ClaimRef]) -> dict[str, Outcome]:
        return self._batch(refs, self._unprepare_outcome)

    def _batch(
        self, refs: Sequence[ClaimRef], one: Callable[[ClaimRef], Outcome]
    ) -> dict[str, Outcome]:
        unique = list({r.uid: r for r in refs}.values())
        if len(unique) <= 1:
            return {r.uid: one(r) for r in unique}
        return dict(zip((r.uid for r in unique), self._pool.map(one, unique), strict=True))

    def _prepare_outcome(self, ref: ClaimRef) -> Outcome:
        try:
            return Outcome(devices=self.prepare(ref))
        except (PrepareError, CdiError, CheckpointError) as exc:
            log.warning(
                "prepare failed",
                extra={
                    "claim_uid": ref.uid,
                    "claim": f"{ref.namespace}/{ref.name}",
                    "error": str(exc),
                },
            )
            return Outcome(error=str(exc), error_type=error_type(exc))

    def _unprepare_outcome(self, ref: ClaimRef) -> Outcome:
        try:
            self.unprepare(ref)
            return Outcome()
        except (PrepareError, CdiError, CheckpointError) as exc:
            log.warning("unprepare failed", extra={"claim_uid": ref.uid, "error": str(exc)})
            return Outcome(error=str(exc), error_type=error_type(exc))

    # -- one claim ---------------------------------------------------------------------------

    def prepare(self, ref: ClaimRef) -> tuple[PreparedDevice, ...]:
        """Prepare one claim. Idempotent: a prepared claim returns its recorded devices."""
        validate_ref(ref)
        with self._in_flight_lock:
            self._in_flight += 1
        try:
            return self._prepare(ref)
        finally:
            with self._in_flight_lock:
                self._in_flight -= 1
            if self._share_claims:
                with self._share_lock:
                    self._share_claims.pop(ref.uid, None)

    def _prepare(self, ref: ClaimRef) -> tuple[PreparedDevice, ...]:
        with self.locks.hold(ref.uid):
            record = self.checkpoint.get(ref.uid)
            if record is not None:
                if (
                    record.phase == PREPARE_COMPLETED
                    and record.namespace
                    and self.specs.path_for(ref.uid).exists()
                ):
                    return record.devices
                # half done (or rebuilt without its claim): undo, then prepare from scratch
                self._roll_back(record)
            claim = self._fetch(ref)
            planned = self._plan(ref, claim)
            # An MPS daemon serving a dynamic MIG device is planned once the device exists.
            uncreated = any(p.target.dynamic is not None and p.target.mig is None for p in planned)
            daemon = None if uncreated else self._plan_mps(ref, planned)
            devices = tuple(self._answer(ref, p) for p in planned)
            if self._mig is not None:
                # Dynamic MIG: PrepareStarted, then the instances, or a whole GPU out of MIG
                # mode (docs/plugin.md "Dynamic MIG"), before a time slice or an MPS daemon on
                # them.
                planned = self._create_instances(ref, planned, devices, self._mig)
                if uncreated:
                    try:
                        daemon = self._plan_mps(ref, planned)  # the created MIG devices' UUIDs
                    except BaseException:
                        self._roll_back_quietly(ref.uid)
                        raise
            if any(p.interval is not None for p in planned):
                # Changes the node beyond the spec: PrepareStarted first (docs/plugin.md,
                # "Durability"), naming the intervals (the devices' configs) so that a
                # rollback knows which GPUs to restore.
                self._set_time_slices(ref, planned, devices)
            if daemon is not None:
                self._start_mps(ref, planned, devices, daemon)
            if any(p.share is not None for p in planned):
                self._start_shares(ref, planned, devices)
            # The spec goes to a temp file and is fsync'd (see _sync_spec: alone, in a helper
            # thread, overlapping the checkpoint's append and fdatasync). Without a time slice
            # the record is written once, as PrepareCompleted: the only change this prepare
            # makes on the node is the spec, and it becomes visible (the rename) only after the
            # record is durable. A crash before the rename leaves a temp file (reconcile removes
            # it) and a record without its spec (the next prepare of the claim, or reconcile,
            # writes it again); the kubelet hears of success only after both are durable.
            capabilities = frozenset().union(*(p.capabilities for p in planned))
            pending = self.specs.begin(
                ref.uid,
                self._encode_spec(
                    ref.uid,
                    [(p.target, p.share) for p in planned],
                    capabilities,
                    daemon[0] if daemon is not None else None,
                ),
            )
            try:
                synced = self._sync_spec(pending)
                try:
                    self._record(self._record_op(ref, planned, devices, phase=PREPARE_COMPLETED))
                finally:
                    # waits: the temp file is busy till then
                    sync_error = synced.exception() if synced is not None else None
                if sync_error is not None:
                    raise sync_error
                pending.commit()
            except BaseException:
                pending.abort()
                self._roll_back_quietly(ref.uid)
                raise
            self._pods[ref.uid] = reserved_pods(claim)
            log.info(
                "prepared claim",
                extra={
                    "claim_uid": ref.uid,
                    "claim": f"{ref.namespace}/{ref.name}",
                    "devices": [d.device for d in devices],
                },
            )
            return devices

    def _record(self, op: Callable[[Claims], None]) -> None:
        """Commit ``op`` (durably); a device conflict with claims no pod can use any more
        clears them and tries once more."""
        try:
            self.checkpoint.transact(op)
        except DeviceConflict as exc:
            if not self._clear_stale(exc.holders):
                raise
            self.checkpoint.transact(op)

    def _set_time_slices(
        self, ref: ClaimRef, planned: Sequence[_Planned], devices: tuple[PreparedDevice, ...]
    ) -> None:
        """Record the claim ``PrepareStarted`` (durably; refusing a device or an interval
        another claim holds), then set the time slice of each GPU it asks one of. On failure the
        claim is rolled back (record removed, GPUs set back to what the other claims ask, else
        Default) and TimeSliceFailed names what nvidia-smi said. Claim lock held."""
        if self._timeslicer is None:
            raise ConfigNotSupported(
                f"ResourceClaim {ref.namespace}/{ref.name}: time slicing is not available "
                "(this agent runs no nvidia-smi)"
            )
        self._record(self._record_op(ref, planned, devices, phase=PREPARE_STARTED))
        try:
            self._sync_slices({p.target.gpu.uuid for p in planned if p.interval}, strict=True)
        except BaseException:
            self._roll_back_quietly(ref.uid)
            raise

    def _plan_mps(
        self, ref: ClaimRef, planned: Sequence[_Planned]
    ) -> tuple[mps.MpsDaemon, mps.Limits] | None:
        """The MPS daemon the claim's devices that ask for MPS share, with its limits (None:
        none asks). Refused: MPS on an agent without daemons, with admin access, or limits
        that do not fit the devices (ConfigDecodeError naming the field); a sharing config
        on a consumable share (it runs under its device's shared MPS daemon already)."""
        where = f"ResourceClaim {ref.namespace}/{ref.name}"
        for p in planned:
            strategy = _strategy(p.config_json()) if p.share is not None else None
            if strategy is not None:
                raise ConfigNotSupported(
                    f"{where}: request {p.request} (device {p.target.name}) is a consumable "
                    f"share, which runs under the device's shared MPS daemon with the share's "
                    f"own limits; a sharing config (strategy {strategy}) does not apply to it"
                )
        shared = [p for p in planned if p.mps_config is not None]
        if not shared:
            return None
        if self._mps is None:
            raise ConfigNotSupported(
                f"{where}: sharing (strategy MPS) is not available: this agent was started "
                "without --mps-image (MPS_IMAGE), so it cannot run MPS control daemons"
            )
        for p in shared:
            if p.admin_access:
                raise ConfigNotSupported(
                    f"{where}: request {p.request} (device {p.target.name}) has admin access; "
                    "sharing (strategy MPS) changes the GPU for its other users and is refused "
                    "with admin access"
                )
        try:
            return self._mps_daemon(ref.uid, [(p.target, p.mps_config or {}) for p in shared])
        except mps.MpsConfigError as exc:
            raise ConfigDecodeError(f"{where}: {exc}") from exc

    def _mps_daemon(
        self, uid: str, shared: Sequence[tuple[DeviceTarget, Mapping[str, Any]]]
    ) -> tuple[mps.MpsDaemon, mps.Limits]:
        """The daemon serving ``shared`` (devices with their mpsConfig) for claim ``uid``."""
        assert self._mps is not None
        if len({repr(sorted(c.items())) for _, c in shared}) > 1:
            raise mps.MpsConfigError(
                "its devices share one MPS control daemon: every device of the claim that asks "
                "for MPS needs the same mpsConfig"
            )
        unique = {t.name: t for t, _ in shared}
        devices = tuple(_mps_device(t) for t in unique.values())
        daemon = mps.MpsDaemon(owner=uid, devices=devices, base=self._mps.base)
        return daemon, mps.limits(shared[0][1], devices)

    def _start_mps(
        self,
        ref: ClaimRef,
        planned: Sequence[_Planned],
        devices: tuple[PreparedDevice, ...],
        daemon: tuple[mps.MpsDaemon, mps.Limits],
    ) -> None:
        """Record the claim ``PrepareStarted`` (durably: a crash from here on leaves a record
        whose rollback stops the daemon), then start its MPS daemon; a failure rolls the claim
        back (daemon, Deployment, tmpfs, directories, compute mode) and raises MpsFailed."""
        assert self._mps is not None
        self._record(self._record_op(ref, planned, devices, phase=PREPARE_STARTED))
        try:
            self._mps.start(*daemon)
        except BaseException:
            self._roll_back_quietly(ref.uid)
            raise

    def _stop_mps(self, record: ClaimRecord) -> None:
        """Stop the claim's MPS daemon, if it asked for one or something of one exists (a
        claim rebuilt from its spec has no config); failures are logged, and reconcile removes
        what is left (it belongs to no recorded claim)."""
        if self._mps is None:
            return
        asked = any(mps.recorded_config(d.config) is not None for d in record.devices)
        if not asked and not mps.daemon_root(self._mps.base, record.uid).exists():
            return
        try:
            self._mps.stop(record.uid)
        except MpsFailed as exc:
            log.error(
                "cannot stop an MPS control daemon; reconcile will retry",
                extra={"claim_uid": record.uid, "error": str(exc)},
            )

    def _create_instances(
        self,
        ref: ClaimRef,
        planned: list[_Planned],
        devices: tuple[PreparedDevice, ...],
        mig: instances.DynamicMig,
    ) -> list[_Planned]:
        """Create the instances of the claim's dynamic MIG devices and take the GPUs it holds
        whole out of MIG mode (recorded ``PrepareStarted`` first, durably, so that every
        instance made and every GPU out of MIG mode is named by a record). Returns ``planned``
        with the created instances. On failure the claim is rolled back (its instances
        destroyed, its GPUs back in MIG mode). Claim lock held. An admin-access claim of a
        whole GPU changes nothing: it shares the GPU with its other users as it is."""
        dynamic = [p for p in planned if p.target.dynamic is not None]
        whole = [p for p in planned if p.target.leaves_mig and not p.admin_access]
        if not dynamic and not whole:
            return planned

        def others() -> frozenset[str]:
            return frozenset(
                d.device
                for r in self.checkpoint.snapshot().values()
                if r.uid != ref.uid
                for d in r.devices
            )

        # Before the record: a record must never name an instance the driver did not create.
        for p in dynamic:
            mig.check_foreign(p.target.gpu, p.target.name, recorded=others)
        self._record(self._record_op(ref, planned, devices, phase=PREPARE_STARTED))
        try:
            for p in whole:
                with self._mig_mode_lock:
                    mig.leave_mig_mode(p.target.gpu, p.target.name, self.mig_off, recorded=others)
                log.info(
                    "took a GPU out of MIG mode",
                    extra={"claim_uid": ref.uid, "device": p.target.name},
                )
            made = {
                p.target.name: replace(
                    p.target, mig=mig.create(p.target.gpu, p.target.name, recorded=others)
                )
                for p in dynamic
            }
        except BaseException as exc:
            # One made by hand since the check: rolled back without it (never destroyed).
            keep = exc.devices if isinstance(exc, ForeignMigInstances) else ()
            self._roll_back_quietly(ref.uid, keep=frozenset(keep))
            raise
        return [replace(p, target=made.get(p.target.name, p.target)) for p in planned]

    def _destroy_instances(self, record: ClaimRecord, keep: frozenset[str] = frozenset()) -> None:
        """Destroy the instances of ``record``'s dynamic MIG devices that no other record
        names (an admin-access claim shares its device) and that are not in ``keep``; before
        ``record`` is removed, so an instance is named by a record until it is gone. MigFailed
        leaves the rest."""
        if self._mig is None:
            return
        targets = self._current.targets
        others = {
            d.device
            for r in self.checkpoint.snapshot().values()
            if r.uid != record.uid
            for d in r.devices
        }
        for device in record.devices:
            target = targets.get(device.device)
            if target is None or target.dynamic is None or device.device in others | keep:
                continue
            if self._mig.destroy(target.gpu, device.device):
                log.info(
                    "destroyed a MIG instance",
                    extra={"claim_uid": record.uid, "device": device.device},
                )

    def _complete_instances(
        self, record: ClaimRecord, targets: Mapping[str, DeviceTarget]
    ) -> list[_SpecTarget]:
        """A prepared claim's targets with their instances, creating (completing) any that is
        gone or half-made; a GPU it holds whole is (still, or again) out of MIG mode."""
        assert self._mig is not None
        have = []
        for device in record.devices:
            target = targets.get(device.device)
            if target is None:
                continue
            if target.dynamic is not None:
                instance = self._mig.create(
                    target.gpu, target.name, recorded=self.recorded_device_names
                )
                target = replace(target, mig=instance)
            elif target.leaves_mig and not device.admin_access:
                with self._mig_mode_lock:
                    self._mig.leave_mig_mode(
                        target.gpu, target.name, self.mig_off, recorded=self.recorded_device_names
                    )
            have.append((target, _recorded_share(device)))
        return have

    def _sync_spec(self, pending: cdi.PendingSpec) -> Future[None] | None:
        """fsync the spec's temp file: in a helper thread when this is the only prepare in
        flight and the spec is on a disk, so the spec's sync and the checkpoint's overlap
        instead of adding up (the rest of the write stays in this thread: two threads of Python
        would only take turns); here and now when others are in flight, whose work fills the
        wait anyway, so the handoff (a few tens of microseconds of the interpreter per prepare,
        under the load where they count) is saved, and when the CDI directory is on a tmpfs
        (/run/cdi on a node), where fsync returns at once. None when synced here (raises on
        failure)."""
        with self._in_flight_lock:
            alone = self._in_flight == 1
        if alone and not self.specs.in_memory:
            return self._spec_writes.submit(pending.sync)
        pending.sync()
        return None

    def unprepare(self, ref: ClaimRef) -> None:
        """Unprepare one claim. Unknown or already unprepared claims succeed."""
        validate_ref(ref, need_names=False)
        with self.locks.hold(ref.uid):
            self._unprepare_locked(ref.uid)

    def _unprepare_locked(self, uid: str) -> None:
        if self._mig is not None:
            record = self.checkpoint.get(uid)
            if record is not None and any(
                d.device in self._current.targets
                and self._current.targets[d.device].dynamic is not None
                for d in record.devices
            ):
                # Dynamic MIG: spec, instance, then the record (docs/plugin.md "Dynamic MIG"):
                # the instance stays named by a record until it is destroyed. A MigFailed
                # (processes run in it) fails the unprepare; the kubelet tries again. An MPS
                # daemon serving an instance stops before it is destroyed (a crash between the
                # two leaves a completed record, whose daemon reconcile starts again until the
                # kubelet's retry of this unprepare).
                self.specs.remove(uid, sync_dir=False)
                self._stop_mps(record)
                self._destroy_instances(record)
                self.checkpoint.transact(lambda claims: claims.discard(uid), durable=False)
                self._pods.pop(uid, None)
                self._restore_time_slices(record)
                self._release_shares(record)
                self._restore_mig_modes(record)
                log.info("unprepared claim", extra={"claim_uid": uid})
                return
        # Nothing here is synced before the kubelet hears of success (docs/plugin.md,
        # "Durability"): the record's removal is appended (a crash of this process cannot lose
        # it: it is in the kernel), and only a power loss could, after which the node reboots
        # and the boot ID check drops every claim. Had a removal been lost anyway, the claim
        # would be found stale against the API server (reconcile, and prepare of another claim
        # that wants its devices) and cleared: a device is never blocked by it.
        record = self.checkpoint.transact(lambda claims: claims.discard(uid), durable=False)
        # The record goes first: a crash now leaves only an orphaned spec, which reconcile
        # removes, never a recorded claim without its spec. For the same reason the removal
        # need not be synced: a spec that comes back after a power loss is an orphan too.
        self.specs.remove(uid, sync_dir=False)
        self._pods.pop(uid, None)
        if record is not None:
            # After the record: a crash before this leaves a GPU marked as maybe not Default
            # and no claim asking for it, which reconcile sets back. A failure never fails
            # the unprepare (logged; reconcile retries). The same holds for an MPS daemon,
            # and for a whole GPU of dynamic MIG going back into MIG mode (after the daemon
            # that ran on it stopped; its mark, migoff.py, is the trace a crash leaves).
            self._restore_time_slices(record)
            self._release_shares(record)
            self._stop_mps(record)
            self._restore_mig_modes(record)
            log.info("unprepared claim", extra={"claim_uid": uid})

    # -- steps -------------------------------------------------------------------------------

    def _fetch(self, ref: ClaimRef) -> Mapping[str, Any]:
        try:
            claim = self.claims.get_resource_claim(namespace=ref.namespace, name=ref.name)
        except KubeError as exc:
            raise ClaimFetchFailed(
                f"cannot get ResourceClaim {ref.namespace}/{ref.name}: {exc}"
            ) from exc
        if claim is None:
            raise ClaimNotFound(f"ResourceClaim {ref.namespace}/{ref.name} does not exist")
        return claim

    def _plan(self, ref: ClaimRef, claim: Mapping[str, Any]) -> list[_Planned]:
        where = f"ResourceClaim {ref.namespace}/{ref.name}"
        uid = _get(claim, "metadata", "uid")
        if uid != ref.uid:
            raise ClaimNotFound(
                f"{where} has UID {uid!r}, not {ref.uid!r} (it was deleted and re-created)"
            )
        allocation = _get(claim, "status", "allocation")
        if not isinstance(allocation, Mapping):
            raise PrepareError(f"{where} is not allocated")
        self._check_node(where, allocation)
        results = _list(_get(allocation, "devices", "results"), f"{where}: allocation results")
        configs = self._decode_configs(where, allocation)
        planned = []
        share_ids: set[str] = set()
        targets = self._current.targets  # one version of the devices for the whole claim
        for result in results:
            if not isinstance(result, Mapping) or result.get("driver") != self.driver_name:
                continue
            request = str(result.get("request", ""))
            pool = str(result.get("pool", ""))
            device = str(result.get("device", ""))
            target = targets.get(device)
            if pool != self.node_name or target is None:
                raise PrepareError(
                    f"{where} is allocated device {pool}/{device}, which this node does not have"
                    + (_not_created(device) if pool == self.node_name else "")
                )
            config = _effective(configs, request)
            if config is not None:  # the default config fits every device and asks for nothing
                from dra_driver.prepare.deviceconfig import check_fits, check_supported  # noqa: PLC0415

                try:
                    check_fits(config, device_type=target.type, device_name=device)
                    check_supported(config, device_name=device, request=request)
                except ConfigDecodeError as exc:
                    raise type(exc)(f"{where}: {exc}") from exc
            share = self._share(where, result, target)
            if share is not None:
                if share.share_id in share_ids:
                    raise PrepareError(f"{where}: shareID {share.share_id} is allocated twice")
                share_ids.add(share.share_id)
            planned.append(
                _Planned(
                    request=request,
                    target=target,
                    pool=pool,
                    share_id=None if share is None else share.share_id,
                    admin_access=bool(result.get("adminAccess", False)),
                    config=config,
                    share=share,
                )
            )
        if not planned:
            raise PrepareError(f"{where} has no device of driver {self.driver_name}")
        return planned

    def _share(
        self, where: str, result: Mapping[str, Any], target: DeviceTarget
    ) -> shares.Share | None:
        """The consumable share an allocation result holds (None: the device whole), checked
        against what this node publishes of the device (per-claim errors)."""
        try:
            share = shares.share_of_result(
                share_id=result.get("shareID"),
                consumed=result.get("consumedCapacity"),
                device=target.name,
                # as shares.shareable publishes it: a partitionable GPU's devices stay whole
                shareable_device=self._shares_mode.enabled and not target.partitioned,
            )
        except ValueError as exc:
            raise PrepareError(f"{where}: {exc}") from None
        if share is None:
            return None
        problem = shares.capacity_problem(
            self._share_capacity(target), [share.consumed], device=target.name
        )
        if problem is not None:
            raise PrepareError(f"{where}: {problem}")
        if self._share_enforcer is None:
            raise ConfigNotSupported(
                f"{where}: device {target.name} is allocated as a consumable share, and this "
                "agent has no MPS daemon to enforce shares with"
            )
        return share

    def _mps_device_by_uuid(self, uuid: str) -> mps.MpsDevice | None:
        """The device of the current targets with ``uuid`` (the share enforcer's lookup)."""
        for target in self._current.targets.values():
            if _uuid(target) == uuid:
                return _mps_device(target)
        return None

    def _share_daemon(self, target: DeviceTarget) -> mps.MpsDaemon | None:
        """The shared MPS daemon of ``target``'s shares (None without MPS daemons: then no
        share is prepared, _share refuses it)."""
        if self._mps is None:
            return None
        return mps.MpsDaemon(
            owner=shares.share_owner(target.name),
            devices=(_mps_device(target),),
            base=self._mps.base,
        )

    def _share_owners(self) -> set[str]:
        """Owners of the shared MPS daemons that must stay: devices a recorded claim, a
        prepare in flight or this process's acquisitions have a share of."""
        with self._share_lock:
            names = set(self._share_running).union(*self._share_claims.values())
        names.update(self._recorded_shared_devices())
        return {shares.share_owner(name) for name in names}

    def _share_capacity(self, target: DeviceTarget) -> dict[str, str]:
        memory = target.gpu.memory_bytes if target.mig is None else target.mig.profile.memory_bytes
        return shares.device_capacity(self._shares_mode, memory_bytes=memory)

    def _check_node(self, where: str, allocation: Mapping[str, Any]) -> None:
        selector = allocation.get("nodeSelector")
        if not isinstance(selector, Mapping):
            return
        names: list[str] = []
        for term in selector.get("nodeSelectorTerms") or ():
            for match in (term or {}).get("matchFields") or ():
                if match.get("key") == "metadata.name" and match.get("operator") == "In":
                    names.extend(str(v) for v in match.get("values") or ())
        if names and self.node_name not in names:
            raise PrepareError(
                f"{where} is allocated on node {', '.join(sorted(set(names)))}, "
                f"not on this node ({self.node_name})"
            )

    def _decode_configs(
        self, where: str, allocation: Mapping[str, Any]
    ) -> list[tuple[frozenset[str], deviceconfig.DeviceConfig]]:
        entries = _list(_get(allocation, "devices", "config") or [], f"{where}: configs")
        ours = [
            e
            for e in entries
            if isinstance(e, Mapping)
            and isinstance(e.get("opaque"), Mapping)
            and e["opaque"].get("driver") == self.driver_name
        ]
        # class configs apply before claim configs, whatever order they arrive in
        ordered = [e for e in ours if e.get("source") == "FromClass"] + [
            e for e in ours if e.get("source") != "FromClass"
        ]
        if not ordered:
            return []
        from dra_driver.prepare.deviceconfig import decode  # noqa: PLC0415

        decoded = []
        for index, entry in enumerate(ordered):
            try:
                config = decode(entry["opaque"].get("parameters"))
            except ConfigDecodeError as exc:
                raise ConfigDecodeError(
                    f"{where}: config {index} ({entry.get('source', 'FromClaim')}): {exc}"
                ) from exc
            decoded.append((frozenset(str(r) for r in entry.get("requests") or ()), config))
        return decoded

    def _answer(self, ref: ClaimRef, planned: _Planned) -> PreparedDevice:
        return PreparedDevice(
            request_names=(planned.request.split("/", 1)[0],),
            pool=planned.pool,
            device=planned.target.name,
            cdi_device_ids=(
                cdi.cdi_device_id(
                    vendor=self.cdi_vendor, claim_uid=ref.uid, device_name=planned.cdi_name
                ),
            ),
            share_id=planned.share_id,
            admin_access=planned.admin_access,
            config=planned.config_json(),
            consumed_capacity=planned.share.consumed if planned.share is not None else {},
        )

    def _record_op(
        self,
        ref: ClaimRef,
        planned: Sequence[_Planned],
        devices: tuple[PreparedDevice, ...],
        *,
        phase: Phase,
    ) -> Callable[[Claims], None]:
        """Record the claim in ``phase``, refusing a device another recorded claim holds
        (admin access aside), or a GPU another claim asks another time-slice interval of (one
        GPU has one time slice); checked and recorded in one step, so two claims racing for a
        device cannot both have it."""
        wanted = {p.target.name for p in planned if not p.admin_access and p.share is None}
        # Dynamic MIG: devices of one GPU whose memory slices overlap exclude each other.
        partitioned = [
            p.target
            for p in planned
            if self._mig is not None and not p.admin_access and p.target.gpu.mig_enabled
        ]
        intervals = {p.target.name: p.interval for p in planned if p.interval is not None}
        # A share conflicts with a claim holding its device whole, never with other shares as
        # long as their consumed capacities fit the device together.
        shared: dict[str, list[Mapping[str, str]]] = {}
        share_targets: dict[str, DeviceTarget] = {}
        for p in planned:
            if p.share is not None and not p.admin_access:
                shared.setdefault(p.target.name, []).append(p.share.consumed)
                share_targets[p.target.name] = p.target
        sharing = {
            p.target.name: _strategy(p.config_json()) for p in planned if p.config is not None
        }

        def op(claims: Claims) -> None:
            consumed = {name: list(mine) for name, mine in shared.items()}
            sharers: dict[str, list[str]] = {name: [] for name in shared}
            for other in claims.values():
                if other.uid == ref.uid:
                    continue
                for held in other.devices:
                    whole = held.device in wanted or (
                        held.device in shared and held.share_id is None
                    )
                    if whole and not held.admin_access:
                        raise DeviceConflict(
                            f"device {held.device} is already prepared for claim {_owner(other)}",
                            holders=(other.uid,),
                        )
                    for target in partitioned:
                        if (
                            not held.admin_access
                            and held.device != target.name
                            and instances.overlaps(target.gpu, target.name, held.device)
                        ):
                            raise DeviceConflict(
                                f"device {target.name} overlaps device {held.device}, which is "
                                f"already prepared for claim {_owner(other)}",
                                holders=(other.uid,),
                            )
                    if held.device in shared and not held.admin_access:
                        consumed[held.device].append(held.consumed_capacity)
                        sharers[held.device].append(other.uid)
                    mine = sharing.get(held.device)
                    other_strategy = _strategy(held.config) if mine else None
                    if other_strategy and "MPS" in (mine, other_strategy):
                        raise DeviceConflict(
                            f"device {held.device} is prepared for claim {_owner(other)} with "
                            f"sharing strategy {other_strategy}; this claim asks for {mine} (a "
                            "GPU shared by MPS runs one control daemon and no time slicing)",
                            holders=(other.uid,),
                        )
                    want = intervals.get(held.device)
                    theirs = timeslice.recorded_interval(held.config) if want else None
                    if theirs is not None and theirs != want:
                        raise DeviceConflict(
                            f"device {held.device} is prepared for claim {_owner(other)} with "
                            f"time-slice "
                            f"interval {theirs}; this claim asks for interval {want} (a GPU has "
                            "one time slice for all its claims)",
                            holders=(other.uid,),
                        )
            for name, target in share_targets.items():
                problem = shares.capacity_problem(
                    self._share_capacity(target), consumed[name], device=name
                )
                if problem is not None:
                    raise DeviceConflict(
                        f"{problem}: the shares prepared on it and this claim's do not fit",
                        holders=tuple(sharers[name]),
                    )
            claims[ref.uid] = ClaimRecord(
                uid=ref.uid, namespace=ref.namespace, name=ref.name, phase=phase, devices=devices
            )

        return op

    def _write_spec(
        self,
        claim_uid: str,
        targets: Iterable[_SpecTarget],
        capabilities: frozenset[str],
        daemon: mps.MpsDaemon | None = None,
    ) -> None:
        """Write the claim's spec (atomically; see cdi.CdiSpecDir for what is synced)."""
        self.specs.write(claim_uid, self._encode_spec(claim_uid, targets, capabilities, daemon))

    def _encode_spec(
        self,
        claim_uid: str,
        targets: Iterable[_SpecTarget],
        capabilities: frozenset[str],
        daemon: mps.MpsDaemon | None = None,
    ) -> bytes:
        """The claim's spec: its devices' nodes (one CDI device per share of a device, with
        the share's limits and what makes a container a client of the device's shared MPS
        daemon), and the driver files of ``capabilities`` (the union of what its devices'
        configs ask for); the devices ``daemon`` serves also get what makes a container its
        client (mps.client_env, mps.client_mounts)."""
        # The current version's nodes of each name: after a swap since the claim was planned
        # (a MIG device re-created under the same name) these are the device's nodes now. A
        # name that is gone by then gets its planned target's nodes.
        # A dynamic MIG device's nodes are those of the instance its target carries.
        current = self._current
        unique = {
            t.name if share is None else shares.share_device_name(t.name, share.share_id): (
                t,
                share,
            )
            for t, share in targets
        }
        served = {d.uuid for d in daemon.devices} if daemon is not None else set()
        devices = []
        for name, (t, share) in sorted(unique.items()):
            device = (None if t.dynamic else current.spec_devices.get(t.name)) or cdi.ClaimDevice(
                name=t.name, nodes=t.nodes(current.files)
            )
            if share is not None:
                client = self._share_daemon(t)
                device = cdi.ClaimDevice(
                    name=name,
                    nodes=device.nodes,
                    env=shares.share_env(device_uuid=_uuid(t), consumed=share.consumed)
                    + (mps.client_env(client) if client is not None else ()),
                    mounts=mps.client_mounts(client) if client is not None else (),
                )
            elif daemon is not None and _uuid(t) in served:
                device = replace(
                    device,
                    env=device.env + mps.client_env(daemon),
                    mounts=device.mounts + mps.client_mounts(daemon),
                )
            devices.append(device)
        return self._spec_encoder.encode(claim_uid, devices, capabilities)

    def _roll_back(self, record: ClaimRecord, keep: frozenset[str] = frozenset()) -> None:
        """Undo a half-done prepare (lock held): the spec first, then its MPS daemon, then its
        dynamic MIG instances (MigFailed keeps the record, for a later try), then the record,
        then the time slices it asked for (set back to what the remaining claims ask, else
        Default), the shared MPS daemons of its shares no other claim uses, and the GPUs it
        took out of MIG mode (back in)."""
        self.specs.remove(record.uid)
        self._stop_mps(record)  # before the MIG instances its daemon may serve
        self._destroy_instances(record, keep)
        self.checkpoint.transact(lambda claims: claims.discard(record.uid))
        self._restore_time_slices(record)
        self._release_shares(record)
        self._restore_mig_modes(record)

    # -- whole GPUs of dynamic MIG -------------------------------------------------------------

    def _whole_gpu_holders(self) -> set[str]:
        """UUIDs of the GPUs a recorded claim (either phase, admin access aside) holds whole
        under dynamic MIG: the GPUs that may be out of MIG mode."""
        targets = self._current.targets
        return {
            uuid for r in self.checkpoint.snapshot().values() for uuid in _held_whole(r, targets)
        }

    def _restore_mig_modes(self, record: ClaimRecord) -> None:
        """Put the GPUs ``record`` (just removed) held whole back into MIG mode, unless another
        claim holds one; failures are logged, and reconcile tries again (the mark stays)."""
        gpus = _held_whole(record, self._current.targets)
        if gpus:
            self._sync_mig_modes(gpus)

    def _sync_mig_modes(self, gpus: Mapping[str, GpuInfo]) -> int:
        """Put each GPU of ``gpus`` (UUID -> GPU) that no recorded claim holds whole back into
        MIG mode and remove its mark. Returns how many went back; failures are logged."""
        assert self._mig is not None
        done = 0
        with self._mig_mode_lock:
            held = self._whole_gpu_holders()
            for uuid, gpu in sorted(gpus.items()):
                if uuid in held:
                    continue
                try:
                    if self._mig.enter_mig_mode(gpu, self.mig_off):
                        done += 1
                        log.info(
                            "put a GPU back into MIG mode",
                            extra={"device": gpu_device_name(gpu.minor), "gpu_uuid": uuid},
                        )
                except MigFailed as exc:
                    log.error(
                        "cannot put a GPU back into MIG mode; reconcile will retry",
                        extra={"gpu_uuid": uuid, "error": str(exc)},
                    )
        return done

    # -- consumable shares -------------------------------------------------------------------

    def _start_shares(
        self, ref: ClaimRef, planned: Sequence[_Planned], devices: tuple[PreparedDevice, ...]
    ) -> None:
        """Make sure the shared MPS daemon of every device the claim has a share of runs.

        A device whose daemon this process acquired already needs nothing (the fast path: the
        claim is recorded once, PrepareCompleted). Otherwise the claim is recorded
        ``PrepareStarted`` first (durably, with the share checks), then the enforcer acquires
        the daemon; a failure rolls the claim back (releasing a daemon no other share uses).
        Claim lock held."""
        assert self._share_enforcer is not None  # _share refuses shares without one
        targets = {p.target.name: p.target for p in planned if p.share is not None}
        with self._share_lock:
            self._share_claims[ref.uid] = frozenset(targets)
            start = sorted(set(targets) - self._share_running)
        if not start:
            return
        self._record(self._record_op(ref, planned, devices, phase=PREPARE_STARTED))
        try:
            for name in start:
                # Under the lock, re-checked: two first shares of a device prepared at once
                # start its daemon once (the other waits, then finds it running).
                with self._share_lock:
                    if name in self._share_running:
                        continue
                    self._share_enforcer.acquire(
                        gpu_uuids=frozenset({_uuid(targets[name])}),
                        owner=shares.share_owner(name),
                    )
                    self._share_running.add(name)
                log.info("acquired a device's shared MPS daemon", extra={"device": name})
        except BaseException:
            self._roll_back_quietly(ref.uid)
            raise

    def _recorded_shared_devices(self, *, but: str | None = None) -> set[str]:
        """The devices a recorded claim (other than ``but``) holds a share of."""
        return {
            d.device
            for record in self.checkpoint.snapshot().values()
            if record.uid != but
            for d in record.devices
            if d.share_id is not None
        }

    def _release_shares(self, record: ClaimRecord) -> None:
        """Release the shared MPS daemon of each device ``record`` (just removed) had a share
        of, where no other recorded claim and no prepare in flight has a share of it any more.
        A failure is logged, never raised (the MPS module adopts what it finds at start)."""
        names = {d.device for d in record.devices if d.share_id is not None}
        if not names or self._share_enforcer is None:
            return
        targets = self._current.targets
        with self._share_lock:
            busy = self._recorded_shared_devices(but=record.uid)
            for uid, devices in self._share_claims.items():
                if uid != record.uid:
                    busy |= devices
            for name in sorted(names - busy):
                target = targets.get(name)
                uuids = frozenset() if target is None else frozenset({_uuid(target)})
                try:
                    self._share_enforcer.release(gpu_uuids=uuids, owner=shares.share_owner(name))
                except ShareEnforcementFailed as exc:
                    log.error(
                        "cannot release a device's shared MPS daemon",
                        extra={"device": name, "error": str(exc)},
                    )
                    continue
                self._share_running.discard(name)
                log.info("released a device's shared MPS daemon", extra={"device": name})

    def _sync_shares(self) -> int:
        """Acquire the daemon of every device a recorded claim has a share of that this process
        has not acquired (after a restart: adoption). Returns how many; failures are logged
        and retried by the next pass."""
        if self._share_enforcer is None:
            return 0
        targets = self._current.targets
        wanted = {name for name in self._recorded_shared_devices() if name in targets}
        done = 0
        for name in sorted(wanted - self._share_running):
            # Under the lock, re-checked: an unprepare may have released it since the snapshot.
            with self._share_lock:
                if name not in self._recorded_shared_devices() or name in self._share_running:
                    continue
                try:
                    self._share_enforcer.acquire(
                        gpu_uuids=frozenset({_uuid(targets[name])}),
                        owner=shares.share_owner(name),
                    )
                except ShareEnforcementFailed as exc:
                    log.error(
                        "cannot acquire a device's shared MPS daemon; reconcile will retry",
                        extra={"device": name, "error": str(exc)},
                    )
                    continue
                self._share_running.add(name)
            done += 1
        return done

    # -- time slices -------------------------------------------------------------------------

    def _restore_time_slices(self, record: ClaimRecord) -> None:
        """Set the GPUs whose time slice ``record`` (just removed) asked for to what the
        remaining claims ask; failures are logged and left to reconcile."""
        targets = self._current.targets
        uuids = {
            targets[d.device].gpu.uuid
            for d in record.devices
            if d.device in targets and timeslice.recorded_interval(d.config) is not None
        }
        if uuids:
            self._sync_slices(uuids, strict=False)

    def _wanted_slices(self) -> dict[str, str]:
        """GPU uuid -> the interval the recorded claims (either phase) ask of it; a GPU no
        claim asks one of should be at Default. The conflict check keeps it to one per GPU."""
        targets = self._current.targets
        wanted: dict[str, str] = {}
        for record in self.checkpoint.snapshot().values():
            for device in record.devices:
                interval = timeslice.recorded_interval(device.config)
                target = targets.get(device.device)
                if interval is not None and target is not None and target.type == "gpu":
                    wanted[target.gpu.uuid] = interval
        return wanted

    def _sync_slices(self, uuids: Iterable[str] | None, *, strict: bool) -> int:
        """Set each GPU of ``uuids`` (None: every full GPU of the node) to the interval the
        checkpoint asks of it now, where it may differ: what this process set since it started
        differs, or it is unknown and a claim asks for a non-default interval or the GPU is
        marked as maybe not Default. Returns how many were set. ``strict``: the first failure
        raises TimeSliceFailed; else failures are logged (the GPU stays unknown: the next
        reconcile pass tries again). Without a time slicer: nothing to do."""
        if self._timeslicer is None:
            return 0
        if uuids is None:
            uuids = {t.gpu.uuid for t in self._current.targets.values() if t.type == "gpu"}
        done = 0
        with self._slice_lock:
            wanted = self._wanted_slices()
            for uuid in sorted(uuids):
                want = wanted.get(uuid, timeslice.DEFAULT)
                known = self._slices.get(uuid)
                if known == want:
                    continue
                mark = self._slice_marks / uuid
                if known is None and want == timeslice.DEFAULT and not mark.exists():
                    self._slices[uuid] = want  # never set by us: the driver's default
                    continue
                try:
                    self._set_slice(uuid, want, mark)
                except TimeSliceFailed as exc:
                    if strict:
                        raise
                    log.error(
                        "cannot set a GPU's time slice; reconcile will retry",
                        extra={"gpu_uuid": uuid, "interval": want, "error": str(exc)},
                    )
                    continue
                done += 1
        return done

    def _set_slice(self, uuid: str, interval: str, mark: Path) -> None:
        assert self._timeslicer is not None
        if interval != timeslice.DEFAULT and not mark.exists():
            try:
                mark.parent.mkdir(parents=True, exist_ok=True)
                mark.touch()
                fsync_dir(mark.parent)
            except OSError as exc:
                raise TimeSliceFailed(
                    f"cannot mark GPU {uuid} as having a time slice set ({mark}): {exc}"
                ) from exc
        self._slices.pop(uuid, None)  # unknown until nvidia-smi says it is done
        self._timeslicer.set(uuid, interval)
        self._slices[uuid] = interval
        if interval == timeslice.DEFAULT:
            mark.unlink(missing_ok=True)
        log.info("set a GPU's time slice", extra={"gpu_uuid": uuid, "interval": interval})

    def _roll_back_quietly(self, uid: str, keep: frozenset[str] = frozenset()) -> None:
        try:
            record = self.checkpoint.get(uid)
            if record is not None:
                self._roll_back(record, keep)
            else:
                self.specs.remove(uid)
        except (CdiError, CheckpointError, MigFailed) as exc:
            log.error(
                "rolling back a failed prepare failed; reconcile will retry",
                extra={"claim_uid": uid, "error": str(exc)},
            )

    # -- state -------------------------------------------------------------------------------

    def prepared_devices_by_type(self) -> dict[str, int]:
        """How many of our devices ``PrepareCompleted`` claims hold, as ``{"gpu": n, "mig": m}``
        (both keys always present). A device shared by admin-access claims counts once. Read
        from the checkpoint, so it includes claims another instance prepared (rolling update);
        a device this node no longer has is typed by its name."""
        targets = self._current.targets
        held: set[str] = set()
        for record in self.checkpoint.snapshot().values():
            if record.phase == PREPARE_COMPLETED:
                held.update(d.device for d in record.devices)
        counts = {"gpu": 0, "mig": 0}
        for name in held:
            target = targets.get(name)
            counts[target.type if target else ("mig" if "-mig-" in name else "gpu")] += 1
        return counts

    def recorded_device_names(self) -> frozenset[str]:
        """Every device name in the checkpoint's claim records, in either phase. Read from the
        checkpoint, so claims another instance recorded count too. In dynamic MIG mode these are
        the MIG devices this driver created or is creating (dynamicmig.py)."""
        return frozenset(
            d.device for record in self.checkpoint.snapshot().values() for d in record.devices
        )

    def claim_pods(self) -> dict[str, tuple[str, ...]]:
        """Claim uid -> the pods its ``status.reservedFor`` named when this process last read the
        claim (its prepare, or a reconcile pass: every prepared claim at start, then every
        reconcile interval). A claim not read since this process started has none yet."""
        return dict(self._pods)

    # -- repair ------------------------------------------------------------------------------

    def reconcile(self) -> dict[str, int]:
        """Repair the node's state; run at start and periodically. Returns what it did.

        - temp files of spec writes a crash interrupted are deleted; spare spec files a dead
          instance left are adopted (or deleted, past ``max_spares``);
        - claims left ``PrepareStarted`` by a crash are rolled back;
        - CDI specs of ours that no claim in the checkpoint owns are removed;
        - claims whose spec disappeared (or rebuilt ones) get their spec written again;
        - claims no pod can use any more (deleted, re-created, deallocated, reserved for no
          pod: ``_stale_reason``) are unprepared.
        Claims another thread or instance is working on right now are left alone.
        """
        done = {"rolled_back": 0, "orphan_specs_removed": 0, "specs_rewritten": 0,
                "unprepared_gone": 0, "temp_files_removed": 0}  # fmt: skip
        _, done["stale_spares_removed"] = self.specs.collect_spares()
        for uid, temp in self.specs.temp_files():  # spec writes happen under the claim's lock
            with self.locks.try_hold(uid) as held:
                if held and self.specs.remove_temp_file(temp):
                    done["temp_files_removed"] += 1
        records = self.checkpoint.snapshot()
        for uid, record in records.items():
            if record.phase != PREPARE_STARTED:
                continue
            with self.locks.try_hold(uid) as held:
                current = self.checkpoint.get(uid) if held else None
                if current is not None and current.phase == PREPARE_STARTED:
                    try:
                        self._roll_back(current)
                    except MigFailed as exc:
                        log.error(
                            "cannot roll back a half-done prepare; will retry",
                            extra={"claim_uid": uid, "error": str(exc)},
                        )
                        continue
                    done["rolled_back"] += 1
        for uid in sorted(self.specs.claim_uids() - set(records)):
            with self.locks.try_hold(uid) as held:
                if held and self.checkpoint.get(uid) is None and self.specs.remove(uid):
                    done["orphan_specs_removed"] += 1
        targets = self._current.targets  # one version for the pass
        for uid, record in self.checkpoint.snapshot().items():
            if record.phase != PREPARE_COMPLETED:
                continue
            with self.locks.try_hold(uid) as held:
                if not held:
                    continue
                reason = self._stale_reason(record) if record.namespace else None
                if reason is None and self._mig is not None:
                    # Dynamic MIG: an instance gone or half-made (a crash while unpreparing,
                    # a reset) is completed again, and the spec names its nodes now.
                    try:
                        have = self._complete_instances(record, targets)
                    except MigFailed as exc:
                        log.error(
                            "cannot complete a prepared claim's MIG instance; will retry",
                            extra={"claim_uid": uid, "error": str(exc)},
                        )
                        continue
                    capabilities = _recorded_capabilities(record)
                    spec = self._encode_spec(uid, have, capabilities) if have else None
                    if spec is not None and spec != self.specs.read(uid):
                        self.specs.write(uid, spec)
                        done["specs_rewritten"] += 1
                elif reason is None and not self.specs.path_for(uid).exists():
                    # A device gone since the claim was prepared (the plugin reports those)
                    # has no nodes to give; a spec needs at least one device.
                    have = [
                        (targets[d.device], _recorded_share(d))
                        for d in record.devices
                        if d.device in targets
                    ]
                    if have:
                        daemon = self._recorded_daemon(record)
                        self._write_spec(
                            uid, have, _recorded_capabilities(record),
                            daemon[0] if daemon is not None else None,
                        )  # fmt: skip
                        done["specs_rewritten"] += 1
                if reason is not None:
                    log.info(
                        "unpreparing a claim no pod can use any more",
                        extra={"claim_uid": uid, "claim": f"{record.namespace}/{record.name}",
                               "reason": reason},
                    )  # fmt: skip
                    self._unprepare_locked(uid)
                    done["unprepared_gone"] += 1
        # What a crash or a failed restore left: GPUs whose time slice is not what the claims
        # ask (at start every GPU a claim asks a non-default interval of, or marked; then
        # only those whose last change failed).
        done["time_slices_set"] = self._sync_slices(None, strict=False)
        done["mig_modes_restored"] = self._sync_marked_gpus()
        done["mps_daemons_adopted"], done["mps_daemons_removed"] = self._sync_mps()
        done["share_daemons_acquired"] = self._sync_shares()
        live = self.checkpoint.snapshot()  # claims another instance unprepared
        for uid in list(self._pods):
            if uid not in live:
                self._pods.pop(uid, None)
        return done

    def _sync_marked_gpus(self) -> int:
        """Marked GPUs (taken out of MIG mode) that no recorded claim holds whole go back into
        MIG mode: what a crash after a claim's record went, or a reboot, left."""
        if self._mig is None:
            return 0
        marked = self.mig_off.uuids()
        if not marked:
            return 0
        gpus = {
            t.gpu.uuid: t.gpu
            for t in self._current.targets.values()
            if t.leaves_mig and t.gpu.uuid in marked
        }
        for uuid in sorted(marked - gpus.keys()):
            log.warning(
                "a GPU marked as taken out of MIG mode is not a partitionable GPU of this node "
                "now; its mark stays until it is",
                extra={"gpu_uuid": uuid, "mark": str(self.mig_off.path(uuid))},
            )
        return self._sync_mig_modes(gpus)

    def _recorded_daemon(self, record: ClaimRecord) -> tuple[mps.MpsDaemon, mps.Limits] | None:
        """The MPS daemon a recorded claim asked for (None: none, or its devices are gone)."""
        if self._mps is None:
            return None
        targets = self._current.targets
        shared = []
        for device in record.devices:
            config = mps.recorded_config(device.config)
            if config is None:
                continue
            target = targets.get(device.device)
            if target is None:
                return None
            shared.append((target, config))
        if not shared:
            return None
        try:
            return self._mps_daemon(record.uid, shared)
        except (mps.MpsConfigError, ValueError) as exc:
            log.error("a prepared claim's MPS config no longer fits its devices",
                      extra={"claim_uid": record.uid, "error": str(exc)})  # fmt: skip
            return None

    def _sync_mps(self) -> tuple[int, int]:
        """Make the node's MPS daemons those of the recorded claims: a daemon (Deployment,
        directories, tmpfs, compute mode) of no recorded claim is stopped and removed; the
        daemons of ``PrepareCompleted`` claims are adopted (their Deployment kept, the daemon
        asked to answer and told its limits again) at the first pass, and started again when
        their Deployment is gone later. Returns (adopted or started, removed)."""
        if self._mps is None:
            return 0, 0
        present = self._mps.owners()  # before the snapshot: a prepare records its claim first
        records = self.checkpoint.snapshot()
        removed = 0
        # Shared daemons of consumable shares belong to devices, not claims: _sync_shares and
        # _release_shares keep and remove them.
        for owner in sorted(present - set(records) - self._share_owners()):
            with self.locks.try_hold(owner) as held:
                if not held or self.checkpoint.get(owner) is not None:
                    continue
                log.info("removing an MPS control daemon of no prepared claim",
                         extra={"claim_uid": owner})  # fmt: skip
                try:
                    self._mps.stop(owner)
                    removed += 1
                except MpsFailed as exc:
                    log.error("cannot remove an orphaned MPS control daemon; will retry",
                              extra={"claim_uid": owner, "error": str(exc)})  # fmt: skip
        try:
            deployed = self._mps.deployed()
        except KubeError as exc:
            log.warning("cannot list MPS control daemons; will retry", extra={"error": str(exc)})
            return 0, removed
        started = 0
        for uid, record in records.items():
            if record.phase != PREPARE_COMPLETED or (self._mps_adopted and uid in deployed):
                continue
            daemon = self._recorded_daemon(record)
            if daemon is None:
                continue
            with self.locks.try_hold(uid) as held:
                if not held or self.checkpoint.get(uid) != record:
                    continue
                try:
                    self._mps.start(*daemon)
                    started += 1
                except MpsFailed as exc:
                    log.error(
                        "cannot adopt or restart a prepared claim's MPS control daemon; will retry",
                        extra={"claim_uid": uid, "error": str(exc)},
                    )
        self._mps_adopted = True
        return started, removed

    def _clear_stale(self, holders: Iterable[str]) -> bool:
        """Unprepare those of ``holders`` (claims holding devices a prepare wants) that the API
        server says no pod can use any more: a record whose unprepare was lost never blocks a
        device. True when one was cleared. A holder being worked on right now is left alone."""
        cleared = False
        for uid in holders:
            record = self.checkpoint.get(uid)
            if record is None or not record.namespace:
                continue
            reason = self._stale_reason(record)
            if reason is None:
                continue
            with self.locks.try_hold(uid) as held:
                if held and self.checkpoint.get(uid) == record:
                    log.warning(
                        "unpreparing a stale claim that held a device another claim needs",
                        extra={"claim_uid": uid, "claim": f"{record.namespace}/{record.name}",
                               "reason": reason},
                    )  # fmt: skip
                    self._unprepare_locked(uid)
                    cleared = True
        return cleared

    def _stale_reason(self, record: ClaimRecord) -> str | None:
        """Why no pod on this node can use the prepared claim any more, by the API server; None
        while one may (or when the server cannot be asked: never guess).

        Stale: the claim was deleted or re-created under another UID, it is no longer allocated
        (or allocated none of the recorded devices of this node), or it is reserved for no
        consumer (its pods are gone: the kubelet prepares a claim again before a new pod uses
        it)."""
        try:
            claim = self.claims.get_resource_claim(namespace=record.namespace, name=record.name)
        except KubeError as exc:
            log.warning(
                "cannot check whether a prepared claim is still in use; will retry",
                extra={"claim_uid": record.uid, "error": str(exc)},
            )
            return None
        if claim is None:
            return "deleted"
        if _get(claim, "metadata", "uid") != record.uid:
            return "deleted and re-created with another UID"
        self._pods[record.uid] = reserved_pods(claim)
        results = _get(claim, "status", "allocation", "devices", "results")
        if not isinstance(results, list):
            return "no longer allocated"
        allocated = {
            str(r.get("device"))
            for r in results
            if isinstance(r, Mapping)
            and r.get("driver") == self.driver_name
            and r.get("pool") == self.node_name
        }
        if not allocated & {d.device for d in record.devices}:
            return "allocated other devices"
        if not _get(claim, "status", "reservedFor"):
            return "reserved for no pod"
        return None

    def rebuild_from_specs(self, *, booted_at_s: float = 0.0) -> int:
        """After the checkpoint was lost: record every claim that has a spec of ours on disk.

        The spec names the claim's devices, so they stay protected against double use. The
        claim's namespace/name are unknown until the kubelet prepares it again, which then
        fetches the claim and re-answers from scratch (the spec content is deterministic).
        Specs written before ``booted_at_s`` (the node's boot time) are from an earlier boot:
        nothing is prepared after a reboot, so they are left for reconcile to remove.
        """
        rebuilt: dict[str, ClaimRecord] = {}
        for uid in sorted(self.specs.claim_uids()):
            try:
                if self.specs.path_for(uid).stat().st_mtime < booted_at_s:
                    continue
            except FileNotFoundError:
                continue
            content = self.specs.read(uid)
            if content is None:
                continue
            try:
                names = cdi.device_names_in_spec(content, claim_uid=uid)
            except CdiError as exc:
                log.warning(
                    "removing an unreadable CDI spec", extra={"claim_uid": uid, "error": str(exc)}
                )
                self.specs.remove(uid)
                continue
            rebuilt[uid] = ClaimRecord(
                uid=uid,
                namespace="",
                name="",
                phase=PREPARE_COMPLETED,
                devices=tuple(
                    PreparedDevice(
                        request_names=(),
                        pool=self.node_name,
                        device=shares.parse_share_device_name(name)[0],
                        cdi_device_ids=(
                            cdi.cdi_device_id(
                                vendor=self.cdi_vendor, claim_uid=uid, device_name=name
                            ),
                        ),
                        share_id=shares.parse_share_device_name(name)[1],
                    )
                    for name in names
                ),
            )

        def op(claims: Claims) -> int:
            added = 0
            for uid, record in rebuilt.items():
                if uid not in claims:
                    claims[uid] = record
                    added += 1
            return added

        return self.checkpoint.transact(op)


_SpecTarget = tuple[DeviceTarget, "shares.Share | None"]
"""A device of a claim's spec, and the share of it the claim holds (None: the whole device)."""


def _uuid(target: DeviceTarget) -> str:
    """The UUID MPS knows the device by: the MIG device's own, else the GPU's."""
    return target.gpu.uuid if target.mig is None else target.mig.uuid


def _mps_device(target: DeviceTarget) -> mps.MpsDevice:
    """The device as an MPS daemon serves it (a full GPU's compute mode is the daemon's to set;
    a MIG device's is its GPU's, which other MIG devices share). A dynamic MIG device must have
    been created (its instance is its UUID)."""
    if target.dynamic is not None and target.mig is None:
        raise mps.MpsConfigError(f"MIG device {target.name} has not been created yet")
    if target.mig is not None:
        return mps.MpsDevice(
            uuid=target.mig.uuid, memory_bytes=target.mig.memory_bytes, exclusive_gpu=None
        )
    return mps.MpsDevice(
        uuid=target.gpu.uuid, memory_bytes=target.gpu.memory_bytes, exclusive_gpu=target.gpu.uuid
    )


def _recorded_share(device: PreparedDevice) -> shares.Share | None:
    """The share a recorded device holds (None: held whole)."""
    if device.share_id is None:
        return None
    return shares.Share(share_id=device.share_id, consumed=device.consumed_capacity)


def _held_whole(record: ClaimRecord, targets: Mapping[str, DeviceTarget]) -> dict[str, GpuInfo]:
    """GPU UUID -> GPU, for each GPU ``record`` holds whole under dynamic MIG (admin access
    aside): the GPUs it may have taken out of MIG mode."""
    return {
        targets[d.device].gpu.uuid: targets[d.device].gpu
        for d in record.devices
        if not d.admin_access and d.device in targets and targets[d.device].leaves_mig
    }


def _not_created(device: str) -> str:
    """Why a device named like ours can be missing under dynamic MIG: a placement of a GPU
    that stays static (it has MIG devices this driver did not create), or the whole GPU of a
    GPU in MIG mode that is not offered whole (static MIG mode, a GPU left static, or one
    that cannot leave MIG mode without a reset)."""
    if "-mig-" in device:
        return (
            ": no such MIG device exists (under --mig-mode dynamic, a GPU with MIG devices "
            "this driver did not create offers only those, as static MIG devices, until they "
            "are removed)"
        )
    return (
        " as a whole GPU (a GPU in MIG mode is prepared whole only under --mig-mode dynamic, "
        "when it has no MIG devices this driver did not create and leaves MIG mode without a "
        "reset: Hopper and newer)"
    )


def _owner(record: ClaimRecord) -> str:
    """How an error names a claim that holds a device."""
    return f"{record.namespace}/{record.name} ({record.uid})" if record.namespace else record.uid


def _strategy(config: Mapping[str, Any] | None) -> str | None:
    """The sharing strategy a recorded effective config asks for (None: exclusive)."""
    sharing = (config or {}).get("sharing")
    return str(sharing.get("strategy")) if isinstance(sharing, Mapping) else None


def _recorded_capabilities(record: ClaimRecord) -> frozenset[str]:
    """The driver capabilities a prepared claim's spec was written with, from the effective
    configs recorded per device (a claim rebuilt from its spec has none: the default)."""
    capabilities: set[str] = set()
    for device in record.devices:
        config = cdi.DEFAULT_CAPABILITIES
        if device.config and "driverCapabilities" in device.config:
            from dra_driver.prepare.deviceconfig import decode, driver_capabilities  # noqa: PLC0415

            with contextlib.suppress(ConfigDecodeError):  # an older agent's: its default
                config = driver_capabilities(decode(device.config))
        capabilities |= config
    return frozenset(capabilities) or cdi.DEFAULT_CAPABILITIES


def _effective(
    configs: Sequence[tuple[frozenset[str], deviceconfig.DeviceConfig]], request: str
) -> deviceconfig.DeviceConfig | None:
    """The last config that applies to ``request`` (``<req>`` also covers ``<req>/<sub>``)."""
    main = request.split("/", 1)[0]
    chosen = None
    for requests, config in configs:
        if not requests or request in requests or main in requests:
            chosen = config
    return chosen


def reserved_pods(claim: Mapping[str, Any]) -> tuple[str, ...]:
    """The names of the pods a claim is reserved for (``status.reservedFor`` entries of
    resource ``pods`` in the core group), in the claim's order."""
    pods = []
    for consumer in _get(claim, "status", "reservedFor") or ():
        if (
            isinstance(consumer, Mapping)
            and consumer.get("resource") == "pods"
            and not consumer.get("apiGroup")
        ):
            pods.append(str(consumer.get("name", "")))
    return tuple(pods)


def _get(obj: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(obj, Mapping):
            return None
        obj = obj.get(key)
    return obj


def _list(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise PrepareError(f"{what} is not a list")
    return value
