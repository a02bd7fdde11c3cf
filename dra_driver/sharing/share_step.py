"""Consumable shares as a prepare step: a device several claims hold at once, each share with its
own CDI device and limits, enforced by the device's shared MPS daemon.

Flow position: the preparer core -> :class:`ShareStep` (prepare.step.Step) -> shares.py (the pure
model: which results are shares, what fits, what a share's container is told) + a
shares.ShareEnforcer (mpsshares.py: the device's shared MPS daemon).

Plan checks each allocation result's ``shareID``/``consumedCapacity`` against what this node
publishes (refusing a sharing config on a share: it runs under the device's daemon with its own
limits); the record's check refuses shares that together do not fit their device. Apply makes
sure the shared daemon of every device the claim has a share of runs: a device whose daemon
this process acquired already needs nothing (the claim is recorded once, PrepareCompleted);
otherwise the claim is recorded ``PrepareStarted`` first, then the enforcer acquires it. Once
no recorded claim and no prepare in flight has a share of a device, its daemon is released.
Reconcile acquires the daemons of recorded shares this process has not (adoption at start).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from dra_driver import cdi
from dra_driver.errors import (
    ConfigNotSupported,
    DeviceConflict,
    PrepareError,
    ShareEnforcementFailed,
)
from dra_driver.prepare import (
    ClaimPlan,
    ClaimRecord,
    Claims,
    DeviceTarget,
    NodeState,
    PlannedDevice,
    Step,
)
from dra_driver.sharing import mps, shares
from dra_driver.sharing.mps import strategy
from dra_driver.sharing.mps_step import mps_device

log = logging.getLogger("dra_driver.prepare")  # steps log as part of prepare


@dataclass(frozen=True)
class SharePlan:
    """The devices a claim has shares of (admin access included), and what its shares that
    count against a device (admin access aside) consume of it."""

    targets: Mapping[str, DeviceTarget]
    consumed: Mapping[str, tuple[Mapping[str, str], ...]]


def device_by_uuid(node: NodeState) -> Callable[[str], mps.MpsDevice | None]:
    """The device of the node's current targets with a UUID, as MPS serves it (the share
    enforcer's lookup)."""

    def lookup(uuid: str) -> mps.MpsDevice | None:
        for target in node.targets.values():
            if target.uuid == uuid:
                return mps_device(target)
        return None

    return lookup


class ShareStep(Step):
    """Checks and enforces consumable shares (``mode``: ``--consumable-shares``; ``enforcer``
    None: shares are refused; ``mps_base``: where the shared daemons' pipes are, for their
    clients' CDI edits)."""

    def __init__(
        self,
        node: NodeState,
        *,
        mode: shares.SharesMode,
        enforcer: shares.ShareEnforcer | None,
        mps_base: Path | None,
    ) -> None:
        self._node = node
        self._mode = mode
        self._enforcer = enforcer
        self._mps_base = mps_base
        # The devices whose daemon this process acquired (a daemon is released only when no
        # recorded claim and no prepare in flight has a share of its device).
        self._lock = threading.Lock()
        self._running: set[str] = set()

    def plan(self, claim: ClaimPlan) -> SharePlan | None:
        share_ids: set[str] = set()
        found = False
        for index, device in enumerate(claim.devices):
            share = self._share(claim.where, device)
            if share is None:
                continue
            if share.share_id in share_ids:
                raise PrepareError(f"{claim.where}: shareID {share.share_id} is allocated twice")
            share_ids.add(share.share_id)
            claim.devices[index] = replace(
                device, share_id=share.share_id, consumed_capacity=share.consumed
            )
            found = True
        if not found:
            return None
        targets: dict[str, DeviceTarget] = {}
        consumed: dict[str, list[Mapping[str, str]]] = {}
        for device in claim.devices:
            if device.share_id is None:
                continue
            asked = strategy(device.config_json)
            if asked is not None:
                raise ConfigNotSupported(
                    f"{claim.where}: request {device.request} (device {device.target.name}) is "
                    f"a consumable share, which runs under the device's shared MPS daemon with "
                    f"the share's own limits; a sharing config (strategy {asked}) does not "
                    "apply to it"
                )
            targets[device.target.name] = device.target
            if not device.admin_access:
                consumed.setdefault(device.target.name, []).append(device.consumed_capacity)
        return SharePlan(targets, {name: tuple(c) for name, c in consumed.items()})

    def _share(self, where: str, device: PlannedDevice) -> shares.Share | None:
        """The consumable share an allocation result holds (None: the device whole), checked
        against what this node publishes of the device (per-claim errors)."""
        target = device.target
        try:
            share = shares.share_of_result(
                share_id=device.result.get("shareID"),
                consumed=device.result.get("consumedCapacity"),
                device=target.name,
                # as shares.shareable publishes it: a partitionable GPU's devices stay whole
                shareable_device=self._mode.enabled and not target.partitioned,
            )
        except ValueError as exc:
            raise PrepareError(f"{where}: {exc}") from None
        if share is None:
            return None
        problem = shares.capacity_problem(
            self._capacity(target), [share.consumed], device=target.name
        )
        if problem is not None:
            raise PrepareError(f"{where}: {problem}")
        if self._enforcer is None:
            raise ConfigNotSupported(
                f"{where}: device {target.name} is allocated as a consumable share, and this "
                "agent has no MPS daemon to enforce shares with"
            )
        return share

    def _capacity(self, target: DeviceTarget) -> dict[str, str]:
        memory = target.gpu.memory_bytes if target.mig is None else target.mig.profile.memory_bytes
        return shares.device_capacity(self._mode, memory_bytes=memory)

    def check(self, plan: SharePlan, claim: ClaimPlan, *, claims: Claims) -> None:
        """Refuse shares that, with those other claims hold, do not fit their device."""
        consumed = {name: list(mine) for name, mine in plan.consumed.items()}
        sharers: dict[str, list[str]] = {name: [] for name in consumed}
        for name, together in consumed.items():
            for other in claims.holding(name):
                if other.uid == claim.ref.uid:
                    continue
                for held in other.devices:
                    if held.device == name and not held.admin_access:
                        together.append(held.consumed_capacity)
                        sharers[name].append(other.uid)
        for name, together in consumed.items():
            problem = shares.capacity_problem(
                self._capacity(plan.targets[name]), together, device=name
            )
            if problem is not None:
                raise DeviceConflict(
                    f"{problem}: the shares prepared on it and this claim's do not fit",
                    holders=tuple(sharers[name]),
                )

    def apply(self, plan: SharePlan, claim: ClaimPlan, *, started: Callable[[], None]) -> None:
        """Make sure the shared MPS daemon of every device the claim has a share of runs
        (a failure releases a daemon no other share uses, with the rollback)."""
        assert self._enforcer is not None  # plan refuses shares without one
        with self._lock:
            start = sorted(set(plan.targets) - self._running)
        if not start:
            return
        started()
        for name in start:
            # Under the lock, re-checked: two first shares of a device prepared at once
            # start its daemon once (the other waits, then finds it running).
            with self._lock:
                if name in self._running:
                    continue
                self._enforcer.acquire(
                    gpu_uuids=frozenset({plan.targets[name].uuid}),
                    owner=shares.share_owner(name),
                )
                self._running.add(name)
            log.info("acquired a device's shared MPS daemon", extra={"device": name})

    def edit(
        self, plan: SharePlan | bool, device: PlannedDevice, *, spec: cdi.ClaimDevice
    ) -> cdi.ClaimDevice:
        """A share's CDI device gets the share's limits and what makes a container a client of
        the device's shared MPS daemon."""
        if device.share_id is None:
            return spec
        client = self._daemon(device.target)
        return replace(
            spec,
            env=spec.env
            + shares.share_env(device_uuid=device.target.uuid, consumed=device.consumed_capacity)
            + (mps.client_env(client) if client is not None else ()),
            mounts=spec.mounts + (mps.client_mounts(client) if client is not None else ()),
        )

    def _daemon(self, target: DeviceTarget) -> mps.MpsDaemon | None:
        """The shared MPS daemon of ``target``'s shares (None without MPS daemons: then no
        share is prepared, plan refuses it)."""
        if self._mps_base is None:
            return None
        return mps.MpsDaemon(
            owner=shares.share_owner(target.name),
            devices=(mps_device(target),),
            base=self._mps_base,
        )

    def recorded(self, record: ClaimRecord, claim: ClaimPlan) -> bool | None:
        """A prepared claim's shares need their CDI edits (True) when it has any."""
        return True if any(d.share_id is not None for d in claim.devices) else None

    def restore(self, record: ClaimRecord) -> None:
        """Release the shared MPS daemon of each device ``record`` (just removed) had a share
        of, where no other recorded claim and no prepare in flight has a share of it any more.
        A failure is logged, never raised (the MPS module adopts what it finds at start)."""
        names = {d.device for d in record.devices if d.share_id is not None}
        if not names or self._enforcer is None:
            return
        targets = self._node.targets
        with self._lock:
            busy = self._recorded_shared_devices(but=record.uid) | self._in_flight(but=record.uid)
            for name in sorted(names - busy):
                target = targets.get(name)
                uuids = frozenset() if target is None else frozenset({target.uuid})
                try:
                    self._enforcer.release(gpu_uuids=uuids, owner=shares.share_owner(name))
                except ShareEnforcementFailed as exc:
                    log.error(
                        "cannot release a device's shared MPS daemon",
                        extra={"device": name, "error": str(exc)},
                    )
                    continue
                self._running.discard(name)
                log.info("released a device's shared MPS daemon", extra={"device": name})

    def _recorded_shared_devices(self, *, but: str | None = None) -> set[str]:
        """The devices a recorded claim (other than ``but``) holds a share of."""
        return {
            d.device
            for record in self._node.records().values()
            if record.uid != but
            for d in record.devices
            if d.share_id is not None
        }

    def _in_flight(self, *, but: str | None = None) -> set[str]:
        """The devices a claim being prepared now (other than ``but``) has a share of."""
        return {
            d.target.name
            for claim in self._node.in_flight()
            if claim.ref.uid != but
            for d in claim.devices
            if d.share_id is not None
        }

    def owners(self) -> set[str]:
        """Owners of the shared MPS daemons that must stay: devices a recorded claim, a
        prepare in flight or this process's acquisitions have a share of (the MPS step keeps
        them)."""
        with self._lock:
            names = set(self._running) | self._in_flight()
        names.update(self._recorded_shared_devices())
        return {shares.share_owner(name) for name in names}

    def reconcile(self) -> dict[str, int]:
        """Acquire the daemon of every device a recorded claim has a share of that this process
        has not acquired (after a restart: adoption). Failures are logged and retried by the
        next pass."""
        return {"share_daemons_acquired": self._sync()}

    def _sync(self) -> int:
        if self._enforcer is None:
            return 0
        targets = self._node.targets
        wanted = {name for name in self._recorded_shared_devices() if name in targets}
        done = 0
        for name in sorted(wanted - self._running):
            # Under the lock, re-checked: an unprepare may have released it since the snapshot.
            with self._lock:
                if name not in self._recorded_shared_devices() or name in self._running:
                    continue
                try:
                    self._enforcer.acquire(
                        gpu_uuids=frozenset({targets[name].uuid}),
                        owner=shares.share_owner(name),
                    )
                except ShareEnforcementFailed as exc:
                    log.error(
                        "cannot acquire a device's shared MPS daemon; reconcile will retry",
                        extra={"device": name, "error": str(exc)},
                    )
                    continue
                self._running.add(name)
            done += 1
        return done
