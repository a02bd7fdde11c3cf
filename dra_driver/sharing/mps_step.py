"""MPS as a prepare step: one MPS control daemon per claim whose devices ask for it.

Flow position: the preparer core -> :class:`MpsStep` (prepare.step.Step) -> mps.py (the pure
daemon model) + mpsdaemon.py (compute mode, directories, tmpfs, Deployment, answer, limits).

Refused at plan: MPS on an agent without daemons (no ``--mps-image``), with admin access,
limits that do not fit the devices, or a multi-user daemon (``multiUser``) on a GPU below
Volta; a device shared by MPS in one claim and by any strategy in another (one control daemon,
no time slicing). Apply records the claim ``PrepareStarted``
(durably: a crash from then on leaves a record whose rollback stops the daemon), then starts
the daemon; the devices it serves get its client env and mounts in the spec. The daemon stops
before the claim's record goes where the record must outlive it (a dynamic MIG instance it
serves), else just after. Reconcile removes the daemons of no recorded claim (the shared
daemons of consumable shares aside: ``keep``) and adopts, or starts again, those of prepared
claims.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from dra_driver import cdi
from dra_driver.errors import (
    ConfigDecodeError,
    ConfigNotSupported,
    DeviceConflict,
    KubeError,
    MpsFailed,
)
from dra_driver.prepare import (
    PREPARE_COMPLETED,
    ClaimPlan,
    ClaimRecord,
    Claims,
    DeviceTarget,
    NodeState,
    PlannedDevice,
    Step,
    owner,
)
from dra_driver.sharing import mps
from dra_driver.sharing.mps import strategy

if TYPE_CHECKING:
    from dra_driver.sharing.mpsdaemon import DeploymentApi, MpsDaemons

log = logging.getLogger("dra_driver.prepare")  # steps log as part of prepare

Daemon = tuple[mps.MpsDaemon, mps.Limits]

# NVIDIA's chart installs into this namespace; its MPS Deployments live there
NVIDIA_NAMESPACE = "nvidia-dra-driver-gpu"
# in the recorded config of an MPS device adopted from NVIDIA's checkpoint (MpsStep.adopted):
# "<namespace>/<name>" of NVIDIA's Deployment, which the claim's unprepare deletes
NVIDIA_MPS_KEY = "nvidiaMpsDeployment"


@dataclass
class MpsPlan:
    """What a claim asks of MPS: each device's sharing strategy (for the conflict check), the
    devices that ask for MPS with their mpsConfig, and their daemon (built at plan, or at apply
    once a dynamic MIG device it serves exists)."""

    strategies: Mapping[str, str]
    shared: tuple[tuple[str, Mapping[str, Any]], ...] = ()
    daemon: Daemon | None = None


def mps_device(target: DeviceTarget) -> mps.MpsDevice:
    """The device as an MPS daemon serves it (a full GPU's compute mode is the daemon's to set;
    a MIG device's is its GPU's, which other MIG devices share). A dynamic MIG device must have
    been created (its instance is its UUID)."""
    if target.type == "mig" and target.mig is None:
        raise mps.MpsConfigError(f"MIG device {target.name} has not been created yet")
    capability = target.gpu.cuda_compute_capability
    if target.mig is not None:
        return mps.MpsDevice(
            uuid=target.mig.uuid,
            memory_bytes=target.mig.memory_bytes,
            exclusive_gpu=None,
            compute_capability=capability,
        )
    return mps.MpsDevice(
        uuid=target.gpu.uuid,
        memory_bytes=target.gpu.memory_bytes,
        exclusive_gpu=target.gpu.uuid,
        compute_capability=capability,
    )


class MpsStep(Step):
    """Runs the MPS control daemons of claims (``daemons`` None: MPS claims are refused).
    ``keep()``: owners of daemons that belong to no claim but must stay (the shared daemons of
    consumable shares). ``deployments`` deletes the daemons NVIDIA's driver started for claims
    adopted from it, also on an agent without daemons of its own (default: the daemons' API);
    ``nvidia_namespace``: where NVIDIA's driver runs them (``--nvidia-namespace``)."""

    def __init__(
        self,
        node: NodeState,
        daemons: MpsDaemons | None,
        *,
        keep: Callable[[], set[str]] = set,
        deployments: DeploymentApi | None = None,
        nvidia_namespace: str = NVIDIA_NAMESPACE,
    ) -> None:
        self._node = node
        self._nvidia_namespace = nvidia_namespace
        self._daemons = daemons
        self._deployments = deployments or (None if daemons is None else daemons.api)
        self._keep = keep
        self._adopted = False  # the daemons of prepared claims were adopted since start

    def plan(self, claim: ClaimPlan) -> MpsPlan | None:
        """Refused: MPS on an agent without daemons, with admin access, limits that do not
        fit the devices (ConfigDecodeError naming the field), or multi-user mode on a device
        below Volta (ConfigNotSupported naming the device). A consumable share is left to the
        share step (which refuses a sharing config on it)."""
        strategies = {}
        for device in claim.devices:
            asked = strategy(device.config_json)
            if asked is not None:
                strategies[device.target.name] = asked
        if not strategies:
            return None
        shared = [
            (d, config)
            for d in claim.devices
            if d.share_id is None and (config := mps.recorded_config(d.config_json)) is not None
        ]
        if not shared:
            return MpsPlan(strategies)
        if self._daemons is None:
            raise ConfigNotSupported(
                f"{claim.where}: sharing (strategy MPS) is not available: this agent was started "
                "without --mps-image (MPS_IMAGE), so it cannot run MPS control daemons"
            )
        for device, _ in shared:
            if device.admin_access:
                raise ConfigNotSupported(
                    f"{claim.where}: request {device.request} (device {device.target.name}) has "
                    "admin access; sharing (strategy MPS) changes the GPU for its other users "
                    "and is refused with admin access"
                )
        plan = MpsPlan(strategies, tuple((d.target.name, c) for d, c in shared))
        # A daemon serving a MIG device not made yet (dynamic MIG: a step makes it at apply) is
        # planned once the device exists (apply).
        if not any(d.target.type == "mig" and d.target.mig is None for d, _ in shared):
            plan.daemon = self._planned_daemon(plan, claim)
        return plan

    def _planned_daemon(self, plan: MpsPlan, claim: ClaimPlan) -> Daemon:
        targets = {d.target.name: d.target for d in claim.devices}
        try:
            return self._daemon(claim.ref.uid, [(targets[n], c) for n, c in plan.shared])
        except mps.MpsNotSupported as exc:
            raise ConfigNotSupported(f"{claim.where}: {exc}") from exc
        except mps.MpsConfigError as exc:
            raise ConfigDecodeError(f"{claim.where}: {exc}") from exc

    def _daemon(self, uid: str, shared: Sequence[tuple[DeviceTarget, Mapping[str, Any]]]) -> Daemon:
        """The daemon serving ``shared`` (devices with their mpsConfig) for claim ``uid``."""
        assert self._daemons is not None
        if len({repr(sorted(c.items())) for _, c in shared}) > 1:
            raise mps.MpsConfigError(
                "its devices share one MPS control daemon: every device of the claim that asks "
                "for MPS needs the same mpsConfig"
            )
        unique = {t.name: t for t, _ in shared}
        devices = tuple(mps_device(t) for t in unique.values())
        config = shared[0][1]
        daemon = mps.MpsDaemon(
            owner=uid,
            devices=devices,
            base=self._daemons.base,
            multi_user=mps.multi_user(config, devices),
        )
        return daemon, mps.limits(config, devices)

    def check(self, plan: MpsPlan, claim: ClaimPlan, *, claims: Claims) -> None:
        """Refuse a device another claim shares with another strategy where either is MPS."""
        for name, mine in plan.strategies.items():
            for other in claims.holding(name):
                if other.uid == claim.ref.uid or not mine:
                    continue
                for held in other.devices:
                    theirs = strategy(held.config) if held.device == name else None
                    if theirs and "MPS" in (mine, theirs):
                        raise DeviceConflict(
                            f"device {name} is prepared for claim {owner(other)} with "
                            f"sharing strategy {theirs}; this claim asks for {mine} (a "
                            "GPU shared by MPS runs one control daemon and no time slicing)",
                            holders=(other.uid,),
                        )

    def apply(self, plan: MpsPlan, claim: ClaimPlan, *, started: Callable[[], None]) -> None:
        """Record the claim ``PrepareStarted``, then start its daemon (MpsFailed on failure)."""
        if not plan.shared:
            return
        assert self._daemons is not None
        if plan.daemon is None:
            plan.daemon = self._planned_daemon(plan, claim)  # the created MIG devices' UUIDs
        started()
        self._daemons.start(*plan.daemon)

    def edit(
        self, plan: MpsPlan, device: PlannedDevice, *, spec: cdi.ClaimDevice
    ) -> cdi.ClaimDevice:
        """The devices the daemon serves get what makes a container its client."""
        if plan.daemon is None or device.share_id is not None:
            return spec
        daemon = plan.daemon[0]
        if device.target.uuid not in {d.uuid for d in daemon.devices}:
            return spec
        return replace(
            spec,
            env=spec.env + mps.client_env(daemon),
            mounts=spec.mounts + mps.client_mounts(daemon),
        )

    def recorded(self, record: ClaimRecord, claim: ClaimPlan) -> MpsPlan | None:
        """The daemon a prepared claim asked for (None: none, or its devices are gone)."""
        if self._daemons is None:
            return None
        targets = {d.target.name: d.target for d in claim.devices}
        daemon = self._recorded_daemon(record, targets)
        return None if daemon is None else MpsPlan({}, daemon=daemon)

    def adopted(self, device: PlannedDevice, *, claim_uid: str) -> Mapping[str, Any]:
        """An MPS device of a claim adopted from NVIDIA's checkpoint names the MPS Deployment
        NVIDIA's driver started for the claim (nvidia-compat.md "Switching in place"): no
        daemon of ours is started for it, and its unprepare deletes NVIDIA's."""
        if strategy(device.config_json) != "MPS":
            return {}
        return {NVIDIA_MPS_KEY: f"{self._nvidia_namespace}/mps-control-daemon-{claim_uid}"}

    def release(self, record: ClaimRecord) -> None:
        """Stop the claim's MPS daemon, if it asked for one or something of one exists (a
        claim rebuilt from its spec has no config); failures are logged, and reconcile removes
        what is left (it belongs to no recorded claim)."""
        if any(NVIDIA_MPS_KEY in d.config for d in record.devices):
            self._stop_nvidia_daemon(record)
            return
        if self._daemons is None:
            return
        asked = any(mps.recorded_config(d.config) is not None for d in record.devices)
        if not asked and not mps.daemon_root(self._daemons.base, record.uid).exists():
            return
        try:
            self._daemons.stop(record.uid)
        except MpsFailed as exc:
            log.error(
                "cannot stop an MPS control daemon; reconcile will retry",
                extra={"claim_uid": record.uid, "error": str(exc)},
            )

    def _stop_nvidia_daemon(self, record: ClaimRecord) -> None:
        """Delete the MPS Deployment NVIDIA's driver started for a claim adopted from it
        (prepare/state/switchover.py); a failure is logged (docs/migration.md says what is left)."""
        if self._deployments is None:
            log.error("cannot delete the MPS Deployment NVIDIA's driver started (no API access)",
                      extra={"claim_uid": record.uid})  # fmt: skip
            return
        names = {
            str(d.config[NVIDIA_MPS_KEY]) for d in record.devices if NVIDIA_MPS_KEY in d.config
        }
        for qualified in sorted(names):
            namespace, _, name = qualified.partition("/")
            try:
                self._deployments.delete_deployment(namespace=namespace, name=name)
                log.info("stopped the MPS control daemon NVIDIA's driver started",
                         extra={"claim_uid": record.uid, "deployment": qualified})  # fmt: skip
            except KubeError as exc:
                log.error("cannot delete the MPS Deployment NVIDIA's driver started; delete it "
                          "by hand", extra={"claim_uid": record.uid, "deployment": qualified,
                          "error": str(exc)})  # fmt: skip

    def _recorded_daemon(
        self, record: ClaimRecord, targets: Mapping[str, DeviceTarget]
    ) -> Daemon | None:
        """The MPS daemon a recorded claim asked for (None: none, or its devices are gone, or
        the daemon is NVIDIA's, of a claim adopted from its driver)."""
        shared = []
        for device in record.devices:
            if NVIDIA_MPS_KEY in device.config:
                return None
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
            return self._daemon(record.uid, shared)
        except (mps.MpsConfigError, ValueError) as exc:
            log.error("a prepared claim's MPS config no longer fits its devices",
                      extra={"claim_uid": record.uid, "error": str(exc)})  # fmt: skip
            return None

    def reconcile(self) -> dict[str, int]:
        """Make the node's MPS daemons those of the recorded claims: a daemon (Deployment,
        directories, tmpfs, compute mode) of no recorded claim is stopped and removed; the
        daemons of ``PrepareCompleted`` claims are adopted (their Deployment kept, the daemon
        asked to answer and told its limits again) at the first pass, and started again when
        their Deployment is gone later."""
        started, removed = self._sync()
        return {"mps_daemons_adopted": started, "mps_daemons_removed": removed}

    def _sync(self) -> tuple[int, int]:
        if self._daemons is None:
            return 0, 0
        node = self._node
        present = self._daemons.owners()  # before the snapshot: a prepare records its claim first
        records = node.records()
        removed = 0
        # Shared daemons of consumable shares belong to devices, not claims: the share step
        # keeps and removes them.
        for uid in sorted(present - set(records) - self._keep()):
            with node.locks.try_hold(uid) as held:
                if not held or node.record(uid) is not None:
                    continue
                log.info("removing an MPS control daemon of no prepared claim",
                         extra={"claim_uid": uid})  # fmt: skip
                try:
                    self._daemons.stop(uid)
                    removed += 1
                except MpsFailed as exc:
                    log.error("cannot remove an orphaned MPS control daemon; will retry",
                              extra={"claim_uid": uid, "error": str(exc)})  # fmt: skip
        try:
            deployed = self._daemons.deployed()
        except KubeError as exc:
            log.warning("cannot list MPS control daemons; will retry", extra={"error": str(exc)})
            return 0, removed
        started = 0
        targets = node.targets
        for uid, record in records.items():
            if record.phase != PREPARE_COMPLETED or (self._adopted and uid in deployed):
                continue
            daemon = self._recorded_daemon(record, targets)
            if daemon is None:
                continue
            with node.locks.try_hold(uid) as held:
                if not held or node.record(uid) != record:
                    continue
                try:
                    self._daemons.start(*daemon)
                    started += 1
                except MpsFailed as exc:
                    log.error(
                        "cannot adopt or restart a prepared claim's MPS control daemon; will retry",
                        extra={"claim_uid": uid, "error": str(exc)},
                    )
        self._adopted = True
        return started, removed
