"""metrics.py: the exposition format on its own, then the driver's metrics end to end: a real
KubeletPlugin over real Unix sockets, claims from the local API server, scraped over real HTTP."""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

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
)
from dra_driver.http_server import HttpServer, metrics_server
from dra_driver.kube import KubeClient
from dra_driver.localapi import FakeKubeApi, free_port
from dra_driver.metrics import (
    CONTENT_TYPE,
    Counter,
    DriverMetrics,
    Gauge,
    Histogram,
    Registry,
    format_value,
)
from dra_driver.plugin.server import KubeletPlugin
from dra_driver.prepare import ERROR_TYPES, error_type
from tests.claimdata import allocated_claim, new_uid
from tests.test_plugin_server import channel, start_plugin, v1_claim

DRIVER = "gpu.nvidia.com"
PREPARE = "NodePrepareResources"
UNPREPARE = "NodeUnprepareResources"

# -- numbers and escaping ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (0.005, "0.005"),
        (0.0025, "0.0025"),
        (1.0, "1"),
        (0.0, "0"),
        (-0.0, "0"),
        (3.0, "3"),
        (12.8, "12.8"),
        (-2.5, "-2.5"),
        (100000.0, "100000"),
        (123456.0, "123456"),
        (1e6, "1e+06"),
        (1234567.0, "1.234567e+06"),
        (0.0001, "0.0001"),
        (1e-5, "1e-05"),
        (2.5e-7, "2.5e-07"),
        (1.5e21, "1.5e+21"),
        (0.1 + 0.2, "0.30000000000000004"),
        (float("inf"), "+Inf"),
        (float("-inf"), "-Inf"),
        (float("nan"), "NaN"),
    ],
)
def test_numbers_are_written_as_the_go_client_writes_them(value: float, text: str) -> None:
    assert format_value(value) == text


def test_label_values_escape_backslash_quote_and_newline() -> None:
    counter = Counter("x_total", "X.", ("path",))
    counter.labels('a\\b"c\nd').inc()
    assert counter.render() == (
        '# HELP x_total X.\n# TYPE x_total counter\nx_total{path="a\\\\b\\"c\\nd"} 1\n'
    )


def test_help_text_escapes_backslash_and_newline_but_not_quotes() -> None:
    gauge = Gauge("g", 'one\\two\n"three"')
    gauge.set(2)
    assert gauge.render() == '# HELP g one\\\\two\\n"three"\n# TYPE g gauge\ng 2\n'


def test_histogram_buckets_are_cumulative_up_to_inf_with_sum_and_count() -> None:
    histogram = Histogram("d_seconds", "D.", ("op",), buckets=(0.005, 0.1, 1.0))
    child = histogram.labels("x")
    for value in (0.001, 0.005, 0.05, 0.5, 0.5, 7.0):  # 0.005 sits on a bound: le is inclusive
        child.observe(value)
    assert histogram.render() == (
        "# HELP d_seconds D.\n"
        "# TYPE d_seconds histogram\n"
        'd_seconds_bucket{op="x",le="0.005"} 2\n'
        'd_seconds_bucket{op="x",le="0.1"} 3\n'
        'd_seconds_bucket{op="x",le="1"} 5\n'
        'd_seconds_bucket{op="x",le="+Inf"} 6\n'
        f'd_seconds_sum{{op="x"}} {format_value(0.001 + 0.005 + 0.05 + 0.5 + 0.5 + 7.0)}\n'
        'd_seconds_count{op="x"} 6\n'
    )
    assert child.count == 6
    assert child.sum == pytest.approx(8.056)


def test_a_histogram_without_labels_has_only_le() -> None:
    histogram = Histogram("h", "H.", buckets=(1, 2, float("inf")))  # a given +Inf is not doubled
    histogram.observe(1.5)
    assert histogram.render().splitlines()[2:] == [
        'h_bucket{le="1"} 0',
        'h_bucket{le="2"} 1',
        'h_bucket{le="+Inf"} 1',
        "h_sum 1.5",
        "h_count 1",
    ]


def test_registry_renders_metrics_by_name_and_label_sets_by_values() -> None:
    registry = Registry()
    zeta = registry.register(Counter("zeta_total", "Z.", ("k",)))
    alpha = registry.register(Gauge("alpha", "A.", ("k", "j")))
    zeta.labels("b").inc(2)
    zeta.labels("a").inc()
    alpha.labels("y", "1").set(0.5)
    alpha.labels("x", "2").inc()
    text = registry.render()
    assert text == (
        "# HELP alpha A.\n# TYPE alpha gauge\n"
        'alpha{k="x",j="2"} 1\n'
        'alpha{k="y",j="1"} 0.5\n'
        "# HELP zeta_total Z.\n# TYPE zeta_total counter\n"
        'zeta_total{k="a"} 1\n'
        'zeta_total{k="b"} 2\n'
    )
    assert registry.render() == text  # deterministic
    assert registry.sample_value("zeta_total", k="b") == 2
    assert registry.sample_value("alpha", k="x", j="2") == 1
    assert registry.sample_value("alpha", k="x") is None
    assert registry.sample_value("missing") is None


def test_a_gauge_collector_is_read_at_each_scrape() -> None:
    registry = Registry()
    calls: list[int] = []

    def collect() -> dict[tuple[str, ...], float]:
        calls.append(1)
        return {("b",): len(calls), ("a",): 10}

    registry.register(Gauge("held", "H.", ("kind",), collector=collect))
    assert calls == []  # nothing runs before a scrape
    assert registry.render().splitlines()[2:] == ['held{kind="a"} 10', 'held{kind="b"} 1']
    assert registry.render().splitlines()[2:] == ['held{kind="a"} 10', 'held{kind="b"} 2']


def test_a_collector_with_the_wrong_labels_fails_the_scrape() -> None:
    gauge = Gauge("g", "G.", ("a", "b"), collector=lambda: {("only-one",): 1.0})
    with pytest.raises(ValueError, match="for label names"):
        gauge.render()


def test_misuse_is_refused() -> None:
    counter = Counter("c_total", "C.", ("a",))
    with pytest.raises(ValueError, match="cannot decrease"):
        counter.labels("x").inc(-1)
    with pytest.raises(ValueError, match="has labels"):
        counter.labels("x", "y")
    with pytest.raises(ValueError, match="invalid metric name"):
        Counter("bad-name", "B.")
    with pytest.raises(ValueError, match="invalid label name"):
        Counter("c", "C.", ("__reserved",))
    with pytest.raises(ValueError, match="reserved"):
        Histogram("h", "H.", ("le",), buckets=(1,))
    with pytest.raises(ValueError, match="increasing"):
        Histogram("h", "H.", buckets=(1, 1))
    registry = Registry()
    registry.register(counter)
    with pytest.raises(ValueError, match="already registered"):
        registry.register(Counter("c_total", "C again."))


def test_updates_from_many_threads_are_not_lost() -> None:
    counter = Counter("c_total", "C.").labels()
    gauge = Gauge("g", "G.").labels()
    histogram = Histogram("h", "H.", buckets=(0.5,)).labels()
    start = threading.Barrier(8)

    def work() -> None:
        start.wait()
        for i in range(5000):
            counter.inc()
            gauge.inc()
            gauge.dec(0.5)
            histogram.observe(i % 2)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert counter.value == 40000
    assert gauge.value == 20000
    assert histogram.count == 40000 and histogram.sum == 20000
    assert histogram.snapshot()[0] == [20000, 40000]


# -- the driver's metrics ----------------------------------------------------------------------


def test_the_driver_metrics_have_the_names_labels_and_buckets_dashboards_use() -> None:
    registry = Registry()
    DriverMetrics(registry, driver_name=DRIVER, node_name="node1", error_types=ERROR_TYPES)
    lines = registry.render().splitlines()
    types = {line.split()[2]: line.split()[3] for line in lines if line.startswith("# TYPE")}
    assert types == {
        "gpu_dra_prepared_devices_missing": "gauge",
        "gpu_dra_published_devices": "gauge",
        "nvidia_dra_node_prepare_errors_total": "counter",
        "nvidia_dra_node_unprepare_errors_total": "counter",
        "nvidia_dra_prepared_devices": "gauge",
        "nvidia_dra_request_duration_seconds": "histogram",
        "nvidia_dra_requests_inflight": "gauge",
        "nvidia_dra_requests_total": "counter",
    }
    helps = [line.split()[2] for line in lines if line.startswith("# HELP ")]
    assert helps == sorted(types)  # each metric has its HELP, in name order
    les = [
        line.split('le="')[1].split('"')[0]
        for line in lines
        if line.startswith("nvidia_dra_request_duration_seconds_bucket")
        and f'operation="{PREPARE}"' in line
    ]
    assert les == [
        "0.001", "0.0025", "0.005", "0.01", "0.025",
        "0.05", "0.1", "0.2", "0.4", "0.8", "1.6", "3.2", "6.4", "12.8", "+Inf",
    ]  # fmt: skip
    # Known series exist at 0 from the start, so rate() sees their first increase.
    assert f'nvidia_dra_requests_total{{driver="{DRIVER}",operation="{UNPREPARE}"}} 0' in lines
    assert f'nvidia_dra_requests_inflight{{driver="{DRIVER}"}} 0' in lines
    for kind in ERROR_TYPES:
        assert (
            f'nvidia_dra_node_prepare_errors_total{{driver="{DRIVER}",error_type="{kind}"}} 0'
            in lines
        )


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
        self.plugin: KubeletPlugin = start_plugin(tmp, kube, metrics=self.metrics)
        self.http: HttpServer = metrics_server(self.registry, port=0, host="127.0.0.1")
        self.http.start()

    def value(self, name: str, **labels: str) -> float | None:
        return self.registry.sample_value(name, **labels)

    def requests(self, operation: str) -> float | None:
        return self.value("nvidia_dra_requests_total", driver=DRIVER, operation=operation)

    def prepare_errors(self, kind: str) -> float | None:
        return self.value("nvidia_dra_node_prepare_errors_total", driver=DRIVER, error_type=kind)

    def prepared(self, device_type: str) -> float | None:
        return self.value(
            "nvidia_dra_prepared_devices", node="node1", driver=DRIVER, device_type=device_type
        )


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
        lines = body.splitlines()
        assert f'nvidia_dra_requests_total{{driver="{DRIVER}",operation="{PREPARE}"}} 3' in lines
        assert 'nvidia_dra_prepared_devices{node="node1",driver="gpu.nvidia.com",' \
            'device_type="gpu"} 2' in lines  # fmt: skip
        assert (
            'nvidia_dra_node_prepare_errors_total{driver="gpu.nvidia.com",'
            'error_type="device_conflict"} 1' in lines
        )

        answer = stub.NodeUnprepareResources(
            v1.NodeUnprepareResourcesRequest(claims=[v1_claim(good), bad_ref]), timeout=5
        )
        assert answer.claims[good["metadata"]["uid"]].error == ""
        assert "not a lowercase UUID" in answer.claims[bad_ref.uid].error

    assert served.requests(UNPREPARE) == 1
    assert (
        served.value(
            "nvidia_dra_node_unprepare_errors_total", driver=DRIVER, error_type="invalid_claim"
        )
        == 1
    )
    assert served.prepared("gpu") == 0
    assert served.value("nvidia_dra_requests_inflight", driver=DRIVER) == 0
    for operation, calls in ((PREPARE, 3), (UNPREPARE, 1)):
        labels = {"driver": DRIVER, "operation": operation}
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
    assert f'nvidia_dra_requests_total{{driver="{DRIVER}",operation="{UNPREPARE}"}} 1' in body
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
            while served.value(inflight, driver=DRIVER) != 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert served.value(inflight, driver=DRIVER) == 1
            assert served.requests(PREPARE) == 0  # counted when answered
        assert call.result().claims[uid].error == ""
    assert served.value(inflight, driver=DRIVER) == 0
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
    assert served.value("nvidia_dra_requests_inflight", driver=DRIVER) == 0
