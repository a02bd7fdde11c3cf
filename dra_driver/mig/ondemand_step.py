"""MIG mode on demand as a prepare step: a Hopper-or-newer GPU that is not in MIG mode is put
into MIG mode when a claim's MIG placement is prepared on it, and taken out again once no claim
holds a MIG device of it, if this driver was the one that put it in (docs/mig.md "MIG mode on
demand").

Flow position: the preparer core -> :class:`MigOnDemandStep` (prepare.step.Step; runs before
instance_step.MigInstanceStep, so the GPU is in MIG mode when the instance is made, and is
undone after it, so the instance is gone when the mode goes off) -> instances.py
(DynamicMig.turn_on_for / turn_off_after) -> gpus/migmanager.py (NVML).

Crash safety, as for the whole-GPU switch (modeswitch_step.py), with its own marks
(``<plugin dir>/mig-on/<GPU UUID>.json``, the same format): apply records the claim
``PrepareStarted`` (durably), then writes the GPU's mark durably, then calls
``nvmlDeviceSetMigMode``. The mark is removed only after the GPU is out of MIG mode again. So a
kill -9 anywhere leaves either no mark and the GPU as the administrator left it, or a mark, and
reconcile (at start and on every pass) turns MIG mode off on every marked GPU no recorded claim
holds a MIG device of, and removes the mark; a prepared claim's GPU is put into MIG mode again
(:meth:`MigOnDemandStep.recorded`) before its instance is made again. Ampere GPUs are never
touched: their MIG mode changes only with a reset (devices.toggles_mig_mode). One lock, shared
with the whole-GPU switch, serialises every mode change with the look at the claims that
decides it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping

from dra_driver.devices import gpu_device_name, toggles_mig_mode
from dra_driver.errors import MigFailed
from dra_driver.gpus.info import GpuInfo
from dra_driver.mig.instances import DynamicMig
from dra_driver.mig.modeswitch import MigOffMarks
from dra_driver.mig.targets import is_placement
from dra_driver.prepare import ClaimPlan, ClaimRecord, DeviceTarget, NodeState, Step

log = logging.getLogger("dra_driver.prepare")  # steps log as part of prepare

MARKS_DIRECTORY = "mig-on"  # under the plugin's data directory, beside modeswitch's "mig-off"


class MigOnDemandStep(Step):
    """Turns MIG mode on for the MIG placements of claims and off once none is held
    (``turned_on``: the GPUs this driver put into MIG mode; ``taken_out``: those the whole-GPU
    switch took out of it, which a placement puts back instead)."""

    def __init__(
        self,
        node: NodeState,
        mig: DynamicMig,
        *,
        turned_on: MigOffMarks,
        taken_out: MigOffMarks,
        lock: threading.Lock,
    ) -> None:
        self._node = node
        self.mig = mig
        self.turned_on = turned_on
        self.taken_out = taken_out
        self._lock = lock

    def plan(self, claim: ClaimPlan) -> tuple[DeviceTarget, ...] | None:
        placements = tuple(
            d.target
            for d in claim.devices
            if is_placement(d.target) and toggles_mig_mode(d.target.gpu)
        )
        return placements or None

    def apply(
        self, plan: tuple[DeviceTarget, ...], claim: ClaimPlan, *, started: Callable[[], None]
    ) -> None:
        """Record the claim ``PrepareStarted``, then put each GPU of its placements into MIG
        mode (MigFailed: processes run on it, or NVML refused; the claim is rolled back)."""
        started()
        self._turn_on(plan, claim.ref.uid)

    def recorded(self, record: ClaimRecord, claim: ClaimPlan) -> None:
        """A GPU a prepared claim holds a MIG device of is (still, or again) in MIG mode."""
        placements = self.plan(claim)
        if placements:
            self._turn_on(placements, record.uid)

    def _turn_on(self, placements: tuple[DeviceTarget, ...], uid: str) -> None:
        done: set[str] = set()
        for target in placements:
            if target.gpu.uuid in done:
                continue
            done.add(target.gpu.uuid)
            try:
                with self._lock:
                    switched = self.mig.turn_on_for(
                        target.gpu, target.name, turned_on=self.turned_on, taken_out=self.taken_out
                    )
            except MigFailed as exc:
                log.error(
                    "cannot put a GPU into MIG mode for a claim",
                    extra={"claim_uid": uid, "device": target.name, "error": str(exc)},
                )
                raise
            if switched:
                log.info(
                    "turned MIG mode on",
                    extra={"claim_uid": uid, "device": gpu_device_name(target.gpu.minor)},
                )

    def restore(self, record: ClaimRecord) -> None:
        """Take the GPUs of ``record``'s (just removed) placements out of MIG mode where this
        driver put them in and no other claim holds a MIG device of them; failures are logged,
        and reconcile tries again (the mark stays)."""
        targets = self._node.targets
        gpus = {
            targets[d.device].gpu.uuid: targets[d.device].gpu
            for d in record.devices
            if d.device in targets and is_placement(targets[d.device])
        }
        if gpus:
            self._sync(gpus)

    def reconcile(self) -> dict[str, int]:
        """Marked GPUs (put into MIG mode by this driver) whose MIG devices no recorded claim
        holds go out of MIG mode: what a crash before or after ``nvmlDeviceSetMigMode``, a
        failed unprepare or a reboot left."""
        marked = self.turned_on.uuids()
        if not marked:
            return {"mig_modes_turned_off": 0}
        gpus = {t.gpu.uuid: t.gpu for t in self._node.targets.values() if t.gpu.uuid in marked}
        for uuid in sorted(marked - gpus.keys()):
            log.warning(
                "a GPU marked as put into MIG mode is not a partitionable GPU of this node now; "
                "its mark stays until it is",
                extra={"gpu_uuid": uuid, "mark": str(self.turned_on.path(uuid))},
            )
        return {"mig_modes_turned_off": self._sync(gpus)}

    def _sync(self, gpus: Mapping[str, GpuInfo]) -> int:
        """Take each GPU of ``gpus`` (UUID -> GPU) that this driver put into MIG mode, and of
        which no recorded claim holds a MIG device, out of MIG mode and remove its mark.
        Returns how many left MIG mode; failures are logged."""
        done = 0
        with self._lock:
            targets = self._node.targets
            needed = {
                targets[d.device].gpu.uuid
                for r in self._node.records().values()
                for d in r.devices
                if d.device in targets and is_placement(targets[d.device])
            }
            for uuid, gpu in sorted(gpus.items()):
                if uuid in needed:
                    continue
                try:
                    if self.mig.turn_off_after(gpu, self.turned_on):
                        done += 1
                        log.info(
                            "turned MIG mode off again",
                            extra={"device": gpu_device_name(gpu.minor), "gpu_uuid": uuid},
                        )
                except MigFailed as exc:
                    log.error(
                        "cannot turn MIG mode off again; reconcile will retry",
                        extra={"gpu_uuid": uuid, "error": str(exc)},
                    )
        return done
