"""What telemetry reads from NVML: plain frozen values, no NVML types, no I/O.

Place in the flow: between the NVML boundary and the telemetry wing. telemetry/sampler.py asks
for a round of readings of its :class:`TelemetryTarget` devices; gpus/readings.py asks NVML and
answers with a :class:`Reading` per device. The values live here, below both, so that the
boundary never imports the wing it serves. A module of its own (not gpus/observations.py, which
the health watch always loads) so that an agent without metrics loads none of it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TelemetryTarget:
    """A device telemetry reports on: a physical GPU (also one in MIG mode, which is not itself
    published but has the temperature, power and clocks), or a MIG device."""

    name: str  # our device name: gpu-0, gpu-4-mig-3g40gb-9-0
    uuid: str
    gpu_minor: int  # the GPU's minor (a MIG device's parent's)
    type: str  # "gpu" or "mig"
    profile: str = ""  # MIG profile, e.g. "3g.40gb"; empty for a GPU
    product_name: str = ""
    mig_enabled: bool = False
    gpu_index: int = 0  # the GPU's NVML index (a MIG device's parent's): DCGM's GPU id
    pci_bus_id: str = ""  # the GPU's extended BDF, lowercase: "0000:1b:00.0"
    gpu_uuid: str = ""  # the GPU's UUID (a MIG device's parent's; a GPU's own)
    gpu_instance_id: int | None = None  # a MIG device's GPU instance id; None for a GPU


@dataclass(frozen=True)
class Reading:
    """One device's values at one sample, in base units. None: the device does not support
    that query (e.g. utilisation of a MIG device), or the query failed this time."""

    utilization_ratio: float | None = None
    memory_utilization_ratio: float | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    temperature_celsius: float | None = None
    power_usage_watts: float | None = None
    power_limit_watts: float | None = None
    sm_clock_hertz: float | None = None
    ecc_corrected_errors: int | None = None
    ecc_uncorrected_errors: int | None = None
    memory_free_bytes: int | None = None
    memory_clock_hertz: float | None = None
    memory_temperature_celsius: float | None = None
    energy_millijoules: int | None = None  # since the driver loaded
    encoder_utilization_ratio: float | None = None
    decoder_utilization_ratio: float | None = None
    pcie_replays: int | None = None
    remapped_rows_corrected: int | None = None
    remapped_rows_uncorrected: int | None = None
    row_remap_pending: bool | None = None
    row_remap_failure: bool | None = None
    clock_event_reasons: int | None = None  # NVML's bitmask (nvmlClocksEventReason*)
    memory_reserved_bytes: int | None = None  # the driver's; not in used (NVML memory info v2)
