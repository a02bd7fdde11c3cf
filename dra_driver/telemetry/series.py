"""The ``gpu_dra_*`` series of telemetry: one family per reading, labelled with the device's
identity only, plus one ``gpu_dra_device_claim_info`` series per (device, claim, pod).

A device's series never carry who holds it: a prepare or unprepare starts or ends only info
series, so the device series stay the same series for the life of the device. Every counter a
device supports is there from the first sample on (XID events: 0 for every device while the
health watcher reports), so ``increase()`` sees a device's first event.

Pure: formats an ``Inputs`` (model.py) with prometheus_client's metric families; names, labels
and units in docs/metrics.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from dra_driver.gpus.telemetryvalues import Reading, TelemetryTarget
from dra_driver.telemetry.model import Inputs, add_sample


@dataclass(frozen=True)
class _Gauge:
    name: str
    field: str
    help: str


_GAUGES = (
    _Gauge(
        "gpu_dra_gpu_utilization_ratio",
        "utilization_ratio",
        "Fraction of the last sample period during which one or more kernels ran on the GPU "
        "(NVML utilization.gpu). Not reported for MIG devices or GPUs in MIG mode.",
    ),
    _Gauge(
        "gpu_dra_gpu_memory_utilization_ratio",
        "memory_utilization_ratio",
        "Fraction of the last sample period during which device memory was read or written "
        "(NVML utilization.memory). Not reported for MIG devices or GPUs in MIG mode.",
    ),
    _Gauge(
        "gpu_dra_gpu_memory_used_bytes",
        "memory_used_bytes",
        "Device memory in use, without the driver's reserved memory, as nvidia-smi shows it "
        "(NVML memory info v2; a MIG device reports its own share).",
    ),
    _Gauge(
        "gpu_dra_gpu_memory_free_bytes",
        "memory_free_bytes",
        "Device memory free (NVML memory info v2; a MIG device reports its own share).",
    ),
    _Gauge(
        "gpu_dra_gpu_memory_reserved_bytes",
        "memory_reserved_bytes",
        "Device memory the driver reserves, neither used nor free (NVML memory info v2); "
        "free + used + reserved = total.",
    ),
    _Gauge(
        "gpu_dra_gpu_memory_total_bytes",
        "memory_total_bytes",
        "Device memory in total (NVML memory info; a MIG device reports its own share).",
    ),
    _Gauge(
        "gpu_dra_gpu_temperature_celsius",
        "temperature_celsius",
        "GPU core temperature in degrees Celsius.",
    ),
    _Gauge("gpu_dra_gpu_power_usage_watts", "power_usage_watts", "Power draw of the GPU board."),
    _Gauge(
        "gpu_dra_gpu_power_limit_watts",
        "power_limit_watts",
        "Power limit the driver enforces on the GPU board.",
    ),
    _Gauge("gpu_dra_gpu_sm_clock_hertz", "sm_clock_hertz", "Current SM clock of the GPU."),
)

SLOWDOWN_REASONS = (
    # nvml.h nvmlClocksEventReason* bits of a slowdown for heat or a hardware signal (power
    # capping at the limit is normal under load and left out; the bitmask is in the reading)
    ("hw_slowdown", 0x8),
    ("sw_thermal", 0x20),
    ("hw_thermal", 0x40),
)

INFO = "gpu_dra_gpu_info"
ECC = "gpu_dra_gpu_ecc_errors"
REMAPPED_ROWS = "gpu_dra_gpu_remapped_rows"
ROW_REMAP_FAILURE = "gpu_dra_gpu_row_remap_failure"
ROW_REMAP_PENDING = "gpu_dra_gpu_row_remap_pending"
ENERGY = "gpu_dra_gpu_energy_joules"
PCIE_REPLAYS = "gpu_dra_gpu_pcie_replays"
SLOWDOWN = "gpu_dra_gpu_clock_slowdown"
HEALTH = "gpu_dra_gpu_health"
XID = "gpu_dra_gpu_xid_errors"
CLAIM = "gpu_dra_device_claim_info"
LAST_SAMPLE = "gpu_dra_telemetry_last_sample_timestamp_seconds"
SAMPLE_DURATION = "gpu_dra_telemetry_sample_duration_seconds"

METRIC_NAMES = (
    INFO,
    *(g.name for g in _GAUGES),
    f"{ENERGY}_total",
    f"{ECC}_total",
    f"{REMAPPED_ROWS}_total",
    ROW_REMAP_FAILURE,
    ROW_REMAP_PENDING,
    f"{PCIE_REPLAYS}_total",
    SLOWDOWN,
    HEALTH,
    f"{XID}_total",
    CLAIM,
    LAST_SAMPLE,
    SAMPLE_DURATION,
)
"""Every ``gpu_dra_*`` metric name telemetry can expose (as written in the exposition)."""

DEVICE_LABELS = ("node", "device", "uuid", "gpu", "profile")
CLAIM_LABELS = (
    "node", "device", "uuid", "gpu", "claim_namespace", "claim_name", "claim_uid",
    "pod_namespace", "pod_name",
)  # fmt: skip


def device_labels(node: str, target: TelemetryTarget) -> dict[str, str]:
    """The identity of a device: the labels of every one of its series. Labels that do not apply
    are left out (Prometheus reads an empty label as none), so most series have four."""
    labels = {"node": node, "device": target.name, "uuid": target.uuid,
              "gpu": str(target.gpu_minor)}  # fmt: skip
    if target.profile:
        labels["profile"] = target.profile
    return labels


def device_series(inputs: Inputs, node: str) -> list[Metric]:
    """Every ``gpu_dra_*`` family of one exposition."""
    out = _Families()
    readings = inputs.readings
    for target in inputs.targets:
        labels = device_labels(node, target)
        mig_enabled = "true" if target.mig_enabled else "false"
        add_sample(out.info, {**labels, "type": target.type, "product": target.product_name,
                              "mig_enabled": mig_enabled}, 1.0)  # fmt: skip
        for holder in inputs.holders.get(target.name, ()):
            claim = {**labels, "claim_namespace": holder.namespace, "claim_name": holder.name,
                     "claim_uid": holder.uid}  # fmt: skip
            claim.pop("profile", None)
            for pod in holder.pods or ("",):
                if pod:
                    add_sample(out.claim, {**claim, "pod_namespace": holder.namespace,
                                           "pod_name": pod}, 1.0)  # fmt: skip
                else:
                    add_sample(out.claim, claim, 1.0)
        state = inputs.states.get(target.name)
        if state is not None:
            add_sample(out.health, {**labels, "state": state}, 1.0)
        if inputs.xids is not None:
            add_sample(out.xid, labels, float(inputs.xids.get(target.name, 0)))
        reading = readings.get(target.uuid)
        if reading is not None:
            _add_reading(out, labels, reading)
    snapshot = inputs.snapshot
    if snapshot is not None:
        add_sample(out.last_sample, {"node": node}, snapshot.taken_at_s)
        add_sample(out.sample_duration, {"node": node}, snapshot.duration_s)
    return out.all()


def _add_reading(out: _Families, labels: dict[str, str], reading: Reading) -> None:
    for family, spec in zip(out.gauges, _GAUGES, strict=True):
        value = getattr(reading, spec.field)
        if value is not None:
            add_sample(family, labels, float(value))
    if reading.energy_millijoules is not None:
        add_sample(out.energy, labels, reading.energy_millijoules / 1000)
    counters: tuple[tuple[CounterMetricFamily, tuple[int | None, int | None]], ...] = (
        (out.ecc, (reading.ecc_corrected_errors, reading.ecc_uncorrected_errors)),
        (out.remapped_rows, (reading.remapped_rows_corrected, reading.remapped_rows_uncorrected)),
    )
    for counter, pair in counters:
        for error_type, count in zip(("corrected", "uncorrected"), pair, strict=True):
            if count is not None:
                add_sample(counter, {**labels, "error_type": error_type}, float(count))
    if reading.row_remap_failure is not None:
        add_sample(out.remap_failure, labels, float(reading.row_remap_failure))
    if reading.row_remap_pending is not None:
        add_sample(out.remap_pending, labels, float(reading.row_remap_pending))
    if reading.pcie_replays is not None:
        add_sample(out.pcie_replays, labels, float(reading.pcie_replays))
    reasons = reading.clock_event_reasons
    if reasons is not None:
        for reason, bit in SLOWDOWN_REASONS:
            add_sample(out.slowdown, {**labels, "reason": reason}, 1.0 if reasons & bit else 0.0)


class _Families:
    """The ``gpu_dra_*`` metric families of one exposition, empty until filled."""

    def __init__(self) -> None:
        labels = DEVICE_LABELS
        self.info = GaugeMetricFamily(
            INFO,
            "1 for every GPU and MIG device of the node, with what it is: type (gpu, mig), "
            "product name and whether the GPU is in MIG mode.",
            labels=(*labels, "type", "product", "mig_enabled"),
        )
        self.gauges = [GaugeMetricFamily(g.name, g.help, labels=labels) for g in _GAUGES]
        self.energy = CounterMetricFamily(
            ENERGY,
            "Energy the GPU consumed since the driver was loaded, in joules "
            "(nvmlDeviceGetTotalEnergyConsumption).",
            labels=labels,
        )
        self.ecc = CounterMetricFamily(
            ECC,
            "ECC errors since the driver was loaded (NVML volatile counters), by error type "
            "(corrected; uncorrected: double-bit). Not reported for MIG devices.",
            labels=(*labels, "error_type"),
        )
        self.remapped_rows = CounterMetricFamily(
            REMAPPED_ROWS,
            "Memory rows remapped for correctable or uncorrectable errors "
            "(nvmlDeviceGetRemappedRows; A100 and newer).",
            labels=(*labels, "error_type"),
        )
        self.remap_failure = GaugeMetricFamily(
            ROW_REMAP_FAILURE,
            "1 when a row remapping of the GPU's memory failed (the GPU needs service), else 0.",
            labels=labels,
        )
        self.remap_pending = GaugeMetricFamily(
            ROW_REMAP_PENDING,
            "1 when a row remapping waits for a GPU reset, else 0.",
            labels=labels,
        )
        self.pcie_replays = CounterMetricFamily(
            PCIE_REPLAYS, "PCIe replays of the GPU (nvmlDeviceGetPcieReplayCounter).", labels=labels
        )
        self.slowdown = GaugeMetricFamily(
            SLOWDOWN,
            "1 while the driver holds the GPU's clocks down for the reason in the label reason "
            "(hw_slowdown, sw_thermal, hw_thermal), else 0.",
            labels=(*labels, "reason"),
        )
        self.health = GaugeMetricFamily(
            HEALTH,
            "1 with the device's current health state in the label state (from the health "
            "watcher).",
            labels=(*labels, "state"),
        )
        self.xid = CounterMetricFamily(
            XID,
            "XID events (NVIDIA driver error reports) seen on the device since the agent "
            "started (from the health watcher); 0 for every device until its first.",
            labels=labels,
        )
        self.claim = GaugeMetricFamily(
            CLAIM,
            "1 for every prepared claim holding a device, once per pod it is reserved for "
            "(status.reservedFor; pod_namespace and pod_name left out while none is known).",
            labels=CLAIM_LABELS,
        )
        self.last_sample = GaugeMetricFamily(
            LAST_SAMPLE,
            "When the last telemetry sample started, as a Unix time in seconds.",
            labels=("node",),
        )
        self.sample_duration = GaugeMetricFamily(
            SAMPLE_DURATION,
            "Wall time the last telemetry sample took (every NVML query of every device).",
            labels=("node",),
        )

    def all(self) -> list[Metric]:
        return [
            self.info,
            *self.gauges,
            self.energy,
            self.ecc,
            self.remapped_rows,
            self.remap_failure,
            self.remap_pending,
            self.pcie_replays,
            self.slowdown,
            self.health,
            self.xid,
            self.claim,
            self.last_sample,
            self.sample_duration,
        ]


def describe() -> list[Metric]:
    """The families, empty (the collector protocol's ``describe``)."""
    return _Families().all()


__all__ = [
    "DEVICE_LABELS",
    "METRIC_NAMES",
    "SLOWDOWN_REASONS",
    "describe",
    "device_labels",
    "device_series",
]
