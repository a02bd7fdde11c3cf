"""GPU health in the simulated library: NVML events and XIDs, the health queries, injected faults.

The health side of the simulated library (library.py collects the table): the event-set
functions (nvmlEventSetCreate, nvmlDeviceRegisterEvents, nvmlEventSetWait_v2, ...), the queries
the health watch polls (retired pages, remapped rows, temperature and its thresholds), and the
faults a test, the demo or another process injects (an XID, a double-bit ECC error, a lost GPU,
a GPU reset, a temperature, a hang: sim/faults.py describes them), directly with
``SimulatedHealth.inject`` or through the inbox file other processes append to. A lost or
hanging GPU affects every call on it (``answers``); telemetry (readings.py) reads the faults'
temperature and ECC counts from here.
"""

from __future__ import annotations

import ctypes
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pynvml

from dra_driver.errors import SimulationSpecError
from dra_driver.sim.nvml.abi import (
    GPU_IS_LOST,
    INVALID_ARGUMENT,
    NO_INSTANCE,
    NOT_SUPPORTED,
    SUCCESS,
    TIMEOUT,
    VERSION_MISMATCH,
    address_of,
    as_int,
    pointee,
    set_pointer,
)
from dra_driver.sim.nvml.inboxwatch import InboxWatch, open_inbox_watch
from dra_driver.sim.nvml.node import SimulatedGpu
from dra_driver.sim.nvml.parts import Library

if TYPE_CHECKING:
    from dra_driver.sim.faults import SimulatedFault

SUPPORTED_EVENT_TYPES = 0xFF9F
"""What ``nvmlDeviceGetSupportedEventTypes`` answers for a simulated GPU with events: what a
real H200 on driver 580.159.04 answered (every type of nvml.h's ``nvmlEventTypeAll``: ECC
errors and storms, P-state, XIDs, clocks, power source, DRAM retirement, poison errors, GPU
unavailable and recovery actions), and each of them registered there on its own."""
SLOWDOWN_C = 87  # NVML_TEMPERATURE_THRESHOLD_SLOWDOWN of every simulated GPU
SHUTDOWN_C = 92
IDLE_C = 38
XID_GPU_LOST = 79  # "GPU has fallen off the bus", what the driver reports for a lost GPU
XID_DOUBLE_BIT_ECC = 48
_INBOX_POLL_S = 0.02  # how often an NVML call (a wait without inotify) looks at the inbox

_log = logging.getLogger("dra_driver.sim.nvml")  # one logger for the whole simulated library


class _GpuHealth:
    # Plain classes, not dataclasses: the agent's memory budget (see health/decisions.py).
    __slots__ = (
        "ecc_aggregate",
        "ecc_volatile",
        "hang_until",
        "lost",
        "remapped_rows_pending",
        "retired_pages_pending",
        "row_remap_failure",
        "temperature_c",
        "temperature_injected",
    )

    def __init__(self) -> None:
        self.lost = False
        self.hang_until = 0.0  # time.monotonic()
        self.ecc_volatile = 0  # uncorrected, since the last reset
        self.ecc_aggregate = 0  # uncorrected, lifetime
        self.retired_pages_pending = False
        self.remapped_rows_pending = False
        self.row_remap_failure = False
        self.temperature_c = IDLE_C
        self.temperature_injected = False  # else telemetry's moving reading is the temperature


class _EventSet:
    __slots__ = ("lost", "queue", "registered")

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}  # GPU index -> event mask
        self.queue: deque[tuple[int, int, int, int, int]] = deque()
        self.lost: set[int] = set()  # GPUs lost since the last wait


class SimulatedHealth:
    """The health side of a simulated node: state per GPU, event sets, faults, the inbox."""

    def __init__(self, library: Library, *, inbox: Path | None) -> None:
        self._library = library
        self._gpus = {g.index: g for g in library.gpus}
        self._state = {g.index: _GpuHealth() for g in library.gpus}
        self._sets: dict[int, _EventSet] = {}
        self._next_set = 0x5E7E0000
        self._changed = threading.Condition()
        self.inbox = inbox
        # where the next unread line starts, in which file (a replaced inbox is read anew)
        self._inbox_offset, self._inbox_file = 0, (0, 0)
        if inbox is not None and inbox.exists():
            seen = inbox.stat()
            self._inbox_offset, self._inbox_file = seen.st_size, (seen.st_dev, seen.st_ino)
        self._inbox_checked = 0.0
        self._inbox_lock = threading.Lock()
        self._watches: set[InboxWatch] = set()  # of the waits blocked on the inbox (lock held)

    # --- faults ------------------------------------------------------------------------------

    def inject(self, fault: SimulatedFault) -> None:
        """Make ``fault`` happen now; SimulationSpecError for a GPU the node does not have."""
        gpu = self._gpus.get(fault.gpu)
        if gpu is None:
            raise SimulationSpecError(
                f"no simulated GPU {fault.gpu}: the node has GPUs 0-{len(self._gpus) - 1}"
            )
        with self._changed:
            state = self._state[gpu.index]
            if fault.kind == "xid":
                gi, ci = fault.gpu_instance_id, fault.compute_instance_id
                self._emit(
                    gpu.index,
                    pynvml.nvmlEventTypeXidCriticalError,
                    data=fault.xid,
                    gpu_instance_id=NO_INSTANCE if gi is None else gi,
                    compute_instance_id=NO_INSTANCE if ci is None else ci,
                )
            elif fault.kind == "ecc":
                state.ecc_volatile += 1
                state.ecc_aggregate += 1
                if gpu.spec.hardware.architecture >= pynvml.NVML_DEVICE_ARCH_AMPERE:
                    state.remapped_rows_pending = True
                else:
                    state.retired_pages_pending = True
                self._emit(gpu.index, pynvml.nvmlEventTypeDoubleBitEccError, data=0)
                self._emit(gpu.index, pynvml.nvmlEventTypeXidCriticalError, data=XID_DOUBLE_BIT_ECC)
            elif fault.kind == "lost":
                self._emit(gpu.index, pynvml.nvmlEventTypeXidCriticalError, data=XID_GPU_LOST)
                state.lost = True
                for event_set in self._sets.values():
                    if gpu.index in event_set.registered:
                        event_set.lost.add(gpu.index)
            elif fault.kind == "reset":
                state.lost = False
                state.hang_until = 0.0
                state.ecc_volatile = 0
                state.retired_pages_pending = state.remapped_rows_pending = False
                state.row_remap_failure = False
            elif fault.kind == "row-remap-failure":
                state.row_remap_failure = True
            elif fault.kind == "temperature":
                state.temperature_c = fault.celsius
                state.temperature_injected = True
            else:
                state.hang_until = time.monotonic() + fault.seconds
            self._changed.notify_all()
            for watch in self._watches:
                watch.wake()

    def _emit(
        self,
        index: int,
        event_type: int,
        *,
        data: int,
        gpu_instance_id: int = NO_INSTANCE,
        compute_instance_id: int = NO_INSTANCE,
    ) -> None:
        """Queue an event on every set that registered the GPU for its type (lock held)."""
        for event_set in self._sets.values():
            if event_set.registered.get(index, 0) & event_type:
                event_set.queue.append(
                    (index, event_type, data, gpu_instance_id, compute_instance_id)
                )

    def read_inbox(self, *, now: bool = False) -> None:
        """Inject the faults other processes appended to the inbox since the last look.

        Called on every NVML call, at most every 20 ms, and by a wait when the inbox changed
        (``now``: whenever it last looked, waiting for another thread's look to end). A line
        that is not a fault is logged and skipped; a truncated or replaced file is read again
        from the start.
        """
        if self.inbox is None:
            return
        started = time.monotonic()
        if now:
            self._inbox_lock.acquire()
        elif started - self._inbox_checked < _INBOX_POLL_S or not self._inbox_lock.acquire(False):
            return
        try:
            self._inbox_checked = started
            try:
                seen = self.inbox.stat()
            except OSError:
                return
            size = seen.st_size
            if size < self._inbox_offset or (seen.st_dev, seen.st_ino) != self._inbox_file:
                self._inbox_offset, self._inbox_file = 0, (seen.st_dev, seen.st_ino)
            if size == self._inbox_offset:
                return
            with self.inbox.open("rb") as f:
                f.seek(self._inbox_offset)
                data = f.read(size - self._inbox_offset)
            complete = data[: data.rfind(b"\n") + 1]
            self._inbox_offset += len(complete)
            for line in complete.decode(errors="replace").splitlines():
                if line.strip():
                    self._inject_line(line)
        finally:
            self._inbox_lock.release()

    def _inject_line(self, line: str) -> None:
        from dra_driver.sim.faults import SimulatedFault  # noqa: PLC0415  (rarely needed)

        try:
            data = json.loads(line)
            if not isinstance(data, dict):
                raise SimulationSpecError("not a JSON object")
            fault = SimulatedFault.from_json(data)
            self.inject(fault)
        except (ValueError, SimulationSpecError) as exc:
            _log.warning("simulated GPUs: ignoring inbox line %r: %s", line, exc)
            return
        _log.info("simulated GPUs: injected %s", fault.to_json())

    def answers(self, gpu: SimulatedGpu) -> bool:
        """False while ``gpu`` is lost; blocks while it hangs (every call on it)."""
        state = self._state[gpu.index]
        left = state.hang_until - time.monotonic()
        if left > 0:
            time.sleep(left)
        return not state.lost

    # --- the NVML functions ------------------------------------------------------------------

    def functions(self) -> dict[str, Callable[..., Any]]:
        # nvmlDeviceGetHandleByUUID, nvmlDeviceGetTemperature and nvmlDeviceGetTotalEccErrors
        # are the library's (telemetry's), which read this state: one answer per symbol.
        return {
            "nvmlEventSetCreate": self._set_create,
            "nvmlEventSetFree": self._set_free,
            "nvmlDeviceGetSupportedEventTypes": self._supported_events,
            "nvmlDeviceRegisterEvents": self._register,
            "nvmlEventSetWait_v2": self._wait,
            "nvmlDeviceGetRetiredPagesPendingStatus": self._retired_pages_pending,
            "nvmlDeviceGetRetiredPages": self._retired_pages,
            "nvmlDeviceGetEccMode": self._ecc_mode,
            "nvmlDeviceGetRemappedRows": self._remapped_rows,
            "nvmlDeviceGetTemperatureV": self._temperature_v,
            "nvmlDeviceGetTemperatureThreshold": self._threshold,
        }

    def _full_gpu(self, handle: Any) -> tuple[SimulatedGpu | None, int]:
        return self._library.full_gpu(handle)

    def _set_create(self, ref: Any) -> int:
        with self._changed:
            self._next_set += 0x10
            self._sets[self._next_set] = _EventSet()
            set_pointer(ref, self._next_set)
        return SUCCESS

    def _set_free(self, event_set: Any) -> int:
        with self._changed:
            if self._sets.pop(address_of(event_set), None) is None:
                return INVALID_ARGUMENT
        return SUCCESS

    def _supported_events(self, handle: Any, ref: Any) -> int:
        gpu, rc = self._full_gpu(handle)
        if gpu is None or rc != SUCCESS:
            return rc
        if not gpu.spec.events:
            return NOT_SUPPORTED
        pointee(ref).value = SUPPORTED_EVENT_TYPES
        return SUCCESS

    def _register(self, handle: Any, event_types: Any, event_set: Any) -> int:
        gpu, rc = self._full_gpu(handle)
        if gpu is None or rc != SUCCESS:
            return rc
        mask = as_int(event_types)
        # nvml.h: NOT_SUPPORTED "if the platform does not support this feature or some of
        # requested event types".
        if not gpu.spec.events or mask & ~SUPPORTED_EVENT_TYPES:
            return NOT_SUPPORTED
        with self._changed:
            found = self._sets.get(address_of(event_set))
            if found is None:
                return INVALID_ARGUMENT
            found.registered[gpu.index] = found.registered.get(gpu.index, 0) | mask
        return SUCCESS

    def _wait(self, event_set: Any, data_ref: Any, timeout_ms: Any) -> int:
        """Block for an event as NVML does; the inbox is watched meanwhile (inboxwatch.py:
        without waking until it changes, where inotify is there; else looked at every 20 ms)."""
        deadline = time.monotonic() + as_int(timeout_ms) / 1000
        watch = open_inbox_watch(self.inbox) if self.inbox is not None else None
        try:
            changed = True  # read the inbox once before the first wait, however recently read
            while True:
                self.read_inbox(now=changed and watch is not None)
                with self._changed:
                    rc = self._take_event(event_set, data_ref)
                    if rc is not None:
                        return rc
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return TIMEOUT
                    if watch is None:
                        self._changed.wait(min(left, _INBOX_POLL_S) if self.inbox else left)
                        continue
                    self._watches.add(watch)  # from here, an inject() wakes the wait below
                try:
                    changed = watch.wait(left)
                finally:
                    with self._changed:
                        self._watches.discard(watch)
        finally:
            if watch is not None:
                watch.close()

    def _take_event(self, event_set: Any, data_ref: Any) -> int | None:
        """The wait's answer when it has one now: the next queued event (written to
        ``data_ref``), GPU_IS_LOST or INVALID_ARGUMENT; None to go on waiting. Lock held."""
        found = self._sets.get(address_of(event_set))
        if found is None:
            return INVALID_ARGUMENT
        if found.queue:
            index, event_type, data, gi, ci = found.queue.popleft()
            event = pointee(data_ref)
            event.device = ctypes.cast(
                ctypes.c_void_p(self._library.handles.gpu_address[index]),
                pynvml.c_nvmlDevice_t,
            )
            event.eventType = event_type
            event.eventData = data
            event.gpuInstanceId = gi
            event.computeInstanceId = ci
            return SUCCESS
        if found.lost:  # nvml.h: GPU_IS_LOST "if a GPU has fallen off the bus"
            found.lost.clear()
            return GPU_IS_LOST
        return None

    def _retired_pages_pending(self, handle: Any, ref: Any) -> int:
        gpu, rc = self._full_gpu(handle)
        if gpu is None or rc != SUCCESS:
            return rc
        if gpu.spec.hardware.architecture >= pynvml.NVML_DEVICE_ARCH_AMPERE:
            return NOT_SUPPORTED  # row remapping replaced page retirement
        pointee(ref).value = int(self._state[gpu.index].retired_pages_pending)
        return SUCCESS

    def _retired_pages(self, handle: Any, cause: Any, count: Any, addresses: Any) -> int:
        """No page is ever retired on a simulated GPU; Ampere and newer remap rows instead and
        answer NOT_SUPPORTED (as a real H200 did)."""
        gpu, rc = self._full_gpu(handle)
        if gpu is None or rc != SUCCESS:
            return rc
        if gpu.spec.hardware.architecture >= pynvml.NVML_DEVICE_ARCH_AMPERE:
            return NOT_SUPPORTED
        if as_int(cause) >= pynvml.NVML_PAGE_RETIREMENT_CAUSE_COUNT:
            return INVALID_ARGUMENT
        pointee(count).value = 0
        return SUCCESS

    def _ecc_mode(self, handle: Any, current: Any, pending: Any) -> int:
        """ECC enabled, now and after the next reset, as every simulated product ships (a real
        H200 answered enabled/enabled)."""
        gpu, rc = self._full_gpu(handle)
        if gpu is None or rc != SUCCESS:
            return rc
        pointee(current).value = pynvml.NVML_FEATURE_ENABLED
        pointee(pending).value = pynvml.NVML_FEATURE_ENABLED
        return SUCCESS

    def _remapped_rows(self, handle: Any, corr: Any, unc: Any, pending: Any, failure: Any) -> int:
        gpu, rc = self._full_gpu(handle)
        if gpu is None or rc != SUCCESS:
            return rc
        if gpu.spec.hardware.architecture < pynvml.NVML_DEVICE_ARCH_AMPERE:
            return NOT_SUPPORTED
        state = self._state[gpu.index]
        pointee(corr).value = 0
        pointee(unc).value = state.ecc_aggregate
        pointee(pending).value = int(state.remapped_rows_pending)
        pointee(failure).value = int(state.row_remap_failure)
        return SUCCESS

    def temperature(self, gpu: SimulatedGpu) -> int | None:
        """The temperature a fault set on ``gpu``; None when none did (telemetry's reading)."""
        state = self._state[gpu.index]
        return state.temperature_c if state.temperature_injected else None

    def uncorrected_ecc(self, gpu: SimulatedGpu, *, volatile: bool) -> int:
        """Uncorrected ECC errors the faults caused on ``gpu`` (volatile: since its reset)."""
        state = self._state[gpu.index]
        return state.ecc_volatile if volatile else state.ecc_aggregate

    def _temperature_v(self, handle: Any, ref: Any) -> int:
        gpu, rc = self._full_gpu(handle)
        if gpu is None or rc != SUCCESS:
            return rc
        reading = pointee(ref)
        if reading.version != pynvml.nvmlTemperature_v1:
            return VERSION_MISMATCH
        if reading.sensorType != pynvml.NVML_TEMPERATURE_GPU:
            return INVALID_ARGUMENT
        reading.temperature = self._library.gpu_temperature(gpu)
        return SUCCESS

    def _threshold(self, handle: Any, threshold: Any, ref: Any) -> int:
        gpu, rc = self._full_gpu(handle)
        if gpu is None or rc != SUCCESS:
            return rc
        values = {
            pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN: SLOWDOWN_C,
            pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN: SHUTDOWN_C,
        }
        value = values.get(as_int(threshold))
        if value is None:
            return NOT_SUPPORTED
        pointee(ref).value = value
        return SUCCESS


# --- MIG instance management: GPU and compute instances created and destroyed through NVML ---
#
# Kept apart from discovery above: nvmlDeviceCreateGpuInstance(WithPlacement),
# nvmlGpuInstanceDestroy, nvmlDeviceGetGpuInstances, nvmlDeviceGetGpuInstanceRemainingCapacity
# and their compute-instance counterparts, with the return codes nvml.h documents for them. The
# instances that exist are one immutable view, replaced under one lock on every change (after the
# state file, when there is one, has been written), so discovery, telemetry and the health watch
# read a consistent set without locking. The spec's layout is the state a node starts from.
#
# Modelled: the profiles' placement tables on the 8 memory slices, the per-profile instance
# counts (which is what makes a ``+me`` profile exclusive: one instance of it per GPU), the 7
# compute slices, the full-GPU-instance compute profile, and processes holding a compute
# instance (SimulatedNvmlLibrary.processes: IN_USE), and each GPU's MIG mode, current and
# pending, switched with nvmlDeviceSetMigMode (see _set_mig_mode for what real NVML does there).
