"""The whole-GPU MIG-mode switch as a prepare step: a partitionable GPU claimed whole is taken out
of MIG mode, and put back once no claim holds it whole (docs/plugin.md "Dynamic MIG").

Flow position: the preparer core -> :class:`MigModeStep` (prepare.step.Step) -> instances.py
(DynamicMig.leave_mig_mode / enter_mig_mode) + modeswitch.py (the marks of GPUs taken out of MIG
mode, which discovery lays over NVML).

Apply records the claim ``PrepareStarted`` (durably), then takes each GPU it holds whole out of
MIG mode (its mark written durably first); an admin-access claim of a whole GPU changes nothing.
After the claim's record went, its GPUs go back into MIG mode unless another claim holds one
whole; a failure leaves the mark, and reconcile puts marked GPUs no claim holds whole back. One
lock serialises every mode change with the look at the claims that decides it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping

from dra_driver.devices import gpu_device_name
from dra_driver.errors import MigFailed
from dra_driver.gpus.info import GpuInfo
from dra_driver.mig.instances import DynamicMig
from dra_driver.mig.modeswitch import MigOffMarks
from dra_driver.mig.targets import leaves_mig
from dra_driver.prepare import ClaimPlan, ClaimRecord, DeviceTarget, NodeState, Step

log = logging.getLogger("dra_driver.prepare")  # steps log as part of prepare


class MigModeStep(Step):
    """Takes GPUs claimed whole out of MIG mode and back (``marks``: the GPUs taken out)."""

    def __init__(
        self,
        node: NodeState,
        mig: DynamicMig,
        *,
        marks: MigOffMarks,
        turned_on: MigOffMarks | None = None,
        lock: threading.Lock | None = None,
    ) -> None:
        self._node = node
        self.mig = mig
        self.marks = marks
        # GPUs this driver put into MIG mode (mig/ondemand_step.py): a whole-GPU claim takes
        # them back out without a mark of its own, and its unprepare leaves them out.
        self.turned_on = turned_on
        self._lock = lock or threading.Lock()  # shared with the on-demand step: one mode change

    def _recorded(self, but: str | None = None) -> Callable[[], frozenset[str]]:
        def recorded() -> frozenset[str]:
            return frozenset(
                d.device for r in self._node.records().values() if r.uid != but for d in r.devices
            )

        return recorded

    def plan(self, claim: ClaimPlan) -> tuple[DeviceTarget, ...] | None:
        whole = tuple(
            d.target for d in claim.devices if leaves_mig(d.target) and not d.admin_access
        )
        return whole or None

    def apply(
        self, plan: tuple[DeviceTarget, ...], claim: ClaimPlan, *, started: Callable[[], None]
    ) -> None:
        """Record the claim ``PrepareStarted``, then take each GPU it holds whole out of MIG
        mode (MigFailed: it has MIG instances or runs processes, or NVML refused)."""
        started()
        others = self._recorded(but=claim.ref.uid)
        for target in plan:
            with self._lock:
                self.mig.leave_mig_mode(
                    target.gpu,
                    target.name,
                    self.marks,
                    recorded=others,
                    turned_on=self.turned_on,
                )
            log.info(
                "took a GPU out of MIG mode",
                extra={"claim_uid": claim.ref.uid, "device": target.name},
            )

    def recorded(self, record: ClaimRecord, claim: ClaimPlan) -> None:
        """A GPU a prepared claim holds whole is (still, or again) out of MIG mode."""
        for device in claim.devices:
            if not leaves_mig(device.target) or device.admin_access:
                continue
            try:
                with self._lock:
                    self.mig.leave_mig_mode(
                        device.target.gpu,
                        device.target.name,
                        self.marks,
                        recorded=self._recorded(),
                        turned_on=self.turned_on,
                    )
            except MigFailed as exc:
                log.error(
                    "cannot complete a prepared claim's MIG instance; will retry",
                    extra={"claim_uid": record.uid, "error": str(exc)},
                )
                raise

    def restore(self, record: ClaimRecord) -> None:
        """Put the GPUs ``record`` (just removed) held whole back into MIG mode, unless another
        claim holds one; failures are logged, and reconcile tries again (the mark stays)."""
        gpus = _held_whole(record, self._node.targets)
        if gpus:
            self._sync(gpus)

    def reconcile(self) -> dict[str, int]:
        """Marked GPUs (taken out of MIG mode) that no recorded claim holds whole go back into
        MIG mode: what a crash after a claim's record went, or a reboot, left."""
        marked = self.marks.uuids()
        if not marked:
            return {"mig_modes_restored": 0}
        gpus = {
            t.gpu.uuid: t.gpu
            for t in self._node.targets.values()
            if leaves_mig(t) and t.gpu.uuid in marked
        }
        for uuid in sorted(marked - gpus.keys()):
            log.warning(
                "a GPU marked as taken out of MIG mode is not a partitionable GPU of this node "
                "now; its mark stays until it is",
                extra={"gpu_uuid": uuid, "mark": str(self.marks.path(uuid))},
            )
        return {"mig_modes_restored": self._sync(gpus)}

    def _sync(self, gpus: Mapping[str, GpuInfo]) -> int:
        """Put each GPU of ``gpus`` (UUID -> GPU) that no recorded claim holds whole back into
        MIG mode and remove its mark. Returns how many went back; failures are logged."""
        done = 0
        with self._lock:
            targets = self._node.targets
            held = {uuid for r in self._node.records().values() for uuid in _held_whole(r, targets)}
            for uuid, gpu in sorted(gpus.items()):
                if uuid in held or not self.marks.path(uuid).exists():
                    continue  # held, or not taken out of MIG mode by this driver (unmarked)
                try:
                    if self.mig.enter_mig_mode(gpu, self.marks):
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


def _held_whole(record: ClaimRecord, targets: Mapping[str, DeviceTarget]) -> dict[str, GpuInfo]:
    """GPU UUID -> GPU, for each GPU ``record`` holds whole under dynamic MIG (admin access
    aside): the GPUs it may have taken out of MIG mode."""
    return {
        targets[d.device].gpu.uuid: targets[d.device].gpu
        for d in record.devices
        if not d.admin_access and d.device in targets and leaves_mig(targets[d.device])
    }
