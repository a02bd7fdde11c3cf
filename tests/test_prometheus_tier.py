"""A real Prometheus (Debian's ``prometheus`` package, installed by .ci/run) scraping the real agent
on simulated GPUs, as the chart runs it, with a prepared claim and injected faults.

One agent and one Prometheus for the module (about 35 s together): the agent runs in-cluster
against the local API server on four simulated H100 with ``--telemetry-interval 1``; Prometheus
scrapes it every second as the chart's PodMonitor has the prometheus-operator scrape it (target
labels, ``honorLabels``), and evaluates the chart's alerts (charts/gpu-dra/rules/, each ``for:``
shortened to 1 s so the tier stays short) every second. Checked: ``promtool check metrics`` on
the agent's exposition (clean but for the lint of dcgm-exporter's own names); every query of the
chart's dashboard, read from its file (charts/gpu-dra/dashboards/: each panel's and each
variable's), returns series for the node and honours ``$node``; the XID and ECC panels count the
first event of a device; the queries of NVIDIA's dcgm-exporter dashboard 12239 (not in this
repository: a fixed list below) return data, with the pod of the claim on the held GPU; each
alert fires on its fault (agent not ready before the kubelet registers it; ECC, fatal XID, GPU
lost, row remapping, thermal slowdown, tainted device) and clears after recovery. Skips only
where ``prometheus`` or ``promtool`` is not installed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from dra_driver._proto.dra_v1 import api_pb2 as v1
from dra_driver._proto.dra_v1 import api_pb2_grpc as v1_grpc
from dra_driver.sim.localapi import FakeKubeApi, free_port
from tests.claimdata import allocated_claim
from tests.test_agent import _in_cluster, _register
from tests.test_chart import HELM, render

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
pytestmark = pytest.mark.skipif(
    PROMETHEUS is None or PROMTOOL is None,
    reason="prometheus/promtool not on PATH: install Debian's prometheus package (.ci/run does: "
    "apt-get install --no-install-recommends prometheus)",
)

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "charts" / "gpu-dra"
RULES = CHART / "rules" / "gpu-dra-alerts.yaml"
NODE = "gpu-node-1"
DRIVER = "gpu.nvidia.com"
POD, POD_NAMESPACE, CONTAINER = "trainer-0", "ml", "trainer"
POD_UID = "8c5ab8b5-2a59-4c4e-9a0e-0c2f3f4b7d11"
WAIT_S = 20.0
# A fault's alert needs the agent's next health check and telemetry pass, a scrape and a rule
# evaluation (1 s each here) and the rule's ``for``: seconds when the machine is free, and one CI
# run on 2 busy cores took more than 20 s; the waits for alerts allow a minute.
ALERT_WAIT_S = 60.0

# NVIDIA's dcgm-exporter dashboard (grafana.com 12239, grafana/dcgm-exporter-dashboard.json):
# its panels' queries and its variables' queries. The two DCGM_FI_PROF_* panels read DCGM's
# profiling counters, which NVML cannot answer (docs/metrics.md): they stay empty here.
DCGM_12239_QUERIES = (
    'max(DCGM_FI_DEV_GPU_TEMP{Hostname=~"$Hostname", gpu=~"$gpu"}) by (Hostname, gpu, uuid)',
    'avg(DCGM_FI_DEV_GPU_TEMP{Hostname=~"$Hostname", gpu=~"$gpu"})',
    'max(DCGM_FI_DEV_POWER_USAGE{Hostname=~"$Hostname", gpu=~"$gpu"}) by (Hostname, gpu, uuid)',
    'sum(max(DCGM_FI_DEV_POWER_USAGE{Hostname=~"$Hostname", gpu=~"$gpu"}) by (gpu))',
    'max(DCGM_FI_DEV_SM_CLOCK{Hostname=~"$Hostname", gpu=~"$gpu"} * 1000000) by (Hostname, UUID, gpu)',  # noqa: E501
    'max(DCGM_FI_DEV_FB_USED{Hostname=~"$Hostname", gpu=~"$gpu"}) by (Hostname, gpu, GPU_I_ID, GPU_I_PROFILE)',  # noqa: E501
    "DCGM_FI_DEV_FB_FREE",  # label_values(DCGM_FI_DEV_FB_FREE, Hostname)
    'DCGM_FI_DEV_FB_FREE{Hostname=~"$Hostname"}',  # label_values(..., gpu)
)  # fmt: skip
DCGM_12239_PROFILING = (
    'max(DCGM_FI_PROF_GR_ENGINE_ACTIVE{Hostname=~"$Hostname", gpu=~"$gpu"}) by (Hostname, gpu, GPU_I_ID, GPU_I_PROFILE)',  # noqa: E501
    'max(DCGM_FI_PROF_PIPE_TENSOR_ACTIVE{Hostname=~"$Hostname", gpu=~"$gpu"}) by (Hostname, gpu, GPU_I_ID, GPU_I_PROFILE)',  # noqa: E501
)  # fmt: skip


def wait(
    what: str,
    done: Callable[[], bool],
    timeout_s: float = WAIT_S,
    *,
    state: Callable[[], object] | None = None,
) -> None:
    """Until ``done()``; on timeout the message names ``what`` and, given ``state``, what
    ``state()`` was then."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() >= deadline:
            now = f"; then: {state()!r}" if state is not None else ""
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}{now}")
        time.sleep(0.2)


@dataclass
class Tier:
    tmp: Path
    api: FakeKubeApi
    metrics_port: int
    prometheus_port: int
    plugins: Path
    not_ready_seen: list[str] = field(default_factory=list)

    def query(self, promql: str) -> list[dict[str, Any]]:
        url = f"http://127.0.0.1:{self.prometheus_port}/api/v1/query?" + urllib.parse.urlencode(
            {"query": promql}
        )
        with urllib.request.urlopen(url, timeout=5) as answer:
            body = json.load(answer)
        assert body["status"] == "success", body
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def firing(self) -> list[dict[str, str]]:
        """Labels of every firing alert."""
        url = f"http://127.0.0.1:{self.prometheus_port}/api/v1/alerts"
        with urllib.request.urlopen(url, timeout=5) as answer:
            alerts = json.load(answer)["data"]["alerts"]
        return [a["labels"] for a in alerts if a["state"] == "firing"]

    def firing_named(self, name: str) -> list[dict[str, str]]:
        return [a for a in self.firing() if a["alertname"] == name]

    def inject(self, gpu: int, *args: str) -> None:
        done = subprocess.run(
            [str(Path(sys.executable).parent / "gpu-dra"), "simulate-event", "--gpu", str(gpu),
             *args],
            env={**os.environ, "KUBELET_PLUGINS_DIRECTORY_PATH": str(self.plugins)},
            capture_output=True, text=True, check=False, timeout=30,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr

    def scrape(self) -> str:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as answer:
            return str(answer.read().decode())


AGENT_POD = {"namespace": "gpu-dra", "pod": "gpu-dra-kubelet-plugin-x7k2p"}


def pod_monitor_endpoint() -> dict[str, Any]:
    """The scrape endpoint of the chart's PodMonitor (helm template), or the operator's defaults
    where helm is not installed."""
    if HELM is None:
        return {"port": "metrics"}
    objects = render("--set", "metrics.podMonitor.enabled=true")
    (monitor,) = [o for o in objects if o["kind"] == "PodMonitor"]
    endpoint: dict[str, Any] = monitor["spec"]["podMetricsEndpoints"][0]
    return endpoint


def prometheus_config(tmp: Path, *, metrics_port: int) -> Path:
    """The chart's rules with every ``for:`` at 1 s, and a 1 s scrape of the agent as the chart's
    PodMonitor has the prometheus-operator scrape it: the agent pod's ``namespace``, ``pod``,
    ``container`` and ``endpoint`` as target labels, and the PodMonitor's ``honorLabels``."""
    rules = yaml.safe_load(RULES.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = "1s"
    (tmp / "rules.yaml").write_text(yaml.safe_dump(rules))
    endpoint = pod_monitor_endpoint()
    # What the operator's generated scrape config gives the target before the PodMonitor's own
    # relabelings: the pod's meta labels and its namespace, pod, container and endpoint.
    target_labels = {
        **AGENT_POD,
        "container": "kubelet-plugin",
        "endpoint": endpoint["port"],
        "__meta_kubernetes_pod_name": AGENT_POD["pod"],
        "__meta_kubernetes_namespace": AGENT_POD["namespace"],
    }
    relabel_configs = [
        {
            key: value
            for key, value in {
                "source_labels": rule.get("sourceLabels"),
                "target_label": rule.get("targetLabel"),
                "action": rule.get("action"),
                "regex": rule.get("regex"),
            }.items()
            if value is not None
        }
        for rule in endpoint.get("relabelings", [])
    ]
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
        "rule_files": [str(tmp / "rules.yaml")],
        "scrape_configs": [
            {
                "job_name": "gpu-dra",
                "honor_labels": bool(endpoint.get("honorLabels", False)),
                "metrics_path": endpoint.get("path", "/metrics"),
                "relabel_configs": relabel_configs,
                "static_configs": [
                    {"targets": [f"127.0.0.1:{metrics_port}"], "labels": target_labels}
                ],
            }
        ],
    }
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


def claim_and_pod(api: FakeKubeApi) -> dict[str, Any]:
    claim = allocated_claim(name="train", namespace=POD_NAMESPACE, node=NODE, devices=("gpu-0",))
    claim["status"]["reservedFor"] = [{"resource": "pods", "name": POD, "uid": POD_UID}]
    api.add_claim(claim)
    api.put(
        "pods",
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": POD, "namespace": POD_NAMESPACE, "uid": POD_UID},
            "spec": {
                "nodeName": NODE,
                "resourceClaims": [{"name": "gpu", "resourceClaimName": "train"}],
                "containers": [
                    {"name": CONTAINER, "image": "cuda", "resources": {"claims": [{"name": "gpu"}]}}
                ],
            },
            "status": {"resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": "train"}]},
        },
    )
    return claim


@pytest.fixture(scope="module")
def tier(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tier]:
    tmp = tmp_path_factory.mktemp("tier")
    api = FakeKubeApi(tls_dir=tmp / "tls").start()
    api.add_node(NODE)
    claim = claim_and_pod(api)
    metrics_port, prometheus_port = free_port(), free_port()
    command, env = _in_cluster(
        api, tmp, simulate="h100:4", node=NODE,
        extra=(
            "--metrics-port", str(metrics_port), "--telemetry-interval", "1",
            "--health-check-interval", "1", "--health-min-change-interval", "0.5",
        ),
    )  # fmt: skip
    agent = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    assert PROMETHEUS is not None
    (tmp / "tsdb").mkdir()
    log = (tmp / "prometheus.log").open("w")
    prometheus = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={prometheus_config(tmp, metrics_port=metrics_port)}",
            f"--storage.tsdb.path={tmp / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{prometheus_port}",
            "--log.level=warn",
        ],
        stdout=subprocess.DEVNULL,
        stderr=log,
    )
    log.close()  # the child has its own copy
    tier = Tier(tmp, api, metrics_port, prometheus_port, tmp / "plugins")
    try:
        wait("Prometheus to scrape the agent", lambda: _up(tier), 30)
        # Not registered by a kubelet yet: not ready, and the alert says so.
        wait(
            "GpuDraAgentNotReady",
            lambda: bool(tier.firing_named("GpuDraAgentNotReady")),
            ALERT_WAIT_S,
        )
        tier.not_ready_seen.append("fired")
        _register(tmp / "registry" / f"{DRIVER}-reg.sock")
        wait(
            "GpuDraAgentNotReady to clear",
            lambda: not tier.firing_named("GpuDraAgentNotReady"),
            ALERT_WAIT_S,
        )
        tier.not_ready_seen.append("cleared")
        prepare(tmp / "plugins" / DRIVER / "dra.sock", claim)
        # Two more scrapes: every counter is stored at its first value before any fault.
        wait("the claim in the telemetry", lambda: _held_by_claim(tier), 30)
        time.sleep(2.5)
        yield tier
    finally:
        prometheus.send_signal(signal.SIGTERM)
        prometheus.wait(timeout=20)
        agent.send_signal(signal.SIGTERM)
        _, stderr = agent.communicate(timeout=20)
        api.stop()
    assert agent.returncode == 0, stderr[-3000:]


def _up(tier: Tier) -> bool:
    try:
        up = tier.query('up{job="gpu-dra"}')
    except OSError:
        return False
    return bool(up) and up[0]["value"][1] == "1"


def _held_by_claim(tier: Tier) -> bool:
    """The telemetry names the prepared claim on gpu-0 (under either info series' name)."""
    held = tier.query('{__name__=~"gpu_dra_(device|gpu)_claim_info", claim_name="train"}')
    return any(s["metric"].get("device") == "gpu-0" for s in held)


def prepare(dra_socket: Path, claim: dict[str, Any]) -> None:
    meta = claim["metadata"]
    with grpc.insecure_channel(f"unix://{dra_socket}") as channel:
        answer = v1_grpc.DRAPluginStub(channel).NodePrepareResources(
            v1.NodePrepareResourcesRequest(
                claims=[v1.Claim(namespace=meta["namespace"], name=meta["name"], uid=meta["uid"])]
            ),
            timeout=30,
        )
    (result,) = answer.claims.values()
    assert not result.error, result.error


def dashboard_files() -> list[dict[str, Any]]:
    """The chart's dashboards (charts/gpu-dra/dashboards/*.json), as the chart ships them."""
    boards = [json.loads(p.read_text()) for p in sorted((CHART / "dashboards").glob("*.json"))]
    assert boards
    return boards


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, query) of every panel target of the chart's dashboards, also of panels
    inside a collapsed row."""
    found = []
    for board in dashboard_files():
        for outer in board["panels"]:
            for panel in [outer, *outer.get("panels", [])]:
                for target in panel.get("targets", []):
                    found.append((panel["title"], target["expr"]))
    assert found
    return found


def dashboard_variables() -> list[tuple[str, str]]:
    """(name, query) of every query variable of the chart's dashboards."""
    found = []
    for board in dashboard_files():
        for variable in board["templating"]["list"]:
            if variable["type"] == "query":
                query = variable["query"]
                found.append(
                    (variable["name"], query["query"] if isinstance(query, dict) else query)
                )
    assert found
    return found


def grafana(query: str, **variables: str) -> str:
    """``query`` as Grafana sends it: its variables replaced (1 s scrapes: $__rate_interval is
    4 scrape intervals, Grafana's floor)."""
    values = {"__rate_interval": "4s", "__interval": "1s", "__range": "1h", **variables}
    return re.sub(r"\$\{?(\w+)\}?", lambda m: values.get(m.group(1), m.group(0)), query)


# -- the exposition ----------------------------------------------------------------------------


DCGM_LINT = re.compile(
    r"^DCGM_\w+ (label names should be written in 'snake_case' not 'camelCase'"
    r"|counter metrics should have \"_total\" suffix"
    r"|metric name should not include type 'counter')$"
)
"""What promtool's lint says of dcgm-exporter's own names and labels (``UUID``, ``modelName``,
counters without ``_total``), which the DCGM-compatible series keep so that its dashboards and
alerts work: they are dcgm-exporter's, and so are these complaints."""


def promtool_check(text: str) -> tuple[int, list[str]]:
    assert PROMTOOL is not None
    checked = subprocess.run(
        [PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30,
        check=False,
    )  # fmt: skip
    return checked.returncode, (checked.stdout + checked.stderr).splitlines()


def test_promtool_check_metrics_is_clean(tier: Tier) -> None:
    text = tier.scrape()
    ours = "".join(
        line
        for line in text.splitlines(keepends=True)
        if not line.startswith(("DCGM_", "# HELP DCGM_", "# TYPE DCGM_"))
    )
    assert "gpu_dra_gpu_info" in ours and "nvidia_dra_requests_total" in ours
    assert promtool_check(ours) == (0, [])
    # With the DCGM-compatible series: parsed, and only the lint of dcgm-exporter's names.
    code, problems = promtool_check(text)
    assert code in (0, 3), problems  # 3: lint problems only (1 would be a parse error)
    assert [p for p in problems if not DCGM_LINT.match(p)] == []


# -- the chart's dashboard ---------------------------------------------------------------------


def test_every_dashboard_query_returns_series_for_the_node(tier: Tier) -> None:
    empty, elsewhere = [], []
    for title, query in dashboard_queries():
        promql = grafana(query, node=NODE)
        assert "$" not in promql, f"{title}: a variable the test does not know: {promql}"
        result = tier.query(promql)
        if not result:
            empty.append(f"{title}: {promql}")
        nodes = {s["metric"].get("node", NODE) for s in result}
        if nodes - {NODE}:
            elsewhere.append(f"{title}: {promql}: {nodes}")
        if "$node" not in query:
            elsewhere.append(f"{title}: does not filter by $node: {query}")
        elif tier.query(grafana(query, node="another-node")):
            elsewhere.append(f"{title}: ignores $node: {promql}")
    assert not empty, "panels without data:\n" + "\n".join(empty)
    assert not elsewhere, "\n".join(elsewhere)


def test_every_dashboard_variable_offers_the_node(tier: Tier) -> None:
    """Grafana's ``label_values(metric, label)``: the label's values among the metric's series."""
    for name, query in dashboard_variables():
        match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query.strip())
        assert match, f"${name}: a variable query the test does not know: {query}"
        selector, label = match.groups()
        values = {s["metric"].get(label) for s in tier.query(selector)}
        assert NODE in values, f"${name}: {query} offers {values}"


# -- alerts (and the XID and ECC panels' first event) ----------------------------------------


def panel_value(tier: Tier, title: str, **labels: str) -> float:
    """The sum of panel ``title``'s series with ``labels`` (0 when there are none)."""
    total = 0.0
    for panel, query in dashboard_queries():
        if panel != title:
            continue
        for series in tier.query(grafana(query, node=NODE)):
            if all(series["metric"].get(k) == v for k, v in labels.items()):
                total += float(series["value"][1])
    return total


def test_each_alert_fires_on_its_fault_and_clears_after_recovery(tier: Tier) -> None:
    assert tier.not_ready_seen == ["fired", "cleared"]  # GpuDraAgentNotReady, in the fixture
    assert panel_value(tier, "XID events (1 h)", device="gpu-1") == 0
    assert panel_value(tier, "ECC errors (1 h)", device="gpu-1") == 0
    tier.inject(1, "--ecc")  # XID 48, a double-bit ECC error
    tier.inject(2, "--lost")  # XID 79, then GPU_IS_LOST
    tier.inject(3, "--temperature", "95")  # above the slowdown threshold (87 C)
    tier.inject(3, "--row-remap-failure")
    expected = {
        ("GpuDraDoubleBitEccError", "gpu-1"),
        ("GpuDraFatalXid", "gpu-1"),
        ("GpuDraFatalXid", "gpu-2"),
        ("GpuDraGpuLost", "gpu-2"),
        ("GpuDraThermalSlowdown", "gpu-3"),
        ("GpuDraRowRemapFailed", "gpu-3"),
        ("GpuDraDeviceTainted", "gpu-1"),
        ("GpuDraDeviceTainted", "gpu-2"),
        ("GpuDraDeviceTainted", "gpu-3"),
    }

    def fired() -> set[tuple[str, str]]:
        return {(a["alertname"], a.get("device", "")) for a in tier.firing()}

    wait(
        "every device alert to fire",
        lambda: expected <= fired(),
        ALERT_WAIT_S,
        state=lambda: {"missing": sorted(expected - fired()), "firing": sorted(fired())},
    )
    assert fired() == expected  # nothing else: not gpu-0, not the agent
    xids = {a["device"]: a["value"] for a in tier.firing_named("GpuDraFatalXid")}
    assert xids == {"gpu-1": "48", "gpu-2": "79"}
    assert all(a["node"] == NODE for a in tier.firing())
    # The panels count the first XID and the first ECC error of the device.
    wait(
        "the XID panel to count", lambda: panel_value(tier, "XID events (1 h)", device="gpu-1") > 0
    )
    wait(
        "the ECC panel to count",
        lambda: panel_value(tier, "ECC errors (1 h)", device="gpu-1", error_type="uncorrected") > 0,
    )
    for gpu in (1, 2, 3):
        tier.inject(gpu, "--reset")
    tier.inject(3, "--temperature", "40")
    wait(
        "every alert to clear",
        lambda: not tier.firing(),
        ALERT_WAIT_S,
        state=lambda: sorted(fired()),
    )


# -- NVIDIA's dcgm-exporter dashboard (12239) --------------------------------------------------


def test_dcgm_dashboard_12239_queries_return_data_with_the_pod_of_the_claim(tier: Tier) -> None:
    variables = {"Hostname": NODE, "gpu": ".*"}
    empty = [q for q in DCGM_12239_QUERIES if not tier.query(grafana(q, **variables))]
    assert not empty, "dashboard 12239 queries without data:\n" + "\n".join(empty)
    for query in DCGM_12239_PROFILING:  # NVML cannot answer these (docs/metrics.md)
        assert tier.query(grafana(query, **variables)) == []
    # The panels aggregate the pod away; their series carry it: the held GPU, by its claim's pod.
    used = tier.query(f'DCGM_FI_DEV_FB_USED{{Hostname="{NODE}", gpu="0"}}')
    assert [
        (s["metric"].get("pod"), s["metric"].get("namespace"), s["metric"].get("container"))
        for s in used
    ] == [(POD, POD_NAMESPACE, CONTAINER)]
    # A GPU no claim holds names no pod: the PodMonitor moves the agent's own pod to
    # agent_pod, so `sum by (namespace)` does not count idle GPUs under the agent's namespace.
    idle = tier.query(f'DCGM_FI_DEV_FB_USED{{Hostname="{NODE}", gpu="1"}}')
    assert idle
    for series in idle:
        assert "pod" not in series["metric"] and "namespace" not in series["metric"]
        assert series["metric"]["agent_pod"] == AGENT_POD["pod"]
    by_namespace = tier.query(f'sum by (namespace) (DCGM_FI_DEV_FB_USED{{Hostname="{NODE}"}})')
    assert AGENT_POD["namespace"] not in {s["metric"].get("namespace") for s in by_namespace}
    # dcgm-exporter's err_code and err_msg on the XID series (gpu-0 never had one: 0, No Error)
    xid = tier.query(f'DCGM_FI_DEV_XID_ERRORS{{Hostname="{NODE}", gpu="0"}}')
    assert [(s["metric"]["err_code"], s["metric"]["err_msg"]) for s in xid] == [("0", "No Error")]
