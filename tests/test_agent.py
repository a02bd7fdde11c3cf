"""The node agent as the DaemonSet runs it: a Pod's ServiceAccount (in-cluster configuration over
TLS), simulated GPUs, both kubelet sockets, the HTTP probes (ready only once the kubelet
registered it), Prometheus metrics with the simulated GPUs' telemetry, and a clean SIGTERM.
Re-discovery applies one change to prepare, the health stream and the slices."""

from __future__ import annotations

import ast
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from functools import partial
from itertools import pairwise
from pathlib import Path

import grpc
import pytest

from dra_driver._proto.dra_v1 import api_pb2 as v1
from dra_driver._proto.dra_v1 import api_pb2_grpc as v1_grpc
from dra_driver._proto.pluginregistration_v1 import api_pb2 as reg
from dra_driver._proto.pluginregistration_v1 import api_pb2_grpc as reg_grpc
from dra_driver.node import agent
from dra_driver.sim.kubelethealth import KubeletHealthWatch
from dra_driver.sim.localapi import FakeKubeApi, free_port
from tests import exposition
from tests.claimdata import allocated_claim

as_a_pod = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("openssl") is None,
    reason="needs root, unshare and openssl to give the agent a Pod's ServiceAccount files",
)


def test_run_agent_reads_as_the_wiring_list_it_is() -> None:
    """``run_agent`` builds each part with a function of its own and starts them in order: short,
    no loop of its own (the re-discovery loop, the metrics, the process set-up are functions
    beside it), so the agent's shape is read in one screen."""
    source = Path(agent.__file__).read_text()
    (run,) = [
        node
        for node in ast.parse(source).body
        if isinstance(node, ast.FunctionDef) and node.name == "run_agent"
    ]
    assert run.end_lineno is not None
    assert run.end_lineno - run.lineno + 1 <= 60
    assert not [n for n in ast.walk(run) if isinstance(n, ast.For | ast.While)]


def _in_cluster(
    api: FakeKubeApi,
    tmp_path: Path,
    *,
    simulate: str,
    node: str = "gpu-node-1",
    healthcheck_port: int = 0,
    extra: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The command and environment of the agent as the chart's DaemonSet runs it (in-cluster,
    localapi.FakeKubeApi.in_cluster_command) on ``simulate``, its directories under
    ``tmp_path``; ``extra`` flags, and ``env`` on top of this process's environment."""
    argv = [
        sys.executable, "-m", "dra_driver", "--node-name", node, "--simulate", simulate,
        "--kubelet-plugins-directory-path", str(tmp_path / "plugins"),
        "--kubelet-registrar-directory-path", str(tmp_path / "registry"),
        "--cdi-root", str(tmp_path / "cdi"), "--healthcheck-port", str(healthcheck_port),
        *extra,
    ]  # fmt: skip
    command, pod_env = api.in_cluster_command(argv, workdir=tmp_path)
    inherited = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
    return command, {**inherited, **pod_env, **(env or {})}


def _probe(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except urllib.error.URLError as exc:
        # The probe port opens after the first slices are published: not listening yet is
        # "not ready", anything else is a failure.
        if isinstance(exc.reason, ConnectionRefusedError):
            return 0, "not listening"
        raise


def _register(registration: Path) -> None:
    """What the kubelet's plugin watcher does with a new socket (spec A.5): GetInfo, then
    NotifyRegistrationStatus once it accepted the plugin. The watcher acts when the socket
    appears, which may be after the first slices (the publisher starts first)."""
    deadline = time.monotonic() + 30
    while not registration.exists():
        assert time.monotonic() < deadline, f"{registration} did not appear"
        time.sleep(0.05)
    with grpc.insecure_channel(f"unix://{registration}") as channel:
        stub = reg_grpc.RegistrationStub(channel)
        assert stub.GetInfo(reg.InfoRequest(), timeout=1).type == "DRAPlugin"
        stub.NotifyRegistrationStatus(reg.RegistrationStatus(plugin_registered=True), timeout=5)


def _scrape(port: int) -> tuple[str, str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as answer:
        assert answer.status == 200
        return answer.headers["Content-Type"], answer.read().decode()


@as_a_pod
def test_the_agent_in_dynamic_mig_mode_creates_a_prepared_partition_and_keeps_a_foreign_gpu_static(
    tmp_path: Path,
) -> None:
    """MIG_MODE=dynamic as the chart's DaemonSet sets it: a GPU in MIG mode without MIG devices is
    partitionable, one with a MIG device the driver did not create stays static (and the log says
    so). Prepare creates the allocated placement's MIG device (in the simulated node's state,
    with its capability nodes in the CDI spec) and unprepare destroys it; the foreign GPU's
    existing MIG device is prepared as a static one."""
    api = FakeKubeApi(tls_dir=tmp_path / "tls", token="sa-token").start()
    try:
        api.add_node("gpu-node-1")
        command, env = _in_cluster(
            api, tmp_path, simulate="h100:1:mig,h100:1:mig=1g.10gb", env={"MIG_MODE": "dynamic"}
        )
        agent = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
        dra = tmp_path / "plugins" / "gpu.nvidia.com" / "dra.sock"
        try:
            deadline = time.monotonic() + 30
            while (
                len(api.slices(node_name="gpu-node-1")) < 2 or not dra.is_socket()
            ) and time.monotonic() < deadline:
                assert agent.poll() is None, agent.stderr.read() if agent.stderr else ""
                time.sleep(0.05)
            stored = api.slices(node_name="gpu-node-1")
            sets = [cs["name"] for s in stored for cs in s["spec"].get("sharedCounters", ())]
            names = [d["name"] for s in stored for d in s["spec"].get("devices", ())]
            assert sets == ["gpu-0-counter-set"]
            # gpu-1's (static) MIG device first, then the whole gpu-0 and its 25 placements
            assert len(names) == 27 and names[:2] == ["gpu-1-mig-1g10gb-19-0", "gpu-0"]
            assert "gpu-0-mig-3g40gb-9-4" in names
            claims = [
                api.add_claim(allocated_claim(name=n, node="gpu-node-1", devices=[d]))
                for n, d in (("dyn", "gpu-0-mig-3g40gb-9-4"), ("static", names[0]))
            ]
            with grpc.insecure_channel(f"unix://{dra}") as channel:
                answer = v1_grpc.DRAPluginStub(channel).NodePrepareResources(
                    v1.NodePrepareResourcesRequest(
                        claims=[
                            v1.Claim(namespace="default", name=c["metadata"]["name"],
                                     uid=c["metadata"]["uid"])
                            for c in claims
                        ]
                    ),
                    timeout=10,
                )  # fmt: skip
            uids = [c["metadata"]["uid"] for c in claims]
            assert [answer.claims[u].error for u in uids] == ["", ""]
            state = tmp_path / "plugins" / "gpu.nvidia.com" / "simulated-mig.json"

            def created() -> list[tuple[int, int]]:
                gpus = json.loads(state.read_text())["gpus"]
                return sorted(
                    (gi["profile_id"], gi["start"]) for instances in gpus.values()
                    for gi in instances
                )  # fmt: skip

            assert created() == [(9, 4), (19, 0)]  # the new 3g.40gb, the foreign 1g.10gb
            (spec,) = [p for p in (tmp_path / "cdi").iterdir() if uids[0] in p.name]
            assert "/dev/nvidia-caps/nvidia-cap" in spec.read_text()
            with grpc.insecure_channel(f"unix://{dra}") as channel:
                undone = v1_grpc.DRAPluginStub(channel).NodeUnprepareResources(
                    v1.NodeUnprepareResourcesRequest(
                        claims=[
                            v1.Claim(namespace="default", name=c["metadata"]["name"],
                                     uid=c["metadata"]["uid"])
                            for c in claims
                        ]
                    ),
                    timeout=10,
                )  # fmt: skip
            assert [undone.claims[u].error for u in uids] == ["", ""]
            assert created() == [(19, 0)]  # destroyed; the foreign one is never touched
            assert not spec.exists()
        finally:
            agent.send_signal(signal.SIGTERM)
            _, stderr = agent.communicate(timeout=20)
        assert agent.returncode == 0, stderr
        (warning,) = [line for line in stderr.splitlines() if "did not create" in line]
        assert '"gpu": "gpu-1"' in warning and "gpu-1-mig-1g10gb-19-0" in warning
    finally:
        api.stop()


@as_a_pod
def test_a_whole_gpu_out_of_mig_mode_changes_no_slice_across_rediscovery_and_a_restart(
    tmp_path: Path,
) -> None:
    """MIG_MODE=dynamic: while a claim holds the whole gpu-0 (out of MIG mode, NVML reports a
    plain GPU), re-discovery passes and an agent restart keep publishing the partitionable GPU
    from its mark: no slice is written. Unprepare puts the GPU back, again without a write."""
    api = FakeKubeApi(tls_dir=tmp_path / "tls", token="sa-token").start()
    try:
        api.add_node("gpu-node-1")
        command, env = _in_cluster(
            api, tmp_path, simulate="h100:1:mig", extra=("--rediscover-interval", "0.1"),
            env={"MIG_MODE": "dynamic"},
        )  # fmt: skip
        dra = tmp_path / "plugins" / "gpu.nvidia.com" / "dra.sock"
        state = tmp_path / "plugins" / "gpu.nvidia.com" / "simulated-mig.json"
        claim = api.add_claim(allocated_claim(name="whole", node="gpu-node-1", devices=["gpu-0"]))
        ref = v1.Claim(namespace="default", name="whole", uid=claim["metadata"]["uid"])

        def versions() -> list[tuple[str, str]]:
            return sorted(
                (s["metadata"]["name"], s["metadata"]["resourceVersion"])
                for s in api.slices(node_name="gpu-node-1")
            )

        def start() -> subprocess.Popen[str]:
            dra.unlink(missing_ok=True)
            agent = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
            deadline = time.monotonic() + 30
            while (
                len(api.slices(node_name="gpu-node-1")) < 2 or not dra.is_socket()
            ) and time.monotonic() < deadline:
                assert agent.poll() is None, agent.stderr.read() if agent.stderr else ""
                time.sleep(0.05)
            return agent

        def stop(agent: subprocess.Popen[str]) -> str:
            agent.send_signal(signal.SIGTERM)
            _, stderr = agent.communicate(timeout=20)
            assert agent.returncode == 0, stderr
            return stderr

        def call(unprepare: bool) -> str:
            with grpc.insecure_channel(f"unix://{dra}") as channel:
                stub = v1_grpc.DRAPluginStub(channel)
                if unprepare:
                    return (
                        stub.NodeUnprepareResources(
                            v1.NodeUnprepareResourcesRequest(claims=[ref]), timeout=10
                        )
                        .claims[ref.uid]
                        .error
                    )
                return (
                    stub.NodePrepareResources(
                        v1.NodePrepareResourcesRequest(claims=[ref]), timeout=10
                    )
                    .claims[ref.uid]
                    .error
                )

        def mig_on() -> int:
            modes: dict[str, dict[str, int]] = json.loads(state.read_text()).get("mig_mode", {})
            return next(iter(modes.values()))["current"] if modes else 1

        agent = start()
        try:
            published = versions()
            names = [d["name"] for s in api.slices(node_name="gpu-node-1")
                     for d in s["spec"].get("devices", ())]  # fmt: skip
            assert names[0] == "gpu-0" and len(names) == 26
            assert call(unprepare=False) == ""
            assert mig_on() == 0
            time.sleep(1.0)  # about ten re-discovery passes with NVML showing a plain GPU
            assert versions() == published
        finally:
            stop(agent)
        agent = start()  # restarted while the claim holds the GPU
        try:
            time.sleep(0.5)
            assert versions() == published and mig_on() == 0
            assert call(unprepare=True) == ""
            assert mig_on() == 1
            time.sleep(0.5)
            assert versions() == published
        finally:
            stderr = stop(agent)
        assert "put a GPU back into MIG mode" in stderr
    finally:
        api.stop()


@as_a_pod
def test_the_agent_runs_in_cluster_publishes_serves_probes_and_cleans_up(tmp_path: Path) -> None:
    api = FakeKubeApi(tls_dir=tmp_path / "tls", token="sa-token").start()
    try:
        api.add_node("gpu-node-1")
        port, metrics_port = free_port(), free_port()
        command, env = _in_cluster(
            api, tmp_path, simulate="h100:2,a100-40gb:1:mig=3g.20gb+2g.10gb",
            healthcheck_port=port,
            extra=("--metrics-port", str(metrics_port), "--telemetry-interval", "1"),
        )  # fmt: skip
        agent = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 30
            while not api.slices(node_name="gpu-node-1") and time.monotonic() < deadline:
                assert agent.poll() is None, agent.stderr.read() if agent.stderr else ""
                time.sleep(0.05)
            (stored,) = api.slices(node_name="gpu-node-1")
            names = [d["name"] for d in stored["spec"]["devices"]]
            assert names == ["gpu-0", "gpu-1", "gpu-2-mig-3g20gb-9-0", "gpu-2-mig-2g10gb-14-4"]
            # The requests carried the ServiceAccount token from the Pod's mounted files.
            assert {r.verb for r in api.requests if r.resource == "resourceslices"} >= {"create"}
            registration = tmp_path / "registry" / "gpu.nvidia.com-reg.sock"
            dra = tmp_path / "plugins" / "gpu.nvidia.com" / "dra.sock"
            while _probe(port, "/healthz")[0] != 200 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _probe(port, "/healthz") == (200, "ok\n")
            # Alive, slices published, but no kubelet has registered it: not ready (a rolling
            # update must not count this pod as available yet).
            unregistered = "kubelet has not registered the plugin yet (no NotifyRegistrationStatus)"
            status, body = _probe(port, "/readyz")
            while body.splitlines() != [unregistered] and time.monotonic() < deadline:
                time.sleep(0.05)
                status, body = _probe(port, "/readyz")
            assert (status, body.splitlines()) == (503, [unregistered])
            assert registration.is_socket() and dra.is_socket()
            _register(registration)
            while _probe(port, "/readyz")[0] != 200 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _probe(port, "/readyz") == (200, "ok\n")

            content_type, text = _scrape(metrics_port)
            assert content_type == "text/plain; version=0.0.4; charset=utf-8"
            series = exposition.parse(text)
            labels = {
                "node": "gpu-node-1",
                "driver": "gpu.nvidia.com",
                "operation": "NodePrepareResources",
            }
            # the probes above called dra.sock with empty requests: not counted as traffic
            assert exposition.value(series, "nvidia_dra_requests_total", **labels) == 0
            node = {"node": "gpu-node-1", "driver": "gpu.nvidia.com"}
            assert exposition.value(series, "gpu_dra_published_devices", **node) == 4
            # Telemetry of the simulated GPUs: every GPU (the A100 in MIG mode too) and MIG device.
            info = exposition.find(series, "gpu_dra_gpu_info", node="gpu-node-1")
            assert sorted(dict(k)["device"] for k in info) == [
                "gpu-0", "gpu-1", "gpu-2", "gpu-2-mig-2g10gb-14-4", "gpu-2-mig-3g20gb-9-0",
            ]  # fmt: skip
            temperatures = exposition.find(series, "gpu_dra_gpu_temperature_celsius")
            assert sorted(dict(k)["device"] for k in temperatures) == ["gpu-0", "gpu-1", "gpu-2"]
            claim = api.add_claim(
                allocated_claim(name="c1", node="gpu-node-1", devices=["gpu-2-mig-3g20gb-9-0"])
            )
            with grpc.insecure_channel(f"unix://{dra}") as channel:
                answer = v1_grpc.DRAPluginStub(channel).NodePrepareResources(
                    v1.NodePrepareResourcesRequest(
                        claims=[
                            v1.Claim(namespace="default", name="c1", uid=claim["metadata"]["uid"])
                        ]
                    ),
                    timeout=10,
                )
            assert answer.claims[claim["metadata"]["uid"]].error == ""
            series = exposition.parse(_scrape(metrics_port)[1])
            assert exposition.value(series, "nvidia_dra_requests_total", **labels) == 1
            assert (
                exposition.value(series, "nvidia_dra_request_duration_seconds_count", **labels) == 1
            )
            prepared = "nvidia_dra_prepared_devices"
            assert exposition.value(series, prepared, **node, device_type="mig") == 1
            assert exposition.value(series, prepared, **node, device_type="gpu") == 0
            # The next telemetry sample (every second here) names the claim and its pod.
            held = {}
            while not held and time.monotonic() < deadline:
                time.sleep(0.2)
                series = exposition.parse(_scrape(metrics_port)[1])
                held = exposition.find(series, "gpu_dra_device_claim_info", claim_name="c1")
            assert [dict(k)["device"] for k in held] == ["gpu-2-mig-3g20gb-9-0"]
            assert [dict(k)["pod_name"] for k in held] == ["pod-0"]
        finally:
            agent.send_signal(signal.SIGTERM)
            _, stderr = agent.communicate(timeout=20)
        assert agent.returncode == 0, stderr
        assert not registration.exists() and not dra.exists()
        assert '"msg": "stopped"' in stderr
    finally:
        api.stop()


@as_a_pod
def test_a_missing_api_server_is_retried_not_fatal(tmp_path: Path) -> None:
    """Unreachable API server: the agent keeps serving the kubelet and logs the retries."""
    api = FakeKubeApi(tls_dir=tmp_path / "tls")  # never started: connection refused
    command, env = _in_cluster(api, tmp_path, simulate="l4:1", node="n1")
    agent = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(3)
        assert agent.poll() is None, "the agent must not exit while the API server is down"
        assert (tmp_path / "registry" / "gpu.nvidia.com-reg.sock").is_socket()
    finally:
        agent.send_signal(signal.SIGTERM)
        _, stderr = agent.communicate(timeout=20)
    assert agent.returncode == 0, stderr
    assert "127.0.0.1" in stderr and "retry" in stderr.lower()


@as_a_pod
def test_a_metrics_port_in_use_stops_the_start_with_a_clear_error(tmp_path: Path) -> None:
    api = FakeKubeApi(tls_dir=tmp_path / "tls").start()
    try:
        api.add_node("n1")
        with socket.socket() as taken:
            taken.bind(("0.0.0.0", 0))  # where the agent binds
            taken.listen()
            port = taken.getsockname()[1]
            command, env = _in_cluster(
                api, tmp_path, simulate="l4:1", node="n1", extra=("--metrics-port", str(port))
            )
            done = subprocess.run(
                command, env=env, capture_output=True, text=True, timeout=60, check=False
            )
        assert done.returncode == 1, done.stderr
        assert (
            f"gpu-dra-kubelet-plugin: --metrics-port (METRICS_PORT): cannot listen on port {port}"
            in done.stderr
        )
        # it failed before serving anything: no socket for the kubelet to find
        assert not (tmp_path / "registry" / "gpu.nvidia.com-reg.sock").exists()
    finally:
        api.stop()


# -- health: faults reach the running agent (re-discovery: tests/test_node_discovery.py) ------


@as_a_pod
def test_faults_injected_from_outside_taint_the_agents_slices_and_recovery_untaints_them(
    tmp_path: Path,
) -> None:
    """The agent as the DaemonSet runs it, on simulated GPUs; ``gpu-dra simulate-event`` (what
    a user runs in the pod) makes GPU 1 fall off the bus and come back."""
    api = FakeKubeApi(tls_dir=tmp_path / "tls", token="sa-token").start()
    try:
        api.add_node("gpu-node-1")
        port, metrics_port = free_port(), free_port()
        plugins = tmp_path / "plugins"
        command, env = _in_cluster(
            api, tmp_path, simulate="h100:2", healthcheck_port=port,
            extra=(
                "--health-min-change-interval", "0.5", "--health-fatal-taint-effect", "NoExecute",
                "--metrics-port", str(metrics_port), "--telemetry-interval", "1",
                "--health-report-interval", "0.5",
            ),
        )  # fmt: skip
        agent = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
        kubelet = KubeletHealthWatch(tmp_path / "registry" / "gpu.nvidia.com-reg.sock")

        def taints() -> dict[str, list[tuple[str, str]]]:
            return {
                d["name"]: [(t["key"], t["effect"]) for t in d["taints"]]
                for s in api.slices(node_name="gpu-node-1")
                for d in s["spec"].get("devices") or ()
                if d.get("taints")
            }

        gpu_dra = str(Path(sys.executable).parent / "gpu-dra")

        def inject(*args: str) -> None:
            done = subprocess.run(
                [gpu_dra, "simulate-event", "--gpu", "1", *args],
                env={**os.environ, "KUBELET_PLUGINS_DIRECTORY_PATH": str(plugins)},
                capture_output=True, text=True, check=False, timeout=30,
            )  # fmt: skip
            assert done.returncode == 0, done.stderr
            assert "simulated-faults.jsonl" in done.stdout

        try:
            deadline = time.monotonic() + 30
            registration = tmp_path / "registry" / "gpu.nvidia.com-reg.sock"
            # the slices come first, the plugin's sockets a moment later
            while (
                not api.slices(node_name="gpu-node-1") or not registration.is_socket()
            ) and time.monotonic() < deadline:
                assert agent.poll() is None, agent.stderr.read() if agent.stderr else ""
                time.sleep(0.05)
            _register(registration)
            # the kubelet's health stream: v1 (a 1.37 kubelet's pick), re-sent every 0.5 s
            kubelet.start()
            assert kubelet.wait_for(lambda: len(kubelet.arrivals) >= 3, 10)
            assert kubelet.service == "v1.DRAResourceHealth"
            assert all(b - a < 2 for a, b in pairwise(kubelet.arrivals))
            assert kubelet.health("gpu-node-1", "gpu-1").status == "HEALTHY"
            inject("--lost")
            lost = [("gpu.nvidia.com/gpu-lost", "NoExecute"), ("gpu.nvidia.com/xid", "NoExecute")]
            while taints() != {"gpu-1": lost} and time.monotonic() < deadline:
                time.sleep(0.05)
            assert taints() == {"gpu-1": lost}
            gpu1_seen = partial(kubelet.health, "gpu-node-1", "gpu-1")
            assert kubelet.wait_for(lambda: gpu1_seen().status == "UNHEALTHY", 5)
            assert "GPU is lost" in gpu1_seen().message
            # /metrics says the same: the health monitor feeds telemetry's health and XID series
            series = exposition.parse(_scrape(metrics_port)[1])
            gpu1 = exposition.find(series, "gpu_dra_gpu_health", device="gpu-1")
            assert [(dict(k)["state"], v) for k, v in gpu1.items()] == [("Unhealthy", 1.0)]
            xids = exposition.find(series, "gpu_dra_gpu_xid_errors_total", device="gpu-1")
            assert list(xids.values()) == [1.0]
            # Unhealthy devices do not make the agent unready: it still serves the others.
            while _probe(port, "/readyz")[0] != 200 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _probe(port, "/readyz") == (200, "ok\n")
            inject("--reset")
            while taints() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert taints() == {}
            assert kubelet.wait_for(lambda: gpu1_seen().status == "HEALTHY", 5)
            healthy = exposition.find(
                exposition.parse(_scrape(metrics_port)[1]), "gpu_dra_gpu_health", state="Healthy"
            )
            assert sorted(dict(k)["device"] for k in healthy) == ["gpu-0", "gpu-1"]
            events = sorted(
                api.objects("events"), key=lambda e: int(e["metadata"]["resourceVersion"])
            )
            assert [e["reason"] for e in events][-1] == "DeviceHealthy"
            assert {e["reason"] for e in events} == {"DeviceUnhealthy", "DeviceHealthy"}
            assert all(e["involvedObject"]["name"] == "gpu-node-1" for e in events)
        finally:
            kubelet.stop()
            agent.send_signal(signal.SIGTERM)
            _, stderr = agent.communicate(timeout=20)
        assert agent.returncode == 0, stderr
        assert '"msg": "device unhealthy; tainted"' in stderr
    finally:
        api.stop()
