"""DCGM-compatible series: the samples again, under NVIDIA dcgm-exporter's names, units, types and
labels, so dashboards and alerts written for dcgm-exporter work on gpu-dra's nodes.

The set is dcgm-exporter's ``etc/default-counters.csv`` less what NVML cannot answer (docs/
metrics.md lists both). Labels as dcgm-exporter writes them: ``gpu``, ``UUID``, ``pci_bus_id``,
``device``, ``modelName``, ``GPU_I_PROFILE``/``GPU_I_ID`` (MIG devices, labelled with their parent
GPU's identity as DCGM labels GPU instances), ``Hostname``, ``DCGM_FI_DRIVER_VERSION``; and, as
its Kubernetes pod mapper with shared GPUs (``--kubernetes-virtual-gpus``) and DRA
(``--kubernetes-enable-dra``) does, one series per (pod, container) using the device with
``pod``, ``namespace``, ``container`` and ``dra_*`` labels. Plus ``node``, as on every series of
the agent.

dcgm-exporter's counters have no ``_total`` suffix, and dashboards query those names;
prometheus_client writes a counter's HELP and TYPE lines as ``<name>_total``, so ``dcgm_texts``
writes those two lines back to the bare name (the samples already carry it). Its label names
(``modelName``, ``UUID``) are not Prometheus' snake case either: ``promtool check metrics`` lints
these series as it lints dcgm-exporter's own.

Pure: formats an ``Inputs`` (model.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.samples import Sample

from dra_driver.gpus.telemetryvalues import Reading, TelemetryTarget
from dra_driver.metrics import family_texts
from dra_driver.telemetry.model import Inputs

_MIB = 1 << 20


def _percent(ratio: float | None) -> float | None:
    return None if ratio is None else float(round(ratio * 100))


def _mhz(hertz: float | None) -> float | None:
    return None if hertz is None else round(hertz / 1e6)


def _mib(size: int | None) -> float | None:
    return None if size is None else float(size // _MIB)


def _number(value: float | bool | None) -> float | None:
    return None if value is None else float(value)


@dataclass(frozen=True)
class _Field:
    """One dcgm-exporter counter: its name, Prometheus type and help (default-counters.csv) and
    how the sample's reading gives its value in DCGM's unit."""

    name: str
    type: str  # "gauge" or "counter"
    help: str
    value: Callable[[Reading], float | None]


FIELDS = (
    _Field("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz).",
           lambda r: _mhz(r.sm_clock_hertz)),
    _Field("DCGM_FI_DEV_MEM_CLOCK", "gauge", "Memory clock frequency (in MHz).",
           lambda r: _mhz(r.memory_clock_hertz)),
    _Field("DCGM_FI_DEV_MEMORY_TEMP", "gauge", "Memory temperature (in C).",
           lambda r: r.memory_temperature_celsius),
    _Field("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C).",
           lambda r: r.temperature_celsius),
    _Field("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W).",
           lambda r: r.power_usage_watts),
    _Field("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "counter",
           "Total energy consumption since boot (in mJ).",
           lambda r: _number(r.energy_millijoules)),
    _Field("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "counter", "Total number of PCIe retries.",
           lambda r: _number(r.pcie_replays)),
    _Field("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %).",
           lambda r: _percent(r.utilization_ratio)),
    _Field("DCGM_FI_DEV_MEM_COPY_UTIL", "gauge", "Memory utilization (in %).",
           lambda r: _percent(r.memory_utilization_ratio)),
    _Field("DCGM_FI_DEV_ENC_UTIL", "gauge", "Encoder utilization (in %).",
           lambda r: _percent(r.encoder_utilization_ratio)),
    _Field("DCGM_FI_DEV_DEC_UTIL", "gauge", "Decoder utilization (in %).",
           lambda r: _percent(r.decoder_utilization_ratio)),
    _Field("DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (in MiB).",
           lambda r: _mib(r.memory_free_bytes)),
    _Field("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB).",
           lambda r: _mib(r.memory_used_bytes)),
    _Field("DCGM_FI_DEV_FB_RESERVED", "gauge", "Framebuffer memory reserved (in MiB).",
           lambda r: _mib(r.memory_reserved_bytes)),
    _Field("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "counter",
           "Number of remapped rows for uncorrectable errors",
           lambda r: _number(r.remapped_rows_uncorrected)),
    _Field("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "counter",
           "Number of remapped rows for correctable errors",
           lambda r: _number(r.remapped_rows_corrected)),
    _Field("DCGM_FI_DEV_ROW_REMAP_FAILURE", "gauge", "Whether remapping of rows has failed",
           lambda r: _number(r.row_remap_failure)),
)  # fmt: skip
XID_ERRORS = _Field(
    "DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error encountered.", lambda r: None
)
DCGM_METRIC_NAMES = (*(f.name for f in FIELDS), XID_ERRORS.name)
"""Every DCGM metric name the agent can expose (as written in the exposition)."""


HOST_LABEL = "Hostname"
"""dcgm-exporter's name of the node label (``--dcgm-host-label``; its next release: hostname)."""

# err_msg of DCGM_FI_DEV_XID_ERRORS, as NVIDIA's XID catalog names each XID (docs.nvidia.com
# "XID Errors"); dcgm-exporter labels its XID series with the same descriptions.
XID_MESSAGES: dict[int, str] = {
    0: "No Error",
    8: "GPU stopped processing",
    13: "Graphics Engine Exception",
    31: "GPU memory page fault",
    32: "Invalid or corrupted push buffer stream",
    38: "Driver firmware error",
    43: "GPU stopped processing",
    45: "Preemptive cleanup, due to previous errors",
    48: "Double Bit ECC Error",
    61: "Internal micro-controller breakpoint/warning",
    62: "Internal micro-controller halt",
    63: "ECC page retirement or row remapping recording event",
    64: "ECC page retirement or row remapper recording failure",
    68: "NVDEC0 Exception",
    69: "Graphics Engine class error",
    74: "NVLINK Error",
    79: "GPU has fallen off the bus",
    92: "High single-bit ECC error rate",
    94: "Contained ECC error",
    95: "Uncontained ECC error",
    109: "Context Switch Timeout Error",
    119: "GSP RPC Timeout",
    120: "GSP Error",
}
UNKNOWN_XID = "Unknown Error"


def dcgm_pci_bus_id(bus_id: str) -> str:
    """NVML's form of a PCI address, as DCGM reports it: ``0000:1b:00.0`` becomes
    ``00000000:1B:00.0``."""
    domain, _, rest = bus_id.partition(":")
    if not rest:
        return bus_id.upper()
    try:
        return f"{int(domain, 16):08X}:{rest.upper()}"
    except ValueError:
        return bus_id.upper()


def identity_labels(
    target: TelemetryTarget, *, node: str, driver_version: str, host_label: str = HOST_LABEL
) -> dict[str, str]:
    """A device's labels as dcgm-exporter writes them (no pod labels); the node name under
    ``host_label`` (dcgm-exporter's ``Hostname``; its next release names it ``hostname``)."""
    labels = {
        "gpu": str(target.gpu_index),
        "UUID": target.gpu_uuid or target.uuid,
        "pci_bus_id": dcgm_pci_bus_id(target.pci_bus_id),
        "device": f"nvidia{target.gpu_index}",
        "modelName": target.product_name,
        host_label: node,
        "node": node,
    }
    if target.type == "mig":
        labels["GPU_I_PROFILE"] = target.profile
        labels["GPU_I_ID"] = str(target.gpu_instance_id)
    if driver_version:
        labels["DCGM_FI_DRIVER_VERSION"] = driver_version
    return {k: v for k, v in labels.items() if v}


def pod_labels(
    inputs: Inputs, target: TelemetryTarget, *, driver: str, node: str
) -> list[dict[str, str]]:
    """One label set per (pod, container) using the device; one empty set when none does."""
    out: list[dict[str, str]] = []
    for holder in inputs.holders.get(target.name, ()):
        dra = {
            "dra_claim_name": holder.name,
            "dra_claim_namespace": holder.namespace,
            "dra_device_name": target.name,
            "dra_driver_name": driver,
            "dra_pool_name": node,
        }
        if target.type == "mig":
            # dcgm-exporter's DRA labels of a MIG device (its kubernetes.go DRA mapper)
            dra["dra_mig_profile"] = target.profile
            dra["dra_mig_device_uuid"] = target.uuid
        for pod in holder.pods:
            use = inputs.pod_uses.get((holder.uid, pod))
            containers = use.containers if use is not None and use.containers else ("",)
            for container in containers:
                labels = {**dra, "namespace": holder.namespace, "pod": pod}
                if container:
                    labels["container"] = container
                out.append({k: v for k, v in labels.items() if v})
    return out or [{}]


def xid_labels(xid: int) -> dict[str, str]:
    """dcgm-exporter's ``err_code`` and ``err_msg`` of an XID (0: none yet)."""
    return {"err_code": str(xid), "err_msg": XID_MESSAGES.get(xid, UNKNOWN_XID)}


def dcgm_series(
    inputs: Inputs, *, node: str, driver: str, driver_version: str, host_label: str = HOST_LABEL
) -> list[Metric]:
    """Every DCGM family of one exposition."""
    families = [_family(f) for f in (*FIELDS, XID_ERRORS)]
    xid_family = families[-1]
    readings = inputs.readings
    for target in inputs.targets:
        identity = identity_labels(
            target, node=node, driver_version=driver_version, host_label=host_label
        )
        reading = readings.get(target.uuid)
        xid = inputs.last_xids.get(target.name, 0) if inputs.xids is not None else None
        if reading is None and xid is None:
            continue
        # A GPU in MIG mode: its GPU-wide series carry no pods (dcgm-exporter maps pods to the
        # GPU instances); its MIG devices carry the pods of their claims.
        variants = (
            [{}]
            if target.mig_enabled and target.type == "gpu"
            else pod_labels(inputs, target, driver=driver, node=node)
        )
        for extra in variants:
            labels = {**identity, **extra}
            if reading is not None:
                for family, spec in zip(families[:-1], FIELDS, strict=True):
                    value = spec.value(reading)
                    if value is not None:
                        _add(family, labels, value)
            if xid is not None and target.type == "gpu":
                _add(xid_family, {**labels, **xid_labels(xid)}, float(xid))
    return families


def _family(spec: _Field) -> Metric:
    if spec.type == "counter":
        return CounterMetricFamily(spec.name, spec.help)
    return GaugeMetricFamily(spec.name, spec.help)


def _add(family: Metric, labels: dict[str, str], value: float) -> None:
    """One series under the family's own name: dcgm-exporter's counters have no ``_total``."""
    family.samples.append(Sample(family.name, labels, value))


def dcgm_texts(families: list[Metric]) -> Iterator[str]:
    """The text exposition of ``families``, one family at a time, with dcgm-exporter's counter
    names (no ``_total``)."""
    return family_texts(families, counter_suffix=False)


def describe() -> list[Metric]:
    return [_family(f) for f in (*FIELDS, XID_ERRORS)]


__all__ = [
    "DCGM_METRIC_NAMES",
    "FIELDS",
    "HOST_LABEL",
    "dcgm_pci_bus_id",
    "dcgm_series",
    "dcgm_texts",
    "describe",
    "identity_labels",
    "pod_labels",
    "xid_labels",
]
