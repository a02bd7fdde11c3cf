"""The stand-in kubelet for Deployments (dra_driver/sim/localkubelet.py) against the local API
server: what the MPS tests rely on it for, checked on plain shell commands."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dra_driver.kube import KubeClient
from dra_driver.sim.localapi import FakeKubeApi
from dra_driver.sim.localkubelet import DeploymentKubelet, map_path, pod_command


def deployment(name: str, script: str, *, node: str = "n1", host: str = "/") -> dict[str, object]:
    return {
        "metadata": {"name": name, "namespace": "ns"},
        "spec": {
            "replicas": 1,
            "template": {
                "spec": {
                    "nodeName": node,
                    "containers": [
                        {
                            "name": "c",
                            "command": ["/bin/sh", "-c", script],
                            "env": [{"name": "OUT", "value": "/data/out"}],
                            "volumeMounts": [{"name": "data", "mountPath": "/data"}],
                        }
                    ],
                    "volumes": [{"name": "data", "hostPath": {"path": host}}],
                }
            },
        },
    }


def wait_for(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.fixture
def kubelet(kubeapi: FakeKubeApi, tmp_path: Path) -> Iterator[DeploymentKubelet]:
    running = DeploymentKubelet(kubeapi, node_name="n1", log_dir=tmp_path / "logs").start()
    yield running
    running.stop()


def test_paths_under_a_volume_are_mapped_to_its_host_path() -> None:
    mounts = {"/driver-root": "/run/nvidia/driver", "/mps": "/p/mps", "/mps/pipe": "/q"}
    assert map_path("/driver-root/usr/bin/x", mounts) == "/run/nvidia/driver/usr/bin/x"
    assert map_path("/mps/pipe", mounts) == "/q"  # the longest mount path wins
    assert map_path("/mps/log", mounts) == "/p/mps/log"
    assert map_path("/mpsx", mounts) == "/mpsx"
    argv, env = pod_command(deployment("d", "true", host="/h"))
    assert argv == ["/bin/sh", "-c", "true"] and env == {"OUT": "/h/out"}


def test_a_pod_runs_in_its_own_session_is_restarted_and_stopped_with_its_deployment(
    kubeapi: FakeKubeApi, kubelet: DeploymentKubelet, tmp_path: Path
) -> None:
    # another node's Deployment is not ours to run
    kubeapi.put("deployments", deployment("other", "sleep 60", node="n2"))
    kubeapi.put("deployments", deployment("d", 'echo $$ >> "$OUT"; exit 3', host=str(tmp_path)))
    out = tmp_path / "out"
    wait_for(lambda: out.exists() and len(out.read_text().split()) >= 2)  # exited, run again
    assert kubelet.starts[("ns", "d")] >= 2 and ("ns", "other") not in kubelet.starts
    sleeper = deployment("s", "sleep 60")
    kubeapi.put("deployments", sleeper)
    wait_for(lambda: ("ns", "s") in kubelet.running())
    pid = kubelet.running()[("ns", "s")]
    assert os.getsid(pid) == pid  # its own session: it does not die with whoever created it
    assert kubeapi.kubeconfig_path is not None
    client = KubeClient.from_config(kubeconfig=kubeapi.kubeconfig_path)
    try:
        assert client.delete_deployment(namespace="ns", name="s")
        assert not client.delete_deployment(namespace="ns", name="s")  # gone: False, no error
    finally:
        client.close()
    wait_for(lambda: gone(pid))
    assert ("ns", "s") not in kubelet.running()


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False
