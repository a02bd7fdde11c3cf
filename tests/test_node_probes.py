"""HTTP probes of node/probes.py against a real plugin (real sockets): liveness (sockets, loops) and
readiness (kubelet registration, slices, NVML), one line per failing condition."""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import grpc
import pytest

from dra_driver._proto.pluginregistration_v1 import api_pb2 as reg
from dra_driver._proto.pluginregistration_v1 import api_pb2_grpc as reg_grpc
from dra_driver.errors import DiscoveryError, DraError
from dra_driver.gpus import nvml
from dra_driver.heartbeat import Heartbeat, heartbeat_problems
from dra_driver.kube import KubeClient
from dra_driver.node.config import Config
from dra_driver.node.discovery import Discovery
from dra_driver.node.nodeplugin import NodePlugin
from dra_driver.node.probes import ProbeServer, SocketChecker
from dra_driver.node.wiring import kubelet_plugin
from dra_driver.sim.localapi import FakeKubeApi
from tests.test_plugin_server import inventory, make_config, start_plugin


@pytest.fixture
def kube(kubeapi: FakeKubeApi) -> Iterator[KubeClient]:
    kubeapi.add_node("node1")
    client = KubeClient.from_config(kubeconfig=kubeapi.kubeconfig_path)
    yield client
    client.close()


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        body = exc.read().decode()
        exc.close()
        return exc.code, body


def test_probes_pass_while_both_sockets_answer_and_fail_when_one_does_not(
    tmp_path: Path, kube: KubeClient
) -> None:
    plugin = start_plugin(tmp_path, kube)
    probes = ProbeServer(
        SocketChecker(
            registration_socket=plugin.paths.registration,
            dra_socket=plugin.paths.dra,
            driver_name="gpu.nvidia.com",
        ),
        port=0,
        host="127.0.0.1",
    )
    probes.start()
    try:
        assert get(probes.port, "/healthz") == (200, "ok\n")
        assert get(probes.port, "/readyz") == (200, "ok\n")
        assert get(probes.port, "/other")[0] == 404
        plugin.stop()
        status, body = get(probes.port, "/healthz")
        assert status == 503 and "does not exist" in body
        plugin.paths.dra.touch()  # a file, but nobody serves it
        plugin.paths.registration.touch()
        status, body = get(probes.port, "/readyz")
        assert status == 503 and "GetInfo failed" in body and "NodePrepareResources failed" in body
    finally:
        probes.stop()
        plugin.stop()


def test_a_probe_port_in_use_is_a_clear_error_naming_the_flag(tmp_path: Path) -> None:
    checker = SocketChecker(
        registration_socket=tmp_path / "reg.sock",
        dra_socket=tmp_path / "dra.sock",
        driver_name="gpu.nvidia.com",
    )
    first = ProbeServer(checker, port=0, host="127.0.0.1")
    try:
        with pytest.raises(DraError, match=r"--healthcheck-port \(HEALTHCHECK_PORT\): .*in use"):
            ProbeServer(checker, port=first.port, host="127.0.0.1")
    finally:
        first.stop()


# -- liveness: the loops -----------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def test_a_loop_is_alive_while_waiting_and_stuck_when_one_pass_runs_too_long() -> None:
    clock = Clock()
    beat = Heartbeat("work", stall_s=30, clock=clock)
    assert beat.problem() is None  # not started yet: still starting, not dead
    with beat.running():
        clock.now_s += 3600  # waiting between passes, however long, is what loops do
        assert beat.problem() is None
        with beat.busy():
            clock.now_s += 29
            assert beat.problem() is None
            clock.now_s += 2
            assert beat.problem() == "loop work is stuck: no progress for 31 s (limit 30 s)"
            beat.beat()  # progress inside a long pass (a watch event)
            assert beat.problem() is None
            clock.now_s += 10
            assert beat.problem() is None
        assert beat.passes == 1
    assert beat.problem() is None  # ended normally: stopped


def test_a_loop_that_ended_by_an_exception_is_dead() -> None:
    beat = Heartbeat("work", stall_s=30)
    with pytest.raises(KeyboardInterrupt), beat.running(), beat.busy():
        raise KeyboardInterrupt
    assert beat.problem() == "loop work died: KeyboardInterrupt: "
    assert heartbeat_problems([Heartbeat("fine", stall_s=1), beat]) == [beat.problem()]


def probe_server(plugin: NodePlugin, **checks: Any) -> ProbeServer:
    probes = ProbeServer(
        SocketChecker(
            registration_socket=plugin.paths.registration,
            dra_socket=plugin.paths.dra,
            driver_name="gpu.nvidia.com",
        ),
        port=0,
        host="127.0.0.1",
        **checks,
    )
    probes.start()
    return probes


def test_a_stuck_reconcile_pass_fails_liveness_until_it_ends(
    tmp_path: Path, kube: KubeClient
) -> None:
    plugin = kubelet_plugin(
        config=make_config(tmp_path),
        inventory=inventory(),
        claims=kube,
        proc_root=tmp_path / "proc",
        boot_id_path=tmp_path / "boot_id",
        reconcile_interval_s=0.02,
    )
    plugin.start()
    assert plugin.state.repair is not None
    release = threading.Event()
    real = plugin.state.repair.reconcile

    def hanging() -> dict[str, int]:
        release.wait(10)
        return real()

    plugin.state.repair.reconcile = hanging  # type: ignore[method-assign]
    plugin.reconcile_heartbeat.stall_s = 0.2
    probes = probe_server(plugin, liveness=[lambda: heartbeat_problems(plugin.heartbeats)])
    try:
        deadline = time.monotonic() + 5
        while get(probes.port, "/healthz")[0] == 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        status, body = get(probes.port, "/healthz")
        assert status == 503 and body.startswith("loop reconcile is stuck: no progress for ")
        release.set()
        while get(probes.port, "/healthz")[0] != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert get(probes.port, "/healthz") == (200, "ok\n")
    finally:
        release.set()
        probes.stop()
        plugin.stop()


# -- readiness ---------------------------------------------------------------------------------


def notify(plugin: NodePlugin, *, registered: bool, error: str = "") -> None:
    with grpc.insecure_channel(f"unix://{plugin.paths.registration}") as channel:
        reg_grpc.RegistrationStub(channel).NotifyRegistrationStatus(
            reg.RegistrationStatus(plugin_registered=registered, error=error), timeout=5
        )


def test_ready_only_once_the_kubelet_registered_the_plugin(
    tmp_path: Path, kube: KubeClient
) -> None:
    plugin = start_plugin(tmp_path, kube)
    probes = probe_server(plugin, readiness=[plugin.readiness_problems])
    try:
        assert get(probes.port, "/healthz") == (200, "ok\n")  # alive, sockets answer
        assert get(probes.port, "/readyz") == (
            503,
            "kubelet has not registered the plugin yet (no NotifyRegistrationStatus)\n",
        )
        notify(plugin, registered=False, error="no known gRPC service")
        assert get(probes.port, "/readyz") == (
            503,
            "kubelet refused the plugin registration: no known gRPC service\n",
        )
        notify(plugin, registered=True)
        assert get(probes.port, "/readyz") == (200, "ok\n")
    finally:
        probes.stop()
        plugin.stop()


def test_readiness_lists_every_failing_condition_and_liveness_none_of_them(
    tmp_path: Path, kube: KubeClient
) -> None:
    plugin = start_plugin(tmp_path, kube)
    probes = probe_server(
        plugin,
        liveness=[lambda: []],
        readiness=[
            plugin.readiness_problems,
            lambda: ["ResourceSlices: not published yet"],
            lambda: ["NVML: the last discovery failed: GPU is lost"],
        ],
    )
    try:
        assert get(probes.port, "/healthz") == (200, "ok\n")
        status, body = get(probes.port, "/readyz")
        assert status == 503
        assert body.splitlines() == [
            "kubelet has not registered the plugin yet (no NotifyRegistrationStatus)",
            "ResourceSlices: not published yet",
            "NVML: the last discovery failed: GPU is lost",
        ]
        plugin.stop()  # a dead socket fails both, and readiness says so too
        status, body = get(probes.port, "/readyz")
        assert status == 503 and "does not exist" in body.splitlines()[0]
        assert get(probes.port, "/healthz")[0] == 503
    finally:
        probes.stop()
        plugin.stop()


def test_nvml_readiness_follows_the_last_discovery_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = Config(node_name="node1", simulate="l4:2")
    with ExitStack() as stack:
        discovery = Discovery(config, stack)
        assert len(discovery.discover().gpus) == 2
        assert discovery.readiness_problems() == []
        real = nvml.discover

        def lost(**kwargs: Any) -> Any:
            raise DiscoveryError("NVML cannot report the driver or the GPU count: GPU is lost")

        monkeypatch.setattr(nvml, "discover", lost)
        with pytest.raises(DiscoveryError):
            discovery.discover()
        assert discovery.readiness_problems() == [
            "NVML: the last discovery failed: "
            "NVML cannot report the driver or the GPU count: GPU is lost"
        ]
        monkeypatch.setattr(nvml, "discover", real)
        discovery.discover()
        assert discovery.readiness_problems() == []


def test_a_gpu_that_alone_fails_its_queries_does_not_make_the_agent_unready() -> None:
    with ExitStack() as stack:
        discovery = Discovery(Config(node_name="node1", simulate="l4:1,l4:1:fail"), stack)
        found = discovery.discover()
        assert len(found.gpus) == 1 and len(found.failures) == 1
        assert discovery.readiness_problems() == []
