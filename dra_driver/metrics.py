"""Prometheus metrics of the node agent, on ``prometheus_client``.

Flow position: beside the flow. plugin/dra.py counts the kubelet's requests, the KubeletPlugin
reports prepared devices, the agent reports published devices, telemetry/sampler.py adds the
GPUs' readings; node/http_server.py serves ``Registry.rendered()`` on ``--metrics-port``.

Why the library: ``prometheus_client`` is the Prometheus project's own client, and its exposition
(escaping, number formatting, histogram layout) is what scrapers are tested against; an earlier
hand-written exposition in this module needed its own copy of all of that, and tests to match.
What it costs, measured with bench_telemetry's agent (in-cluster, 8 simulated H100, 2 in MIG
mode, median of 3): the agent imports this module only with ``--metrics-port`` set, so with
metrics off its RSS is unchanged (59.2 MiB); with metrics on (the chart's default) the library's
modules and objects add about 1.1 MiB over the hand-written exposition (60.5 against 59.3 MiB,
telemetry sampling off). Importing it without its package ``__init__`` (push gateway, WSGI/ASGI
apps, default collectors) saved only 0.06 MiB, so the package is imported normally.
Choices made on top of it:

- a private ``CollectorRegistry`` per ``Registry``: no global state, no default process, platform
  or GC collectors (the kubelet and cAdvisor already report the container's CPU and memory);
- no ``*_created`` series: NVIDIA's Go driver does not expose them, dashboards do not use them,
  and they would double the series of every counter and histogram;
- the text format 0.0.4 (``CONTENT_TYPE``), as before and as NVIDIA's driver serves it.

Every metric is thread-safe; a child (one label set) is bound once with ``labels(...)`` and then
costs one short lock per update, so the prepare path stays in the microseconds. Values computed
from state (prepared devices) are read at scrape time through ``CollectedGauge``. A collector
with hundreds of series that change only now and then (telemetry/sampler.py) keeps its own
exposition, formatted by the library when its values change (the telemetry's kept deflated:
``Deflated``, ``Rendered``), and is added with ``register_formatted``: a scrape then costs the
same whatever the number of GPUs.

Metric names and labels of the driver (``DriverMetrics``): nvidia-compat.md, "Metrics".
"""

from __future__ import annotations

import re
import struct
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import prometheus_client.metrics
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.metrics import Counter, Gauge, Histogram
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

# Process-wide in the library; this package is its only user in the agent.
prometheus_client.metrics.disable_created_metrics()  # type: ignore[no-untyped-call]

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4

Collect = Callable[[], Mapping[tuple[str, ...], float]]
"""Values of a gauge read at scrape time: label values (in label-name order) -> value."""

C = TypeVar("C", bound=Collector)
F = TypeVar("F", bound="Formatted")


def render(collector: Collector) -> str:
    """The text exposition (format 0.0.4) of ``collector``'s metrics, by prometheus_client."""
    return generate_latest(collector).decode()


_RENDERED_TYPES = {
    "counter": "counter",
    "gauge": "gauge",
    "info": "gauge",
    "histogram": "histogram",
}
_MOVED_SUFFIXES = ("_created", "_gsum", "_gcount")  # generate_latest moves these to the end


def render_families(families: Iterable[Metric], *, counter_suffix: bool = True) -> str:
    """``render`` of already built families, the same text, faster where many series share one
    label dict (telemetry: every series of a device reuses its labels): each label dict is
    formatted once per call, not once per sample as ``generate_latest`` does (64 GPUs with the
    DCGM-compatible series: 2,900 lines, 6 times faster).
    Families of other types than counter, gauge, info and histogram, ``_created`` samples,
    samples with a timestamp, and names outside the classic charset go through
    ``generate_latest``. ``counter_suffix`` False writes a counter's header under its own name,
    without ``_total`` (dcgm-exporter's counters; their samples carry the name they have).
    tests/test_metrics_render.py holds it byte-equal to ``render``."""
    return "".join(family_texts(families, counter_suffix=counter_suffix))


def family_texts(families: Iterable[Metric], *, counter_suffix: bool = True) -> Iterator[str]:
    """``render_families``, one family's text at a time (``Deflated.of`` compresses them as they
    come, so the whole text is never held)."""
    label_text: dict[int, tuple[Mapping[str, str], str]] = {}
    for family in families:
        kind = _RENDERED_TYPES.get(family.type)
        if (
            kind is None
            or not _CLASSIC_NAME.fullmatch(family.name)
            or any(sample.name.endswith(_MOVED_SUFFIXES) for sample in family.samples)
        ):
            yield render(_Families([family]))
            continue
        name = family.name
        if family.type == "counter" and counter_suffix:
            name += "_total"
        elif family.type == "info":
            name += "_info"
        help_text = family.documentation.replace("\\", r"\\").replace("\n", r"\n")
        out = [f"# HELP {name} {help_text}\n# TYPE {name} {kind}\n"]
        for sample in family.samples:
            if sample.timestamp is not None or not _CLASSIC_NAME.fullmatch(sample.name):
                out.append(render(_Families([_only(family, sample)])).split("\n", 2)[2])
                continue
            labels = sample.labels
            # keyed by identity, holding the dict: a freed one's id may come back (collect()
            # may build families, and their label dicts, one at a time)
            cached = label_text.get(id(labels))
            if cached is not None and cached[0] is labels:
                text = cached[1]
            else:
                text = _label_text(labels)
                label_text[id(labels)] = (labels, text)
            if text == _ODD:
                out.append(render(_Families([_only(family, sample)])).split("\n", 2)[2])
                continue
            value = floatToGoString(sample.value)  # type: ignore[no-untyped-call]
            out.append(f"{sample.name}{text} {value}\n")
        yield "".join(out)


_CLASSIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_CLASSIC_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_ODD = "\0"  # a label set with a name outside the classic charset: generate_latest escapes it


def _label_text(labels: Mapping[str, str]) -> str:
    """``{a="1",b="2"}`` as generate_latest writes it (names sorted, values escaped)."""
    if not labels:
        return ""
    parts = []
    for key, value in sorted(labels.items()):
        if not _CLASSIC_LABEL.fullmatch(key):
            return _ODD
        escaped = value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
        parts.append(f'{key}="{escaped}"')
    return "{" + ",".join(parts) + "}"


def _only(family: Metric, sample: Sample) -> Metric:
    alone = Metric(family.name, family.documentation, family.type)
    alone.samples = [sample]
    return alone


@dataclass(frozen=True)
class _Families:
    families: list[Metric]

    def collect(self) -> list[Metric]:
        return self.families


DEFLATE_LEVEL = 6
"""zlib's default, for a kept exposition. The simulated bench node's telemetry (64 GPUs, 224 MIG
devices, DCGM names on: 918 KB of text) deflates to 93 KiB in 9.7 ms of CPU (level 1: 111 KiB
in 4.2 ms), once per telemetry pass, in zlib without the interpreter lock."""

# A gzip member's header: deflate, no flags, no modification time, no extra flags, OS unknown
_GZIP_HEADER = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"


@dataclass(frozen=True)
class Deflated:
    """A text kept compressed: raw deflate ``data`` that ends on a byte boundary without a final
    block (``Z_SYNC_FLUSH``), so that more deflate data may follow it in one gzip member, with
    the CRC-32 and the length of the text, which that member's trailer needs (``Rendered``).

    Why: the telemetry of a large node is the agent's largest object, and it is only sent, never
    read. Held as text, the simulated bench node's (64 GPUs, 224 MIG devices) took 0.9 MiB, and
    formatting it again each pass (the parts, the joined text, its bytes) left the agent about
    1 MiB larger than with the text deflated as it is formatted (bench_prepare's agent RSS after
    its cycles: docs/benchmarks.md, "Seventh pass"). A scrape that accepts gzip (Prometheus
    does) sends ``data`` as it is; one that does not gets it inflated (1.6 ms for 918 KB)."""

    data: bytes
    crc: int
    size: int

    @classmethod
    def of(cls, texts: Iterable[str], *, level: int = DEFLATE_LEVEL) -> Deflated:
        """``texts`` joined, compressed one at a time as they come (the whole text is never
        held)."""
        compressor = zlib.compressobj(level, zlib.DEFLATED, -zlib.MAX_WBITS)
        parts = []
        crc = size = 0
        for text in texts:
            raw = text.encode()
            crc = zlib.crc32(raw, crc)
            size += len(raw)
            parts.append(compressor.compress(raw))
        parts.append(compressor.flush(zlib.Z_SYNC_FLUSH))
        return cls(b"".join(parts), crc, size)

    def raw(self) -> bytes:
        """The text's bytes (UTF-8)."""
        return zlib.decompressobj(-zlib.MAX_WBITS).decompress(self.data)

    def text(self) -> str:
        return self.raw().decode()


_NOTHING = Deflated(b"", 0, 0)

Exposition = str | Deflated
"""What a ``Formatted`` collector keeps: its text, or its text deflated."""


@dataclass(frozen=True)
class Rendered:
    """One scrape's exposition (format 0.0.4): ``lead``, a kept deflated exposition sent as it
    is, then ``rest`` (UTF-8 text). The text format does not order families, so the lead goes
    first, where a gzip member can start with it."""

    lead: Deflated | None
    rest: bytes

    def plain(self) -> bytes:
        return self.rest if self.lead is None else self.lead.raw() + self.rest

    def gzipped(self, *, level: int = DEFLATE_LEVEL) -> bytes:
        """One gzip member (RFC 1952) holding ``plain()``: the lead's deflate data, then
        ``rest`` compressed now, then the CRC-32 and length of both (the lead's CRC carried on
        over ``rest``). One member, not one per part: some clients read only the first."""
        lead = self.lead or _NOTHING
        compressor = zlib.compressobj(level, zlib.DEFLATED, -zlib.MAX_WBITS)
        tail = compressor.compress(self.rest) + compressor.flush()
        trailer = struct.pack(
            "<II", zlib.crc32(self.rest, lead.crc), (lead.size + len(self.rest)) & 0xFFFFFFFF
        )
        return _GZIP_HEADER + lead.data + tail + trailer


class Formatted(Collector, Protocol):
    """A collector that keeps its own exposition, formatted again only when its values change
    (telemetry/sampler.py: thousands of series that change once per sample, kept deflated;
    node/healthmetrics.py)."""

    def describe(self) -> Iterable[Metric]: ...

    def exposition(self) -> Exposition:
        """``render(self)`` (or that text deflated), possibly cached."""
        ...


class Registry:
    """The metrics one endpoint serves (a private ``CollectorRegistry``, plus collectors that
    keep their exposition formatted)."""

    def __init__(self) -> None:
        # auto_describe: a collector without describe() is asked once at registration, so a
        # name registered twice is refused there and not at the first scrape.
        self.collectors = CollectorRegistry(auto_describe=True)
        self._formatted: list[Formatted] = []

    def register(self, collector: C) -> C:
        """Add ``collector``; a metric name may be registered once (ValueError otherwise)."""
        self.collectors.register(collector)
        return collector

    def register_formatted(self, collector: F) -> F:
        """Add a collector whose own ``exposition()`` is served. Its names are reserved in the
        ``CollectorRegistry``, which refuses duplicates either way."""
        self.collectors.register(_Reserved(list(collector.describe())))
        self._formatted.append(collector)
        return collector

    def rendered(self) -> Rendered:
        """Every metric, for a scrape. Collectors run now; what they raise is raised here. The
        first formatted collector's exposition that is kept deflated leads; then the others'
        families, then the other formatted collectors' in the order they were added."""
        lead: Deflated | None = None
        rest = [render_families(self.collectors.collect()).encode()]
        for collector in self._formatted:
            exposition = collector.exposition()
            if isinstance(exposition, str):
                rest.append(exposition.encode())
            elif lead is None:
                lead = exposition
            else:
                rest.append(exposition.raw())
        return Rendered(lead, b"".join(rest))

    def render(self) -> str:
        """The text exposition (format 0.0.4) of every metric, as ``rendered()`` orders it."""
        return self.rendered().plain().decode()

    def sample_value(self, name: str, **labels: str) -> float | None:
        """The value of the line ``name{labels}`` (e.g. ``x_bucket`` with ``le="0.1"``), or None
        when there is no such line. For tests and debugging, not for the hot path."""
        value = self.collectors.get_sample_value(name, labels)
        for collector in self._formatted:
            for metric in collector.collect() if value is None else ():
                for sample in metric.samples:
                    if sample.name == name and sample.labels == labels:
                        value = sample.value
        return value


class _Reserved:
    """Holds the names of a ``Formatted`` collector in the CollectorRegistry; collects nothing."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def describe(self) -> list[Metric]:
        return self._families

    def collect(self) -> list[Metric]:
        return []


class CollectedGauge:
    """A gauge whose values are read when scraped (and only then) from a ``Collect`` callable
    that the part owning the state sets with ``set_collector``; without one it has no lines."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        *,
        collect: Collect | None = None,
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._collect = collect

    def set_collector(self, collect: Collect | None) -> None:
        self._collect = collect

    def describe(self) -> list[Metric]:
        return [GaugeMetricFamily(self.name, self.documentation, labels=self.labelnames)]

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(self.name, self.documentation, labels=self.labelnames)
        collect = self._collect
        if collect is not None:
            for values, value in sorted(collect().items()):
                if len(values) != len(self.labelnames):
                    raise ValueError(
                        f"collector of {self.name} returned labels {values!r} "
                        f"for label names {list(self.labelnames)}"
                    )
                family.add_metric(values, float(value))
        yield family


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

    __slots__ = ("_duration", "_errors", "_inflight", "_requests", "driver_name", "node_name")

    def __init__(
        self,
        *,
        driver_name: str,
        node_name: str,
        operation: str,
        requests: Counter,
        duration: Histogram,
        inflight: Gauge,
        errors: Counter,
    ) -> None:
        self.driver_name = driver_name
        self.node_name = node_name
        self._requests = requests.labels(node_name, driver_name, operation)
        self._duration = duration.labels(node_name, driver_name, operation)
        self._inflight = inflight.labels(node_name, driver_name)
        self._errors = errors

    def started(self) -> None:
        self._inflight.inc()

    def finished(self, elapsed_s: float) -> None:
        self._inflight.dec()
        self._requests.inc()
        self._duration.observe(elapsed_s)

    def failed(self, error_type: str) -> None:
        self._errors.labels(self.node_name, self.driver_name, error_type).inc()


class DriverMetrics:
    """Every request and device-count metric of the node agent, registered in ``registry``.

    ``error_types`` are created at 0 up front, so that ``rate()`` sees the first error of a
    kind. Every series carries ``node`` (``node_name``, from the config), so dashboards filter
    them by node like the telemetry; NVIDIA's driver labels them by ``driver`` (and
    ``operation``, ``error_type``) only. Gauges computed from state (prepared devices, prepared
    devices that are missing) get their collector from the part that owns the state
    (``prepared_devices.set_collector``).
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
        to = registry.collectors
        self.requests = Counter(
            "nvidia_dra_requests_total",
            "NodePrepareResources and NodeUnprepareResources calls of the kubelet that "
            "were answered, by operation.",
            ("node", "driver", "operation"),
            registry=to,
        )
        self.request_duration = Histogram(
            "nvidia_dra_request_duration_seconds",
            "Time to answer a NodePrepareResources or NodeUnprepareResources call of the "
            "kubelet (all claims of the call), in seconds.",
            ("node", "driver", "operation"),
            buckets=REQUEST_DURATION_BUCKETS_S,
            registry=to,
        )
        self.requests_inflight = Gauge(
            "nvidia_dra_requests_inflight",
            "NodePrepareResources and NodeUnprepareResources calls being answered now.",
            ("node", "driver"),
            registry=to,
        )
        self.prepared_devices = registry.register(
            CollectedGauge(
                "nvidia_dra_prepared_devices",
                "Devices of this node held by prepared claims, by device type (gpu, mig).",
                ("node", "driver", "device_type"),
            )
        )
        self.prepare_errors = Counter(
            "nvidia_dra_node_prepare_errors_total",
            "Claims whose prepare failed, by error type.",
            ("node", "driver", "error_type"),
            registry=to,
        )
        self.unprepare_errors = Counter(
            "nvidia_dra_node_unprepare_errors_total",
            "Claims whose unprepare failed, by error type.",
            ("node", "driver", "error_type"),
            registry=to,
        )
        self.published_devices = Gauge(
            "gpu_dra_published_devices",
            "Devices in the ResourceSlices this agent publishes for its node.",
            ("node", "driver"),
            registry=to,
        )
        self.prepared_devices_missing = registry.register(
            CollectedGauge(
                "gpu_dra_prepared_devices_missing",
                "Devices held by prepared claims that this node no longer has (a re-discovery "
                "found them gone); their containers cannot use them.",
                ("node", "driver"),
            )
        )
        self.claim_status_writes = Counter(
            "gpu_dra_claim_status_writes_total",
            "Writes of prepared claims' status.devices entries (KEP-4817) and their removal at "
            "unprepare, by result: ok, or failed after the retries (the prepare is not affected).",
            ("node", "driver", "result"),
            registry=to,
        )
        self.requests_inflight.labels(node_name, driver_name)
        for result in ("ok", "failed"):
            self.claim_status_writes.labels(node_name, driver_name, result)
        for error_type in error_types:
            self.prepare_errors.labels(node_name, driver_name, error_type)
            self.unprepare_errors.labels(node_name, driver_name, error_type)
        self.prepare = self._request_metrics(PREPARE, self.prepare_errors)
        self.unprepare = self._request_metrics(UNPREPARE, self.unprepare_errors)

    def _request_metrics(self, operation: str, errors: Counter) -> RequestMetrics:
        return RequestMetrics(
            driver_name=self.driver_name,
            node_name=self.node_name,
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
    "Collect",
    "CollectedGauge",
    "DriverMetrics",
    "Formatted",
    "Registry",
    "RequestMetrics",
    "render",
]
