"""Per-device telemetry: readings of every GPU and MIG device, sampled on an interval and exposed
on ``/metrics``.

Flow position: beside the flow, after discovery. ``Telemetry`` keeps one ``TelemetryTarget`` per
GPU and per MIG device of the current inventory (``set_inventory`` after a re-discovery). Its
loop samples every ``interval_s`` (``--telemetry-interval``; 0 turns sampling off): it asks the
claim holders once (the plugin's checkpoint: which claim, and which pods of it, hold each
device), reads the pods of claims it has not seen yet (holders.py ``PodMapper``, only with
``get_pod``), and then the injected ``read`` for the readings (gpus/readings.py asks NVML, or
the simulated GPUs through the same pynvml calls), and keeps the result as one immutable
``Snapshot``. ``Telemetry`` is a prometheus_client collector: a scrape formats the last snapshot
and never calls NVML or the API server, so scrapes cost the same however often they come.

What is exposed: series.py (``gpu_dra_*``: device series with the device's identity only, and one
claim info series per (device, claim, pod)) and, with ``dcgm``, dcgm.py (dcgm-exporter's names
and labels, with the pods and containers using each device).

Health state and XID events come from providers the health watcher sets with
``set_health_providers`` (device name -> state; (device name, XID) -> events since start); read
at scrape time. Without a provider their metrics have no series.

Pure: no NVML, no Kubernetes API, no files (the reader, the holders and the Pod GET are
injected). Metric names, labels and units: docs/metrics.md.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import fields
from typing import TYPE_CHECKING

from prometheus_client.metrics_core import Metric

from dra_driver.devices import gpu_device_name, mig_device_name
from dra_driver.errors import DraError
from dra_driver.gpus.info import Inventory
from dra_driver.gpus.telemetryvalues import Reading, TelemetryTarget
from dra_driver.metrics import Deflated, family_texts
from dra_driver.telemetry import dcgm, series
from dra_driver.telemetry.holders import (
    GetPod,
    PodMapper,
    XidCounts,
    XidHistory,
    holders_from_records,
)
from dra_driver.telemetry.model import ClaimHolder, Holders, Inputs, PodUses, Snapshot

if TYPE_CHECKING:
    from dra_driver.heartbeat import Heartbeat

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 10.0
MIN_INTERVAL_S = 1.0
"""Shortest sampling interval accepted: NVML's own counters (utilisation) average over about a
second, and sampling faster only costs CPU."""

METRIC_NAMES = series.METRIC_NAMES
"""Every ``gpu_dra_*`` metric name telemetry can expose (as written in the exposition)."""
DCGM_METRIC_NAMES = dcgm.DCGM_METRIC_NAMES
"""Every DCGM-compatible metric name telemetry can expose (with ``dcgm``)."""


def telemetry_targets(inventory: Inventory) -> tuple[TelemetryTarget, ...]:
    """Every GPU and every MIG device of ``inventory``, GPUs each followed by their MIG devices."""
    targets: list[TelemetryTarget] = []
    for gpu in inventory.gpus:
        common = {
            "gpu_minor": gpu.minor,
            "product_name": gpu.product_name,
            "gpu_index": gpu.index,
            "pci_bus_id": gpu.pci_bus_id,
            "gpu_uuid": gpu.uuid,
        }
        targets.append(
            TelemetryTarget(
                name=gpu_device_name(gpu.minor),
                uuid=gpu.uuid,
                type="gpu",
                mig_enabled=gpu.mig_enabled,
                **common,  # type: ignore[arg-type]
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
                    type="mig",
                    profile=mig.profile.name,
                    mig_enabled=True,
                    gpu_instance_id=mig.gpu_instance_id,
                    **common,  # type: ignore[arg-type]
                )
            )
    return tuple(targets)


def _driver_version(inventory: Inventory) -> str:
    return next((gpu.driver_version for gpu in inventory.gpus if gpu.driver_version), "")


READING_FIELDS = tuple(f.name for f in fields(Reading))

Read = Callable[[Sequence[TelemetryTarget]], Mapping[str, Reading]]
"""Read every target once: UUID -> Reading (a device that could not be read is left out)."""

HealthStates = Callable[[], Mapping[str, str]]
"""Device name -> health state (e.g. "Healthy", "Unhealthy"); from the health watcher."""


class Telemetry:
    """The node's per-device telemetry: targets, the sampling loop and the Prometheus collector.

    ``read`` None (or ``interval_s`` 0) samples nothing: the info, health, XID and claim series
    remain (claims then read at scrape time). ``holders`` answers which claims hold which
    device; it may raise DraError (the checkpoint is closed), which keeps the last answer.
    ``dcgm`` adds the DCGM-compatible series; ``get_pod`` (the API server's Pod GET) gives them
    the containers of each claim's pods. Thread-safe: the loop, ``set_inventory`` and scrapes
    each read or swap whole immutable values.
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
        dcgm: bool = False,
        dcgm_host_label: str = dcgm.HOST_LABEL,
        driver_name: str = "gpu.nvidia.com",
        get_pod: GetPod | None = None,
    ) -> None:
        if interval_s and interval_s < MIN_INTERVAL_S:
            raise ValueError(f"telemetry interval {interval_s} s is below {MIN_INTERVAL_S} s")
        self.node_name = node_name
        self.driver_name = driver_name
        self.interval_s = interval_s
        self.heartbeat = heartbeat
        self.dcgm = dcgm
        self.dcgm_host_label = dcgm_host_label
        self._read = read if interval_s else None
        self._holders = holders
        self._pods = PodMapper(get_pod) if get_pod is not None else None
        self._clock = clock
        self._targets = telemetry_targets(inventory)
        self._driver_version = _driver_version(inventory)
        self._snapshot: Snapshot | None = None
        self._held: frozenset[str] = frozenset()
        self._health_states: HealthStates | None = None
        self._xid_counts: XidCounts | None = None
        self._xid_history = XidHistory()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._render_lock = threading.Lock()
        self._rendered: tuple[Inputs, Deflated] | None = None

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
        self._driver_version = _driver_version(inventory) or self._driver_version
        self._targets = telemetry_targets(inventory)

    def set_health_providers(
        self, *, states: HealthStates | None = None, xid_counts: XidCounts | None = None
    ) -> None:
        """Where ``gpu_dra_gpu_health`` and the XID series (``gpu_dra_gpu_xid_errors_total``,
        ``DCGM_FI_DEV_XID_ERRORS``) come from (the health watcher); None leaves those metrics
        without series. Called at scrape time."""
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
        """One pass now, in the caller's thread: holders (and the pods not read yet), then
        readings; the result becomes the snapshot scrapes show. Raises ValueError without a
        reader."""
        if self._read is None:
            raise ValueError("telemetry sampling is off (no reader, or interval 0)")
        started_s = self._clock()
        began = time.perf_counter()
        holders = self._current_holders()
        targets = self._targets
        by_name = {t.name: t for t in targets}
        self._held = frozenset(by_name[name].uuid for name in holders if name in by_name)
        pod_uses: PodUses = (
            self._pods.refresh(holders) if self._pods is not None and self.dcgm else {}
        )
        readings = dict(self._read(targets))
        snapshot = Snapshot(
            taken_at_s=started_s,
            duration_s=time.perf_counter() - began,
            readings=readings,
            holders=holders,
            pod_uses=pod_uses,
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
        return [*series.describe(), *(dcgm.describe() if self.dcgm else ())]

    def collect(self) -> Iterator[Metric]:
        """The metrics of the last snapshot; calls no NVML, only the health providers."""
        inputs = self._inputs()
        yield from self._series(inputs)
        if self.dcgm:
            yield from self._dcgm(inputs)

    def exposition(self) -> Deflated:
        """``collect()`` in the text format, kept deflated (metrics.Deflated: a scrape sends it
        as it is), formatted again only when its inputs changed (a new sample, a re-discovery,
        a health or XID change, a claim with sampling off). The loop calls it after each pass,
        so scrapes normally find it ready."""
        inputs = self._inputs()
        with self._render_lock:
            cached = self._rendered
            if cached is not None and cached[0].same_as(inputs):
                return cached[1]
            deflated = Deflated.of(self._texts(inputs))
            self._rendered = (inputs, deflated)
            return deflated

    def _texts(self, inputs: Inputs) -> Iterator[str]:
        """The exposition one family at a time; the DCGM families are built only once the
        native ones are written and dropped."""
        yield from family_texts(self._series(inputs))
        if self.dcgm:
            yield from dcgm.dcgm_texts(self._dcgm(inputs))

    def _series(self, inputs: Inputs) -> list[Metric]:
        return series.device_series(inputs, self.node_name)

    def _dcgm(self, inputs: Inputs) -> list[Metric]:
        return dcgm.dcgm_series(
            inputs,
            node=self.node_name,
            driver=self.driver_name,
            driver_version=self._driver_version,
            host_label=self.dcgm_host_label,
        )

    def _inputs(self) -> Inputs:
        snapshot = self._snapshot
        xids: Mapping[str, int] | None = None
        last_xids: Mapping[str, int] = {}
        if self._xid_counts is not None:
            xids, last_xids = self._xid_history.update(self._xid_counts())
        return Inputs(
            snapshot=snapshot,
            targets=self._targets,
            holders=snapshot.holders if snapshot is not None else self._current_holders(),
            states=dict(self._health_states()) if self._health_states is not None else {},
            xids=xids,
            last_xids=last_xids,
        )


__all__ = [
    "DCGM_METRIC_NAMES",
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
