"""Simulated GPUs: a stand-in for the NVML C library that pynvml loads, plus a matching sysfs tree.

This is the first step of the flow for nodes without GPUs (the demo, tests, users trying the
driver): ``simulated_nvml(spec, node_name=...)`` puts a fake library object where pynvml keeps
its ``CDLL`` handle (``pynvml.nvmlLib``). pynvml looks C symbols up by name on that object and
calls them with ctypes arguments, so ``gpus.nvml.discover`` runs its normal pynvml call sequence,
including pynvml's own argument marshalling and return-code checks, against simulated hardware.
There is no second discovery path. Hardware facts come from gpus/profiles.py.

Spec syntax (documented for users in docs/simulate.md)::

    spec   := group ("," group)*
    group  := product [":" count] (":" option)*
    option := "mig" | "mig=" layout | "mig-pending" | "addressing=" ("hmm" | "ats")
            | "numa=" (node | "none") | "fail" | "no-events"
    layout := entry ("+" entry)*          entry := profile ["*" count]

e.g. ``h100:8``, ``a100-80gb:2,l4:1``, ``a100-40gb:1:mig=3g.20gb+2g.10gb+1g.5gb``,
``h100:1:mig=1g.10gb*7``. A layout entry that does not start with a digit belongs to the previous
profile name, so ``mig=1g.5gb+me+3g.20gb`` reads as ``1g.5gb+me`` and ``3g.20gb``. Instances
take the first free placement of their profile's placement table, in the order given; earlier
choices are revisited when a later instance would not fit. ``fail`` makes every NVML query on
that GPU return NVML_ERROR_GPU_IS_LOST (the fault hook for tests); ``no-events`` makes the GPU
refuse NVML event registration (NOT_SUPPORTED), as GPUs without event support do. ``numa=``
overrides the NUMA node the sysfs tree reports for the group's GPUs; ``none`` writes -1, as the
kernel does for a device without NUMA affinity. By default the first half of the node's PCIe
root complexes (and their GPUs) sit on NUMA node 0 and the second half on node 1, as on a
two-socket server.

UUIDs and PCI addresses are derived from the node name with SHA-256, so the same spec on the same
node always yields the same devices, and two nodes never share UUIDs.

Telemetry readings (utilisation, memory used, temperature, power, SM clock, ECC counts) move over
time as a deterministic function of the device's UUID and the clock (``simulated_load``), higher
while the library's ``workload`` says a device runs work (the agent points it at the devices
prepared claims hold).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import math
import tempfile
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from dataclasses import replace as _replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pynvml

from dra_driver.errors import SimulationSpecError
from dra_driver.fsutil import replace_file
from dra_driver.gpus import nvml
from dra_driver.gpus.info import Inventory

if TYPE_CHECKING:
    from dra_driver.sim.faults import SimulatedFault
from dra_driver.sim.profiles import (
    CUDA_DRIVER_VERSION,
    DRIVER_VERSION,
    GpuInstanceProfile,
    HardwareProfile,
    hardware_profile,
    known_keys,
)

MAX_GPUS = 64
"""More GPUs than any real node has; a typo like ``h100:800`` is an error, not a long wait."""

TOTAL_SLICES = 8  # memory slices of the A100/H100/H200 MIG layout
TOTAL_COMPUTE_SLICES = 7

_ADDRESSING = {"hmm": 1, "ats": 2}  # NVML_DEVICE_ADDRESSING_MODE_HMM / _ATS
_OPTIONS = (
    "mig",
    "mig=<layout>",
    "mig-pending",
    "addressing=hmm|ats",
    "numa=<node>|none",
    "fail",
    "no-events",
)
NO_NUMA_NODE = -1
"""What the kernel writes to ``numa_node`` for a device without NUMA affinity."""
MAX_NUMA_NODE = 1023  # Linux: MAX_NUMNODES is at most 1 << 10


@dataclass(frozen=True)
class MigPlacementSpec:
    """A MIG instance to pre-create: its GPU-instance profile and first memory slice."""

    profile: GpuInstanceProfile
    start: int


@dataclass(frozen=True)
class SimulatedGpuSpec:
    """One GPU of a spec, before node-specific identities (UUID, PCI address) are assigned."""

    hardware: HardwareProfile
    mig_enabled: bool = False
    mig_pending: bool = False
    mig_instances: tuple[MigPlacementSpec, ...] = ()
    addressing_mode: int | None = None
    numa_node: int | None = None  # None: by position (see build_node); NO_NUMA_NODE: none
    fail: bool = False
    events: bool = True  # False: NVML event registration answers NOT_SUPPORTED


@dataclass(frozen=True)
class SimulationSpec:
    """A parsed ``--simulate`` spec: the node's GPUs in NVML index order."""

    gpus: tuple[SimulatedGpuSpec, ...]


def parse_spec(spec: str) -> SimulationSpec:
    """Parse a ``--simulate`` spec; raise SimulationSpecError naming the bad part."""
    if not spec.strip():
        raise SimulationSpecError("empty --simulate spec; expected e.g. 'h100:8' or 'l4:1,t4:2'")
    gpus: list[SimulatedGpuSpec] = []
    for position, group in enumerate(spec.split(","), start=1):
        gpus.extend(_parse_group(group.strip(), position=position))
        if len(gpus) > MAX_GPUS:
            raise SimulationSpecError(f"spec {spec!r} asks for more than {MAX_GPUS} GPUs")
    return SimulationSpec(gpus=tuple(gpus))


def _parse_group(group: str, *, position: int) -> list[SimulatedGpuSpec]:
    where = f"group {position} ({group!r})"
    if not group:
        raise SimulationSpecError(f"group {position} is empty (two commas in a row?)")
    parts = group.split(":")
    hardware = hardware_profile(parts[0].strip())
    if hardware is None:
        raise SimulationSpecError(
            f"{where}: unknown GPU {parts[0]!r}; known: {', '.join(known_keys())}"
        )
    options = parts[1:]
    count = 1
    if options and options[0].isdigit():
        count = int(options[0])
        options = options[1:]
    gpu = SimulatedGpuSpec(hardware=hardware)
    for option in options:
        gpu = _apply_option(gpu, option.strip(), where=where)
    return [gpu] * count


def _apply_option(gpu: SimulatedGpuSpec, option: str, *, where: str) -> SimulatedGpuSpec:
    name, _, value = option.partition("=")
    if name in ("mig", "mig-pending") and not gpu.hardware.mig_capable:
        raise SimulationSpecError(
            f"{where}: {gpu.hardware.key} ({gpu.hardware.product_name}) does not support MIG"
        )
    if option == "mig":
        return _replace(gpu, mig_enabled=True, mig_pending=True)
    if name == "mig" and value:
        layout = _place(gpu.hardware, value, where=where)
        return _replace(gpu, mig_enabled=True, mig_pending=True, mig_instances=layout)
    if option == "mig-pending":
        return _replace(gpu, mig_pending=True)
    if name == "addressing" and value.lower() in _ADDRESSING:
        return _replace(gpu, addressing_mode=_ADDRESSING[value.lower()])
    if name == "numa" and value.lower() == "none":
        return _replace(gpu, numa_node=NO_NUMA_NODE)
    if name == "numa" and value.isascii() and value.isdigit() and int(value) <= MAX_NUMA_NODE:
        return _replace(gpu, numa_node=int(value))
    if option == "fail":
        return _replace(gpu, fail=True)
    if option == "no-events":
        return _replace(gpu, events=False)
    raise SimulationSpecError(
        f"{where}: unknown option {option!r}; expected a GPU count or one of {', '.join(_OPTIONS)}"
    )


def _layout_names(layout: str, *, where: str) -> list[str]:
    """Split ``3g.20gb+1g.5gb+me*2`` into profile names, re-joining ``+me``-style suffixes."""
    entries: list[str] = []
    for token in layout.split("+"):
        if not token:
            raise SimulationSpecError(f"{where}: empty entry in MIG layout {layout!r}")
        if token[0].isdigit() or not entries:
            entries.append(token)
        else:
            entries[-1] += "+" + token
    names: list[str] = []
    for entry in entries:
        name, star, repeat = entry.partition("*")
        if star and not (repeat.isdigit() and int(repeat) > 0):
            raise SimulationSpecError(f"{where}: bad repeat count in MIG layout entry {entry!r}")
        names.extend([name] * (int(repeat) if star else 1))
    return names


def _place(hardware: HardwareProfile, layout: str, *, where: str) -> tuple[MigPlacementSpec, ...]:
    """Place the layout's instances on their profiles' possible placements, or explain why not.

    Each instance takes the first free placement in the profile's table; when a later instance
    then finds no room, earlier choices are revisited (so ``3g+2g+1g+1g`` fits with the 3g at
    slice 4, as NVML places it), and the layout is refused only if no arrangement exists.
    """
    profiles: list[GpuInstanceProfile] = []
    for name in _layout_names(layout, where=where):
        profile = hardware.gpu_instance_profile(name)
        if profile is None:
            known = ", ".join(p.name for p in hardware.gpu_instance_profiles)
            raise SimulationSpecError(
                f"{where}: {hardware.key} has no MIG profile {name!r}; it has: {known}"
            )
        if profiles.count(profile) >= profile.instance_count:
            raise SimulationSpecError(
                f"{where}: MIG layout {layout!r} does not fit: {hardware.key} allows at most "
                f"{profile.instance_count} instance(s) of {name}"
            )
        profiles.append(profile)
    compute = sum(p.slice_count for p in profiles)
    if compute > TOTAL_COMPUTE_SLICES:
        raise SimulationSpecError(
            f"{where}: MIG layout {layout!r} does not fit: it needs {compute} compute slices, "
            f"a GPU has {TOTAL_COMPUTE_SLICES}"
        )
    starts = _arrange(profiles, used=frozenset())
    if starts is None:
        tables = "; ".join(
            f"{p.name} {{{','.join(map(str, p.placement_starts))}}}:{p.placement_size}"
            for p in dict.fromkeys(profiles)
        )
        raise SimulationSpecError(
            f"{where}: MIG layout {layout!r} does not fit: no combination of possible "
            f"placements holds all instances on {TOTAL_SLICES} memory slices ({tables})"
        )
    return tuple(
        MigPlacementSpec(profile=p, start=s) for p, s in zip(profiles, starts, strict=True)
    )


def _arrange(profiles: list[GpuInstanceProfile], *, used: frozenset[int]) -> list[int] | None:
    """Placement starts for ``profiles`` avoiding ``used`` memory slices; None if impossible."""
    if not profiles:
        return []
    first, rest = profiles[0], profiles[1:]
    for start in first.placement_starts:
        span = frozenset(range(start, start + first.placement_size))
        if span & used:
            continue
        arranged = _arrange(rest, used=used | span)
        if arranged is not None:
            return [start, *arranged]
    return None


# --- node identities -------------------------------------------------------------------------


def _digest(*parts: object) -> bytes:
    return hashlib.sha256("/".join(str(p) for p in parts).encode()).digest()


def _uuid(node_name: str, *parts: object) -> str:
    return str(uuid.UUID(bytes=_digest(node_name, *parts)[:16]))


def _bus_numbers(node_name: str, count: int) -> list[int]:
    """Distinct PCI bus numbers, ascending (NVML enumerates GPUs in PCI bus order)."""
    buses: set[int] = set()
    attempt = 0
    while len(buses) < count:
        bus = _digest(node_name, "bus", attempt)[0]
        if 0x10 <= bus <= 0xFE:
            buses.add(bus)
        attempt += 1
    return sorted(buses)


@dataclass(frozen=True)
class SimulatedMig:
    """A pre-created MIG device of a simulated GPU."""

    uuid: str
    gpu_instance_id: int
    compute_instance_id: int
    profile: GpuInstanceProfile
    start: int


@dataclass(frozen=True)
class SimulatedGpu:
    """A simulated GPU with its node-specific identities.

    ``migs`` is the spec's layout, the MIG devices the GPU starts with when no state file says
    otherwise; the library's ``mig.devices(gpu)`` are the ones that exist now.
    """

    index: int
    minor: int
    uuid: str
    pci_bus_id: str  # extended BDF, lowercase: "0000:1b:00.0"
    pcie_root: str  # "pci0000:17"
    numa_node: int  # what sysfs numa_node says; NO_NUMA_NODE (-1) for none
    spec: SimulatedGpuSpec
    migs: tuple[SimulatedMig, ...] = ()


def _gpu_instance_id(start: int, size: int) -> int:
    """A GPU-instance id for an instance at this placement on an 8-slice GPU.

    In the ranges NVIDIA's ``nvidia-smi mig -lgi`` examples show (full GPU 0, halves 1-2,
    quarters 3-6, single slices 7-13). Real NVML hands ids out in creation order, so there they
    are not a function of the placement; nothing may rely on that mapping.
    """
    if size >= TOTAL_SLICES:
        return 0
    if size == 4:
        return 1 if start == 4 else 2
    if size == 2:
        return 3 + start // 2
    return 7 + start


def _default_numa_node(index: int, count: int) -> int:
    """NUMA node 0 for the first half of the root complexes (rounded up), node 1 for the rest.

    GPUs of one root complex (pairs, see build_node) always share their NUMA node, as the root
    complex belongs to one socket.
    """
    roots = (count + 1) // 2
    return 0 if index // 2 < (roots + 1) // 2 else 1


def build_node(spec: SimulationSpec, *, node_name: str) -> tuple[SimulatedGpu, ...]:
    """Give each GPU of ``spec`` its identities on ``node_name``; deterministic."""
    buses = _bus_numbers(node_name, len(spec.gpus))
    gpus = []
    for index, (gpu, bus) in enumerate(zip(spec.gpus, buses, strict=True)):
        migs = tuple(
            SimulatedMig(
                uuid=_mig_uuid(node_name, index, m.profile, m.start),
                gpu_instance_id=_gpu_instance_id(m.start, m.profile.placement_size),
                compute_instance_id=0,
                profile=m.profile,
                start=m.start,
            )
            for m in gpu.mig_instances
        )
        # Pairs of GPUs share a PCIe root complex, as behind the PCIe switches of an HGX board.
        root_bus = buses[index - index % 2] - 4
        gpus.append(
            SimulatedGpu(
                index=index,
                minor=index,
                uuid="GPU-" + _uuid(node_name, "gpu", index),
                pci_bus_id=f"0000:{bus:02x}:00.0",
                pcie_root=f"pci0000:{root_bus:02x}",
                numa_node=(
                    _default_numa_node(index, len(spec.gpus))
                    if gpu.numa_node is None
                    else gpu.numa_node
                ),
                spec=gpu,
                migs=tuple(sorted(migs, key=lambda m: m.gpu_instance_id)),
            )
        )
    return tuple(gpus)


def write_sysfs(root: Path, gpus: tuple[SimulatedGpu, ...]) -> Path:
    """Create the parts of /sys that pcieRoot and NUMA discovery read, under ``root``; return it.

    Like the kernel's tree: ``bus/pci/devices/<bdf>`` is a relative symlink into
    ``devices/pci<domain>:<bus>/<bridge>/<bdf>``, and that directory holds ``numa_node``.
    """
    links = root / "bus" / "pci" / "devices"
    links.mkdir(parents=True, exist_ok=True)
    for gpu in gpus:
        root_bus = gpu.pcie_root.removeprefix("pci")
        device = root / "devices" / gpu.pcie_root / f"{root_bus}:01.0" / gpu.pci_bus_id
        device.mkdir(parents=True, exist_ok=True)
        (device / "vendor").write_text("0x10de\n")
        (device / "device").write_text(f"0x{gpu.spec.hardware.pci_device_id >> 16:04x}\n")
        (device / "numa_node").write_text(f"{gpu.numa_node}\n")
        (links / gpu.pci_bus_id).symlink_to(Path("../../..") / device.relative_to(root))
    return root


# --- the fake C library ----------------------------------------------------------------------

_SUCCESS: int = pynvml.NVML_SUCCESS
# nvidia-smi's compute mode names -> NVML's values
_COMPUTE_MODES: dict[str, int] = {
    "DEFAULT": pynvml.NVML_COMPUTEMODE_DEFAULT,
    "EXCLUSIVE_THREAD": pynvml.NVML_COMPUTEMODE_EXCLUSIVE_THREAD,
    "PROHIBITED": pynvml.NVML_COMPUTEMODE_PROHIBITED,
    "EXCLUSIVE_PROCESS": pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS,
}
_UNINITIALIZED: int = pynvml.NVML_ERROR_UNINITIALIZED
_INVALID_ARGUMENT: int = pynvml.NVML_ERROR_INVALID_ARGUMENT
_NOT_SUPPORTED: int = pynvml.NVML_ERROR_NOT_SUPPORTED
_NOT_FOUND: int = pynvml.NVML_ERROR_NOT_FOUND
_INSUFFICIENT_SIZE: int = pynvml.NVML_ERROR_INSUFFICIENT_SIZE
_GPU_IS_LOST: int = pynvml.NVML_ERROR_GPU_IS_LOST
_VERSION_MISMATCH: int = pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
_TIMEOUT: int = pynvml.NVML_ERROR_TIMEOUT
_IN_USE: int = pynvml.NVML_ERROR_IN_USE
_RESET_REQUIRED: int = pynvml.NVML_ERROR_RESET_REQUIRED
_INSUFFICIENT_RESOURCES: int = pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES
_UNKNOWN: int = pynvml.NVML_ERROR_UNKNOWN

_ERROR_STRINGS = {
    _SUCCESS: b"Success",
    _UNINITIALIZED: b"Uninitialized",
    _INVALID_ARGUMENT: b"Invalid Argument",
    _NOT_SUPPORTED: b"Not Supported",
    _NOT_FOUND: b"Not Found",
    _INSUFFICIENT_SIZE: b"Insufficient Size",
    _GPU_IS_LOST: b"GPU is lost",
    _VERSION_MISMATCH: b"Argument version mismatch",
    _TIMEOUT: b"Timeout",
    _IN_USE: b"In use by another client",
    _RESET_REQUIRED: b"GPU requires restart",
    _INSUFFICIENT_RESOURCES: b"Insufficient resources",
    _UNKNOWN: b"Unknown Error",
}


_WITHOUT_INIT = frozenset({"nvmlInitWithFlags", "nvmlInit_v2", "nvmlErrorString"})


class _CFunction:
    """One exported symbol. A plain object, so pynvml may set ``restype`` on it like on ctypes."""

    def __init__(self, name: str, impl: Callable[..., Any]) -> None:
        self.__name__ = name
        self._impl = impl
        self.restype: Any = ctypes.c_int
        self.argtypes: Any = None

    def __call__(self, *args: Any) -> Any:
        return self._impl(*args)


def _target(ref: Any) -> Any:
    """The object a ``byref(...)`` argument points at."""
    return ref._obj


def _int(arg: Any) -> int:
    return arg if isinstance(arg, int) else int(arg.value)


def _address(handle: Any) -> int:
    return ctypes.cast(handle, ctypes.c_void_p).value or 0


def _set_pointer(ref: Any, address: int) -> None:
    """Store ``address`` in the pointer that ``ref`` (a byref of a handle) points at."""
    target = _target(ref)
    value = ctypes.c_void_p(address)
    ctypes.memmove(ctypes.addressof(target), ctypes.addressof(value), ctypes.sizeof(value))


def _write_string(buffer: Any, length: Any, text: str) -> int:
    data = text.encode()
    if len(data) + 1 > _int(length):
        return _INSUFFICIENT_SIZE
    buffer.value = data
    return _SUCCESS


def _nvml_bus_id(pci_bus_id: str) -> str:
    """NVML's spelling of a bus id: 8-digit domain, upper case ("00000000:1B:00.0")."""
    domain, rest = pci_bus_id.split(":", 1)
    return f"{int(domain, 16):08X}:{rest.upper()}"


@dataclass
class _Handles:
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


class SimulatedNvmlLibrary:
    """Answers pynvml's calls the way libnvidia-ml.so.1 would, from simulated GPUs.

    Only the symbols discovery, telemetry, the health watch and MIG management use exist; any
    other lookup raises AttributeError, which pynvml turns into NVML_ERROR_FUNCTION_NOT_FOUND, as
    with an old real library. Safe to call from several threads (the agent's re-discovery,
    telemetry and health watch). ``health`` holds the GPUs' health and injects faults
    (:meth:`SimulatedHealth.inject`); ``inbox`` is the file other processes append faults to
    (docs/simulate.md "Faults"). ``mig`` holds the GPU and compute instances that exist now
    (:class:`SimulatedMigInstances`), kept in ``state_path`` when one is given.
    ``compute_modes``: the JSON file (GPU uuid -> mode name) the simulated driver root's stand-in
    nvidia-smi keeps each GPU's compute mode in (gpus/fakedriver.py); ``nvmlDeviceGetComputeMode``
    reads it (a GPU it does not name is in DEFAULT).
    """

    def __init__(
        self,
        gpus: tuple[SimulatedGpu, ...],
        *,
        node_name: str,
        inbox: Path | None = None,
        state_path: Path | None = None,
        compute_modes: Path | None = None,
    ) -> None:
        self._gpus = gpus
        self._compute_modes = compute_modes
        self._handles = _Handles()
        self._handles.add(gpus)
        self._initialised = 0
        self._init_lock = threading.Lock()
        self.health = SimulatedHealth(self, inbox=inbox)
        self.mig = SimulatedMigInstances(self, node_name=node_name, state_path=state_path)
        # Symbol names in call order, for tests and debugging; bounded for long-lived use.
        self.calls: deque[str] = deque(maxlen=10_000)
        # Telemetry (see "telemetry" below): the clock readings move with, and which UUIDs run
        # work (the agent points it at the devices prepared claims hold); volatile ECC counts.
        self.clock: Callable[[], float] = time.time
        self.workload: Callable[[str], bool] | None = None
        self.ecc_errors: dict[tuple[str, int], int] = {}
        # Compute processes by device UUID (a GPU's or a MIG device's): what
        # nvmlDeviceGetComputeRunningProcesses lists, and what makes destroying a compute
        # instance IN_USE. Set by tests and users (put_process) to stand for workloads.
        self.processes: dict[str, tuple[int, ...]] = {}
        impls: dict[str, Callable[..., Any]] = {
            "nvmlInitWithFlags": self._init,
            "nvmlInit_v2": lambda: self._init(0),
            "nvmlShutdown": self._shutdown,
            "nvmlErrorString": lambda rc: _ERROR_STRINGS.get(_int(rc), b"Unknown Error"),
            "nvmlSystemGetDriverVersion": self._driver_version,
            "nvmlSystemGetCudaDriverVersion": self._cuda_driver_version,
            "nvmlSystemGetCudaDriverVersion_v2": self._cuda_driver_version,
            "nvmlDeviceGetCount_v2": self._count,
            "nvmlDeviceGetHandleByIndex_v2": self._handle_by_index,
            "nvmlDeviceGetName": self._name,
            "nvmlDeviceGetUUID": self._uuid,
            "nvmlDeviceGetBrand": self._brand,
            "nvmlDeviceGetArchitecture": self._architecture,
            "nvmlDeviceGetCudaComputeCapability": self._compute_capability,
            "nvmlDeviceGetMemoryInfo": self._memory_info,
            "nvmlDeviceGetPciInfo_v3": self._pci_info,
            "nvmlDeviceGetMinorNumber": self._minor,
            "nvmlDeviceGetAddressingMode": self._addressing_mode,
            "nvmlDeviceGetMigMode": self._mig_mode,
            "nvmlDeviceGetComputeMode": self._compute_mode,
            "nvmlDeviceGetGpuInstanceProfileInfoV": self._gi_profile_info,
            "nvmlDeviceGetGpuInstancePossiblePlacements_v2": self._gi_placements,
            "nvmlDeviceGetMaxMigDeviceCount": self._max_mig_count,
            "nvmlDeviceGetMigDeviceHandleByIndex": self._mig_handle_by_index,
            "nvmlDeviceIsMigDeviceHandle": self._is_mig_handle,
            "nvmlDeviceGetGpuInstanceId": self._gpu_instance_id,
            "nvmlDeviceGetComputeInstanceId": self._compute_instance_id,
            "nvmlDeviceGetAttributes_v2": self._attributes,
            "nvmlDeviceGetGpuInstanceById": self._gpu_instance_by_id,
            "nvmlGpuInstanceGetInfo": self._gpu_instance_info,
            "nvmlDeviceGetComputeRunningProcesses_v3": self._running_processes,
            **self.health.functions(),
            **self.mig.functions(),
        }
        impls.update(self._telemetry_functions())
        self._functions = {
            name: _CFunction(name, self._traced(name, f)) for name, f in impls.items()
        }

    def __getattr__(self, name: str) -> _CFunction:
        functions = self.__dict__.get("_functions", {})
        if name in functions:
            return functions[name]  # type: ignore[no-any-return]
        raise AttributeError(f"simulated NVML has no symbol {name}")

    def _traced(self, name: str, impl: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            self.calls.append(name)
            if name not in _WITHOUT_INIT and not self._initialised:
                return _UNINITIALIZED
            self.health.read_inbox()
            return impl(*args)

        return call

    # system

    def _init(self, flags: Any) -> int:
        with self._init_lock:  # NVML counts nested init/shutdown pairs, from any thread
            self._initialised += 1
        return _SUCCESS

    def _shutdown(self) -> int:
        with self._init_lock:
            self._initialised -= 1
        return _SUCCESS

    def _driver_version(self, buffer: Any, length: Any) -> int:
        return _write_string(buffer, length, DRIVER_VERSION)

    def _cuda_driver_version(self, ref: Any) -> int:
        _target(ref).value = CUDA_DRIVER_VERSION
        return _SUCCESS

    def _count(self, ref: Any) -> int:
        _target(ref).value = len(self._gpus)
        return _SUCCESS

    def _handle_by_index(self, index: Any, ref: Any) -> int:
        address = self._handles.gpu_address.get(_int(index))
        if address is None:
            return _INVALID_ARGUMENT
        _set_pointer(ref, address)
        return _SUCCESS

    # lookups

    def _device(self, handle: Any) -> tuple[SimulatedGpu | None, SimulatedMig | None, int]:
        """(gpu, mig, rc): the GPU a handle names, the MIG device if it is a MIG handle."""
        address = _address(handle)
        mig_devices = self.mig.view.mig_devices
        if address in self._handles.gpus:
            gpu, mig = self._handles.gpus[address], None
        elif address in mig_devices:
            gpu, mig = mig_devices[address]
        else:
            return None, None, _INVALID_ARGUMENT
        if gpu.spec.fail or not self.health.answers(gpu):
            return gpu, mig, _GPU_IS_LOST
        return gpu, mig, _SUCCESS

    def _gpu(self, handle: Any) -> tuple[SimulatedGpu | None, int]:
        """A full-GPU handle; MIG handles are invalid where NVML wants the parent."""
        gpu, mig, rc = self._device(handle)
        if rc == _SUCCESS and mig is not None:
            return None, _INVALID_ARGUMENT
        return gpu, rc

    # devices

    def _name(self, handle: Any, buffer: Any, length: Any) -> int:
        gpu, mig, rc = self._device(handle)
        if gpu is None or rc != _SUCCESS:
            return rc
        name = gpu.spec.hardware.product_name
        return _write_string(buffer, length, f"{name} MIG {mig.profile.name}" if mig else name)

    def _uuid(self, handle: Any, buffer: Any, length: Any) -> int:
        gpu, mig, rc = self._device(handle)
        if gpu is None or rc != _SUCCESS:
            return rc
        return _write_string(buffer, length, mig.uuid if mig else gpu.uuid)

    def _brand(self, handle: Any, ref: Any) -> int:
        gpu, _, rc = self._device(handle)
        if gpu is not None and rc == _SUCCESS:
            _target(ref).value = gpu.spec.hardware.brand
        return rc

    def _architecture(self, handle: Any, ref: Any) -> int:
        gpu, _, rc = self._device(handle)
        if gpu is not None and rc == _SUCCESS:
            _target(ref).value = gpu.spec.hardware.architecture
        return rc

    def _compute_capability(self, handle: Any, major: Any, minor: Any) -> int:
        gpu, _, rc = self._device(handle)
        if gpu is not None and rc == _SUCCESS:
            _target(major).value, _target(minor).value = gpu.spec.hardware.cuda_compute_capability
        return rc

    def _memory_info(self, handle: Any, ref: Any) -> int:
        gpu, mig, rc = self._device(handle)
        if gpu is None or rc != _SUCCESS:
            return rc
        mib = mig.profile.memory_mib if mig else gpu.spec.hardware.memory_mib
        memory = _target(ref)
        memory.total = mib * 1024 * 1024
        memory.used = self._memory_used_bytes(gpu, mig, total_bytes=memory.total)
        memory.free = memory.total - memory.used
        return _SUCCESS

    def _pci_info(self, handle: Any, ref: Any) -> int:
        gpu, _, rc = self._device(handle)
        if gpu is None or rc != _SUCCESS:
            return rc
        info = _target(ref)
        domain, bus, device_function = gpu.pci_bus_id.split(":")
        info.busId = _nvml_bus_id(gpu.pci_bus_id).encode()
        info.busIdLegacy = _nvml_bus_id(gpu.pci_bus_id)[4:].encode()
        info.domain = int(domain, 16)
        info.bus = int(bus, 16)
        info.device = int(device_function.split(".")[0], 16)
        info.pciDeviceId = gpu.spec.hardware.pci_device_id
        return _SUCCESS

    def _minor(self, handle: Any, ref: Any) -> int:
        gpu, rc = self._gpu(handle)
        if gpu is not None and rc == _SUCCESS:
            _target(ref).value = gpu.minor
        return rc

    def _addressing_mode(self, handle: Any, ref: Any) -> int:
        gpu, _, rc = self._device(handle)
        if gpu is None or rc != _SUCCESS:
            return rc
        mode = _target(ref)
        if mode.version != pynvml.nvmlDeviceAddressingMode_v1:
            return _VERSION_MISMATCH
        if gpu.spec.addressing_mode is None:
            return _NOT_SUPPORTED
        mode.value = gpu.spec.addressing_mode
        return _SUCCESS

    def _mig_mode(self, handle: Any, current: Any, pending: Any) -> int:
        gpu, rc = self._gpu(handle)
        if gpu is None or rc != _SUCCESS:
            return rc
        if not gpu.spec.hardware.mig_capable:
            return _NOT_SUPPORTED
        current_mode, pending_mode = self.mig.mode(gpu)
        _target(current).value = int(current_mode)
        _target(pending).value = int(pending_mode)
        return _SUCCESS

    def _compute_mode(self, handle: Any, mode: Any) -> int:
        gpu, mig, rc = self._device(handle)
        if gpu is None or rc != _SUCCESS:
            return rc
        if mig is not None:  # a property of the whole GPU
            return _NOT_SUPPORTED
        modes: dict[str, Any] = {}
        if self._compute_modes is not None:
            try:
                modes = json.loads(self._compute_modes.read_text())
            except (OSError, ValueError):
                modes = {}
        _target(mode).value = _COMPUTE_MODES.get(str(modes.get(gpu.uuid, "DEFAULT")), 0)
        return _SUCCESS

    def _profile_by_index(self, gpu: SimulatedGpu, index: int) -> GpuInstanceProfile | None:
        return next((p for p in gpu.spec.hardware.gpu_instance_profiles if p.index == index), None)

    def _profile_by_id(self, gpu: SimulatedGpu, profile_id: int) -> GpuInstanceProfile | None:
        profiles = gpu.spec.hardware.gpu_instance_profiles
        return next((p for p in profiles if p.profile_id == profile_id), None)

    def _gi_profile_info(self, handle: Any, index: Any, ref: Any) -> int:
        gpu, rc = self._gpu(handle)
        if gpu is None or rc != _SUCCESS:
            return rc
        info = _target(ref)
        if info.version != pynvml.nvmlGpuInstanceProfileInfo_v2:
            return _VERSION_MISMATCH
        if _int(index) >= pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT:
            return _INVALID_ARGUMENT
        # nvml.h: NOT_SUPPORTED "if device doesn't have MIG mode enabled or profile isn't
        # supported".
        profile = self._profile_by_index(gpu, _int(index))
        if profile is None or not self.mig.enabled(gpu):
            return _NOT_SUPPORTED
        info.id = profile.profile_id
        info.isP2pSupported = 0
        info.sliceCount = profile.slice_count
        info.instanceCount = profile.instance_count
        info.multiprocessorCount = profile.multiprocessors
        info.copyEngineCount = profile.copy_engines
        info.decoderCount = profile.decoders
        info.encoderCount = profile.encoders
        info.jpegCount = profile.jpeg_engines
        info.ofaCount = profile.ofa_engines
        info.memorySizeMB = profile.memory_mib
        info.name = f"MIG {profile.name}".encode()
        return _SUCCESS

    def _gi_placements(self, handle: Any, profile_id: Any, placements: Any, count: Any) -> int:
        gpu, rc = self._gpu(handle)
        if gpu is None or rc != _SUCCESS:
            return rc
        profile = self._profile_by_id(gpu, _int(profile_id))
        if profile is None or not self.mig.enabled(gpu):
            return _NOT_SUPPORTED
        # nvml.h: with placements == NULL only the count is returned.
        if placements is not None:
            array = ctypes.cast(placements, ctypes.POINTER(pynvml.c_nvmlGpuInstancePlacement_t))
            for i, start in enumerate(profile.placement_starts):
                array[i].start = start
                array[i].size = profile.placement_size
        _target(count).value = len(profile.placement_starts)
        return _SUCCESS

    def _max_mig_count(self, handle: Any, ref: Any) -> int:
        gpu, rc = self._gpu(handle)
        if gpu is None or rc != _SUCCESS:
            return rc
        if not gpu.spec.hardware.mig_capable:
            return _NOT_SUPPORTED
        _target(ref).value = TOTAL_COMPUTE_SLICES
        return _SUCCESS

    def _mig_handle_by_index(self, handle: Any, index: Any, ref: Any) -> int:
        gpu, rc = self._gpu(handle)
        if gpu is None or rc != _SUCCESS:
            return rc
        if not self.mig.enabled(gpu):
            return _NOT_SUPPORTED
        i = _int(index)
        if i >= TOTAL_COMPUTE_SLICES:
            return _INVALID_ARGUMENT
        migs = self.mig.devices(gpu)
        if i >= len(migs):
            return _NOT_FOUND
        _set_pointer(ref, self.mig.mig_address(gpu, migs[i]))
        return _SUCCESS

    def _is_mig_handle(self, handle: Any, ref: Any) -> int:
        gpu, mig, rc = self._device(handle)
        if gpu is not None and rc == _SUCCESS:
            _target(ref).value = int(mig is not None)
        return rc

    def _gpu_instance_id(self, handle: Any, ref: Any) -> int:
        gpu, mig, rc = self._device(handle)
        if gpu is None or rc != _SUCCESS:
            return rc
        if mig is None:
            return _INVALID_ARGUMENT
        _target(ref).value = mig.gpu_instance_id
        return _SUCCESS

    def _compute_instance_id(self, handle: Any, ref: Any) -> int:
        gpu, mig, rc = self._device(handle)
        if gpu is None or rc != _SUCCESS:
            return rc
        if mig is None:
            return _INVALID_ARGUMENT
        _target(ref).value = mig.compute_instance_id
        return _SUCCESS

    def _attributes(self, handle: Any, ref: Any) -> int:
        gpu, mig, rc = self._device(handle)
        if gpu is None or rc != _SUCCESS:
            return rc
        if mig is None:
            return _NOT_SUPPORTED  # nvml.h: only MIG device handles are supported
        attributes = _target(ref)
        profile = mig.profile
        attributes.multiprocessorCount = profile.multiprocessors
        attributes.sharedCopyEngineCount = profile.copy_engines
        attributes.sharedDecoderCount = profile.decoders
        attributes.sharedEncoderCount = profile.encoders
        attributes.sharedJpegCount = profile.jpeg_engines
        attributes.sharedOfaCount = profile.ofa_engines
        attributes.gpuInstanceSliceCount = profile.slice_count
        attributes.computeInstanceSliceCount = profile.slice_count
        attributes.memorySizeMB = profile.memory_mib
        return _SUCCESS

    def _gpu_instance_by_id(self, handle: Any, gpu_instance_id: Any, ref: Any) -> int:
        gpu, rc = self._gpu(handle)
        if gpu is None or rc != _SUCCESS:
            return rc
        if not self.mig.enabled(gpu):
            return _NOT_SUPPORTED
        instances = self.mig.view.instances[gpu.index]
        found = next((i for i in instances if i.id == _int(gpu_instance_id)), None)
        if found is None:
            return _NOT_FOUND
        _set_pointer(ref, self.mig.gpu_instance_address(found))
        return _SUCCESS

    def _gpu_instance_info(self, gpu_instance: Any, ref: Any) -> int:
        found, rc = self.mig.gpu_instance(gpu_instance)
        if found is None:
            return rc
        info = _target(ref)
        info.device = ctypes.cast(
            ctypes.c_void_p(self._handles.gpu_address[found.gpu_index]), pynvml.c_nvmlDevice_t
        )
        info.id = found.id
        info.profileId = found.profile.profile_id
        info.placement.start = found.start
        info.placement.size = found.profile.placement_size
        return _SUCCESS

    # telemetry: the readings telemetry.py samples (utilisation, memory used, temperature, power,
    # clocks, ECC counts), moving with time as a deterministic function of the UUID; higher while
    # ``workload`` says the device runs work. MIG device handles answer NOT_SUPPORTED for all but
    # memory, and a GPU in MIG mode for utilisation, as nvml.h documents for real GPUs.

    def put_process(self, uuid: str, pid: int) -> None:
        """Run a compute process (``pid``) on the GPU or MIG device ``uuid``."""
        self.processes[uuid] = (*self.processes.get(uuid, ()), pid)

    def end_processes(self, uuid: str) -> None:
        """End every compute process on the GPU or MIG device ``uuid``."""
        self.processes.pop(uuid, None)

    def _running_processes(self, handle: Any, count: Any, array: Any) -> int:
        """nvml.h: a MIG device's handle lists its processes; a GPU's lists its own and, in MIG
        mode, those of its MIG devices (with their GPU/compute instance ids)."""
        gpu, mig, rc = self._device(handle)
        if gpu is None or rc != _SUCCESS:
            return rc
        devices = [mig] if mig is not None else list(self.mig.devices(gpu))
        found = (
            []
            if mig is not None
            else [(p, _NO_INSTANCE, _NO_INSTANCE) for p in self.processes.get(gpu.uuid, ())]
        )
        for device in devices:
            assert device is not None
            found.extend(
                (p, device.gpu_instance_id, device.compute_instance_id)
                for p in self.processes.get(device.uuid, ())
            )
        size = _target(count)
        if array is None or size.value < len(found):
            size.value = len(found)
            return _INSUFFICIENT_SIZE if found else _SUCCESS
        entries = ctypes.cast(array, ctypes.POINTER(pynvml.c_nvmlProcessInfo_v3_t))
        for n, (pid, gi, ci) in enumerate(found):
            entries[n].pid = pid
            entries[n].usedGpuMemory = 0
            entries[n].gpuInstanceId = gi
            entries[n].computeInstanceId = ci
        size.value = len(found)
        return _SUCCESS

    def _telemetry_functions(self) -> dict[str, Callable[..., Any]]:
        return {
            "nvmlDeviceGetHandleByUUID": self._handle_by_uuid,
            "nvmlDeviceGetUtilizationRates": self._utilization_rates,
            "nvmlDeviceGetTemperature": self._temperature,
            "nvmlDeviceGetPowerUsage": self._power_usage,
            "nvmlDeviceGetEnforcedPowerLimit": self._enforced_power_limit,
            "nvmlDeviceGetClockInfo": self._clock_info,
            "nvmlDeviceGetTotalEccErrors": self._total_ecc_errors,
        }

    def add_ecc_errors(self, uuid: str, *, corrected: int = 0, uncorrected: int = 0) -> None:
        """Count ECC errors on a GPU (volatile counters, as after a real error)."""
        for error_type, n in (
            (pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, corrected),
            (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, uncorrected),
        ):
            self.ecc_errors[uuid, error_type] = self.ecc_errors.get((uuid, error_type), 0) + n

    def _load(self, gpu: SimulatedGpu, mig: SimulatedMig | None) -> float:
        """0..1, how hard the device works now. A GPU in MIG mode works when one of its MIG
        devices does."""
        workload = self.workload
        if mig is not None:
            busy = workload is not None and workload(mig.uuid)
            return simulated_load(mig.uuid, now_s=self.clock(), busy=busy)
        busy = workload is not None and (
            workload(gpu.uuid) or any(workload(m.uuid) for m in self.mig.devices(gpu))
        )
        return simulated_load(gpu.uuid, now_s=self.clock(), busy=busy)

    def _memory_used_bytes(
        self, gpu: SimulatedGpu, mig: SimulatedMig | None, *, total_bytes: int
    ) -> int:
        if mig is None and self.mig.enabled(gpu):
            used = sum(
                self._memory_used_bytes(gpu, m, total_bytes=m.profile.memory_mib << 20)
                for m in self.mig.devices(gpu)
            )
            return min(total_bytes, used + (total_bytes >> 9))  # + the driver's own share
        # Memory follows the slow part of the load (allocations outlive kernel bursts).
        load = self._load(gpu, mig)
        fraction = 0.004 + 0.85 * load * load
        return int(total_bytes * min(fraction, 0.97)) & ~0xFFFFF  # whole MiB, as NVML reports

    def _telemetry_device(
        self, handle: Any
    ) -> tuple[SimulatedGpu | None, SimulatedMig | None, int]:
        """The device of a full-GPU telemetry query; MIG device handles are NOT_SUPPORTED."""
        gpu, mig, rc = self._device(handle)
        if rc == _SUCCESS and mig is not None:
            return gpu, mig, _NOT_SUPPORTED
        return gpu, mig, rc

    def _handle_by_uuid(self, uuid_arg: Any, ref: Any) -> int:
        raw = uuid_arg if isinstance(uuid_arg, bytes) else uuid_arg.value
        wanted = (raw or b"").decode()
        for address, gpu in self._handles.gpus.items():
            if gpu.uuid == wanted:
                if gpu.spec.fail or not self.health.answers(gpu):
                    return _GPU_IS_LOST
                _set_pointer(ref, address)
                return _SUCCESS
        for address, (parent, mig) in self.mig.view.mig_devices.items():
            if mig.uuid == wanted:
                if parent.spec.fail or not self.health.answers(parent):
                    return _GPU_IS_LOST
                _set_pointer(ref, address)
                return _SUCCESS
        return _NOT_FOUND

    def gpu_temperature(self, gpu: SimulatedGpu) -> int:
        """A fault's temperature, else the reading that moves with the GPU's load."""
        injected = self.health.temperature(gpu)
        return injected if injected is not None else round(31 + 44 * self._load(gpu, None))

    def _utilization_rates(self, handle: Any, ref: Any) -> int:
        gpu, _, rc = self._telemetry_device(handle)
        if gpu is None or rc != _SUCCESS:
            return rc
        if self.mig.enabled(gpu):
            return _NOT_SUPPORTED  # nvml.h: not supported on MIG-enabled GPUs
        load = self._load(gpu, None)
        rates = _target(ref)
        rates.gpu = round(100 * load)
        rates.memory = round(70 * load)
        return _SUCCESS

    def _temperature(self, handle: Any, sensor: Any, ref: Any) -> int:
        gpu, _, rc = self._telemetry_device(handle)
        if gpu is None or rc != _SUCCESS:
            return rc
        if _int(sensor) != pynvml.NVML_TEMPERATURE_GPU:
            return _INVALID_ARGUMENT
        _target(ref).value = self.gpu_temperature(gpu)
        return _SUCCESS

    def _power_usage(self, handle: Any, ref: Any) -> int:
        gpu, _, rc = self._telemetry_device(handle)
        if gpu is None or rc != _SUCCESS:
            return rc
        envelope = _envelope(gpu)
        span_w = envelope.power_limit_w - envelope.idle_power_w
        watts = envelope.idle_power_w + 0.9 * span_w * self._load(gpu, None)
        _target(ref).value = round(watts * 1000)  # milliwatts
        return _SUCCESS

    def _enforced_power_limit(self, handle: Any, ref: Any) -> int:
        gpu, _, rc = self._telemetry_device(handle)
        if gpu is None or rc != _SUCCESS:
            return rc
        _target(ref).value = _envelope(gpu).power_limit_w * 1000  # milliwatts
        return _SUCCESS

    def _clock_info(self, handle: Any, clock_type: Any, ref: Any) -> int:
        gpu, _, rc = self._telemetry_device(handle)
        if gpu is None or rc != _SUCCESS:
            return rc
        if _int(clock_type) not in (pynvml.NVML_CLOCK_GRAPHICS, pynvml.NVML_CLOCK_SM):
            return _NOT_SUPPORTED
        envelope = _envelope(gpu)
        load = self._load(gpu, None)
        boost = min(1.0, 1.25 * load) if load > 0.05 else 0.0
        mhz = envelope.idle_sm_clock_mhz + boost * (
            envelope.max_sm_clock_mhz - envelope.idle_sm_clock_mhz
        )
        _target(ref).value = round(mhz / 15) * 15  # clocks move in 15 MHz steps
        return _SUCCESS

    def _total_ecc_errors(self, handle: Any, error_type: Any, counter_type: Any, ref: Any) -> int:
        gpu, _, rc = self._telemetry_device(handle)
        if gpu is None or rc != _SUCCESS:
            return rc
        kind = _int(error_type)
        if kind not in (
            pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED,
            pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
        ) or _int(counter_type) not in (pynvml.NVML_VOLATILE_ECC, pynvml.NVML_AGGREGATE_ECC):
            return _INVALID_ARGUMENT
        count = self.ecc_errors.get((gpu.uuid, kind), 0)
        if kind == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED:  # the faults' double-bit errors
            volatile = _int(counter_type) == pynvml.NVML_VOLATILE_ECC
            count += self.health.uncorrected_ecc(gpu, volatile=volatile)
        _target(ref).value = count
        return _SUCCESS


@dataclass(frozen=True)
class _Envelope:
    """Power and clock range of a product (NVIDIA's data sheets; idle values typical)."""

    power_limit_w: int
    idle_power_w: int
    max_sm_clock_mhz: int
    idle_sm_clock_mhz: int


_ENVELOPES = {
    "a100-40gb": _Envelope(400, 55, 1410, 210),
    "a100-80gb": _Envelope(400, 60, 1410, 210),
    "h100-80gb": _Envelope(700, 70, 1980, 345),
    "h200-141gb": _Envelope(700, 75, 1980, 345),
    "l4": _Envelope(72, 16, 2040, 210),
    "t4": _Envelope(70, 10, 1590, 300),
}
_DEFAULT_ENVELOPE = _Envelope(300, 40, 1500, 300)


def _envelope(gpu: SimulatedGpu) -> _Envelope:
    return _ENVELOPES.get(gpu.spec.hardware.key, _DEFAULT_ENVELOPE)


def simulated_load(uuid: str, *, now_s: float, busy: bool) -> float:
    """How hard a simulated device works at ``now_s``, 0..1; the same for the same arguments.

    A slow wave with a period and phase of the UUID's own (2-6 minutes), plus a step that
    changes every 5 s: idle devices stay at a few percent, busy ones between 65 and 95 %.
    """
    seed = _digest("load", uuid)
    period_s = 120 + 240 * seed[1] / 255
    wave = 0.5 + 0.5 * math.sin(2 * math.pi * (now_s / period_s + seed[0] / 255))
    step = _digest("step", uuid, int(now_s // 5))[0] / 255 - 0.5
    load = 0.65 + 0.25 * wave + 0.1 * step if busy else 0.03 + 0.06 * wave + 0.04 * step
    return min(1.0, max(0.0, load))


# --- health: NVML events, health queries and injected faults ------------------------------------
#
# Kept apart from discovery above: the event-set functions (nvmlEventSetCreate,
# nvmlDeviceRegisterEvents, nvmlEventSetWait_v2, ...), the queries the health watch polls
# (ECC counts, retired pages, remapped rows, temperature and its thresholds), and the faults a
# test, the demo or another process injects (an XID, a double-bit ECC error, a lost GPU, a GPU
# reset, a temperature, a hang: gpus/injector.py describes them).

SUPPORTED_EVENT_TYPES = (
    pynvml.nvmlEventTypeSingleBitEccError
    | pynvml.nvmlEventTypeDoubleBitEccError
    | pynvml.nvmlEventTypePState
    | pynvml.nvmlEventTypeXidCriticalError
    | pynvml.nvmlEventTypeClock
)
"""What ``nvmlDeviceGetSupportedEventTypes`` answers for a simulated GPU with events."""
SLOWDOWN_C = 87  # NVML_TEMPERATURE_THRESHOLD_SLOWDOWN of every simulated GPU
SHUTDOWN_C = 92
IDLE_C = 38
XID_GPU_LOST = 79  # "GPU has fallen off the bus", what the driver reports for a lost GPU
XID_DOUBLE_BIT_ECC = 48
_INBOX_POLL_S = 0.02  # how often a waiting or calling thread looks at the inbox file
_NO_INSTANCE = 0xFFFFFFFF

_log = logging.getLogger(__name__)


class _GpuHealth:
    # Plain classes, not dataclasses: the agent's memory budget (see devicehealth.py).
    __slots__ = (
        "ecc_aggregate",
        "ecc_volatile",
        "hang_until",
        "lost",
        "remapped_rows_pending",
        "retired_pages_pending",
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

    def __init__(self, library: SimulatedNvmlLibrary, *, inbox: Path | None) -> None:
        self._library = library
        self._gpus = {g.index: g for g in library._gpus}
        self._state = {g.index: _GpuHealth() for g in library._gpus}
        self._sets: dict[int, _EventSet] = {}
        self._next_set = 0x5E7E0000
        self._changed = threading.Condition()
        self.inbox = inbox
        self._inbox_offset = inbox.stat().st_size if inbox and inbox.exists() else 0
        self._inbox_checked = 0.0
        self._inbox_lock = threading.Lock()

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
                    gpu_instance_id=_NO_INSTANCE if gi is None else gi,
                    compute_instance_id=_NO_INSTANCE if ci is None else ci,
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
            elif fault.kind == "temperature":
                state.temperature_c = fault.celsius
                state.temperature_injected = True
            else:
                state.hang_until = time.monotonic() + fault.seconds
            self._changed.notify_all()

    def _emit(
        self,
        index: int,
        event_type: int,
        *,
        data: int,
        gpu_instance_id: int = _NO_INSTANCE,
        compute_instance_id: int = _NO_INSTANCE,
    ) -> None:
        """Queue an event on every set that registered the GPU for its type (lock held)."""
        for event_set in self._sets.values():
            if event_set.registered.get(index, 0) & event_type:
                event_set.queue.append(
                    (index, event_type, data, gpu_instance_id, compute_instance_id)
                )

    def read_inbox(self) -> None:
        """Inject the faults other processes appended to the inbox since the last look.

        Called on every NVML call and while a wait is blocked, at most every 20 ms. A line that
        is not a fault is logged and skipped; a truncated file is read again from the start.
        """
        if self.inbox is None:
            return
        now = time.monotonic()
        if now - self._inbox_checked < _INBOX_POLL_S or not self._inbox_lock.acquire(False):
            return
        try:
            self._inbox_checked = now
            try:
                size = self.inbox.stat().st_size
            except OSError:
                return
            if size < self._inbox_offset:
                self._inbox_offset = 0
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
            "nvmlDeviceGetRemappedRows": self._remapped_rows,
            "nvmlDeviceGetTemperatureV": self._temperature_v,
            "nvmlDeviceGetTemperatureThreshold": self._threshold,
        }

    def _full_gpu(self, handle: Any) -> tuple[SimulatedGpu | None, int]:
        return self._library._gpu(handle)

    def _set_create(self, ref: Any) -> int:
        with self._changed:
            self._next_set += 0x10
            self._sets[self._next_set] = _EventSet()
            _set_pointer(ref, self._next_set)
        return _SUCCESS

    def _set_free(self, event_set: Any) -> int:
        with self._changed:
            if self._sets.pop(_address(event_set), None) is None:
                return _INVALID_ARGUMENT
        return _SUCCESS

    def _supported_events(self, handle: Any, ref: Any) -> int:
        gpu, rc = self._full_gpu(handle)
        if gpu is None or rc != _SUCCESS:
            return rc
        if not gpu.spec.events:
            return _NOT_SUPPORTED
        _target(ref).value = SUPPORTED_EVENT_TYPES
        return _SUCCESS

    def _register(self, handle: Any, event_types: Any, event_set: Any) -> int:
        gpu, rc = self._full_gpu(handle)
        if gpu is None or rc != _SUCCESS:
            return rc
        mask = _int(event_types)
        # nvml.h: NOT_SUPPORTED "if the platform does not support this feature or some of
        # requested event types".
        if not gpu.spec.events or mask & ~SUPPORTED_EVENT_TYPES:
            return _NOT_SUPPORTED
        with self._changed:
            found = self._sets.get(_address(event_set))
            if found is None:
                return _INVALID_ARGUMENT
            found.registered[gpu.index] = found.registered.get(gpu.index, 0) | mask
        return _SUCCESS

    def _wait(self, event_set: Any, data_ref: Any, timeout_ms: Any) -> int:
        deadline = time.monotonic() + _int(timeout_ms) / 1000
        while True:
            self.read_inbox()
            with self._changed:
                found = self._sets.get(_address(event_set))
                if found is None:
                    return _INVALID_ARGUMENT
                if found.queue:
                    index, event_type, data, gi, ci = found.queue.popleft()
                    event = _target(data_ref)
                    event.device = ctypes.cast(
                        ctypes.c_void_p(self._library._handles.gpu_address[index]),
                        pynvml.c_nvmlDevice_t,
                    )
                    event.eventType = event_type
                    event.eventData = data
                    event.gpuInstanceId = gi
                    event.computeInstanceId = ci
                    return _SUCCESS
                if found.lost:  # nvml.h: GPU_IS_LOST "if a GPU has fallen off the bus"
                    found.lost.clear()
                    return _GPU_IS_LOST
                left = deadline - time.monotonic()
                if left <= 0:
                    return _TIMEOUT
                self._changed.wait(min(left, _INBOX_POLL_S) if self.inbox else left)

    def _retired_pages_pending(self, handle: Any, ref: Any) -> int:
        gpu, rc = self._full_gpu(handle)
        if gpu is None or rc != _SUCCESS:
            return rc
        if gpu.spec.hardware.architecture >= pynvml.NVML_DEVICE_ARCH_AMPERE:
            return _NOT_SUPPORTED  # row remapping replaced page retirement
        _target(ref).value = int(self._state[gpu.index].retired_pages_pending)
        return _SUCCESS

    def _remapped_rows(self, handle: Any, corr: Any, unc: Any, pending: Any, failure: Any) -> int:
        gpu, rc = self._full_gpu(handle)
        if gpu is None or rc != _SUCCESS:
            return rc
        if gpu.spec.hardware.architecture < pynvml.NVML_DEVICE_ARCH_AMPERE:
            return _NOT_SUPPORTED
        state = self._state[gpu.index]
        _target(corr).value = 0
        _target(unc).value = state.ecc_aggregate
        _target(pending).value = int(state.remapped_rows_pending)
        _target(failure).value = 0
        return _SUCCESS

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
        if gpu is None or rc != _SUCCESS:
            return rc
        reading = _target(ref)
        if reading.version != pynvml.nvmlTemperature_v1:
            return _VERSION_MISMATCH
        if reading.sensorType != pynvml.NVML_TEMPERATURE_GPU:
            return _INVALID_ARGUMENT
        reading.temperature = self._library.gpu_temperature(gpu)
        return _SUCCESS

    def _threshold(self, handle: Any, threshold: Any, ref: Any) -> int:
        gpu, rc = self._full_gpu(handle)
        if gpu is None or rc != _SUCCESS:
            return rc
        values = {
            pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN: SLOWDOWN_C,
            pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN: SHUTDOWN_C,
        }
        value = values.get(_int(threshold))
        if value is None:
            return _NOT_SUPPORTED
        _target(ref).value = value
        return _SUCCESS


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
# Not modelled: compute profiles smaller than their GPU instance, and permissions.

_STATE_VERSION = 1
# NVML_COMPUTE_INSTANCE_PROFILE_* of the compute profile that spans a whole GPU instance, by
# the GPU instance's compute slices; real NVML gives compute profiles ids equal to their index.
_FULL_COMPUTE_PROFILE: dict[int, int] = {
    1: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE,
    2: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE,
    3: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE,
    4: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE,
    7: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE,
}
# Handle addresses inside a GPU's 0x1000 (see _Handles), by GPU-instance id (0-13) and
# compute-instance id (0-7).
_MIG_DEVICE_OFFSET = 0x100
_COMPUTE_INSTANCE_OFFSET = 0x400
_GPU_INSTANCE_OFFSET = 0x800


@dataclass(frozen=True)
class SimulatedGpuInstance:
    """A GPU instance of a simulated GPU; each of its compute instances is one MIG device."""

    gpu_index: int
    id: int
    profile: GpuInstanceProfile
    start: int
    compute_instances: tuple[SimulatedMig, ...] = ()

    @property
    def memory_slices(self) -> frozenset[int]:
        return frozenset(range(self.start, self.start + self.profile.placement_size))


@dataclass(frozen=True)
class _MigView:
    """Every instance that exists, and the handle addresses that name them; never mutated."""

    instances: dict[int, tuple[SimulatedGpuInstance, ...]]  # GPU index -> by id
    modes: dict[int, tuple[bool, bool]]  # GPU index -> MIG mode (current, pending)
    devices: dict[int, tuple[SimulatedMig, ...]]  # GPU index -> MIG devices, NVML's order
    mig_devices: dict[int, tuple[SimulatedGpu, SimulatedMig]]
    gpu_instances: dict[int, SimulatedGpuInstance]
    compute_instances: dict[int, tuple[SimulatedGpuInstance, SimulatedMig]]


def _mig_uuid(node_name: str, gpu_index: int, profile: GpuInstanceProfile, start: int) -> str:
    return "MIG-" + _uuid(node_name, "mig", gpu_index, profile.profile_id, start)


def _full_compute_profile(instance: SimulatedGpuInstance) -> int:
    return _FULL_COMPUTE_PROFILE[instance.profile.slice_count]


def _placement(arg: Any) -> Any:
    """The placement struct a ``const nvml...Placement_t *`` argument points at."""
    if hasattr(arg, "_obj"):
        return arg._obj  # byref(...)
    if isinstance(arg, ctypes.Structure):
        return arg
    return arg.contents  # a pointer(...)


class SimulatedMigInstances:
    """The GPU and compute instances of a simulated node, and the NVML functions that manage them.

    It also holds each GPU's MIG mode (current, pending), starting from the spec's
    (``mig``/``mig=``: on, on; ``mig-pending``: off, on) and changed by ``nvmlDeviceSetMigMode``.

    ``state_path``: a JSON file this node owns; read at start when it exists (it then replaces
    the spec's layout and modes for the GPUs it names), rewritten atomically (temporary file,
    rename; not synced: it must outlive the agent process, and real instances do not outlive a
    reboot) on every change, under the lock, before the change becomes visible. Format::

        {"version": 1, "gpus": {"<GPU UUID>": [{"gpu_instance_id": 2, "profile_id": 9,
          "start": 0, "compute_instances": [{"compute_instance_id": 0, "profile_id": 2}]}]},
         "mig_mode": {"<GPU UUID>": {"current": 1, "pending": 1}}}

    ``gpus`` names every GPU whose current MIG mode is on (an empty list: no instances);
    ``mig_mode`` every MIG-capable GPU. Both keys are optional per GPU: a GPU ``mig_mode`` does
    not name has the spec's modes (files written before the key existed), and a GPU ``gpus``
    does not name has the spec's layout, or no instances when its recorded current mode is off.
    UUIDs of other nodes are ignored. A file that cannot be read, or names impossible instances
    or modes (instances on a GPU whose MIG mode is off, a mode for a GPU without MIG), is a
    SimulationSpecError at start.
    """

    def __init__(
        self, library: SimulatedNvmlLibrary, *, node_name: str, state_path: Path | None
    ) -> None:
        self._library = library
        self._gpus = library._gpus
        self._node_name = node_name
        self.state_path = state_path
        self._lock = threading.Lock()
        instances = {
            gpu.index: tuple(
                SimulatedGpuInstance(
                    gpu_index=gpu.index,
                    id=mig.gpu_instance_id,
                    profile=mig.profile,
                    start=mig.start,
                    compute_instances=(mig,),
                )
                for mig in gpu.migs
            )
            for gpu in self._gpus
        }
        modes = {gpu.index: (gpu.spec.mig_enabled, gpu.spec.mig_pending) for gpu in self._gpus}
        if state_path is not None and state_path.exists():
            self._read(state_path, instances=instances, modes=modes)
        self.view = self._build_view(instances, modes)

    def mode(self, gpu: SimulatedGpu) -> tuple[bool, bool]:
        """The GPU's MIG mode now: (current, pending)."""
        return self.view.modes[gpu.index]

    def enabled(self, gpu: SimulatedGpu) -> bool:
        """Whether the GPU is in MIG mode now (its current mode)."""
        return self.view.modes[gpu.index][0]

    # --- the view and handles ------------------------------------------------------------------

    def devices(self, gpu: SimulatedGpu) -> tuple[SimulatedMig, ...]:
        """The MIG devices of ``gpu`` now, by GPU-instance id then compute-instance id."""
        return self.view.devices[gpu.index]

    def _base(self, gpu_index: int) -> int:
        return self._library._handles.gpu_address[gpu_index]

    def mig_address(self, gpu: SimulatedGpu, mig: SimulatedMig) -> int:
        offset = _MIG_DEVICE_OFFSET + 0x10 * mig.gpu_instance_id + mig.compute_instance_id
        return self._base(gpu.index) + offset

    def gpu_instance_address(self, instance: SimulatedGpuInstance) -> int:
        return self._base(instance.gpu_index) + _GPU_INSTANCE_OFFSET + 0x10 * instance.id

    def _compute_instance_address(self, instance: SimulatedGpuInstance, ci: SimulatedMig) -> int:
        offset = _COMPUTE_INSTANCE_OFFSET + 0x10 * instance.id + ci.compute_instance_id
        return self._base(instance.gpu_index) + offset

    def _build_view(
        self,
        instances: dict[int, tuple[SimulatedGpuInstance, ...]],
        modes: dict[int, tuple[bool, bool]],
    ) -> _MigView:
        by_id = {i: tuple(sorted(found, key=lambda g: g.id)) for i, found in instances.items()}
        view = _MigView(
            instances=by_id,
            modes=dict(modes),
            devices={
                i: tuple(ci for gi in found for ci in gi.compute_instances)
                for i, found in by_id.items()
            },
            mig_devices={},
            gpu_instances={},
            compute_instances={},
        )
        for gpu in self._gpus:
            for gi in by_id[gpu.index]:
                view.gpu_instances[self.gpu_instance_address(gi)] = gi
                for ci in gi.compute_instances:
                    view.mig_devices[self.mig_address(gpu, ci)] = (gpu, ci)
                    view.compute_instances[self._compute_instance_address(gi, ci)] = (gi, ci)
        return view

    def _answers(self, gpu_index: int) -> bool:
        gpu = self._gpus[gpu_index]
        return not gpu.spec.fail and self._library.health.answers(gpu)

    def gpu_instance(self, handle: Any) -> tuple[SimulatedGpuInstance | None, int]:
        """(instance, rc) for a GPU-instance handle; INVALID_ARGUMENT once it is destroyed."""
        found = self.view.gpu_instances.get(_address(handle))
        if found is None:
            return None, _INVALID_ARGUMENT
        if not self._answers(found.gpu_index):
            return None, _GPU_IS_LOST
        return found, _SUCCESS

    def _mig_gpu(self, handle: Any) -> tuple[SimulatedGpu | None, int]:
        """A full-GPU handle of a GPU in MIG mode (nvml.h: NOT_SUPPORTED when it is off)."""
        gpu, rc = self._library._gpu(handle)
        if gpu is None or rc != _SUCCESS:
            return None, rc
        if not self.enabled(gpu):
            return None, _NOT_SUPPORTED
        return gpu, _SUCCESS

    # --- state changes ---------------------------------------------------------------------------

    def _commit(
        self,
        gpu_index: int,
        instances: tuple[SimulatedGpuInstance, ...] | None = None,
        *,
        mode: tuple[bool, bool] | None = None,
    ) -> int:
        """Make ``instances`` the GPU's instances and ``mode`` its MIG mode (None: unchanged):
        state file first, then the view (lock held)."""
        changed = dict(self.view.instances)
        modes = dict(self.view.modes)
        if instances is not None:
            changed[gpu_index] = instances
        if mode is not None:
            modes[gpu_index] = mode
        if self.state_path is not None:
            try:
                self._write(self.state_path, changed, modes)
            except OSError as exc:
                _log.error("simulated GPUs: cannot write MIG state %s: %s", self.state_path, exc)
                return _UNKNOWN
        self.view = self._build_view(changed, modes)
        return _SUCCESS

    def _refusal(self, gpu: SimulatedGpu, profile: GpuInstanceProfile, start: int) -> int:
        """Why a ``profile`` instance at ``start`` cannot be created now; SUCCESS if it can."""
        if start not in profile.placement_starts:
            return _INVALID_ARGUMENT
        existing = self.view.instances[gpu.index]
        span = frozenset(range(start, start + profile.placement_size))
        compute = sum(i.profile.slice_count for i in existing) + profile.slice_count
        same = sum(1 for i in existing if i.profile.profile_id == profile.profile_id)
        if (
            same >= profile.instance_count
            or compute > TOTAL_COMPUTE_SLICES
            or any(span & i.memory_slices for i in existing)
        ):
            return _INSUFFICIENT_RESOURCES
        return _SUCCESS

    def _create_gpu_instance(
        self, gpu: SimulatedGpu, profile: GpuInstanceProfile, start: int | None, ref: Any
    ) -> int:
        with self._lock:
            if start is None:  # the first placement that fits, in the profile's table order
                start = next(
                    (
                        s
                        for s in profile.placement_starts
                        if self._refusal(gpu, profile, s) == _SUCCESS
                    ),
                    None,
                )
                if start is None:
                    return _INSUFFICIENT_RESOURCES
            rc = self._refusal(gpu, profile, start)
            if rc != _SUCCESS:
                return rc
            created = SimulatedGpuInstance(
                gpu_index=gpu.index,
                id=_gpu_instance_id(start, profile.placement_size),
                profile=profile,
                start=start,
            )
            rc = self._commit(gpu.index, (*self.view.instances[gpu.index], created))
            if rc == _SUCCESS:
                _set_pointer(ref, self.gpu_instance_address(created))
            return rc

    def _destroy_gpu_instance(self, handle: Any) -> int:
        with self._lock:
            instance, rc = self.gpu_instance(handle)
            if instance is None:
                return rc
            if instance.compute_instances:  # nvml.h: IN_USE while compute instances exist
                return _IN_USE
            left = tuple(i for i in self.view.instances[instance.gpu_index] if i is not instance)
            return self._commit(instance.gpu_index, left)

    def _create_compute_instance(self, handle: Any, profile_id: int, ref: Any) -> int:
        with self._lock:
            instance, rc = self.gpu_instance(handle)
            if instance is None:
                return rc
            rc = self._compute_profile_refusal(instance, profile_id)
            if rc != _SUCCESS:
                return rc
            if instance.compute_instances:
                return _INSUFFICIENT_RESOURCES  # the full compute profile leaves no room
            ci = SimulatedMig(
                uuid=_mig_uuid(
                    self._node_name, instance.gpu_index, instance.profile, instance.start
                ),
                gpu_instance_id=instance.id,
                compute_instance_id=0,
                profile=instance.profile,
                start=instance.start,
            )
            grown = _replace(instance, compute_instances=(ci,))
            others = (i for i in self.view.instances[instance.gpu_index] if i is not instance)
            rc = self._commit(instance.gpu_index, (*others, grown))
            if rc == _SUCCESS:
                _set_pointer(ref, self._compute_instance_address(grown, ci))
            return rc

    def _compute_profile_refusal(self, instance: SimulatedGpuInstance, profile_id: int) -> int:
        if profile_id >= pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT:
            return _INVALID_ARGUMENT
        if profile_id != _full_compute_profile(instance):
            return _NOT_SUPPORTED  # smaller compute profiles are not simulated
        return _SUCCESS

    def _set_mig_mode(self, handle: Any, mode: Any, status_ref: Any) -> int:
        """nvmlDeviceSetMigMode: set the pending MIG mode and try to activate it.

        nvml.h (quoted in NVIDIA's cuda-python docs of ``device_set_mig_mode``): the return code
        is NOT_SUPPORTED when the device does not support MIG mode and INVALID_ARGUMENT for a bad
        device, mode or activation-status pointer; otherwise SUCCESS, and *activationStatus*
        says whether the mode became current. Activation "may unbind or reset the device"; where
        a reset is needed and cannot happen it is RESET_REQUIRED, and "if device unbind fails
        because the device isn't idle, NVML_ERROR_IN_USE would be returned. The caller of this
        API is expected to idle the device and retry". The pending mode is "the target mode
        following the next activation trigger" (nvmlDeviceGetMigMode).

        Which GPUs need the reset: NVIDIA's MIG user guide ("Deployment Considerations"):
        "Setting MIG mode on the A100/A30 requires a GPU reset"; kubernetes-sigs/
        dra-driver-nvidia-gpu (``supportsMIGModeToggle``) toggles it without a reset on Hopper
        and newer only. So an Ampere GPU here only changes its pending mode (RESET_REQUIRED),
        and a Hopper or newer one switches unless compute processes run on it (IN_USE, pending
        changed). Disabling while GPU instances exist is refused with IN_USE as the return code,
        nothing changed: nvml.h does not document that case; the upstream driver never tries it
        (it disables MIG mode only once no MIG device is left), and instances cannot outlive the
        mode they need.
        """
        gpu, rc = self._library._gpu(handle)
        if gpu is None or rc != _SUCCESS:
            return rc
        if not gpu.spec.hardware.mig_capable:
            return _NOT_SUPPORTED
        wanted = _int(mode)
        if wanted not in (pynvml.NVML_DEVICE_MIG_DISABLE, pynvml.NVML_DEVICE_MIG_ENABLE):
            return _INVALID_ARGUMENT
        if status_ref is None:
            return _INVALID_ARGUMENT
        enable = wanted == pynvml.NVML_DEVICE_MIG_ENABLE
        with self._lock:
            current, _ = self.view.modes[gpu.index]
            if not enable and self.view.instances[gpu.index]:
                return _IN_USE
            if enable == current:
                status, changed = _SUCCESS, (current, enable)  # cancels a pending change
            elif gpu.spec.hardware.architecture < pynvml.NVML_DEVICE_ARCH_HOPPER:
                status, changed = _RESET_REQUIRED, (current, enable)
            elif self._library.processes.get(gpu.uuid):  # (those in MIG devices: refused above)
                status, changed = _IN_USE, (current, enable)
            else:
                status, changed = _SUCCESS, (enable, enable)
            rc = self._commit(gpu.index, mode=changed)
            if rc == _SUCCESS:
                _target(status_ref).value = status
            return rc

    # --- the NVML functions ----------------------------------------------------------------------

    def functions(self) -> dict[str, Callable[..., Any]]:
        return {
            "nvmlDeviceCreateGpuInstance": self._nvml_create_gi,
            "nvmlDeviceCreateGpuInstanceWithPlacement": self._nvml_create_gi_with_placement,
            "nvmlGpuInstanceDestroy": self._destroy_gpu_instance,
            "nvmlDeviceGetGpuInstances": self._nvml_gpu_instances,
            "nvmlDeviceGetGpuInstanceRemainingCapacity": self._nvml_gi_remaining,
            "nvmlGpuInstanceGetComputeInstanceProfileInfoV": self._nvml_ci_profile_info,
            "nvmlGpuInstanceGetComputeInstancePossiblePlacements": self._nvml_ci_placements,
            "nvmlGpuInstanceCreateComputeInstance": self._nvml_create_ci,
            "nvmlGpuInstanceCreateComputeInstanceWithPlacement": self._nvml_create_ci_placed,
            "nvmlComputeInstanceDestroy": self._nvml_destroy_ci,
            "nvmlGpuInstanceGetComputeInstances": self._nvml_compute_instances,
            "nvmlGpuInstanceGetComputeInstanceRemainingCapacity": self._nvml_ci_remaining,
            "nvmlComputeInstanceGetInfo_v2": self._nvml_ci_info,
            "nvmlDeviceSetMigMode": self._set_mig_mode,
        }

    def _gpu_and_profile(
        self, handle: Any, profile_id: Any
    ) -> tuple[SimulatedGpu | None, GpuInstanceProfile | None, int]:
        gpu, rc = self._mig_gpu(handle)
        if gpu is None:
            return None, None, rc
        profile = self._library._profile_by_id(gpu, _int(profile_id))
        if profile is None:  # nvml.h: INVALID_ARGUMENT "if ... profileId ... are invalid"
            return None, None, _INVALID_ARGUMENT
        return gpu, profile, _SUCCESS

    def _nvml_create_gi(self, handle: Any, profile_id: Any, ref: Any) -> int:
        gpu, profile, rc = self._gpu_and_profile(handle, profile_id)
        if gpu is None or profile is None:
            return rc
        return self._create_gpu_instance(gpu, profile, None, ref)

    def _nvml_create_gi_with_placement(
        self, handle: Any, profile_id: Any, placement: Any, ref: Any
    ) -> int:
        gpu, profile, rc = self._gpu_and_profile(handle, profile_id)
        if gpu is None or profile is None:
            return rc
        if placement is None:
            return _INVALID_ARGUMENT
        wanted = _placement(placement)
        if wanted.size != profile.placement_size:
            return _INVALID_ARGUMENT
        return self._create_gpu_instance(gpu, profile, int(wanted.start), ref)

    def _nvml_gpu_instances(self, handle: Any, profile_id: Any, array: Any, count: Any) -> int:
        gpu, profile, rc = self._gpu_and_profile(handle, profile_id)
        if gpu is None or profile is None:
            return rc
        if array is None:
            return _INVALID_ARGUMENT
        found = [i for i in self.view.instances[gpu.index] if i.profile is profile]
        # nvml.h: the caller sizes the array for the profile's instanceCount.
        handles = ctypes.cast(array, ctypes.POINTER(ctypes.c_void_p))
        for n, instance in enumerate(found):
            handles[n] = self.gpu_instance_address(instance)
        _target(count).value = len(found)
        return _SUCCESS

    def _nvml_gi_remaining(self, handle: Any, profile_id: Any, ref: Any) -> int:
        gpu, profile, rc = self._gpu_and_profile(handle, profile_id)
        if gpu is None or profile is None:
            return rc
        existing = self.view.instances[gpu.index]
        used = frozenset().union(*(i.memory_slices for i in existing))
        compute_left = TOTAL_COMPUTE_SLICES - sum(i.profile.slice_count for i in existing)
        same = sum(1 for i in existing if i.profile is profile)
        # Placements of one profile are aligned to their size, so taking free ones in table
        # order finds the most that fit together.
        fit = 0
        for start in profile.placement_starts:
            span = frozenset(range(start, start + profile.placement_size))
            if not span & used:
                used |= span
                fit += 1
        _target(ref).value = max(
            0, min(fit, profile.instance_count - same, compute_left // profile.slice_count)
        )
        return _SUCCESS

    def _nvml_ci_profile_info(self, handle: Any, profile: Any, engine: Any, ref: Any) -> int:
        instance, rc = self.gpu_instance(handle)
        if instance is None:
            return rc
        info = _target(ref)
        if info.version != pynvml.nvmlComputeInstanceProfileInfo_v2:
            return _VERSION_MISMATCH
        if _int(engine) >= pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_COUNT:
            return _INVALID_ARGUMENT
        rc = self._compute_profile_refusal(instance, _int(profile))
        if rc != _SUCCESS:
            return rc
        gi = instance.profile
        info.id = _full_compute_profile(instance)
        info.sliceCount = gi.slice_count
        info.instanceCount = 1
        info.multiprocessorCount = gi.multiprocessors
        info.sharedCopyEngineCount = gi.copy_engines
        info.sharedDecoderCount = gi.decoders
        info.sharedEncoderCount = gi.encoders
        info.sharedJpegCount = gi.jpeg_engines
        info.sharedOfaCount = gi.ofa_engines
        info.name = f"MIG {gi.name}".encode()  # nvidia-smi names the full compute profile so
        return _SUCCESS

    def _nvml_ci_placements(self, handle: Any, profile_id: Any, placements: Any, count: Any) -> int:
        instance, rc = self.gpu_instance(handle)
        if instance is None:
            return rc
        rc = self._compute_profile_refusal(instance, _int(profile_id))
        if rc != _SUCCESS:
            return rc
        if placements is not None:  # nvml.h: with placements == NULL only the count is returned
            array = ctypes.cast(placements, ctypes.POINTER(pynvml.c_nvmlComputeInstancePlacement_t))
            array[0].start = 0
            array[0].size = instance.profile.slice_count
        _target(count).value = 1
        return _SUCCESS

    def _nvml_create_ci(self, handle: Any, profile_id: Any, ref: Any) -> int:
        return self._create_compute_instance(handle, _int(profile_id), ref)

    def _nvml_create_ci_placed(self, handle: Any, profile_id: Any, placement: Any, ref: Any) -> int:
        instance, rc = self.gpu_instance(handle)
        if instance is None:
            return rc
        if placement is None:
            return _INVALID_ARGUMENT
        wanted = _placement(placement)
        if (wanted.start, wanted.size) != (0, instance.profile.slice_count):
            return _INVALID_ARGUMENT
        return self._create_compute_instance(handle, _int(profile_id), ref)

    def _nvml_destroy_ci(self, handle: Any) -> int:
        with self._lock:
            found = self.view.compute_instances.get(_address(handle))
            if found is None:
                return _INVALID_ARGUMENT
            instance, ci = found
            if not self._answers(instance.gpu_index):
                return _GPU_IS_LOST
            if self._library.processes.get(ci.uuid):  # nvml.h: IN_USE while processes run
                return _IN_USE
            shrunk = _replace(
                instance,
                compute_instances=tuple(c for c in instance.compute_instances if c is not ci),
            )
            others = (i for i in self.view.instances[instance.gpu_index] if i is not instance)
            return self._commit(instance.gpu_index, (*others, shrunk))

    def _nvml_compute_instances(self, handle: Any, profile_id: Any, array: Any, count: Any) -> int:
        instance, rc = self.gpu_instance(handle)
        if instance is None:
            return rc
        if _int(profile_id) >= pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT or array is None:
            return _INVALID_ARGUMENT
        found = [
            ci
            for ci in instance.compute_instances
            if _int(profile_id) == _full_compute_profile(instance)
        ]
        handles = ctypes.cast(array, ctypes.POINTER(ctypes.c_void_p))
        for n, ci in enumerate(found):
            handles[n] = self._compute_instance_address(instance, ci)
        _target(count).value = len(found)
        return _SUCCESS

    def _nvml_ci_remaining(self, handle: Any, profile_id: Any, ref: Any) -> int:
        instance, rc = self.gpu_instance(handle)
        if instance is None:
            return rc
        rc = self._compute_profile_refusal(instance, _int(profile_id))
        if rc != _SUCCESS:
            return rc
        _target(ref).value = 0 if instance.compute_instances else 1
        return _SUCCESS

    def _nvml_ci_info(self, handle: Any, ref: Any) -> int:
        found = self.view.compute_instances.get(_address(handle))
        if found is None:
            return _INVALID_ARGUMENT
        instance, ci = found
        if not self._answers(instance.gpu_index):
            return _GPU_IS_LOST
        info = _target(ref)
        info.device = ctypes.cast(
            ctypes.c_void_p(self._base(instance.gpu_index)), pynvml.c_nvmlDevice_t
        )
        info.gpuInstance = ctypes.cast(
            ctypes.c_void_p(self.gpu_instance_address(instance)), pynvml.c_nvmlGpuInstance_t
        )
        info.id = ci.compute_instance_id
        info.profileId = _full_compute_profile(instance)
        info.placement.start = 0
        info.placement.size = instance.profile.slice_count
        return _SUCCESS

    # --- the state file --------------------------------------------------------------------------

    def _write(
        self,
        path: Path,
        instances: dict[int, tuple[SimulatedGpuInstance, ...]],
        modes: dict[int, tuple[bool, bool]],
    ) -> None:
        """Replace ``path`` with ``instances`` and ``modes``, atomically (lock held)."""
        # Every GPU in MIG mode is written, those without instances too: none is a state.
        state: dict[str, Any] = {
            "version": _STATE_VERSION,
            "gpus": {
                gpu.uuid: [
                    {
                        "gpu_instance_id": gi.id,
                        "profile_id": gi.profile.profile_id,
                        "start": gi.start,
                        "compute_instances": [
                            {
                                "compute_instance_id": ci.compute_instance_id,
                                "profile_id": _full_compute_profile(gi),
                            }
                            for ci in gi.compute_instances
                        ],
                    }
                    for gi in instances[gpu.index]
                ]
                for gpu in self._gpus
                if modes[gpu.index][0]
            },
            "mig_mode": {
                gpu.uuid: {"current": int(modes[gpu.index][0]), "pending": int(modes[gpu.index][1])}
                for gpu in self._gpus
                if gpu.spec.hardware.mig_capable
            },
        }
        # Not synced: a crash of a process cannot lose a renamed file, and real MIG instances do
        # not survive what could (a power loss reboots the node, and a reboot clears them).
        replace_file(path, (json.dumps(state, indent=1) + "\n").encode(), durable=False)

    def _read(
        self,
        path: Path,
        *,
        instances: dict[int, tuple[SimulatedGpuInstance, ...]],
        modes: dict[int, tuple[bool, bool]],
    ) -> None:
        """Replace the spec's ``instances`` and ``modes`` with those ``path`` records for this
        node's GPUs; SimulationSpecError if invalid."""
        try:
            state = json.loads(path.read_text())
            if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
                raise ValueError(f"not a version {_STATE_VERSION} MIG state file")
            recorded = state["gpus"]
            recorded_modes = state.get("mig_mode", {})  # absent in files of older agents
            if not isinstance(recorded, dict) or not isinstance(recorded_modes, dict):
                raise ValueError("'gpus' or 'mig_mode' is not an object")
            for gpu in self._gpus:
                if gpu.uuid in recorded_modes:
                    modes[gpu.index] = _read_mode(gpu, recorded_modes[gpu.uuid])
                    if not modes[gpu.index][0]:
                        instances[gpu.index] = ()  # the spec's layout needs MIG mode on
                if gpu.uuid in recorded:
                    instances[gpu.index] = self._read_gpu(
                        gpu, recorded[gpu.uuid], enabled=modes[gpu.index][0]
                    )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise SimulationSpecError(f"simulated MIG state {path}: {exc}") from exc

    def _read_gpu(
        self, gpu: SimulatedGpu, entries: Any, *, enabled: bool
    ) -> tuple[SimulatedGpuInstance, ...]:
        if entries and not enabled:
            raise ValueError(f"GPU {gpu.index} has MIG instances but MIG mode is off")
        found: list[SimulatedGpuInstance] = []
        for entry in entries:
            profile = self._library._profile_by_id(gpu, int(entry["profile_id"]))
            start = int(entry["start"])
            if profile is None:
                raise ValueError(f"GPU {gpu.index}: no GPU-instance profile {entry['profile_id']}")
            span = frozenset(range(start, start + profile.placement_size))
            if start not in profile.placement_starts or any(span & i.memory_slices for i in found):
                raise ValueError(f"GPU {gpu.index}: {profile.name} cannot be at slice {start}")
            if int(entry["gpu_instance_id"]) != _gpu_instance_id(start, profile.placement_size):
                raise ValueError(f"GPU {gpu.index}: wrong GPU-instance id in {entry}")
            instance = SimulatedGpuInstance(
                gpu_index=gpu.index, id=int(entry["gpu_instance_id"]), profile=profile, start=start
            )
            cis = entry["compute_instances"]
            if len(cis) > 1 or any(
                (int(c["compute_instance_id"]), int(c["profile_id"]))
                != (0, _full_compute_profile(instance))
                for c in cis
            ):
                raise ValueError(f"GPU {gpu.index}: unsupported compute instances in {entry}")
            mig = SimulatedMig(
                uuid=_mig_uuid(self._node_name, gpu.index, profile, start),
                gpu_instance_id=instance.id,
                compute_instance_id=0,
                profile=profile,
                start=start,
            )
            found.append(_replace(instance, compute_instances=(mig,) if cis else ()))
        return tuple(found)


def _read_mode(gpu: SimulatedGpu, entry: Any) -> tuple[bool, bool]:
    """A GPU's ``mig_mode`` entry of the state file: (current, pending)."""
    if not gpu.spec.hardware.mig_capable:
        raise ValueError(f"GPU {gpu.index} ({gpu.spec.hardware.key}) has no MIG mode")
    if not isinstance(entry, dict):
        raise ValueError(f"GPU {gpu.index}: MIG mode {entry!r} is not an object")
    current, pending = entry["current"], entry["pending"]
    if any(type(value) is not int or value not in (0, 1) for value in (current, pending)):
        raise ValueError(f"GPU {gpu.index}: MIG mode {entry!r} is not 0 or 1")
    return bool(current), bool(pending)


@dataclass(frozen=True)
class SimulatedNode:
    """What ``simulated_nvml`` yields: the GPUs it serves and the sysfs tree to read."""

    node_name: str
    gpus: tuple[SimulatedGpu, ...]
    sysfs_root: Path
    library: SimulatedNvmlLibrary


@contextmanager
def simulated_nvml(
    spec: str,
    *,
    node_name: str,
    inbox: Path | None = None,
    state_path: Path | None = None,
    compute_modes: Path | None = None,
) -> Iterator[SimulatedNode]:
    """Install simulated GPUs as pynvml's NVML library for the duration of the block.

    Parses ``spec`` first (SimulationSpecError before anything changes), writes a sysfs tree to a
    temporary directory (removed afterwards; pass ``node.sysfs_root`` to discovery), and restores
    pynvml's previous library, symbol cache and reference count on exit, so blocks may be used
    one after another or nested in one process (the installing and restoring are not for
    concurrent use; the library itself may be called from several threads). ``inbox``: a file
    other processes append faults to (gpus/injector.py); lines already in it are skipped.
    ``state_path``: the file the node keeps its MIG instances in (see SimulatedMigInstances),
    read here when it exists, so a second block on the same file sees the instances the first
    created; None keeps them in memory, starting from the spec's layout. ``compute_modes``: see
    SimulatedNvmlLibrary.
    """
    gpus = build_node(parse_spec(spec), node_name=node_name)
    library = SimulatedNvmlLibrary(
        gpus, node_name=node_name, inbox=inbox, state_path=state_path, compute_modes=compute_modes
    )
    with tempfile.TemporaryDirectory(prefix="gpu-dra-sysfs-") as tmp:
        sysfs_root = write_sysfs(Path(tmp), gpus)
        with pynvml.libLoadLock:
            saved = (
                pynvml.nvmlLib,
                dict(pynvml._nvmlGetFunctionPointer_cache),
                pynvml._nvmlLib_refcount,
            )
            pynvml.nvmlLib = library
            # pynvml caches function pointers by name; stale entries would call the old library.
            pynvml._nvmlGetFunctionPointer_cache.clear()
            pynvml._nvmlLib_refcount = 0
        try:
            yield SimulatedNode(
                node_name=node_name, gpus=gpus, sysfs_root=sysfs_root, library=library
            )
        finally:
            with pynvml.libLoadLock:
                pynvml.nvmlLib, cache, pynvml._nvmlLib_refcount = saved
                pynvml._nvmlGetFunctionPointer_cache.clear()
                pynvml._nvmlGetFunctionPointer_cache.update(cache)


def discover_simulated(spec: str, *, node_name: str) -> Inventory:
    """Run ``nvml.discover`` once against simulated GPUs (what ``--simulate`` does at start)."""
    with simulated_nvml(spec, node_name=node_name) as node:
        # The driver root is never read: pynvml already holds the simulated library.
        return nvml.discover(driver_root=Path("/"), sysfs_root=node.sysfs_root)
