"""Telemetry readings of the simulated library: load, memory, temperature, power, clocks, ECC.

The telemetry side of the simulated library (library.py collects the table): utilisation,
memory (for the v1 and v2 calls: ``memory``), temperature (GPU, and HBM memory through
``nvmlDeviceGetFieldValues``), power, its limit and the energy it adds up to, SM and memory
clocks, encoder and decoder use (0: the simulated work uses neither), PCIe replays (0), the clock
event reasons (idle, thermal slowdown at the slowdown threshold), ECC counts, and the lookup by
UUID telemetry uses. They move over time
as a deterministic function of the device's UUID and the library's ``clock``
(``simulated_load``), higher while the library's ``workload`` says a device runs work (the agent
points it at the devices prepared claims hold). MIG device handles answer NOT_SUPPORTED for all
but memory, and a GPU in MIG mode for utilisation, as nvml.h documents for real GPUs. A fault's
temperature and ECC errors (health.py) take precedence.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pynvml

from dra_driver.sim.nvml.abi import (
    GPU_IS_LOST,
    INVALID_ARGUMENT,
    NOT_FOUND,
    NOT_SUPPORTED,
    SUCCESS,
    as_int,
    pointee,
    set_pointer,
)
from dra_driver.sim.nvml.health import SLOWDOWN_C
from dra_driver.sim.nvml.node import SimulatedGpu, SimulatedMig, digest
from dra_driver.sim.nvml.parts import Library, MemoryInfo
from dra_driver.sim.profiles import MEMORY_RESERVED_MIB


@dataclass(frozen=True)
class _Envelope:
    """Power and clock range of a product (NVIDIA's data sheets; idle values typical)."""

    power_limit_w: int
    idle_power_w: int
    max_sm_clock_mhz: int
    idle_sm_clock_mhz: int
    memory_clock_mhz: int
    hbm: bool  # HBM boards report a memory temperature (NVML_FI_DEV_MEMORY_TEMP); GDDR ones not


_ENVELOPES = {
    "a100-40gb": _Envelope(400, 55, 1410, 210, 1215, hbm=True),
    "a100-80gb": _Envelope(400, 60, 1410, 210, 1593, hbm=True),
    "h100-80gb": _Envelope(700, 70, 1980, 345, 2619, hbm=True),
    "h200-141gb": _Envelope(700, 75, 1980, 345, 3201, hbm=True),
    "l4": _Envelope(72, 16, 2040, 210, 6251, hbm=False),
    "t4": _Envelope(70, 10, 1590, 300, 5001, hbm=False),
}
_DEFAULT_ENVELOPE = _Envelope(300, 40, 1500, 300, 1500, hbm=False)
_UPTIME_S = 3600.0  # energy counters start as if the driver had loaded an hour before
_SAMPLING_PERIOD_US = 167_000  # what NVML reports for the encoder and decoder samples
_REASON_GPU_IDLE = 0x1
_REASON_HW_SLOWDOWN = 0x8
_REASON_HW_THERMAL_SLOWDOWN = 0x40


def _envelope(gpu: SimulatedGpu) -> _Envelope:
    return _ENVELOPES.get(gpu.spec.hardware.key, _DEFAULT_ENVELOPE)


def simulated_load(uuid: str, *, now_s: float, busy: bool) -> float:
    """How hard a simulated device works at ``now_s``, 0..1; the same for the same arguments.

    A slow wave with a period and phase of the UUID's own (2-6 minutes), plus a step that
    changes every 5 s: idle devices stay at a few percent, busy ones between 65 and 95 %.
    """
    seed = digest("load", uuid)
    period_s = 120 + 240 * seed[1] / 255
    wave = 0.5 + 0.5 * math.sin(2 * math.pi * (now_s / period_s + seed[0] / 255))
    step = digest("step", uuid, int(now_s // 5))[0] / 255 - 0.5
    load = 0.65 + 0.25 * wave + 0.1 * step if busy else 0.03 + 0.06 * wave + 0.04 * step
    return min(1.0, max(0.0, load))


class SimulatedReadings:
    """The telemetry functions of one simulated library; the state they read is the library's
    (``clock``, ``workload``, ``ecc_errors``, the MIG devices, the health faults)."""

    def __init__(self, library: Library) -> None:
        self._library = library
        self._energy_lock = threading.Lock()
        self._energy: dict[str, tuple[float, float]] = {}  # UUID -> (clock s, millijoules)

    def functions(self) -> dict[str, Callable[..., Any]]:
        return {
            "nvmlDeviceGetHandleByUUID": self._handle_by_uuid,
            "nvmlDeviceGetUtilizationRates": self._utilization_rates,
            "nvmlDeviceGetTemperature": self._temperature,
            "nvmlDeviceGetPowerUsage": self._power_usage,
            "nvmlDeviceGetEnforcedPowerLimit": self._enforced_power_limit,
            "nvmlDeviceGetClockInfo": self._clock_info,
            "nvmlDeviceGetTotalEccErrors": self._total_ecc_errors,
            "nvmlDeviceGetFieldValues": self._field_values,
            "nvmlDeviceGetTotalEnergyConsumption": self._total_energy,
            "nvmlDeviceGetEncoderUtilization": self._codec_utilization,
            "nvmlDeviceGetDecoderUtilization": self._codec_utilization,
            "nvmlDeviceGetPcieReplayCounter": self._pcie_replay_counter,
            "nvmlDeviceGetCurrentClocksEventReasons": self._clocks_event_reasons,
        }

    def _load(self, gpu: SimulatedGpu, mig: SimulatedMig | None) -> float:
        """0..1, how hard the device works now. A GPU in MIG mode works when one of its MIG
        devices does."""
        workload = self._library.workload
        if mig is not None:
            busy = workload is not None and workload(mig.uuid)
            return simulated_load(mig.uuid, now_s=self._library.clock(), busy=busy)
        busy = workload is not None and (
            workload(gpu.uuid) or any(workload(m.uuid) for m in self._library.mig.devices(gpu))
        )
        return simulated_load(gpu.uuid, now_s=self._library.clock(), busy=busy)

    def memory(self, gpu: SimulatedGpu, mig: SimulatedMig | None) -> MemoryInfo:
        """The memory of the GPU or MIG device as ``nvmlDeviceGetMemoryInfo_v2`` reports it:
        ``used`` excludes what the driver reserves (``reserved``, a whole GPU's only), and
        free + used + reserved = total. The v1 call counts the reservation as used."""
        if mig is not None:
            total = mig.profile.memory_mib << 20
            return MemoryInfo(total=total, reserved=0, used=self._used(gpu, mig, total))
        total = gpu.spec.hardware.memory_mib << 20
        reserved = MEMORY_RESERVED_MIB << 20
        if self._library.mig.enabled(gpu):  # what its MIG devices use
            used = sum(self.memory(gpu, m).used for m in self._library.mig.devices(gpu))
        else:
            used = self._used(gpu, None, total - reserved)
        return MemoryInfo(total=total, reserved=reserved, used=min(used, total - reserved))

    def _used(self, gpu: SimulatedGpu, mig: SimulatedMig | None, room: int) -> int:
        # Memory follows the slow part of the load (allocations outlive kernel bursts).
        load = self._load(gpu, mig)
        fraction = 0.002 + 0.85 * load * load
        return int(room * min(fraction, 0.97)) & ~0xFFFFF  # whole MiB, as NVML reports

    def _telemetry_device(
        self, handle: Any
    ) -> tuple[SimulatedGpu | None, SimulatedMig | None, int]:
        """The device of a full-GPU telemetry query; MIG device handles are NOT_SUPPORTED."""
        gpu, mig, rc = self._library.device(handle)
        if rc == SUCCESS and mig is not None:
            return gpu, mig, NOT_SUPPORTED
        return gpu, mig, rc

    def _handle_by_uuid(self, uuid_arg: Any, ref: Any) -> int:
        raw = uuid_arg if isinstance(uuid_arg, bytes) else uuid_arg.value
        wanted = (raw or b"").decode()
        for address, gpu in self._library.handles.gpus.items():
            if gpu.uuid == wanted:
                if gpu.spec.fail or not self._library.health.answers(gpu):
                    return GPU_IS_LOST
                set_pointer(ref, address)
                return SUCCESS
        for address, (parent, mig) in self._library.mig.view.mig_devices.items():
            if mig.uuid == wanted:
                if parent.spec.fail or not self._library.health.answers(parent):
                    return GPU_IS_LOST
                set_pointer(ref, address)
                return SUCCESS
        return NOT_FOUND

    def gpu_temperature(self, gpu: SimulatedGpu) -> int:
        """A fault's temperature, else the reading that moves with the GPU's load."""
        injected = self._library.health.temperature(gpu)
        return injected if injected is not None else round(31 + 44 * self._load(gpu, None))

    def _utilization_rates(self, handle: Any, ref: Any) -> int:
        gpu, _, rc = self._telemetry_device(handle)
        if gpu is None or rc != SUCCESS:
            return rc
        if self._library.mig.enabled(gpu):
            return NOT_SUPPORTED  # nvml.h: not supported on MIG-enabled GPUs
        load = self._load(gpu, None)
        rates = pointee(ref)
        rates.gpu = round(100 * load)
        rates.memory = round(70 * load)
        return SUCCESS

    def _temperature(self, handle: Any, sensor: Any, ref: Any) -> int:
        gpu, _, rc = self._telemetry_device(handle)
        if gpu is None or rc != SUCCESS:
            return rc
        if as_int(sensor) != pynvml.NVML_TEMPERATURE_GPU:
            return INVALID_ARGUMENT
        pointee(ref).value = self.gpu_temperature(gpu)
        return SUCCESS

    def _power_w(self, gpu: SimulatedGpu) -> float:
        envelope = _envelope(gpu)
        span_w = envelope.power_limit_w - envelope.idle_power_w
        return envelope.idle_power_w + 0.9 * span_w * self._load(gpu, None)

    def _power_usage(self, handle: Any, ref: Any) -> int:
        gpu, _, rc = self._telemetry_device(handle)
        if gpu is None or rc != SUCCESS:
            return rc
        pointee(ref).value = round(self._power_w(gpu) * 1000)  # milliwatts
        return SUCCESS

    def _total_energy(self, handle: Any, ref: Any) -> int:
        """Millijoules since the driver loaded: the power of each call over the time since the
        last one (so it never goes back, and follows the power readings)."""
        gpu, _, rc = self._telemetry_device(handle)
        if gpu is None or rc != SUCCESS:
            return rc
        now_s, watts = self._library.clock(), self._power_w(gpu)
        with self._energy_lock:
            since_s, total_mj = self._energy.get(gpu.uuid, (now_s - _UPTIME_S, 0.0))
            total_mj += max(0.0, now_s - since_s) * watts * 1000
            self._energy[gpu.uuid] = (now_s, total_mj)
        pointee(ref).value = int(total_mj)
        return SUCCESS

    def _codec_utilization(self, handle: Any, util_ref: Any, period_ref: Any) -> int:
        gpu, _, rc = self._telemetry_device(handle)
        if gpu is None or rc != SUCCESS:
            return rc
        if self._library.mig.enabled(gpu):
            return NOT_SUPPORTED
        pointee(util_ref).value = 0  # the simulated work encodes and decodes nothing
        pointee(period_ref).value = _SAMPLING_PERIOD_US
        return SUCCESS

    def _pcie_replay_counter(self, handle: Any, ref: Any) -> int:
        gpu, _, rc = self._telemetry_device(handle)
        if gpu is None or rc != SUCCESS:
            return rc
        pointee(ref).value = 0
        return SUCCESS

    def _clocks_event_reasons(self, handle: Any, ref: Any) -> int:
        gpu, _, rc = self._telemetry_device(handle)
        if gpu is None or rc != SUCCESS:
            return rc
        reasons = 0
        if self._load(gpu, None) <= 0.05:
            reasons |= _REASON_GPU_IDLE
        if self.gpu_temperature(gpu) >= SLOWDOWN_C:
            reasons |= _REASON_HW_SLOWDOWN | _REASON_HW_THERMAL_SLOWDOWN
        pointee(ref).value = reasons
        return SUCCESS

    def _field_values(self, handle: Any, count: Any, ref: Any) -> int:
        """Only ``NVML_FI_DEV_MEMORY_TEMP`` is known (HBM boards); other fields answer
        NOT_SUPPORTED in their own ``nvmlReturn``, as the real call does per field."""
        gpu, _, rc = self._telemetry_device(handle)
        if gpu is None or rc != SUCCESS:
            return rc
        values = pointee(ref)
        for i in range(as_int(count)):
            value = values[i]
            value.timestamp = int(self._library.clock() * 1e6)
            if value.fieldId == pynvml.NVML_FI_DEV_MEMORY_TEMP and _envelope(gpu).hbm:
                value.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
                value.value.uiVal = self.gpu_temperature(gpu) + 4  # HBM runs a little hotter
                value.nvmlReturn = SUCCESS
            else:
                value.nvmlReturn = NOT_SUPPORTED
        return SUCCESS

    def _enforced_power_limit(self, handle: Any, ref: Any) -> int:
        gpu, _, rc = self._telemetry_device(handle)
        if gpu is None or rc != SUCCESS:
            return rc
        pointee(ref).value = _envelope(gpu).power_limit_w * 1000  # milliwatts
        return SUCCESS

    def _clock_info(self, handle: Any, clock_type: Any, ref: Any) -> int:
        gpu, _, rc = self._telemetry_device(handle)
        if gpu is None or rc != SUCCESS:
            return rc
        envelope = _envelope(gpu)
        if as_int(clock_type) == pynvml.NVML_CLOCK_MEM:
            pointee(ref).value = envelope.memory_clock_mhz
            return SUCCESS
        if as_int(clock_type) not in (pynvml.NVML_CLOCK_GRAPHICS, pynvml.NVML_CLOCK_SM):
            return NOT_SUPPORTED
        load = self._load(gpu, None)
        boost = min(1.0, 1.25 * load) if load > 0.05 else 0.0
        mhz = envelope.idle_sm_clock_mhz + boost * (
            envelope.max_sm_clock_mhz - envelope.idle_sm_clock_mhz
        )
        pointee(ref).value = round(mhz / 15) * 15  # clocks move in 15 MHz steps
        return SUCCESS

    def _total_ecc_errors(self, handle: Any, error_type: Any, counter_type: Any, ref: Any) -> int:
        gpu, _, rc = self._telemetry_device(handle)
        if gpu is None or rc != SUCCESS:
            return rc
        kind = as_int(error_type)
        if kind not in (
            pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED,
            pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
        ) or as_int(counter_type) not in (pynvml.NVML_VOLATILE_ECC, pynvml.NVML_AGGREGATE_ECC):
            return INVALID_ARGUMENT
        count = self._library.ecc_errors.get((gpu.uuid, kind), 0)
        if kind == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED:  # the faults' double-bit errors
            volatile = as_int(counter_type) == pynvml.NVML_VOLATILE_ECC
            count += self._library.health.uncorrected_ecc(gpu, volatile=volatile)
        pointee(ref).value = count
        return SUCCESS
