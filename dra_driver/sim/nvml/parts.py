"""The simulated library as its parts see it: what each part (devices.py, health.py, mig.py,
readings.py) uses of the library and of the other parts, and the values they hand each other.

library.py's ``SimulatedNvmlLibrary`` builds the parts and hands itself to each as a
:class:`Library`; a part names only the Protocols here, never the library's class or another
part's module, so the parts and the library import no module that imports them (no cycle, not
even through annotations: tests/test_architecture.py). mypy checks that the library and each
part satisfy these where library.py hands them over.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from dra_driver.sim.nvml.abi import Handles
from dra_driver.sim.nvml.node import SimulatedGpu, SimulatedGpuInstance, SimulatedMig


@dataclass(frozen=True)
class MemoryInfo:
    """A device's memory in bytes, as ``nvmlMemory_v2_t`` has it (used without reserved)."""

    total: int
    reserved: int
    used: int

    @property
    def free(self) -> int:
        return self.total - self.reserved - self.used


@dataclass(frozen=True)
class MigView:
    """Every MIG instance that exists, and the handle addresses that name them; never mutated
    (mig.py replaces it whole on each change)."""

    instances: dict[int, tuple[SimulatedGpuInstance, ...]]  # GPU index -> by id
    modes: dict[int, tuple[bool, bool]]  # GPU index -> MIG mode (current, pending)
    devices: dict[int, tuple[SimulatedMig, ...]]  # GPU index -> MIG devices, NVML's order
    mig_devices: dict[int, tuple[SimulatedGpu, SimulatedMig]]
    gpu_instances: dict[int, SimulatedGpuInstance]
    compute_instances: dict[int, tuple[SimulatedGpuInstance, SimulatedMig]]


class HealthPart(Protocol):
    """What the other parts ask of health.py's ``SimulatedHealth``."""

    def answers(self, gpu: SimulatedGpu) -> bool: ...

    def temperature(self, gpu: SimulatedGpu) -> int | None: ...

    def uncorrected_ecc(self, gpu: SimulatedGpu, *, volatile: bool) -> int: ...


class MigPart(Protocol):
    """What the other parts ask of mig.py's ``SimulatedMigInstances``."""

    @property
    def view(self) -> MigView: ...

    def mode(self, gpu: SimulatedGpu) -> tuple[bool, bool]: ...

    def enabled(self, gpu: SimulatedGpu) -> bool: ...

    def devices(self, gpu: SimulatedGpu) -> tuple[SimulatedMig, ...]: ...

    def mig_address(self, gpu: SimulatedGpu, mig: SimulatedMig) -> int: ...

    def gpu_instance_address(self, instance: SimulatedGpuInstance) -> int: ...

    def gpu_instance(self, handle: Any) -> tuple[SimulatedGpuInstance | None, int]: ...


class ReadingsPart(Protocol):
    """What the other parts ask of readings.py's ``SimulatedReadings``."""

    def memory(self, gpu: SimulatedGpu, mig: SimulatedMig | None) -> MemoryInfo: ...


class Library(Protocol):
    """What the parts ask of library.py's ``SimulatedNvmlLibrary`` (its docstring says what
    each member holds)."""

    @property
    def gpus(self) -> tuple[SimulatedGpu, ...]: ...

    @property
    def handles(self) -> Handles: ...

    @property
    def compute_modes(self) -> Path | None: ...

    @property
    def processes(self) -> dict[str, tuple[int, ...]]: ...

    @property
    def ecc_errors(self) -> dict[tuple[str, int], int]: ...

    @property
    def workload(self) -> Callable[[str], bool] | None: ...

    @property
    def clock(self) -> Callable[[], float]: ...

    @property
    def health(self) -> HealthPart: ...

    @property
    def mig(self) -> MigPart: ...

    @property
    def readings(self) -> ReadingsPart: ...

    def device(self, handle: Any) -> tuple[SimulatedGpu | None, SimulatedMig | None, int]: ...

    def full_gpu(self, handle: Any) -> tuple[SimulatedGpu | None, int]: ...

    def gpu_temperature(self, gpu: SimulatedGpu) -> int: ...


__all__ = ["HealthPart", "Library", "MemoryInfo", "MigPart", "MigView", "ReadingsPart"]
