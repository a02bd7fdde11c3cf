"""Device health and agent readiness as Prometheus series: what the chart's alerts read.

Flow position: beside the flow, with the other metrics (``/metrics``, only with
``--metrics-port``). Read at scrape time from the health monitor and the readiness checks; a
scrape makes no NVML and no API call (those checks only read state the loops keep).

- ``gpu_dra_gpu_condition{node, device, condition, value, fatal}`` 1 for each health condition
  NVML reports for a published device now (health/decisions.py: ``gpu-lost``,
  ``ecc-double-bit``, ``row-remap-failed``, ``remapped-rows-pending``, ``retired-pages-pending``,
  ``xid`` with the XID as ``value``, ``thermal-slowdown``); ``fatal`` is ``"true"`` for the
  conditions that need a GPU reset, XIDs by the agent's ``--health-fatal-xids``. Taken before
  the taints' rate limit, so an alert sees a condition as soon as the agent does.
- ``gpu_dra_device_health_taints{node, device}``: how many health taints the device carries in
  the published ResourceSlices; 0 for a healthy device, so the series exists from the start.
- ``gpu_dra_agent_ready{node}``: 1 while the readiness checks of ``/readyz`` that the agent
  passes in (kubelet registration, current slices, discovery, NVML answering) all pass, else 0.

Names and alerts: docs/metrics.md ("Alerts").
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

from prometheus_client.metrics_core import GaugeMetricFamily, Metric

from dra_driver.health.decisions import ActiveCondition, DeviceHealth
from dra_driver.metrics import render

CONDITION = "gpu_dra_gpu_condition"
TAINTS = "gpu_dra_device_health_taints"
READY = "gpu_dra_agent_ready"


Inputs = tuple[
    tuple[tuple[str, tuple[ActiveCondition, ...]], ...], tuple[tuple[str, int], ...], bool
]
"""What the series are made of: conditions per device, health taints per device, readiness."""


class HealthMetrics:
    """A collector of the three families above that keeps its exposition formatted
    (metrics.Formatted, ``Registry.register_formatted``): a scrape reads the inputs (a few dict
    copies) and formats again only when they changed. prometheus_client formats a line in about
    17 us, so the 64 devices of a large node would otherwise cost a millisecond per scrape."""

    def __init__(
        self,
        *,
        node_name: str,
        conditions: Callable[[], Mapping[str, Sequence[ActiveCondition]]],
        states: Callable[[], Mapping[str, DeviceHealth]],
        readiness: Sequence[Callable[[], Iterable[str]]],
    ) -> None:
        self.node_name = node_name
        self._conditions = conditions
        self._states = states
        self._readiness = tuple(readiness)
        self._lock = threading.Lock()
        self._formatted: tuple[Inputs, str] | None = None

    def describe(self) -> list[Metric]:
        return list(self._families())

    def collect(self) -> Iterator[Metric]:
        return iter(self._collect(self._inputs()))

    def exposition(self) -> str:
        inputs = self._inputs()
        with self._lock:
            if self._formatted is None or self._formatted[0] != inputs:
                self._formatted = (inputs, render(_Fixed(self._collect(inputs))))
            return self._formatted[1]

    def _inputs(self) -> Inputs:
        conditions = tuple(sorted((d, tuple(c)) for d, c in self._conditions().items()))
        taints = tuple(sorted((d, len(h.taints)) for d, h in self._states().items()))
        ready = not any(True for check in self._readiness for _ in check())
        return conditions, taints, ready

    def _collect(self, inputs: Inputs) -> list[Metric]:
        conditions, taint_counts, is_ready = inputs
        condition, taints, ready = self._families()
        node = self.node_name
        for device, active in conditions:
            for c in active:
                condition.add_metric(
                    [node, device, c.kind, c.value, "true" if c.fatal else "false"], 1.0
                )
        for device, count in taint_counts:
            taints.add_metric([node, device], float(count))
        ready.add_metric([node], 1.0 if is_ready else 0.0)
        return [condition, taints, ready]

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily]:
        return (
            GaugeMetricFamily(
                CONDITION,
                "1 for each health condition NVML reports for the device now (value: the XID "
                "of an xid condition; fatal: it needs a GPU reset).",
                labels=("node", "device", "condition", "value", "fatal"),
            ),
            GaugeMetricFamily(
                TAINTS,
                "Health taints the device carries in the published ResourceSlices (0: none).",
                labels=("node", "device"),
            ),
            GaugeMetricFamily(
                READY,
                "1 while the agent's readiness checks pass (kubelet registration, current "
                "slices, discovery, NVML answering), else 0.",
                labels=("node",),
            ),
        )


class _Fixed:
    """Families already built, as a collector for ``render``."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


__all__ = ["CONDITION", "READY", "TAINTS", "HealthMetrics"]
