"""Per-device telemetry: readings of every GPU and MIG device, sampled on an interval and exposed
on ``/metrics``.

Flow position: beside the flow, after discovery. ``Telemetry`` keeps one ``TelemetryTarget`` per
GPU and per MIG device of the current inventory (``set_inventory`` after a re-discovery). Its
loop samples every ``interval_s`` (``--telemetry-interval``; 0 turns sampling off): it asks the
claim holders once (the plugin's checkpoint: which claim, and which pods of it, hold each
device) and then the injected ``read`` for the readings (gpus/readings.py asks NVML, or the
simulated GPUs through the same pynvml calls), and keeps the result as one immutable
``Snapshot``. ``Telemetry`` is a prometheus_client collector: a scrape formats the last snapshot
and never calls NVML, so scrapes cost the same however often they come and however slow NVML is.

Health state and XID event counts come from providers the health watcher sets with
``set_health_providers`` (device name -> state, device name -> events since start); read at
scrape time. Without a provider their metric has no series.

Pure: no NVML, no Kubernetes API, no files (the reader and the holders are injected).
Metric names, labels and units: docs/metrics.md.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.samples import Sample

from dra_driver.devices import gpu_device_name, mig_device_name
from dra_driver.errors import DraError
from dra_driver.gpus.info import Inventory
from dra_driver.gpus.telemetryvalues import Reading, TelemetryTarget
from dra_driver.metrics import render

if TYPE_CHECKING:
    from dra_driver.heartbeat import Heartbeat
    from dra_driver.prepare.checkpoint import ClaimRecord

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 10.0
MIN_INTERVAL_S = 1.0
"""Shortest sampling interval accepted: NVML's own counters (utilisation) average over about a
second, and sampling faster only costs CPU."""


def telemetry_targets(inventory: Inventory) -> tuple[TelemetryTarget, ...]:
    """Every GPU and every MIG device of ``inventory``, GPUs each followed by their MIG devices."""
    targets: list[TelemetryTarget] = []
    for gpu in inventory.gpus:
        targets.append(
            TelemetryTarget(
                name=gpu_device_name(gpu.minor),
                uuid=gpu.uuid,
                gpu_minor=gpu.minor,
                type="gpu",
                product_name=gpu.product_name,
                mig_enabled=gpu.mig_enabled,
            )
        )
        if not gpu.mig_enabled:
            continue
        for mig in gpu.mig_instances:
            targets.append(
                TelemetryTarget(
                    name=mig_device_name(
                        parent_minor=gpu.minor,
                        profile=mig.profile.name,
                        profile_id=mig.profile.profile_id,
                        placement_start=mig.placement.start,
                    ),
                    uuid=mig.uuid,
                    gpu_minor=gpu.minor,
                    type="mig",
                    profile=mig.profile.name,
                    product_name=gpu.product_name,
                    mig_enabled=True,
                )
            )
    return tuple(targets)


READING_FIELDS = tuple(f.name for f in fields(Reading))

Read = Callable[[Sequence[TelemetryTarget]], Mapping[str, Reading]]
"""Read every target once: UUID -> Reading (a device that could not be read is left out)."""


@dataclass(frozen=True)
class ClaimHolder:
    """A prepared claim holding a device, and the pods it is reserved for (may be empty)."""

    namespace: str
    name: str
    uid: str
    pods: tuple[str, ...] = ()


Holders = Mapping[str, tuple[ClaimHolder, ...]]
"""Device name -> the prepared claims holding it (more than one only with admin access)."""

HealthStates = Callable[[], Mapping[str, str]]
"""Device name -> health state (e.g. "Healthy", "Unhealthy"); from the health watcher."""

XidCounts = Callable[[], Mapping[str, int]]
"""Device name -> XID events seen since the agent started; from the health watcher."""


def holders_from_records(
    records: Iterable[ClaimRecord], *, pods: Mapping[str, tuple[str, ...]]
) -> dict[str, tuple[ClaimHolder, ...]]:
    """Device name -> holders, from the checkpoint's records (``PrepareCompleted`` only) and the
    pods each claim uid is reserved for. A claim rebuilt without its name shows its uid only."""
    held: dict[str, list[ClaimHolder]] = {}
    for record in records:
        if record.phase != "PrepareCompleted":
            continue
        holder = ClaimHolder(record.namespace, record.name, record.uid, pods.get(record.uid, ()))
        for device in dict.fromkeys(d.device for d in record.devices):
            held.setdefault(device, []).append(holder)
    return {
        device: tuple(sorted(hs, key=lambda h: (h.namespace, h.name, h.uid)))
        for device, hs in held.items()
    }


@dataclass(frozen=True)
class Snapshot:
    """The result of one sampling pass."""

    taken_at_s: float  # wall clock (Unix time) at the start of the pass
    duration_s: float  # wall time the pass took
    readings: Mapping[str, Reading]  # by UUID
    holders: Holders


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
        "Device memory in use (NVML memory info; a MIG device reports its own share).",
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
_DEVICE_LABELS = ("node", "device", "uuid", "gpu", "profile", "claim_namespace", "claim_name")
_INFO = "gpu_dra_gpu_info"
_ECC = "gpu_dra_gpu_ecc_errors"
_HEALTH = "gpu_dra_gpu_health"
_XID = "gpu_dra_gpu_xid_errors"
_CLAIM = "gpu_dra_gpu_claim_info"
_LAST_SAMPLE = "gpu_dra_telemetry_last_sample_timestamp_seconds"
_SAMPLE_DURATION = "gpu_dra_telemetry_sample_duration_seconds"

METRIC_NAMES = (
    _INFO,
    *(g.name for g in _GAUGES),
    f"{_ECC}_total",
    _HEALTH,
    f"{_XID}_total",
    _CLAIM,
    _LAST_SAMPLE,
    _SAMPLE_DURATION,
)
"""Every metric name telemetry can expose (as written in the exposition)."""


class Telemetry:
    """The node's per-device telemetry: targets, the sampling loop and the Prometheus collector.

    ``read`` None (or ``interval_s`` 0) samples nothing: the info, health, XID and claim series
    remain (claims then read at scrape time). ``holders`` answers which claims hold which
    device; it may raise DraError (the checkpoint is closed), which keeps the last answer.
    Thread-safe: the loop, ``set_inventory`` and scrapes each read or swap whole immutable values.
    """

    def __init__(
        self,
        *,
        node_name: str,
        inventory: Inventory,
        read: Read | None,
        interval_s: float = DEFAULT_INTERVAL_S,
        holders: Callable[[], Holders] | None = None,
        heartbeat: Heartbeat | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if interval_s and interval_s < MIN_INTERVAL_S:
            raise ValueError(f"telemetry interval {interval_s} s is below {MIN_INTERVAL_S} s")
        self.node_name = node_name
        self.interval_s = interval_s
        self.heartbeat = heartbeat
        self._read = read if interval_s else None
        self._holders = holders
        self._clock = clock
        self._targets = telemetry_targets(inventory)
        self._snapshot: Snapshot | None = None
        self._held: frozenset[str] = frozenset()
        self._health_states: HealthStates | None = None
        self._xid_counts: XidCounts | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._render_lock = threading.Lock()
        self._rendered: tuple[_Inputs, str] | None = None

    # -- configuration ---------------------------------------------------------------------

    @property
    def targets(self) -> tuple[TelemetryTarget, ...]:
        return self._targets

    @property
    def snapshot(self) -> Snapshot | None:
        """The last sample; None before the first one (or with sampling off)."""
        return self._snapshot

    def set_inventory(self, inventory: Inventory) -> None:
        """Report on the devices of ``inventory`` from now on (after a re-discovery). Devices
        that are gone disappear from the next scrape; new ones appear with the next sample."""
        self._targets = telemetry_targets(inventory)

    def set_health_providers(
        self, *, states: HealthStates | None = None, xid_counts: XidCounts | None = None
    ) -> None:
        """Where ``gpu_dra_gpu_health`` and ``gpu_dra_gpu_xid_errors_total`` come from (the
        health watcher); None leaves that metric without series. Called at scrape time."""
        self._health_states = states
        self._xid_counts = xid_counts

    def held_uuids(self) -> frozenset[str]:
        """UUIDs of the devices prepared claims held at the start of the current or last pass
        (what simulated GPUs use to decide which devices are busy)."""
        return self._held

    # -- sampling --------------------------------------------------------------------------

    def start(self) -> None:
        """Start the sampling loop (the first pass runs at once). Without sampling, nothing."""
        if self._read is None or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name="telemetry", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the loop and wait for the pass in progress. Safe twice and before start()."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def sample(self) -> Snapshot:
        """One pass now, in the caller's thread: holders, then readings; the result becomes
        the snapshot scrapes show. Raises ValueError without a reader."""
        if self._read is None:
            raise ValueError("telemetry sampling is off (no reader, or interval 0)")
        started_s = self._clock()
        began = time.perf_counter()
        holders = self._current_holders()
        targets = self._targets
        by_name = {t.name: t for t in targets}
        self._held = frozenset(by_name[name].uuid for name in holders if name in by_name)
        readings = dict(self._read(targets))
        snapshot = Snapshot(
            taken_at_s=started_s,
            duration_s=time.perf_counter() - began,
            readings=readings,
            holders=holders,
        )
        self._snapshot = snapshot
        self.exposition()  # formatted here, off the scrape path
        return snapshot

    def _current_holders(self) -> Holders:
        if self._holders is None:
            return {}
        try:
            return self._holders()
        except DraError as exc:
            log.warning("telemetry: cannot read the claim holders", extra={"error": str(exc)})
            last = self._snapshot
            return last.holders if last is not None else {}

    def _loop(self) -> None:
        beat = self.heartbeat
        with beat.running() if beat else nullcontext():
            while True:
                with beat.busy() if beat else nullcontext():
                    self.sample()
                if self._stop.wait(self.interval_s):
                    return

    # -- exposition (prometheus_client collector protocol) -----------------------------------

    def describe(self) -> list[Metric]:
        return _Families().all()

    def collect(self) -> Iterator[Metric]:
        """The metrics of the last snapshot; calls no NVML, only the health providers."""
        yield from self._collect(self._inputs())

    def exposition(self) -> str:
        """``collect()`` in the text format, formatted again only when its inputs changed (a new
        sample, a re-discovery, a health or XID change, a claim with sampling off). The loop
        calls it after each pass, so scrapes normally find it ready."""
        inputs = self._inputs()
        with self._render_lock:
            cached = self._rendered
            if cached is not None and cached[0].same_as(inputs):
                return cached[1]
            text = render(_Fixed(list(self._collect(inputs))))
            self._rendered = (inputs, text)
            return text

    def _inputs(self) -> _Inputs:
        snapshot = self._snapshot
        return _Inputs(
            snapshot=snapshot,
            targets=self._targets,
            holders=snapshot.holders if snapshot is not None else self._current_holders(),
            states=dict(self._health_states()) if self._health_states is not None else {},
            xids=dict(self._xid_counts()) if self._xid_counts is not None else {},
        )

    def _collect(self, inputs: _Inputs) -> list[Metric]:
        snapshot, holders = inputs.snapshot, inputs.holders
        readings = snapshot.readings if snapshot is not None else {}
        out = _Families()
        node = self.node_name
        for target in inputs.targets:
            held = holders.get(target.name, ())
            labels = {"node": node, "device": target.name, "uuid": target.uuid,
                      "gpu": str(target.gpu_minor)}  # fmt: skip
            # Labels that do not apply are left out (Prometheus reads an empty label as none),
            # which also keeps the exposition small: most series have four labels.
            if target.profile:
                labels["profile"] = target.profile
            if held:
                labels["claim_namespace"] = ",".join(dict.fromkeys(h.namespace for h in held))
                labels["claim_name"] = ",".join(h.name or h.uid for h in held)
            mig_enabled = "true" if target.mig_enabled else "false"
            _add(out.info, {**labels, "type": target.type, "product": target.product_name,
                            "mig_enabled": mig_enabled}, 1.0)  # fmt: skip
            for holder in held:
                claim = {"node": node, "device": target.name, "uuid": target.uuid,
                         "claim_namespace": holder.namespace, "claim_name": holder.name,
                         "claim_uid": holder.uid}  # fmt: skip
                for pod in holder.pods or ("",):
                    _add(out.claim, {**claim, "claim_pod": pod} if pod else claim, 1.0)
            state = inputs.states.get(target.name)
            if state is not None:
                _add(out.health, {**labels, "state": state}, 1.0)
            xid_count = inputs.xids.get(target.name)
            if xid_count is not None:
                _add(out.xid, labels, float(xid_count))
            reading = readings.get(target.uuid)
            if reading is None:
                continue
            for family, spec in zip(out.gauges, _GAUGES, strict=True):
                value = getattr(reading, spec.field)
                if value is not None:
                    _add(family, labels, float(value))
            for error_type, count in (
                ("corrected", reading.ecc_corrected_errors),
                ("uncorrected", reading.ecc_uncorrected_errors),
            ):
                if count is not None:
                    _add(out.ecc, {**labels, "error_type": error_type}, float(count))
        if snapshot is not None:
            _add(out.last_sample, {"node": node}, snapshot.taken_at_s)
            _add(out.sample_duration, {"node": node}, snapshot.duration_s)
        return out.all()


def _add(family: Metric, labels: dict[str, str], value: float) -> None:
    """One series of ``family`` with these labels: what ``GaugeMetricFamily.add_metric`` and
    ``CounterMetricFamily.add_metric`` append, for a label set that varies by device."""
    name = family.name + "_total" if family.type == "counter" else family.name
    family.samples.append(Sample(name, labels, value))


@dataclass(frozen=True)
class _Inputs:
    """Everything one exposition of telemetry is made from."""

    snapshot: Snapshot | None
    targets: tuple[TelemetryTarget, ...]
    holders: Holders
    states: dict[str, str]
    xids: dict[str, int]

    def same_as(self, other: _Inputs) -> bool:
        # Snapshots and targets are replaced whole, never changed: identity is equality.
        return (
            self.snapshot is other.snapshot
            and self.targets is other.targets
            and self.holders == other.holders
            and self.states == other.states
            and self.xids == other.xids
        )


@dataclass(frozen=True)
class _Fixed:
    """Metric families already made, as a collector (for ``render``)."""

    families: list[Metric]

    def collect(self) -> list[Metric]:
        return self.families


class _Families:
    """The telemetry metric families of one scrape, empty until filled."""

    def __init__(self) -> None:
        labels = _DEVICE_LABELS
        self.info = GaugeMetricFamily(
            _INFO,
            "1 for every GPU and MIG device of the node, with what it is: type (gpu, mig), "
            "product name and whether the GPU is in MIG mode.",
            labels=(*labels, "type", "product", "mig_enabled"),
        )
        self.gauges = [GaugeMetricFamily(g.name, g.help, labels=labels) for g in _GAUGES]
        self.ecc = CounterMetricFamily(
            _ECC,
            "ECC errors since the driver was loaded (NVML volatile counters), by error type "
            "(corrected, uncorrected). Not reported for MIG devices.",
            labels=(*labels, "error_type"),
        )
        self.health = GaugeMetricFamily(
            _HEALTH,
            "1 with the device's current health state in the label state (from the health "
            "watcher).",
            labels=(*labels, "state"),
        )
        self.xid = CounterMetricFamily(
            _XID,
            "XID events (NVIDIA driver error reports) seen on the device since the agent "
            "started (from the health watcher).",
            labels=labels,
        )
        self.claim = GaugeMetricFamily(
            _CLAIM,
            "1 for every prepared claim holding a device, once per pod it is reserved for "
            "(status.reservedFor; claim_pod is empty while none is known).",
            labels=(
                "node", "device", "uuid", "claim_namespace", "claim_name", "claim_uid",
                "claim_pod",
            ),
        )  # fmt: skip
        self.last_sample = GaugeMetricFamily(
            _LAST_SAMPLE,
            "When the last telemetry sample started, as a Unix time in seconds.",
            labels=("node",),
        )
        self.sample_duration = GaugeMetricFamily(
            _SAMPLE_DURATION,
            "Wall time the last telemetry sample took (every NVML query of every device).",
            labels=("node",),
        )

    def all(self) -> list[Metric]:
        return [
            self.info,
            *self.gauges,
            self.ecc,
            self.health,
            self.xid,
            self.claim,
            self.last_sample,
            self.sample_duration,
        ]


__all__ = [
    "DEFAULT_INTERVAL_S",
    "METRIC_NAMES",
    "MIN_INTERVAL_S",
    "READING_FIELDS",
    "ClaimHolder",
    "HealthStates",
    "Holders",
    "Read",
    "Reading",
    "Snapshot",
    "Telemetry",
    "TelemetryTarget",
    "XidCounts",
    "holders_from_records",
    "telemetry_targets",
]
