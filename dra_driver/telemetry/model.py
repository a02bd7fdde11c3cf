"""The values telemetry's exposition is made from: who holds a device, one sample, one scrape's
inputs. Plain frozen values, no I/O; sampler.py makes them, series.py and dcgm.py format them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from prometheus_client.metrics_core import Metric
from prometheus_client.samples import Sample

from dra_driver.gpus.telemetryvalues import Reading, TelemetryTarget


@dataclass(frozen=True)
class ClaimHolder:
    """A prepared claim holding a device, and the pods it is reserved for (may be empty)."""

    namespace: str
    name: str
    uid: str
    pods: tuple[str, ...] = ()


Holders = Mapping[str, tuple[ClaimHolder, ...]]
"""Device name -> the prepared claims holding it (more than one only with admin access)."""


@dataclass(frozen=True)
class PodUse:
    """A pod a claim is reserved for, and its containers that use the claim (empty when the
    pod could not be read: deleted, or no permission)."""

    namespace: str
    pod: str
    containers: tuple[str, ...]


PodUses = Mapping[tuple[str, str], PodUse]
"""(claim uid, pod name) -> the pod and its containers using the claim."""


@dataclass(frozen=True)
class Snapshot:
    """The result of one sampling pass."""

    taken_at_s: float  # wall clock (Unix time) at the start of the pass
    duration_s: float  # wall time the pass took
    readings: Mapping[str, Reading]  # by UUID
    holders: Holders
    pod_uses: PodUses = field(default_factory=dict)


@dataclass(frozen=True)
class Inputs:
    """Everything one exposition of telemetry is made from."""

    snapshot: Snapshot | None
    targets: tuple[TelemetryTarget, ...]
    holders: Holders
    states: Mapping[str, str]  # device name -> health state
    xids: Mapping[str, int] | None  # device name -> XID events; None: no health watcher
    last_xids: Mapping[str, int]  # device name -> the last XID seen

    @property
    def readings(self) -> Mapping[str, Reading]:
        return self.snapshot.readings if self.snapshot is not None else {}

    @property
    def pod_uses(self) -> PodUses:
        return self.snapshot.pod_uses if self.snapshot is not None else {}

    def same_as(self, other: Inputs) -> bool:
        # Snapshots and targets are replaced whole, never changed: identity is equality.
        return (
            self.snapshot is other.snapshot
            and self.targets is other.targets
            and self.holders == other.holders
            and self.states == other.states
            and self.xids == other.xids
            and self.last_xids == other.last_xids
        )


def add_sample(family: Metric, labels: dict[str, str], value: float) -> None:
    """One series of ``family`` with these labels: what ``GaugeMetricFamily.add_metric`` and
    ``CounterMetricFamily.add_metric`` append, for a label set that varies by device."""
    name = family.name + "_total" if family.type == "counter" else family.name
    family.samples.append(Sample(name, labels, value))


__all__ = [
    "ClaimHolder",
    "Holders",
    "Inputs",
    "PodUse",
    "PodUses",
    "Snapshot",
    "add_sample",
]
