"""metrics.py: the registry on prometheus_client, then the driver's metrics end to end: a real
NodePlugin over real Unix sockets, claims from the local API server, scraped over real HTTP and
read back with prometheus_client's parser."""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from prometheus_client.metrics_core import GaugeMetricFamily, Metric

from dra_driver._proto.dra_v1 import api_pb2 as v1
from dra_driver._proto.dra_v1 import api_pb2_grpc as v1_grpc
from dra_driver._proto.dra_v1beta1 import api_pb2 as v1beta1
from dra_driver._proto.dra_v1beta1 import api_pb2_grpc as v1beta1_grpc
from dra_driver.errors import (
    CdiError,
    CheckpointError,
    ClaimFetchFailed,
    ClaimNotFound,
    ConfigDecodeError,
    DeviceConflict,
    DraError,
    KubeError,
    PrepareError,
    ShareEnforcementFailed,
)
from dra_driver.kube import KubeClient
from dra_driver.metrics import CONTENT_TYPE, CollectedGauge, DriverMetrics, Registry, render
from dra_driver.node.http_server import HttpServer, metrics_server
from dra_driver.node.nodeplugin import NodePlugin
from dra_driver.prepare import ERROR_TYPES, error_type
from dra_driver.sim.localapi import FakeKubeApi, free_port
from tests import exposition
from tests.claimdata import allocated_claim, new_uid
from tests.test_plugin_server import channel, start_plugin, v1_claim

DRIVER = "gpu.nvidia.com"
AT = {"node": "node1", "driver": DRIVER}  # every driver series carries its node
PREPARE = "NodePrepareResources"
UNPREPARE = "NodeUnprepareResources"

# -- the registry -------------------------------------------------------------------------------


def test_the_exposition_is_prometheus_text_without_created_series() -> None:
    registry = Registry()
    DriverMetrics(registry, driver_name=DRIVER, node_name="node1", error_types=ERROR_TYPES)
    text = registry.render()
    series = exposition.parse(text)  # prometheus_client's own parser reads it back
    assert series
    assert not [name for name, _ in series if name.endswith("_created")]
    assert CONTENT_TYPE == "text/plain; version=0.0.4; charset=utf-8"


def test_a_collected_gauge_is_read_at_each_scrape_and_only_then() -> None:
    registry = Registry()
    calls: list[int] = []

    def collect() -> dict[tuple[str, ...], float]:
        calls.append(1)
        return {("b",): len(calls), ("a",): 10}

    registry.register(CollectedGauge("held", "H.", ("kind",), collect=collect))
    assert calls == []  # nothing runs before a scrape
    assert registry.render().splitlines()[2:] == ['held{kind="a"} 10.0', 'held{kind="b"} 1.0']
    assert registry.render().splitlines()[2:] == ['held{kind="a"} 10.0', 'held{kind="b"} 2.0']


def test_a_collected_gauge_without_a_collector_has_no_series() -> None:
    registry = Registry()
    gauge = registry.register(CollectedGauge("held", "H.", ("kind",)))
    assert registry.render() == "# HELP held H.\n# TYPE held gauge\n"
    gauge.set_collector(lambda: {("x",): 1.0})
    assert registry.sample_value("held", kind="x") == 1


def test_a_collector_with_the_wrong_labels_fails_the_scrape() -> None:
    registry = Registry()
    registry.register(CollectedGauge("g", "G.", ("a", "b"), collect=lambda: {("only-one",): 1.0}))
    with pytest.raises(ValueError, match="for label names"):
        registry.render()


def test_a_name_is_registered_once_whichever_way() -> None:
    registry = Registry()
    registry.register(CollectedGauge("g", "G."))
    with pytest.raises(ValueError, match="Duplicated"):
        registry.register(CollectedGauge("g", "G again."))
    with pytest.raises(ValueError, match="Duplicated"):
        registry.register_formatted(Formatted([GaugeMetricFamily("g", "G.", value=1)]))
    registry.register_formatted(Formatted([GaugeMetricFamily("f", "F.", value=2)]))
    with pytest.raises(ValueError, match="Duplicated"):
        registry.register(CollectedGauge("f", "F again."))


def test_a_formatted_collector_is_served_after_the_others_from_its_own_text() -> None:
    registry = Registry()
    registry.register(CollectedGauge("a", "A.", collect=lambda: {(): 1.0}))
    formatted = registry.register_formatted(Formatted([GaugeMetricFamily("b", "B.", value=2)]))
    assert registry.render() == (
        "# HELP a A.\n# TYPE a gauge\na 1.0\n" + "# HELP b B.\n# TYPE b gauge\nb 2.0\n"
    )
    assert formatted.renders == 1
    assert registry.sample_value("b") == 2
    assert registry.sample_value("a") == 1
    assert registry.sample_value("c") is None


class Formatted:
    """A Formatted collector that counts how often it was formatted."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families
        self.renders = 0

    def describe(self) -> list[Metric]:
        return self.families

    def collect(self) -> list[Metric]:
        return self.families

    def exposition(self) -> str:
        self.renders += 1
        return render(self)


def test_request_updates_from_many_threads_are_not_lost() -> None:
    registry = Registry()
    driver = DriverMetrics(registry, driver_name=DRIVER, node_name="node1")
    start = threading.Barrier(8)

    def work() -> None:
        start.wait()
        for i in range(2000):
            driver.prepare.started()
            driver.prepare.finished(0.0005 * (i % 2))
            driver.prepare.failed("cdi")

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    labels = {"node": "node1", "driver": DRIVER, "operation": PREPARE}
    assert registry.sample_value("nvidia_dra_requests_total", **labels) == 16000
    assert registry.sample_value("nvidia_dra_requests_inflight", **AT) == 0
    duration = "nvidia_dra_request_duration_seconds"
    assert registry.sample_value(f"{duration}_bucket", **labels, le="0.001") == 16000
    assert registry.sample_value(f"{duration}_sum", **labels) == pytest.approx(4.0)
    errors = "nvidia_dra_node_prepare_errors_total"
    assert registry.sample_value(errors, **AT, error_type="cdi") == 16000


# -- the driver's metrics ----------------------------------------------------------------------


def test_the_driver_metrics_have_the_names_labels_and_buckets_dashboards_use() -> None:
    registry = Registry()
    DriverMetrics(registry, driver_name=DRIVER, node_name="node1", error_types=ERROR_TYPES)
    text = registry.render()
    assert exposition.types(text) == {
        "gpu_dra_claim_status_writes_total": "counter",
        "gpu_dra_prepared_devices_missing": "gauge",
        "gpu_dra_published_devices": "gauge",
        "nvidia_dra_node_prepare_errors_total": "counter",
        "nvidia_dra_node_unprepare_errors_total": "counter",
        "nvidia_dra_prepared_devices": "gauge",
        "nvidia_dra_request_duration_seconds": "histogram",
        "nvidia_dra_requests_inflight": "gauge",
        "nvidia_dra_requests_total": "counter",
    }
    lines = text.splitlines()
    helps = {line.split()[2] for line in lines if line.startswith("# HELP ")}
    assert helps == set(exposition.types(text))  # each metric has its HELP
    series = exposition.parse(text)
    buckets = exposition.find(
        series, "nvidia_dra_request_duration_seconds_bucket", **AT, operation=PREPARE
    )
    assert sorted(float(dict(k)["le"]) for k in buckets) == [
        0.001, 0.0025, 0.005, 0.01, 0.025,
        0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 12.8, float("inf"),
    ]  # fmt: skip
    les = [line.split('le="')[1].split('"')[0] for line in lines if "_bucket{" in line]
    assert les[:6] == ["0.001", "0.0025", "0.005", "0.01", "0.025", "0.05"]  # as Go writes them
    # Known series exist at 0 from the start, so rate() sees their first increase.
    requests = "nvidia_dra_requests_total"
    assert exposition.value(series, requests, **AT, operation=UNPREPARE) == 0
    assert exposition.value(series, "nvidia_dra_requests_inflight", **AT) == 0
    for kind in ERROR_TYPES:
        errors = "nvidia_dra_node_prepare_errors_total"
        assert exposition.value(series, errors, **AT, error_type=kind) == 0
    for result in ("ok", "failed"):  # claim status writes (claimstatus/reporter.py)
        writes = "gpu_dra_claim_status_writes_total"
        assert exposition.value(series, writes, **AT, result=result) == 0


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (ClaimNotFound("gone"), "claim_not_found"),
        (ClaimFetchFailed("403"), "api_error"),
        (DeviceConflict("held"), "device_conflict"),
        (ConfigDecodeError("bad"), "config"),
        (PrepareError("not allocated"), "invalid_claim"),
        (CdiError("disk"), "cdi"),
        (CheckpointError("disk"), "checkpoint"),
        (ShareEnforcementFailed("daemon"), "share"),
    ],
)
def test_each_claim_error_class_has_its_error_type(exc: DraError, kind: str) -> None:
    assert error_type(exc) == kind
    assert kind in ERROR_TYPES


def test_an_error_class_without_a_type_is_a_bug_not_a_silent_label() -> None:
    with pytest.raises(TypeError, match="KubeError"):
        error_type(KubeError("x"))


# -- end to end: real plugin, real sockets, real HTTP ------------------------------------------


def scrape(port: int, path: str = "/metrics") -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.headers["Content-Type"], r.read().decode()
    except urllib.error.HTTPError as exc:
        body = exc.read().decode()
        exc.close()
        return exc.code, exc.headers["Content-Type"], body


@pytest.fixture
def kube(kubeapi: FakeKubeApi) -> Iterator[KubeClient]:
    kubeapi.add_node("node1")
    client = KubeClient.from_config(kubeconfig=kubeapi.kubeconfig_path)
    yield client
    client.close()


class Served:
    def __init__(self, tmp: Path, kube: KubeClient) -> None:
        self.registry = Registry()
        self.metrics = DriverMetrics(
            self.registry, driver_name=DRIVER, node_name="node1", error_types=ERROR_TYPES
        )
        self.plugin: NodePlugin = start_plugin(tmp, kube, metrics=self.metrics)
        self.http: HttpServer = metrics_server(self.registry, port=0, host="127.0.0.1")
        self.http.start()

    def value(self, name: str, **labels: str) -> float | None:
        return self.registry.sample_value(name, **labels)

    def requests(self, operation: str) -> float | None:
        return self.value("nvidia_dra_requests_total", **AT, operation=operation)

    def prepare_errors(self, kind: str) -> float | None:
        return self.value("nvidia_dra_node_prepare_errors_total", **AT, error_type=kind)

    def prepared(self, device_type: str) -> float | None:
        return self.value("nvidia_dra_prepared_devices", **AT, device_type=device_type)


@pytest.fixture
def served(tmp_path: Path, kube: KubeClient) -> Iterator[Served]:
    s = Served(tmp_path, kube)
    yield s
    s.http.stop()
    s.plugin.stop()


def test_prepare_and_unprepare_over_the_sockets_show_in_the_metrics(
    served: Served, kubeapi: FakeKubeApi
) -> None:
    good = kubeapi.add_claim(allocated_claim(name="good", devices=["gpu-0", "gpu-1"]))
    thief = kubeapi.add_claim(allocated_claim(name="thief", devices=["gpu-1"]))
    missing = v1beta1.Claim(namespace="default", name="never-created", uid=new_uid())
    bad_ref = v1.Claim(namespace="default", name="x", uid="../../etc/passwd")
    assert served.prepared("gpu") == 0
    with channel(served.plugin.paths.dra) as ch:
        stub = v1_grpc.DRAPluginStub(ch)
        ok = stub.NodePrepareResources(
            v1.NodePrepareResourcesRequest(claims=[v1_claim(good)]), timeout=5
        )
        assert ok.claims[good["metadata"]["uid"]].error == ""
        # the claim is missing from the API; over v1beta1, which shares the counters
        gone = v1beta1_grpc.DRAPluginStub(ch).NodePrepareResources(
            v1beta1.NodePrepareResourcesRequest(claims=[missing]), timeout=5
        )
        assert "does not exist" in gone.claims[missing.uid].error
        # two failing claims in one call: one request, two errors of different types
        both = stub.NodePrepareResources(
            v1.NodePrepareResourcesRequest(claims=[v1_claim(thief), bad_ref]), timeout=5
        )
        assert "already prepared" in both.claims[thief["metadata"]["uid"]].error
        assert "not a lowercase UUID" in both.claims[bad_ref.uid].error
        # what the readiness probe sends: not kubelet traffic, not counted
        stub.NodePrepareResources(v1.NodePrepareResourcesRequest(), timeout=5)

        assert served.requests(PREPARE) == 3
        assert served.requests(UNPREPARE) == 0
        assert served.prepare_errors("claim_not_found") == 1
        assert served.prepare_errors("device_conflict") == 1
        assert served.prepare_errors("invalid_claim") == 1
        assert served.prepare_errors("api_error") == 0
        assert served.prepared("gpu") == 2
        assert served.prepared("mig") == 0

        status, content_type, body = scrape(served.http.port)
        assert status == 200
        assert content_type == "text/plain; version=0.0.4; charset=utf-8" == CONTENT_TYPE
        series = exposition.parse(body)
        requests = "nvidia_dra_requests_total"
        assert exposition.value(series, requests, **AT, operation=PREPARE) == 3
        prepared = "nvidia_dra_prepared_devices"
        assert exposition.value(series, prepared, **AT, device_type="gpu") == 2
        errors = "nvidia_dra_node_prepare_errors_total"
        assert exposition.value(series, errors, **AT, error_type="device_conflict") == 1

        answer = stub.NodeUnprepareResources(
            v1.NodeUnprepareResourcesRequest(claims=[v1_claim(good), bad_ref]), timeout=5
        )
        assert answer.claims[good["metadata"]["uid"]].error == ""
        assert "not a lowercase UUID" in answer.claims[bad_ref.uid].error

    assert served.requests(UNPREPARE) == 1
    assert (
        served.value("nvidia_dra_node_unprepare_errors_total", **AT, error_type="invalid_claim")
        == 1
    )
    assert served.prepared("gpu") == 0
    assert served.value("nvidia_dra_requests_inflight", **AT) == 0
    for operation, calls in ((PREPARE, 3), (UNPREPARE, 1)):
        labels = {"node": "node1", "driver": DRIVER, "operation": operation}
        duration = "nvidia_dra_request_duration_seconds"
        count = served.value(f"{duration}_count", **labels)
        total_s = served.value(f"{duration}_sum", **labels)
        assert count == calls
        assert served.value(f"{duration}_bucket", **labels, le="+Inf") == calls
        assert total_s is not None and 0 < total_s < 5 * calls
        buckets = [
            served.value(f"{duration}_bucket", **labels, le=le)
            for le in ("0.001", "0.025", "0.4", "12.8")
        ]
        assert buckets == sorted(buckets)  # cumulative

    status, _, body = scrape(served.http.port)
    assert status == 200
    assert body == served.registry.render()  # HTTP serves exactly the registry
    requests = "nvidia_dra_requests_total"
    assert exposition.value(exposition.parse(body), requests, **AT, operation=UNPREPARE) == 1
    assert scrape(served.http.port, "/other")[0] == 404
    assert scrape(served.http.port, "/metrics?x=1")[0] == 200


def test_a_claim_the_api_refuses_to_show_counts_as_an_api_error(
    served: Served, kubeapi: FakeKubeApi
) -> None:
    claim = kubeapi.add_claim(allocated_claim(name="c1"))
    kubeapi.forbid("get", "resourceclaims")
    with channel(served.plugin.paths.dra) as ch:
        answer = v1_grpc.DRAPluginStub(ch).NodePrepareResources(
            v1.NodePrepareResourcesRequest(claims=[v1_claim(claim)]), timeout=5
        )
    assert "forbidden" in answer.claims[claim["metadata"]["uid"]].error
    assert served.prepare_errors("api_error") == 1
    assert served.prepare_errors("claim_not_found") == 0


def test_a_call_in_progress_is_counted_in_flight(served: Served, kubeapi: FakeKubeApi) -> None:
    claim = kubeapi.add_claim(allocated_claim(name="c1", devices=["gpu-3"]))
    uid = claim["metadata"]["uid"]
    inflight = "nvidia_dra_requests_inflight"
    with channel(served.plugin.paths.dra) as ch:
        stub = v1_grpc.DRAPluginStub(ch)
        with served.plugin.locks.hold(uid):  # the prepare waits for the claim's lock
            call = stub.NodePrepareResources.future(
                v1.NodePrepareResourcesRequest(claims=[v1_claim(claim)]), timeout=10
            )
            deadline = time.monotonic() + 5
            while served.value(inflight, **AT) != 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert served.value(inflight, **AT) == 1
            assert served.requests(PREPARE) == 0  # counted when answered
        assert call.result().claims[uid].error == ""
    assert served.value(inflight, **AT) == 0
    assert served.requests(PREPARE) == 1


def test_a_scrape_after_the_plugin_stopped_is_a_500_with_the_reason(
    served: Served,
) -> None:
    served.plugin.stop()
    status, _, body = scrape(served.http.port)
    assert status == 500
    assert "checkpoint is not open" in body


def test_without_metrics_the_plugin_serves_as_before(tmp_path: Path, kube: KubeClient) -> None:
    plugin = start_plugin(tmp_path, kube)
    try:
        assert plugin.metrics is None
        with channel(plugin.paths.dra) as ch:
            answer = v1_grpc.DRAPluginStub(ch).NodePrepareResources(
                v1.NodePrepareResourcesRequest(
                    claims=[v1.Claim(namespace="default", name="x", uid=new_uid())]
                ),
                timeout=5,
            )
        assert "does not exist" in next(iter(answer.claims.values())).error
    finally:
        plugin.stop()


def test_a_metrics_port_in_use_is_a_clear_error_naming_the_flag() -> None:
    port = free_port()
    taken = HttpServer({}, port=port, host="127.0.0.1", flag="--other", name="other")
    try:
        with pytest.raises(
            DraError, match=rf"--metrics-port \(METRICS_PORT\): .*:{port}: .*in use"
        ):
            metrics_server(Registry(), port=port, host="127.0.0.1")
    finally:
        taken.stop()


def test_a_server_stops_cleanly_whether_or_not_it_was_started() -> None:
    never_started = metrics_server(Registry(), port=0, host="127.0.0.1")
    never_started.stop()
    never_started.stop()
    started = metrics_server(Registry(), port=0, host="127.0.0.1")
    started.start()
    port = started.port
    assert scrape(port)[0] == 200
    started.stop()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_grpc_errors_of_the_whole_call_still_count_the_request(
    served: Served,
) -> None:
    """A handler that raises (here: a batch that cannot be scheduled because the preparer is
    closed) still ends the in-flight count and counts the call."""
    assert served.plugin.preparer is not None
    served.plugin.preparer.close()
    claims = [v1.Claim(namespace="default", name=f"c{i}", uid=new_uid()) for i in range(2)]
    with channel(served.plugin.paths.dra) as ch, pytest.raises(grpc.RpcError):
        v1_grpc.DRAPluginStub(ch).NodePrepareResources(
            v1.NodePrepareResourcesRequest(claims=claims), timeout=5
        )
    assert served.requests(PREPARE) == 1
    assert served.value("nvidia_dra_requests_inflight", **AT) == 0
