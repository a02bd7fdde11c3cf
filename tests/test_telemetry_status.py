"""gpu-dra status: node-local against a simulated agent's metrics served over real HTTP, and
cluster-wide through the real client against the local API server (slices, claims, the agent's
pod), in table, json and yaml; --watch until Ctrl-C; clear errors."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from dra_driver import devices
from dra_driver.errors import MetricsUnavailable
from dra_driver.gpus import nvml
from dra_driver.gpus.readings import NvmlReader
from dra_driver.kube.permissions import STATUS_PERMISSIONS
from dra_driver.metrics import Registry
from dra_driver.node.http_server import Answer, HttpServer, metrics_server
from dra_driver.publish import slices
from dra_driver.sim.localapi import FakeKubeApi, free_port
from dra_driver.sim.nvml import simulated_nvml
from dra_driver.telemetry.sampler import ClaimHolder, Telemetry
from dra_driver.telemetry.status.cluster import DEFAULT_AGENT_SELECTOR
from dra_driver.telemetry.status.command import main, watch
from tests.claimdata import allocated_claim

NODE = "gpu-node-1"
SPEC = "h100:2,a100-80gb:1:mig=3g.40gb+2g.20gb"
DRIVER = "gpu.nvidia.com"
REPO = Path(__file__).resolve().parent.parent


@dataclass
class Agent:
    """A simulated node's telemetry served as the agent serves it."""

    url: str
    port: int
    telemetry: Telemetry
    inventory: nvml.Inventory


@pytest.fixture
def agent() -> Iterator[Agent]:
    with simulated_nvml(SPEC, node_name=NODE) as node:
        inventory = nvml.discover(driver_root=Path("/"), sysfs_root=node.sysfs_root)
        reader = NvmlReader()
        held = {"gpu-0": (ClaimHolder("team-a", "train", "u1", ("trainer-0",)),)}
        telemetry = Telemetry(
            node_name=NODE, inventory=inventory, read=reader, holders=lambda: held
        )
        node.library.workload = lambda uuid: uuid in telemetry.held_uuids()
        telemetry.sample()
        telemetry.sample()  # the second pass runs gpu-0 busy
        telemetry.set_health_providers(states=lambda: {"gpu-0": "Healthy", "gpu-1": "Healthy"})
        registry = Registry()
        registry.register_formatted(telemetry)
        server = metrics_server(registry, port=0, host="127.0.0.1")
        server.start()
        try:
            url = f"http://127.0.0.1:{server.port}/metrics"
            yield Agent(url, server.port, telemetry, inventory)
        finally:
            server.stop()
            reader.close()


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(argv)
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


# -- node-local --------------------------------------------------------------------------------


def test_the_table_shows_each_device_with_claim_pod_health_and_readings(
    agent: Agent, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, err = run(["--metrics-url", agent.url], capsys)
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].split() == [
        "NODE", "DEVICE", "TYPE", "HEALTH", "CLAIM", "POD", "UTIL", "MEMORY", "TEMP", "POWER",
    ]  # fmt: skip
    rows = {line.split()[1]: line for line in lines[1:]}
    assert list(rows) == [
        "gpu-0", "gpu-1", "gpu-2", "gpu-2-mig-3g40gb-9-0", "gpu-2-mig-2g20gb-14-4",
    ]  # fmt: skip
    gpu0 = rows["gpu-0"].split()
    assert gpu0[:6] == [NODE, "gpu-0", "gpu", "Healthy", "team-a/train", "trainer-0"]
    assert gpu0[6].endswith("%") and int(gpu0[6][:-1]) >= 60  # busy: a claim holds it
    assert gpu0[7].endswith("/79.6") and gpu0[8] == "GiB"
    assert gpu0[10] == "C" and gpu0[12] == "W" and gpu0[11].endswith("/700")
    assert "gpu (MIG mode)" in rows["gpu-2"]
    mig = rows["gpu-2-mig-3g40gb-9-0"].split()
    assert mig[2:4] == ["mig", "3g.40gb"]
    assert mig[4:8] == ["-", "-", "-", "-"]  # no health, claim, pod, utilisation (MIG)
    assert mig[8].endswith("/39.2")


def test_json_and_yaml_carry_the_same_values_in_base_units(
    agent: Agent, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, _ = run(["--metrics-url", agent.url, "-o", "json"], capsys)
    assert rc == 0
    report = json.loads(out)
    by_name = {d["device"]: d for d in report["devices"]}
    gpu0 = by_name["gpu-0"]
    assert gpu0["claims"] == [{"namespace": "team-a", "name": "train", "pods": ["trainer-0"]}]
    assert gpu0["health"] == "Healthy" and gpu0["taints"] == []
    assert gpu0["memoryTotalBytes"] == 81559 << 20
    assert 0.6 <= gpu0["utilization"] <= 1
    assert gpu0["powerLimitWatts"] == 700 and 0 < gpu0["powerWatts"] <= 700
    assert by_name["gpu-2"]["migEnabled"] is True
    assert by_name["gpu-2-mig-3g40gb-9-0"]["utilization"] is None
    assert by_name["gpu-2-mig-3g40gb-9-0"]["profile"] == "3g.40gb"
    assert "published" not in gpu0  # node-local: the slices are not read
    rc, out, _ = run(["--metrics-url", agent.url, "-o", "yaml"], capsys)
    assert rc == 0
    assert [d["device"] for d in yaml.safe_load(out)["devices"]] == list(by_name)


def test_an_unreachable_agent_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}/metrics"
    rc, out, err = run(["--metrics-url", url], capsys)
    assert (rc, out) == (1, "")
    assert f"cannot reach {url}" in err and "refused" in err
    assert "--metrics-port" in err and "port-forward" in err


def test_a_wrong_endpoint_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    server = HttpServer(
        {"/metrics": lambda: Answer(200, "<html>not metrics {</html>\n")},
        port=0,
        host="127.0.0.1",
        flag="--x",
        name="other",
    )
    server.start()
    try:
        rc, _, err = run(["--metrics-url", f"http://127.0.0.1:{server.port}/other"], capsys)
        assert rc == 1 and "answered HTTP 404: not found: use /metrics" in err
        rc, _, err = run(["--metrics-url", f"http://127.0.0.1:{server.port}/metrics"], capsys)
        assert rc == 1 and "not Prometheus metrics" in err
    finally:
        server.stop()


# -- cluster-wide ------------------------------------------------------------------------------


def publish(api: FakeKubeApi, agent: Agent, *, node: str, taint_gpu1: bool = False) -> None:
    """The slices the agent of ``node`` publishes (built by the real slice code)."""
    pool = slices.build_slices(
        devices.node_devices(agent.inventory, driver_name=DRIVER),
        driver_name=DRIVER,
        node_name=node,
    )
    for obj in slices.to_api_objects(pool, node_uid="uid"):
        obj["metadata"]["name"] = obj["metadata"].pop("generateName") + "x"
        for device in obj["spec"]["devices"]:
            if taint_gpu1 and device["name"] == "gpu-1":
                device["taints"] = [
                    {"key": "gpu.nvidia.com/unhealthy", "value": "xid-79", "effect": "NoSchedule"}
                ]
        api.put("resourceslices", obj)


def agent_pod(node: str, port: int, *, name: str = "agent-0") -> dict[str, object]:
    return {
        "metadata": {
            "name": name,
            "namespace": "gpu-dra",
            "labels": dict(label.split("=") for label in DEFAULT_AGENT_SELECTOR.split(",")),
        },
        "spec": {
            "nodeName": node,
            "containers": [
                {
                    "name": "kubelet-plugin",
                    "ports": [
                        {"name": "healthz", "containerPort": 51515},
                        {"name": "metrics", "containerPort": port},
                    ],
                }
            ],
        },
        "status": {"phase": "Running", "podIP": "127.0.0.1"},
    }


@pytest.fixture
def api(tmp_path: Path) -> Iterator[FakeKubeApi]:
    server = FakeKubeApi().start()
    server.write_kubeconfig(tmp_path / "kubeconfig")
    yield server
    server.stop()


def test_cluster_wide_merges_slices_claims_taints_and_each_reachable_agent(
    api: FakeKubeApi, agent: Agent, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    publish(api, agent, node=NODE, taint_gpu1=True)
    publish(api, agent, node="gpu-node-2")  # its agent's port answers nothing
    api.add_claim(allocated_claim(name="infer", node=NODE, devices=["gpu-1"]))
    api.put("pods", agent_pod(NODE, agent.port))
    api.put("pods", agent_pod("gpu-node-2", free_port(), name="agent-1"))
    kubeconfig = str(tmp_path / "kubeconfig")
    rc, out, err = run(["--kubeconfig", kubeconfig, "-o", "json"], capsys)
    assert rc == 0, err
    report = json.loads(out)
    rows = {(d["node"], d["device"]): d for d in report["devices"]}
    gpu1 = rows[NODE, "gpu-1"]
    # Claims come from the API (the claim of gpu-1), readings from the node's agent.
    assert gpu1["claims"] == [{"namespace": "default", "name": "infer", "pods": ["pod-0"]}]
    assert gpu1["taints"] == ["gpu.nvidia.com/unhealthy=xid-79:NoSchedule"]
    assert gpu1["published"] is True and gpu1["health"] == "Healthy"
    assert gpu1["temperatureCelsius"] is not None
    assert rows[NODE, "gpu-0"]["claims"] == []  # the API knows of no claim on gpu-0
    # The GPU in MIG mode is not published, but its agent reports it.
    assert rows[NODE, "gpu-2"]["published"] is False
    assert rows[NODE, "gpu-2"]["powerWatts"] is not None
    # The second node: its slices, no readings, and a note why.
    node2 = [d for d in report["devices"] if d["node"] == "gpu-node-2"]
    assert [d["device"] for d in node2] == [
        "gpu-0", "gpu-1", "gpu-2-mig-3g40gb-9-0", "gpu-2-mig-2g20gb-14-4",
    ]  # fmt: skip
    assert all(d["utilization"] is None and d["memoryTotalBytes"] is None for d in node2)
    (note,) = report["notes"]
    assert note.startswith("gpu-node-2: agent metrics unavailable: cannot reach http://127.0.0.1:")
    rc, out, _ = run(["--kubeconfig", kubeconfig], capsys)
    assert rc == 0
    assert "taint gpu.nvidia.com/unhealthy=xid-79:NoSchedule" in out
    # Exactly the reads kube/ declares for it (docs name them for RBAC).
    reads = {request for request in api.permissions_used() if request[0] == "list"}
    assert reads == set(STATUS_PERMISSIONS)
    assert "default/infer" in out and "note: gpu-node-2: agent metrics unavailable" in out


def test_without_permission_to_list_pods_slices_and_claims_are_still_shown(
    api: FakeKubeApi, agent: Agent, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    publish(api, agent, node=NODE)
    api.put("pods", agent_pod(NODE, agent.port))
    api.forbid("list", "pods")
    rc, out, err = run(["--kubeconfig", str(tmp_path / "kubeconfig"), "-o", "yaml"], capsys)
    assert rc == 0, err
    report = yaml.safe_load(out)
    assert len(report["devices"]) == 4
    assert all(d["temperatureCelsius"] is None for d in report["devices"])
    (note,) = report["notes"]
    assert "the agent pods cannot be listed (forbidden" in note and "list pods" in note


def test_an_api_server_that_refuses_the_slices_is_an_error(
    api: FakeKubeApi, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    api.forbid("list", "resourceslices")
    rc, out, err = run(["--kubeconfig", str(tmp_path / "kubeconfig")], capsys)
    assert (rc, out) == (1, "")
    assert err.startswith("gpu-dra status: forbidden")


# -- watch ---------------------------------------------------------------------------------------


def test_watch_refreshes_until_ctrl_c_and_shows_failures_in_place() -> None:
    answers: list[str | Exception] = ["first", MetricsUnavailable("agent down"), "third"]
    sleeps: list[float] = []

    def show() -> str:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if not answers:
            raise KeyboardInterrupt

    out = io.StringIO()
    assert watch(show, interval_s=1.5, out=out, sleep=sleep) == 0
    text = out.getvalue()
    assert text.count("Every 1.5s: gpu-dra status") == 3
    assert "first" in text and "error: agent down" in text and "third" in text
    assert sleeps == [1.5, 1.5, 1.5]


def test_watch_in_a_terminal_session_ends_cleanly_on_sigint(agent: Agent) -> None:
    command = [sys.executable, "-c", "from dra_driver.cli import gpu_dra_main as m; m()"]
    process = subprocess.Popen(
        [*command, "status", "--metrics-url", agent.url, "--watch", "0.2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        # as from a terminal: a test run started in the background (`nohup … &`) ignores
        # SIGINT, the child would inherit that, and Python then installs no Ctrl-C handler
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # noqa: PLW1509
    )
    try:
        time.sleep(2)
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=10)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()  # reaped and its pipes closed, not left to a later test
    assert process.returncode == 0, err
    assert "Traceback" not in err
    assert out.count("gpu-dra status") >= 2 and "team-a/train" in out


def test_watch_wants_a_positive_interval(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--watch", "0"])
    assert exit_info.value.code == 2
    assert "greater than 0" in capsys.readouterr().err
