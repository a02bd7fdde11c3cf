"""The C side of the simulated library as pynvml sees it: return codes, exported symbols, handles.

What every simulated NVML function (library.py, devices.py, readings.py, health.py, mig.py) is
written with: the NVML return codes, the object pynvml finds for a symbol name
(``CFunction``), the ctypes helpers that write through the pointers pynvml passes, and the
opaque handle values that stand for GPUs. Nothing here knows a GPU's state.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pynvml

from dra_driver.sim.nvml.node import SimulatedGpu

SUCCESS: int = pynvml.NVML_SUCCESS
UNINITIALIZED: int = pynvml.NVML_ERROR_UNINITIALIZED
INVALID_ARGUMENT: int = pynvml.NVML_ERROR_INVALID_ARGUMENT
NOT_SUPPORTED: int = pynvml.NVML_ERROR_NOT_SUPPORTED
NOT_FOUND: int = pynvml.NVML_ERROR_NOT_FOUND
INSUFFICIENT_SIZE: int = pynvml.NVML_ERROR_INSUFFICIENT_SIZE
GPU_IS_LOST: int = pynvml.NVML_ERROR_GPU_IS_LOST
VERSION_MISMATCH: int = pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
TIMEOUT: int = pynvml.NVML_ERROR_TIMEOUT
IN_USE: int = pynvml.NVML_ERROR_IN_USE
RESET_REQUIRED: int = pynvml.NVML_ERROR_RESET_REQUIRED
INSUFFICIENT_RESOURCES: int = pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES
UNKNOWN: int = pynvml.NVML_ERROR_UNKNOWN

ERROR_STRINGS = {
    SUCCESS: b"Success",
    UNINITIALIZED: b"Uninitialized",
    INVALID_ARGUMENT: b"Invalid Argument",
    NOT_SUPPORTED: b"Not Supported",
    NOT_FOUND: b"Not Found",
    INSUFFICIENT_SIZE: b"Insufficient Size",
    GPU_IS_LOST: b"GPU is lost",
    VERSION_MISMATCH: b"Argument version mismatch",
    TIMEOUT: b"Timeout",
    IN_USE: b"In use by another client",
    RESET_REQUIRED: b"GPU requires restart",
    INSUFFICIENT_RESOURCES: b"Insufficient resources",
    UNKNOWN: b"Unknown Error",
}


WITHOUT_INIT = frozenset({"nvmlInitWithFlags", "nvmlInit_v2", "nvmlErrorString"})


class CFunction:
    """One exported symbol. A plain object, so pynvml may set ``restype`` on it like on ctypes."""

    def __init__(self, name: str, impl: Callable[..., Any]) -> None:
        self.__name__ = name
        self._impl = impl
        self.restype: Any = ctypes.c_int
        self.argtypes: Any = None

    def __call__(self, *args: Any) -> Any:
        return self._impl(*args)


def pointee(ref: Any) -> Any:
    """The object a ``byref(...)`` argument points at."""
    return ref._obj


def as_int(arg: Any) -> int:
    """An integer argument, passed as a Python int or as a ctypes value."""
    return arg if isinstance(arg, int) else int(arg.value)


def address_of(handle: Any) -> int:
    """The address a handle argument holds (0 for NULL)."""
    return ctypes.cast(handle, ctypes.c_void_p).value or 0


def set_pointer(ref: Any, address: int) -> None:
    """Store ``address`` in the pointer that ``ref`` (a byref of a handle) points at."""
    target = pointee(ref)
    value = ctypes.c_void_p(address)
    ctypes.memmove(ctypes.addressof(target), ctypes.addressof(value), ctypes.sizeof(value))


def write_string(buffer: Any, length: Any, text: str) -> int:
    """Copy ``text`` into a caller's buffer of ``length`` bytes (NUL included), as NVML does."""
    data = text.encode()
    if len(data) + 1 > as_int(length):
        return INSUFFICIENT_SIZE
    buffer.value = data
    return SUCCESS


def nvml_bus_id(pci_bus_id: str) -> str:
    """NVML's spelling of a bus id: 8-digit domain, upper case ("00000000:1B:00.0")."""
    domain, rest = pci_bus_id.split(":", 1)
    return f"{int(domain, 16):08X}:{rest.upper()}"


@dataclass
class Handles:
    """Opaque full-GPU handle values pynvml passes back to us; never dereferenced by anyone.

    Each GPU owns 0x1000 addresses from its handle on; the MIG block (SimulatedMigInstances)
    gives its MIG device, GPU-instance and compute-instance handles addresses inside that range.
    """

    gpus: dict[int, SimulatedGpu] = field(default_factory=dict)
    gpu_address: dict[int, int] = field(default_factory=dict)  # index -> handle

    def add(self, gpus: tuple[SimulatedGpu, ...]) -> None:
        address = 0x5EED0000
        for gpu in gpus:
            address += 0x1000
            self.gpus[address] = gpu
            self.gpu_address[gpu.index] = address


NO_INSTANCE = 0xFFFFFFFF
"""The GPU/compute-instance id of an event or process that belongs to no MIG instance."""


def placement_arg(arg: Any) -> Any:
    """The placement struct a ``const nvml...Placement_t *`` argument points at."""
    if hasattr(arg, "_obj"):
        return arg._obj  # byref(...)
    if isinstance(arg, ctypes.Structure):
        return arg
    return arg.contents  # a pointer(...)
