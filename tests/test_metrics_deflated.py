"""The telemetry's exposition kept deflated (metrics.Deflated) and a scrape's body built around it
(metrics.Rendered): the same bytes as the text, one gzip member that any gzip reader reads to
its end, and the agent's telemetry holding its exposition compressed, not as text."""

from __future__ import annotations

import gzip
import http.client
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from prometheus_client.metrics import Counter
from prometheus_client.metrics_core import GaugeMetricFamily, Metric

from dra_driver.gpus import nvml
from dra_driver.gpus.readings import NvmlReader
from dra_driver.metrics import Deflated, Exposition, Registry, Rendered, render, render_families
from dra_driver.node.http_server import metrics_server
from dra_driver.sim.nvml import simulated_nvml
from dra_driver.telemetry.sampler import Telemetry

TEXTS = [
    "# HELP a_total A.\n# TYPE a_total counter\n",
    'a_total{device="gpu-0",product="NVIDIA H100 80GB HBM3"} 1.0\n' * 50,
    'b{model="Ünïcode µs ✓"} 2.0\n',  # label values are UTF-8: the CRC is over the bytes
    "",
]


def one_member(body: bytes) -> bytes:
    """``body`` read as gzip by zlib, which stops at the end of the first member: all of it is
    one member (a reader that reads only the first one, as some do, gets everything)."""
    reader = zlib.decompressobj(16 + zlib.MAX_WBITS)
    data = reader.decompress(body)
    assert reader.eof, "the gzip member does not end"
    assert reader.unused_data == b"", "more than one gzip member"
    return data


def test_a_deflated_text_inflates_to_its_bytes_with_their_crc_and_length() -> None:
    deflated = Deflated.of(iter(TEXTS))
    joined = "".join(TEXTS).encode()
    assert deflated.raw() == joined
    assert deflated.text() == "".join(TEXTS)
    assert deflated.crc == zlib.crc32(joined)
    assert deflated.size == len(joined)
    assert len(deflated.data) < len(joined) / 5  # the repeated lines compress
    empty = Deflated.of([])
    assert (empty.raw(), empty.crc, empty.size) == (b"", 0, 0)


@pytest.mark.parametrize(
    ("lead", "rest"),
    [
        (TEXTS, b'c{x="1"} 3.0\n'),
        (TEXTS, b""),
        ([], b'c{x="1"} 3.0\n'),
        (None, "".join(TEXTS).encode()),
        (None, b""),
    ],
)
def test_a_rendered_body_is_one_gzip_member_of_its_plain_bytes(
    lead: list[str] | None, rest: bytes
) -> None:
    rendered = Rendered(None if lead is None else Deflated.of(lead), rest)
    plain = rendered.plain()
    assert plain == "".join(lead or ()).encode() + rest
    body = rendered.gzipped()
    assert one_member(body) == plain
    assert gzip.decompress(body) == plain  # the CRC and length in the trailer hold


@dataclass
class Kept:
    """A formatted collector that keeps ``families`` as text or deflated."""

    families: list[Metric]
    deflate: bool
    calls: list[int] = field(default_factory=list)

    def describe(self) -> list[Metric]:
        return [GaugeMetricFamily(f.name, f.documentation) for f in self.families]

    def collect(self) -> Iterable[Metric]:
        return self.families

    def exposition(self) -> Exposition:
        self.calls.append(1)
        text = render(self)
        return Deflated.of([text]) if self.deflate else text


def gauge(name: str, value: float) -> Metric:
    family = GaugeMetricFamily(name, f"{name}.", labels=["device"])
    family.add_metric(["gpu-0"], value)
    return family


def test_the_registry_leads_with_the_first_deflated_exposition_and_holds_every_family() -> None:
    registry = Registry()
    Counter("own_total", "Own.", registry=registry.collectors).inc(3)
    text = registry.register_formatted(Kept([gauge("kept_text", 1)], deflate=False))
    first = registry.register_formatted(Kept([gauge("kept_first", 2)], deflate=True))
    second = registry.register_formatted(Kept([gauge("kept_second", 3)], deflate=True))
    rendered = registry.rendered()
    assert rendered.lead is not None and rendered.lead.text() == render(first)
    # the second deflated one is inflated into the rest: one lead per gzip member
    assert rendered.rest.decode() == (render(registry.collectors) + render(text) + render(second))
    assert registry.render() == render(first) + rendered.rest.decode()
    assert one_member(rendered.gzipped()) == registry.render().encode()
    for kept in (text, first, second):  # each asked once per scrape
        kept.calls.clear()
    registry.rendered()
    assert len(text.calls) == len(first.calls) == len(second.calls) == 1


def test_a_scrape_over_http_sends_the_kept_exposition_in_one_gzip_member() -> None:
    registry = Registry()
    Counter("own_total", "Own.", registry=registry.collectors).inc(3)
    registry.register_formatted(Kept([gauge(f"kept_{i}", i) for i in range(40)], deflate=True))
    server = metrics_server(registry, port=0, host="127.0.0.1")
    server.start()
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    try:
        connection.request("GET", "/metrics")
        plain = connection.getresponse()
        text = plain.read()
        assert plain.getheader("Content-Encoding") is None
        connection.request("GET", "/metrics", headers={"Accept-Encoding": "gzip"})
        zipped = connection.getresponse()
        body = zipped.read()
        assert zipped.getheader("Content-Encoding") == "gzip"
        assert int(zipped.getheader("Content-Length", "-1")) == len(body)
        assert one_member(body) == text
        assert b"own_total 3.0" in text and b'kept_39{device="gpu-0"} 39.0' in text
    finally:
        connection.close()
        server.stop()


@pytest.fixture(scope="module")
def telemetry() -> Iterator[Telemetry]:
    reader = NvmlReader()
    try:
        with simulated_nvml("h100:4,h100:4:mig=1g.10gb*7", node_name="n") as node:
            inventory = nvml.discover(driver_root=Path("/"), sysfs_root=node.sysfs_root)
            sampled = Telemetry(node_name="n", inventory=inventory, read=reader.read, dcgm=True)
            sampled.sample()
            yield sampled
    finally:
        reader.close()


def test_the_telemetry_keeps_its_exposition_deflated(telemetry: Telemetry) -> None:
    # what it serves is what it collects, in the text format; held at a fraction of the text
    kept = telemetry.exposition()
    assert isinstance(kept, Deflated)
    families = list(telemetry.collect())
    ours = [f for f in families if not f.name.startswith("DCGM_")]
    dcgm = [f for f in families if f.name.startswith("DCGM_")]
    assert kept.text() == render_families(ours) + render_families(dcgm, counter_suffix=False)
    assert sum(len(f.samples) for f in families) > 500  # 8 GPUs, 28 MIG devices
    assert len(kept.data) < kept.size / 6
