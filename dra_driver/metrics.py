"""Prometheus metrics of the node agent: counters, gauges, histograms and their text exposition.

Flow position: beside the flow. plugin/dra.py counts the kubelet's requests, the KubeletPlugin
reports prepared devices, the agent reports published devices; http_server.py serves
``Registry.render()`` on ``--metrics-port``.

Hand-written and stdlib only (no prometheus_client): the agent has a tight memory budget, and
this is all it needs. Pure code, no I/O. Every metric is thread-safe; a child (one label set) is
bound once with ``labels(...)`` and then costs one short lock per update, so the prepare path
stays in the microseconds. Output follows the text exposition format 0.0.4
(https://prometheus.io/docs/instrumenting/exposition_formats/): ``# HELP``/``# TYPE`` lines,
escaped label values, cumulative ``_bucket{le=...}`` up to ``+Inf``, ``_sum``, ``_count``, and
numbers written the way the Go client writes them (``0.005``, ``1``, ``1e+06``, ``+Inf``).

Metric names and labels of the driver (``DriverMetrics``): nvidia-compat.md, "Metrics".
"""

from __future__ import annotations

import math
import re
import threading
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Generic, TypeVar

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_METRIC_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")

Collector = Callable[[], Mapping[tuple[str, ...], float]]
"""Values of a gauge read at scrape time: label values (in label-name order) -> value."""


def format_value(value: float) -> str:
    """``value`` as Go's ``strconv.FormatFloat(v, 'g', -1, 64)`` writes it (what Prometheus'
    client_golang puts in the exposition): shortest digits that read back exactly, exponent
    form below 1e-4 and from 1e6 on (``1e-05``, ``1e+06``), ``+Inf``, ``-Inf``, ``NaN``."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == 0:
        return "0"  # -0.0 too, as client_golang writes it
    sign = "-" if value < 0 else ""
    mantissa, _, exp = repr(abs(value)).partition("e")  # repr: shortest round-trip digits
    whole, _, fraction = mantissa.partition(".")
    all_digits = whole + fraction
    digits = all_digits.lstrip("0")
    # the value is 0.<digits> * 10**point
    point = len(whole) + int(exp or 0) - (len(all_digits) - len(digits))
    digits = digits.rstrip("0")
    exponent = point - 1
    if exponent < -4 or exponent >= 6:
        rest = f".{digits[1:]}" if len(digits) > 1 else ""
        return f"{sign}{digits[0]}{rest}e{'-' if exponent < 0 else '+'}{abs(exponent):02d}"
    if point <= 0:
        return f"{sign}0.{'0' * -point}{digits}"
    if point >= len(digits):
        return sign + digits + "0" * (point - len(digits))
    return f"{sign}{digits[:point]}.{digits[point:]}"


def escape_label_value(value: str) -> str:
    """Backslash, double quote and newline escaped, as the exposition format requires."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


@dataclass(frozen=True)
class Sample:
    """One line of the exposition: ``name{labels} value``."""

    name: str
    labels: tuple[tuple[str, str], ...]
    value: float

    def render(self) -> str:
        if not self.labels:
            return f"{self.name} {format_value(self.value)}\n"
        pairs = ",".join(f'{k}="{escape_label_value(v)}"' for k, v in self.labels)
        return f"{self.name}{{{pairs}}} {format_value(self.value)}\n"


class _CounterChild:
    __slots__ = ("_lock", "_value")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        """Add ``amount`` (>= 0: a counter never goes down)."""
        if amount < 0:
            raise ValueError(f"a counter cannot decrease (inc by {amount})")
        with self._lock:
            self._value += amount

    @property
    def value(self) -> float:
        return self._value


class _GaugeChild:
    __slots__ = ("_lock", "_value")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._value = 0.0

    def set(self, value: float) -> None:
        with self._lock:
            self._value = float(value)

    def inc(self, amount: float = 1.0) -> None:
        with self._lock:
            self._value += amount

    def dec(self, amount: float = 1.0) -> None:
        with self._lock:
            self._value -= amount

    @property
    def value(self) -> float:
        return self._value


class _HistogramChild:
    __slots__ = ("_counts", "_lock", "_sum", "_upper_bounds")

    def __init__(self, upper_bounds: tuple[float, ...]) -> None:
        self._upper_bounds = upper_bounds
        self._lock = threading.Lock()
        self._counts = [0] * (len(upper_bounds) + 1)  # the last one is +Inf
        self._sum = 0.0

    def observe(self, value: float) -> None:
        # Bucket ``le`` is inclusive: the first bound >= value.
        index = bisect_left(self._upper_bounds, value)
        with self._lock:
            self._counts[index] += 1
            self._sum += value

    def snapshot(self) -> tuple[list[int], float]:
        """Cumulative counts per bucket (+Inf last, equal to the count) and the sum, read
        together."""
        with self._lock:
            counts, total = list(self._counts), self._sum
        running = 0
        for i, n in enumerate(counts):
            running += n
            counts[i] = running
        return counts, total

    @property
    def count(self) -> int:
        return self.snapshot()[0][-1]

    @property
    def sum(self) -> float:
        return self.snapshot()[1]


C = TypeVar("C", _CounterChild, _GaugeChild, _HistogramChild)


class _Family(Generic[C]):
    """A metric name with its label names; one child per distinct label values."""

    type_name = ""

    def __init__(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> None:
        if not _METRIC_NAME.match(name):
            raise ValueError(f"invalid metric name {name!r}")
        for label in labelnames:
            if not _LABEL_NAME.match(label) or label.startswith("__"):
                raise ValueError(f"invalid label name {label!r} of {name}")
        if len(set(labelnames)) != len(labelnames):
            raise ValueError(f"duplicate label names of {name}: {list(labelnames)}")
        self.name = name
        self.help_text = help_text
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], C] = {}
        self._lock = threading.Lock()

    def _new_child(self) -> C:
        raise NotImplementedError

    def labels(self, *values: str) -> C:
        """The child of these label values (in label-name order), created at 0 on first use.
        Bind it once and keep it: updates on it take no dictionary lookup."""
        child = self._children.get(values)
        if child is not None:
            return child
        if len(values) != len(self.labelnames):
            raise ValueError(
                f"{self.name} has labels {list(self.labelnames)}, got values {list(values)}"
            )
        if not all(isinstance(v, str) for v in values):
            raise TypeError(f"label values of {self.name} must be strings: {values!r}")
        with self._lock:
            return self._children.setdefault(values, self._new_child())

    def _sorted_children(self) -> list[tuple[tuple[str, ...], C]]:
        with self._lock:
            return sorted(self._children.items())

    def samples(self) -> list[Sample]:
        """The family's lines, sorted by label values."""
        raise NotImplementedError

    def render(self) -> str:
        head = f"# HELP {self.name} {_escape_help(self.help_text)}\n# TYPE {self.name} "
        return head + self.type_name + "\n" + "".join(s.render() for s in self.samples())


class Counter(_Family[_CounterChild]):
    """A value that only goes up (requests served, errors seen). The name should end in
    ``_total``."""

    type_name = "counter"

    def _new_child(self) -> _CounterChild:
        return _CounterChild()

    def inc(self, amount: float = 1.0) -> None:
        """For a counter without labels."""
        self.labels().inc(amount)

    def samples(self) -> list[Sample]:
        return [
            Sample(self.name, tuple(zip(self.labelnames, values, strict=True)), child.value)
            for values, child in self._sorted_children()
        ]


class Gauge(_Family[_GaugeChild]):
    """A value that goes up and down. With a ``collector`` its values are read when scraped
    (and only then): the collector's label sets replace any set through ``labels()``."""

    type_name = "gauge"

    def __init__(
        self,
        name: str,
        help_text: str,
        labelnames: Sequence[str] = (),
        *,
        collector: Collector | None = None,
    ) -> None:
        super().__init__(name, help_text, labelnames)
        self._collector = collector

    def set_collector(self, collector: Collector | None) -> None:
        self._collector = collector

    def _new_child(self) -> _GaugeChild:
        return _GaugeChild()

    def set(self, value: float) -> None:
        """For a gauge without labels."""
        self.labels().set(value)

    def samples(self) -> list[Sample]:
        collector = self._collector
        if collector is None:
            values = [(labels, child.value) for labels, child in self._sorted_children()]
        else:
            collected = collector()
            for labels in collected:
                if len(labels) != len(self.labelnames):
                    raise ValueError(
                        f"collector of {self.name} returned labels {labels!r} "
                        f"for label names {list(self.labelnames)}"
                    )
            values = sorted((tuple(k), float(v)) for k, v in collected.items())
        return [
            Sample(self.name, tuple(zip(self.labelnames, labels, strict=True)), value)
            for labels, value in values
        ]


class Histogram(_Family[_HistogramChild]):
    """Observations counted in buckets (durations). ``buckets`` are the upper bounds, strictly
    increasing; ``+Inf`` is always added."""

    type_name = "histogram"

    def __init__(
        self,
        name: str,
        help_text: str,
        labelnames: Sequence[str] = (),
        *,
        buckets: Iterable[float],
    ) -> None:
        if "le" in labelnames:
            raise ValueError(f"{name}: 'le' is reserved for histogram buckets")
        super().__init__(name, help_text, labelnames)
        bounds = [float(b) for b in buckets]
        if bounds and math.isinf(bounds[-1]) and bounds[-1] > 0:
            bounds.pop()
        if not bounds or any(a >= b for a, b in pairwise(bounds)):
            raise ValueError(f"{name}: buckets must be a non-empty increasing list, got {bounds}")
        if any(math.isnan(b) or math.isinf(b) for b in bounds):
            raise ValueError(f"{name}: bucket bounds must be finite, got {bounds}")
        self.buckets = tuple(bounds)
        self._le = (*(format_value(b) for b in bounds), "+Inf")

    def _new_child(self) -> _HistogramChild:
        return _HistogramChild(self.buckets)

    def observe(self, value: float) -> None:
        """For a histogram without labels."""
        self.labels().observe(value)

    def samples(self) -> list[Sample]:
        out: list[Sample] = []
        for values, child in self._sorted_children():
            labels = tuple(zip(self.labelnames, values, strict=True))
            counts, total = child.snapshot()
            out.extend(
                Sample(f"{self.name}_bucket", (*labels, ("le", le)), float(n))
                for le, n in zip(self._le, counts, strict=True)
            )
            out.append(Sample(f"{self.name}_sum", labels, total))
            out.append(Sample(f"{self.name}_count", labels, float(counts[-1])))
        return out


Metric = Counter | Gauge | Histogram
M = TypeVar("M", Counter, Gauge, Histogram)


class Registry:
    """The metrics one endpoint serves, rendered sorted by name."""

    def __init__(self) -> None:
        self._metrics: dict[str, Metric] = {}
        self._lock = threading.Lock()

    def register(self, metric: M) -> M:
        """Add ``metric``; a name may be registered once."""
        with self._lock:
            if metric.name in self._metrics:
                raise ValueError(f"metric {metric.name} is already registered")
            self._metrics[metric.name] = metric
        return metric

    def _sorted(self) -> list[Metric]:
        with self._lock:
            return [self._metrics[name] for name in sorted(self._metrics)]

    def render(self) -> str:
        """The text exposition (format 0.0.4) of every metric. Collectors run now; what they
        raise is raised here."""
        return "".join(metric.render() for metric in self._sorted())

    def sample_value(self, name: str, **labels: str) -> float | None:
        """The value of the line ``name{labels}`` (e.g. ``x_bucket`` with ``le="0.1"``), or None
        when there is no such line. For tests and debugging, not for the hot path."""
        wanted = sorted(labels.items())
        for metric in self._sorted():
            if not name.startswith(metric.name):
                continue
            for sample in metric.samples():
                if sample.name == name and sorted(sample.labels) == wanted:
                    return sample.value
        return None


# -- the driver's metrics (nvidia-compat.md, "Metrics") ----------------------------------------

PREPARE = "NodePrepareResources"
UNPREPARE = "NodeUnprepareResources"

REQUEST_DURATION_BUCKETS_S = (
    # This driver answers in milliseconds: finer buckets below NVIDIA's first one.
    0.001, 0.0025, 0.005, 0.01, 0.025,
    # NVIDIA's buckets, 0.05 s * 2^k for k = 0..8 (dashboards may rely on these bounds).
    *(0.05 * 2**k for k in range(9)),
)  # fmt: skip


class RequestMetrics:
    """The request metrics of one RPC (operation) with their label values bound once.

    ``started()`` before the handler, ``finished(t)`` in its ``finally``; ``failed(error_type)``
    per claim that got an error. Each costs a lock or two and no allocation.
    """

    __slots__ = ("_duration", "_errors", "_inflight", "_requests", "driver_name")

    def __init__(
        self,
        *,
        driver_name: str,
        operation: str,
        requests: Counter,
        duration: Histogram,
        inflight: Gauge,
        errors: Counter,
    ) -> None:
        self.driver_name = driver_name
        self._requests = requests.labels(driver_name, operation)
        self._duration = duration.labels(driver_name, operation)
        self._inflight = inflight.labels(driver_name)
        self._errors = errors

    def started(self) -> None:
        self._inflight.inc()

    def finished(self, elapsed_s: float) -> None:
        self._inflight.dec()
        self._requests.inc()
        self._duration.observe(elapsed_s)

    def failed(self, error_type: str) -> None:
        self._errors.labels(self.driver_name, error_type).inc()


class DriverMetrics:
    """Every metric of the node agent, registered in ``registry``.

    ``error_types`` are created at 0 up front, so that ``rate()`` sees the first error of a
    kind. Gauges computed from state (prepared devices, prepared devices that are missing) get
    their collector from the part that owns the state (``prepared_devices.set_collector``).
    """

    def __init__(
        self,
        registry: Registry,
        *,
        driver_name: str,
        node_name: str,
        error_types: Iterable[str] = (),
    ) -> None:
        self.driver_name = driver_name
        self.node_name = node_name
        self.requests = registry.register(
            Counter(
                "nvidia_dra_requests_total",
                "NodePrepareResources and NodeUnprepareResources calls of the kubelet that "
                "were answered, by operation.",
                ("driver", "operation"),
            )
        )
        self.request_duration = registry.register(
            Histogram(
                "nvidia_dra_request_duration_seconds",
                "Time to answer a NodePrepareResources or NodeUnprepareResources call of the "
                "kubelet (all claims of the call), in seconds.",
                ("driver", "operation"),
                buckets=REQUEST_DURATION_BUCKETS_S,
            )
        )
        self.requests_inflight = registry.register(
            Gauge(
                "nvidia_dra_requests_inflight",
                "NodePrepareResources and NodeUnprepareResources calls being answered now.",
                ("driver",),
            )
        )
        self.prepared_devices = registry.register(
            Gauge(
                "nvidia_dra_prepared_devices",
                "Devices of this node held by prepared claims, by device type (gpu, mig).",
                ("node", "driver", "device_type"),
            )
        )
        self.prepare_errors = registry.register(
            Counter(
                "nvidia_dra_node_prepare_errors_total",
                "Claims whose prepare failed, by error type.",
                ("driver", "error_type"),
            )
        )
        self.unprepare_errors = registry.register(
            Counter(
                "nvidia_dra_node_unprepare_errors_total",
                "Claims whose unprepare failed, by error type.",
                ("driver", "error_type"),
            )
        )
        self.published_devices = registry.register(
            Gauge(
                "gpu_dra_published_devices",
                "Devices in the ResourceSlices this agent publishes for its node.",
                ("node", "driver"),
            )
        )
        self.prepared_devices_missing = registry.register(
            Gauge(
                "gpu_dra_prepared_devices_missing",
                "Devices held by prepared claims that this node no longer has (a re-discovery "
                "found them gone); their containers cannot use them.",
                ("node", "driver"),
            )
        )
        self.requests_inflight.labels(driver_name)
        for error_type in error_types:
            self.prepare_errors.labels(driver_name, error_type)
            self.unprepare_errors.labels(driver_name, error_type)
        self.prepare = self._request_metrics(PREPARE, self.prepare_errors)
        self.unprepare = self._request_metrics(UNPREPARE, self.unprepare_errors)

    def _request_metrics(self, operation: str, errors: Counter) -> RequestMetrics:
        return RequestMetrics(
            driver_name=self.driver_name,
            operation=operation,
            requests=self.requests,
            duration=self.request_duration,
            inflight=self.requests_inflight,
            errors=errors,
        )

    def set_published_devices(self, count: int) -> None:
        self.published_devices.labels(self.node_name, self.driver_name).set(count)


__all__ = [
    "CONTENT_TYPE",
    "PREPARE",
    "REQUEST_DURATION_BUCKETS_S",
    "UNPREPARE",
    "Counter",
    "DriverMetrics",
    "Gauge",
    "Histogram",
    "Registry",
    "RequestMetrics",
    "Sample",
    "escape_label_value",
    "format_value",
]
