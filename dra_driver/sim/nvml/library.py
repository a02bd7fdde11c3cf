"""The simulated NVML library object that pynvml holds as ``pynvml.nvmlLib``: its symbol table.

pynvml looks C symbols up by name on the object it loaded and calls them with ctypes arguments;
``SimulatedNvmlLibrary`` answers those lookups with a table it collects from the NVML areas (the
system calls here; device queries in devices.py; readings in readings.py; events, health
queries and faults in health.py; MIG instances and mode in mig.py), traces each call, refuses
calls before ``nvmlInit`` as NVML does, and maps a handle back to the simulated GPU or MIG
device it names. install.py puts it where pynvml looks. The parts see the library, and each
other, only through the Protocols of parts.py.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pynvml

from dra_driver.sim.nvml.abi import (
    ERROR_STRINGS,
    GPU_IS_LOST,
    INVALID_ARGUMENT,
    SUCCESS,
    UNINITIALIZED,
    WITHOUT_INIT,
    CFunction,
    Handles,
    address_of,
    as_int,
    pointee,
    set_pointer,
    write_string,
)
from dra_driver.sim.nvml.devices import DeviceQueries
from dra_driver.sim.nvml.health import SimulatedHealth
from dra_driver.sim.nvml.mig import SimulatedMigInstances
from dra_driver.sim.nvml.node import SimulatedGpu, SimulatedMig
from dra_driver.sim.nvml.readings import SimulatedReadings
from dra_driver.sim.profiles import CUDA_DRIVER_VERSION, DRIVER_VERSION


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
    nvidia-smi keeps each GPU's compute mode in (sim/fakedriver.py); ``nvmlDeviceGetComputeMode``
    reads it (a GPU it does not name is in DEFAULT). ``driver_version`` and
    ``cuda_driver_version``: what ``nvmlSystemGetDriverVersion`` and
    ``nvmlSystemGetCudaDriverVersion`` answer (the simulated R570 driver by default; gpu-check's
    twin takes the real node's).
    """

    def __init__(
        self,
        gpus: tuple[SimulatedGpu, ...],
        *,
        node_name: str,
        inbox: Path | None = None,
        state_path: Path | None = None,
        compute_modes: Path | None = None,
        driver_version: str = DRIVER_VERSION,
        cuda_driver_version: int = CUDA_DRIVER_VERSION,
    ) -> None:
        self.gpus = gpus
        self.driver_version = driver_version
        self.cuda_driver_version = cuda_driver_version
        self.compute_modes = compute_modes
        self.handles = Handles()
        self.handles.add(gpus)
        self._initialised = 0
        self._init_lock = threading.Lock()
        self.health = SimulatedHealth(self, inbox=inbox)
        self.mig = SimulatedMigInstances(self, node_name=node_name, state_path=state_path)
        self.devices = DeviceQueries(self)
        self.readings = SimulatedReadings(self)
        # Symbol names in call order, for tests and debugging; bounded for long-lived use.
        self.calls: deque[str] = deque(maxlen=10_000)
        # Telemetry (readings.py): the clock readings move with, and which UUIDs run
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
            "nvmlErrorString": lambda rc: ERROR_STRINGS.get(as_int(rc), b"Unknown Error"),
            "nvmlSystemGetDriverVersion": self._driver_version,
            "nvmlSystemGetCudaDriverVersion": self._cuda_driver_version,
            "nvmlSystemGetCudaDriverVersion_v2": self._cuda_driver_version,
            "nvmlDeviceGetCount_v2": self._count,
            "nvmlDeviceGetHandleByIndex_v2": self._handle_by_index,
            **self.devices.functions(),
            **self.health.functions(),
            **self.mig.functions(),
            **self.readings.functions(),
        }
        self._functions = {
            name: CFunction(name, self._traced(name, f)) for name, f in impls.items()
        }

    def __getattr__(self, name: str) -> CFunction:
        functions = self.__dict__.get("_functions", {})
        if name in functions:
            return functions[name]  # type: ignore[no-any-return]
        raise AttributeError(f"simulated NVML has no symbol {name}")

    def _traced(self, name: str, impl: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            self.calls.append(name)
            if name not in WITHOUT_INIT and not self._initialised:
                return UNINITIALIZED
            self.health.read_inbox()
            return impl(*args)

        return call

    # system

    def _init(self, flags: Any) -> int:
        with self._init_lock:  # NVML counts nested init/shutdown pairs, from any thread
            self._initialised += 1
        return SUCCESS

    def _shutdown(self) -> int:
        with self._init_lock:
            self._initialised -= 1
        return SUCCESS

    def _driver_version(self, buffer: Any, length: Any) -> int:
        return write_string(buffer, length, self.driver_version)

    def _cuda_driver_version(self, ref: Any) -> int:
        pointee(ref).value = self.cuda_driver_version
        return SUCCESS

    def _count(self, ref: Any) -> int:
        pointee(ref).value = len(self.gpus)
        return SUCCESS

    def _handle_by_index(self, index: Any, ref: Any) -> int:
        address = self.handles.gpu_address.get(as_int(index))
        if address is None:
            return INVALID_ARGUMENT
        set_pointer(ref, address)
        return SUCCESS

    # lookups

    def device(self, handle: Any) -> tuple[SimulatedGpu | None, SimulatedMig | None, int]:
        """(gpu, mig, rc): the GPU a handle names, the MIG device if it is a MIG handle."""
        address = address_of(handle)
        mig_devices = self.mig.view.mig_devices
        if address in self.handles.gpus:
            gpu, mig = self.handles.gpus[address], None
        elif address in mig_devices:
            gpu, mig = mig_devices[address]
        else:
            return None, None, INVALID_ARGUMENT
        if gpu.spec.fail or not self.health.answers(gpu):
            return gpu, mig, GPU_IS_LOST
        return gpu, mig, SUCCESS

    def full_gpu(self, handle: Any) -> tuple[SimulatedGpu | None, int]:
        """A full-GPU handle; MIG handles are invalid where NVML wants the parent."""
        gpu, mig, rc = self.device(handle)
        if rc == SUCCESS and mig is not None:
            return None, INVALID_ARGUMENT
        return gpu, rc

    # workloads: processes, ECC errors and temperatures stand in for work on the GPUs

    def put_process(self, uuid: str, pid: int) -> None:
        """Run a compute process (``pid``) on the GPU or MIG device ``uuid``."""
        self.processes[uuid] = (*self.processes.get(uuid, ()), pid)

    def end_processes(self, uuid: str) -> None:
        """End every compute process on the GPU or MIG device ``uuid``."""
        self.processes.pop(uuid, None)

    def add_ecc_errors(self, uuid: str, *, corrected: int = 0, uncorrected: int = 0) -> None:
        """Count ECC errors on a GPU (volatile counters, as after a real error)."""
        for error_type, n in (
            (pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, corrected),
            (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, uncorrected),
        ):
            self.ecc_errors[uuid, error_type] = self.ecc_errors.get((uuid, error_type), 0) + n

    def gpu_temperature(self, gpu: SimulatedGpu) -> int:
        """A fault's temperature, else the reading that moves with the GPU's load."""
        return self.readings.gpu_temperature(gpu)
