"""Time slicing as a prepare step: a full GPU's time slice set to what its claims ask.

Flow position: the preparer core -> :class:`TimeSliceStep` (prepare.step.Step) -> timeslice.py
(``nvidia-smi compute-policy``). A claim whose full GPU's config asks for an interval is
recorded ``PrepareStarted`` (durably; refusing an interval other than the one another claim on
the GPU asks for: one GPU has one time slice), then the GPU's time slice is set; a failure
rolls the claim back. Once a claim's record is gone its GPUs are set back to what the remaining
claims ask, else Default; reconcile repairs what a crash or a failed restore left.

A file per GPU uuid under ``<state dir>/timeslice`` means "its time slice may not be Default":
created (durably) before a non-default interval is set, removed once Default is set again, so
a crash between a claim's removal and the restore still leaves a trace reconcile sees.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from dra_driver.errors import ConfigNotSupported, DeviceConflict, TimeSliceFailed
from dra_driver.fsutil import fsync_dir
from dra_driver.prepare import ClaimPlan, ClaimRecord, Claims, NodeState, Step, owner
from dra_driver.sharing import timeslice

log = logging.getLogger("dra_driver.prepare")  # steps log as part of prepare

MARKS_DIRECTORY = "timeslice"


@dataclass(frozen=True)
class SlicePlan:
    """The intervals a claim asks of its full GPUs: device name -> interval, and their UUIDs."""

    intervals: Mapping[str, str]
    gpu_uuids: frozenset[str]


class TimeSliceStep(Step):
    """Sets the time slices claims ask for (``timeslicer`` None: such claims are refused)."""

    def __init__(self, node: NodeState, timeslicer: timeslice.TimeSlicer | None) -> None:
        self._node = node
        self._timeslicer = timeslicer
        # GPU uuid -> the interval this process set or found there since it started (absent:
        # unknown). One lock for every change, so that a GPU is set to what the checkpoint says
        # at that moment.
        self._slices: dict[str, str] = {}
        self._lock = threading.Lock()
        self._marks = node.state_dir / MARKS_DIRECTORY

    def plan(self, claim: ClaimPlan) -> SlicePlan | None:
        intervals = {}
        uuids = set()
        for device in claim.devices:
            if device.target.type != "gpu":
                continue
            interval = timeslice.recorded_interval(device.config_json)
            if interval is not None:
                intervals[device.target.name] = interval
                uuids.add(device.target.gpu.uuid)
        if not intervals:
            return None
        if self._timeslicer is None:
            raise ConfigNotSupported(
                f"{claim.where}: time slicing is not available (this agent runs no nvidia-smi)"
            )
        return SlicePlan(intervals, frozenset(uuids))

    def check(self, plan: SlicePlan, claim: ClaimPlan, *, claims: Claims) -> None:
        """Refuse a GPU another claim asks another interval of (one GPU has one time slice)."""
        for name, want in plan.intervals.items():
            for other in claims.holding(name):
                if other.uid == claim.ref.uid or not want:
                    continue
                for held in other.devices:
                    theirs = (
                        timeslice.recorded_interval(held.config) if held.device == name else None
                    )
                    if theirs is not None and theirs != want:
                        raise DeviceConflict(
                            f"device {name} is prepared for claim {owner(other)} with "
                            f"time-slice "
                            f"interval {theirs}; this claim asks for interval {want} (a GPU has "
                            "one time slice for all its claims)",
                            holders=(other.uid,),
                        )

    def apply(self, plan: SlicePlan, claim: ClaimPlan, *, started: Callable[[], None]) -> None:
        """Record the claim ``PrepareStarted``, then set the time slice of each GPU it asks one
        of; TimeSliceFailed names what nvidia-smi said."""
        started()
        self.sync(plan.gpu_uuids, strict=True)

    def restore(self, record: ClaimRecord) -> None:
        """Set the GPUs whose time slice ``record`` (just removed) asked for to what the
        remaining claims ask; failures are logged and left to reconcile."""
        targets = self._node.targets
        uuids = {
            targets[d.device].gpu.uuid
            for d in record.devices
            if d.device in targets and timeslice.recorded_interval(d.config) is not None
        }
        if uuids:
            self.sync(uuids, strict=False)

    def reconcile(self) -> dict[str, int]:
        """GPUs whose time slice is not what the claims ask (at start every GPU a claim asks a
        non-default interval of, or marked; then only those whose last change failed)."""
        return {"time_slices_set": self.sync(None, strict=False)}

    def _wanted(self) -> dict[str, str]:
        """GPU uuid -> the interval the recorded claims (either phase) ask of it; a GPU no
        claim asks one of should be at Default. The conflict check keeps it to one per GPU."""
        targets = self._node.targets
        wanted: dict[str, str] = {}
        for record in self._node.records().values():
            for device in record.devices:
                interval = timeslice.recorded_interval(device.config)
                target = targets.get(device.device)
                if interval is not None and target is not None and target.type == "gpu":
                    wanted[target.gpu.uuid] = interval
        return wanted

    def sync(self, uuids: Iterable[str] | None, *, strict: bool) -> int:
        """Set each GPU of ``uuids`` (None: every full GPU of the node) to the interval the
        checkpoint asks of it now, where it may differ: what this process set since it started
        differs, or it is unknown and a claim asks for a non-default interval or the GPU is
        marked as maybe not Default. Returns how many were set. ``strict``: the first failure
        raises TimeSliceFailed; else failures are logged (the GPU stays unknown: the next
        reconcile pass tries again). Without a time slicer: nothing to do."""
        if self._timeslicer is None:
            return 0
        if uuids is None:
            uuids = {t.gpu.uuid for t in self._node.targets.values() if t.type == "gpu"}
        done = 0
        with self._lock:
            wanted = self._wanted()
            for uuid in sorted(uuids):
                want = wanted.get(uuid, timeslice.DEFAULT)
                known = self._slices.get(uuid)
                if known == want:
                    continue
                mark = self._marks / uuid
                if known is None and want == timeslice.DEFAULT and not mark.exists():
                    self._slices[uuid] = want  # never set by us: the driver's default
                    continue
                try:
                    self._set(uuid, want, mark)
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

    def _set(self, uuid: str, interval: str, mark: Path) -> None:
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
