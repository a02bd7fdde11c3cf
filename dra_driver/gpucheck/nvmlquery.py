"""The check's NVML questions: every one read-only, timed, and answered with its return code.

Place in the flow: beside discovery (gpus/nvml.py, which the check also runs as the agent does),
for what the agent does not ask and a first real GPU should answer: the MIG tables in whatever
mode the GPU is in, event registration, ECC, retired pages and remapped rows. Each call goes
through :class:`Asker`, which refuses any NVML function that changes a GPU (:func:`is_setter`)
before it is called, times it, and records a success as ``{"value": ...}`` and a refusal as
``{"error": "NOT_SUPPORTED", "rc": 3}``, so a report says what NVML answered in the mode the GPU
was in, and the simulated GPUs can be held to the same answers (compare.py).
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from typing import Any

import pynvml

SETTER_PREFIXES = (
    "nvmlDeviceSet",
    "nvmlDeviceReset",
    "nvmlDeviceClear",
    "nvmlDeviceCreate",
    "nvmlDeviceModify",
    "nvmlDeviceDiscover",
    "nvmlDeviceRemove",
    "nvmlGpuInstanceCreate",
    "nvmlGpuInstanceDestroy",
    "nvmlComputeInstanceDestroy",
    "nvmlSystemSet",
    "nvmlUnitSet",
    "nvmlVgpuInstanceSet",
    "nvmlGpmSet",
)
"""Name prefixes of the NVML functions that change a GPU, a MIG layout or the system (pynvml
spells each C function's name; the C names carry version suffixes such as ``_v2``)."""

# Every event type pynvml names, registered one at a time (which ones the GPU accepts).
EVENT_TYPES: dict[str, int] = {
    name.removeprefix("nvmlEventType"): int(getattr(pynvml, name))
    for name in sorted(dir(pynvml))
    if name.startswith("nvmlEventType") and name not in ("nvmlEventTypeAll", "nvmlEventTypeNone")
}
_ERROR_NAMES = {
    int(getattr(pynvml, n)): n.removeprefix("NVML_ERROR_")
    for n in dir(pynvml)
    if n.startswith("NVML_ERROR_") and isinstance(getattr(pynvml, n), int)
}


def is_setter(name: str) -> bool:
    """Whether the NVML function ``name`` changes anything (the check never calls one)."""
    return name.startswith(SETTER_PREFIXES)


class ReadOnlyViolation(RuntimeError):
    """The check was about to call an NVML function that changes something (a bug in it)."""


class Asker:
    """Calls pynvml functions read-only, timing each; ``calls`` lists (name, seconds) in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, float]] = []

    def __call__(self, fn: Callable[..., Any], *args: Any, name: str | None = None) -> Any:
        """The answer of ``fn(*args)`` as JSON: ``{"value": v, "ms": t}`` or ``{"error": NAME,
        "rc": n, "ms": t}``. Raises ReadOnlyViolation for a setter, before calling it."""
        label = name or fn.__name__
        if is_setter(label) or is_setter(fn.__name__):
            raise ReadOnlyViolation(f"the GPU check must not call {label}")
        start = time.perf_counter()
        try:
            value = fn(*args)
        except pynvml.NVMLError as exc:
            seconds = time.perf_counter() - start
            self.calls.append((label, seconds))
            rc = int(exc.value)
            return {"error": _ERROR_NAMES.get(rc, str(rc)), "rc": rc, "ms": _ms(seconds)}
        seconds = time.perf_counter() - start
        self.calls.append((label, seconds))
        return {"value": plain(value), "ms": _ms(seconds)}


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def plain(value: Any) -> Any:
    """A pynvml answer as JSON: ctypes structures as dicts of their fields, bytes as text."""
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    if isinstance(value, ctypes.Structure):
        return {name: plain(getattr(value, name)) for name, *_ in value._fields_}
    if isinstance(value, ctypes.Array):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [plain(v) for v in value]
    if isinstance(value, int | float | str | bool) or value is None:
        return value
    return str(value)


def _placements(handle: Any, profile_id: int) -> list[dict[str, int]]:
    count = ctypes.c_uint(0)
    fn = pynvml.nvmlDeviceGetGpuInstancePossiblePlacements
    fn(handle, profile_id, None, ctypes.byref(count))  # NVML reports the count first
    array = (pynvml.c_nvmlGpuInstancePlacement_t * count.value)()
    fn(handle, profile_id, array, ctypes.byref(count))
    return [{"start": p.start, "size": p.size} for p in array[: count.value]]


def mig_answers(ask: Asker, handle: Any) -> dict[str, Any]:
    """MIG mode (current, pending) and every GPU-instance profile NVML answers for in the mode
    the GPU is in: its info, possible placements and remaining capacity, or the return code."""
    profiles: dict[str, Any] = {}
    for index in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
        info = ask(pynvml.nvmlDeviceGetGpuInstanceProfileInfo, handle, index)
        entry: dict[str, Any] = {"info": info}
        if "value" in info:
            profile_id = info["value"]["id"]
            entry["placements"] = ask(
                _placements, handle, profile_id, name="nvmlDeviceGetGpuInstancePossiblePlacements"
            )
            entry["remaining_capacity"] = ask(
                pynvml.nvmlDeviceGetGpuInstanceRemainingCapacity, handle, profile_id
            )
        profiles[str(index)] = entry
    return {
        "mode": ask(pynvml.nvmlDeviceGetMigMode, handle),
        "max_mig_devices": ask(pynvml.nvmlDeviceGetMaxMigDeviceCount, handle),
        "profiles": profiles,
    }


def _register_each(handle: Any) -> dict[str, Any]:
    """Which event types the GPU accepts, each on an event set of its own (freed at once)."""
    answers: dict[str, Any] = {}
    for name, bit in EVENT_TYPES.items():
        event_set = pynvml.nvmlEventSetCreate()
        try:
            pynvml.nvmlDeviceRegisterEvents(handle, bit, event_set)
            answers[name] = "registered"
        except pynvml.NVMLError as exc:
            answers[name] = _ERROR_NAMES.get(int(exc.value), str(exc.value))
        finally:
            pynvml.nvmlEventSetFree(event_set)
    return answers


def health_answers(ask: Asker, handle: Any) -> dict[str, Any]:
    """Event support, ECC mode and counts, retired pages and remapped rows of one GPU."""
    volatile, aggregate = pynvml.NVML_VOLATILE_ECC, pynvml.NVML_AGGREGATE_ECC
    corrected = pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED
    uncorrected = pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
    total = pynvml.nvmlDeviceGetTotalEccErrors
    retired = pynvml.nvmlDeviceGetRetiredPages
    return {
        "supported_event_types": ask(pynvml.nvmlDeviceGetSupportedEventTypes, handle),
        "event_registration": ask(_register_each, handle, name="nvmlDeviceRegisterEvents"),
        "ecc_mode": ask(pynvml.nvmlDeviceGetEccMode, handle),
        "ecc_errors": {
            "volatile_corrected": ask(total, handle, corrected, volatile),
            "volatile_uncorrected": ask(total, handle, uncorrected, volatile),
            "aggregate_corrected": ask(total, handle, corrected, aggregate),
            "aggregate_uncorrected": ask(total, handle, uncorrected, aggregate),
        },
        "remapped_rows": ask(pynvml.nvmlDeviceGetRemappedRows, handle),
        "retired_pages": {
            "single_bit_ecc": ask(
                retired, handle, pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS
            ),
            "double_bit_ecc": ask(
                retired, handle, pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR
            ),
        },
        "retired_pages_pending": ask(pynvml.nvmlDeviceGetRetiredPagesPendingStatus, handle),
    }


def gpu_handle(index: int) -> Any:
    return pynvml.nvmlDeviceGetHandleByIndex(index)


__all__ = [
    "EVENT_TYPES",
    "SETTER_PREFIXES",
    "Asker",
    "ReadOnlyViolation",
    "gpu_handle",
    "health_answers",
    "is_setter",
    "mig_answers",
    "plain",
]
