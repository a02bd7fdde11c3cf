"""Dynamic MIG instances as a prepare step: a claim's MIG placements are created when it is
prepared and destroyed when it is unprepared (docs/plugin.md "Dynamic MIG").

Flow position: the preparer core -> :class:`MigInstanceStep` (prepare.step.Step) -> instances.py
(which instance a name stands for, what overlaps, creating/destroying safely) -> gpus/migmanager.py
(NVML).

Plan refuses a GPU with instances no record names (before the claim is recorded: a record never
names an instance this driver did not create); the record's check refuses devices of one GPU
whose memory slices overlap a device another claim holds. Apply records the claim
``PrepareStarted`` (durably), then creates each instance; the claim's devices then carry them
(their UUIDs, their device nodes in the spec). Undo destroys the instances no other record
names while the claim's record still names them (so the core removes the spec, then the
instances, then the record); an instance made by hand since the check is never destroyed.
Reconcile completes the instance of a prepared claim that is gone or half-made.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

from dra_driver.errors import DeviceConflict, ForeignMigInstances, MigFailed
from dra_driver.mig import instances
from dra_driver.mig.targets import is_placement
from dra_driver.prepare import ClaimPlan, ClaimRecord, Claims, DeviceTarget, NodeState, Step, owner

log = logging.getLogger("dra_driver.prepare")  # steps log as part of prepare


@dataclass(frozen=True)
class InstancePlan:
    """A claim's dynamic MIG devices (created by apply), and its devices of partitionable GPUs
    that exclude overlapping devices of other claims (admin access aside)."""

    dynamic: tuple[str, ...]
    partitioned: tuple[DeviceTarget, ...]


class MigInstanceStep(Step):
    """Creates and destroys the instances of dynamic MIG devices through ``mig``."""

    def __init__(self, node: NodeState, mig: instances.DynamicMig) -> None:
        self._node = node
        self.mig = mig
        # claim uid -> instances a failed prepare found made by hand (by name): its rollback
        # never destroys them.
        self._spared: dict[str, frozenset[str]] = {}

    def _others(self, uid: str) -> Callable[[], frozenset[str]]:
        """The device names the records of claims other than ``uid`` name, read when called."""

        def others() -> frozenset[str]:
            return frozenset(
                d.device for r in self._node.records().values() if r.uid != uid for d in r.devices
            )

        return others

    def _recorded(self) -> frozenset[str]:
        return frozenset(d.device for r in self._node.records().values() for d in r.devices)

    def plan(self, claim: ClaimPlan) -> InstancePlan | None:
        dynamic = tuple(d.target for d in claim.devices if is_placement(d.target))
        partitioned = tuple(
            d.target
            for d in claim.devices
            if not d.admin_access and (d.target.gpu.mig_enabled or d.target.partitioned)
        )
        if not dynamic and not partitioned:
            return None
        # Before the record: a record must never name an instance the driver did not create.
        others = self._others(claim.ref.uid)
        for target in dynamic:
            self.mig.check_foreign(target.gpu, target.name, recorded=others)
        return InstancePlan(tuple(t.name for t in dynamic), partitioned)

    def check(self, plan: InstancePlan, claim: ClaimPlan, *, claims: Claims) -> None:
        """Refuse devices of one GPU whose memory slices overlap a device another claim holds."""
        for other in claims.values():
            if other.uid == claim.ref.uid:
                continue
            for held in other.devices:
                if held.admin_access:
                    continue
                for target in plan.partitioned:
                    if held.device != target.name and instances.overlaps(
                        target.gpu, target.name, held.device
                    ):
                        raise DeviceConflict(
                            f"device {target.name} overlaps device {held.device}, which is "
                            f"already prepared for claim {owner(other)}",
                            holders=(other.uid,),
                        )

    def apply(self, plan: InstancePlan, claim: ClaimPlan, *, started: Callable[[], None]) -> None:
        """Record the claim ``PrepareStarted`` (so every instance made is named by a record),
        then create the instance of each dynamic device; the claim's devices carry them."""
        if not plan.dynamic:
            return
        started()
        others = self._others(claim.ref.uid)
        for index, device in enumerate(claim.devices):
            target = device.target
            if target.name not in plan.dynamic:
                continue
            try:
                made = self.mig.create(target.gpu, target.name, recorded=others)
            except ForeignMigInstances as exc:
                # One made by hand since the check: rolled back without it (never destroyed).
                self._spared[claim.ref.uid] = frozenset(exc.devices)
                raise
            claim.devices[index] = replace(device, target=replace(target, mig=made))

    def keeps_record(self, record: ClaimRecord) -> bool:
        """A claim with a dynamic device keeps its record until its instance is destroyed (an
        MPS daemon serving the instance stops before; a crash between the two leaves a
        completed record, whose daemon reconcile starts again until the kubelet's retry)."""
        targets = self._node.targets
        return any(d.device in targets and is_placement(targets[d.device]) for d in record.devices)

    def release(self, record: ClaimRecord) -> None:
        """Destroy the instances of ``record``'s dynamic MIG devices that no other record names
        (an admin-access claim shares its device), before ``record`` is removed, so an
        instance is named by a record until it is gone. MigFailed (processes run in it) leaves
        the rest, and the record."""
        keep = self._spared.pop(record.uid, frozenset())
        targets = self._node.targets
        others = self._others(record.uid)()
        for device in record.devices:
            target = targets.get(device.device)
            if target is None or not is_placement(target) or device.device in others | keep:
                continue
            if self.mig.destroy(target.gpu, device.device):
                log.info(
                    "destroyed a MIG instance",
                    extra={"claim_uid": record.uid, "device": device.device},
                )

    def recorded(self, record: ClaimRecord, claim: ClaimPlan) -> None:
        """Create (complete) the instance of each of the claim's dynamic devices that is gone
        or half-made; the claim's devices then carry them (the spec names their nodes now)."""
        for index, device in enumerate(claim.devices):
            target = device.target
            if not is_placement(target):
                continue
            try:
                made = self.mig.create(target.gpu, target.name, recorded=self._recorded)
            except MigFailed as exc:
                log.error(
                    "cannot complete a prepared claim's MIG instance; will retry",
                    extra={"claim_uid": record.uid, "error": str(exc)},
                )
                raise
            claim.devices[index] = replace(device, target=replace(target, mig=made))

    def close(self) -> None:
        self.mig.backend.close()
