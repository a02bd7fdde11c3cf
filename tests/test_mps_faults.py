"""MPS daemons and agent crashes: the plugin runs as a separate process (tests/plugin_process.py)
and is killed with SIGKILL at each step prepare and unprepare add for MPS; the next instance
must leave no orphan daemon, Deployment, mount, directory or compute-mode change, and must adopt
(never duplicate) the daemon of a prepared claim.

The daemons run as the stand-in kubelet (localkubelet.py, in this test process) runs the
Deployments the plugin creates through the local API server: outside the plugin's process tree,
so they outlive it as pods outlive the agent.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from dra_driver._proto.dra_v1 import api_pb2 as v1
from dra_driver._proto.dra_v1 import api_pb2_grpc as v1_grpc
from dra_driver.sim.fakedriver import (
    MPS_CONTROL_HANG,
    make_fake_driver,
    read_compute_modes,
    read_mps_control_calls,
    simulated_inventory,
)
from dra_driver.sim.localapi import FakeKubeApi
from dra_driver.sim.localkubelet import DeploymentKubelet
from tests.claimdata import allocated_claim, opaque
from tests.test_plugin_faults import (
    GPUS,
    PluginProcess,
    _kill_while_nvidia_smi_hangs,
    check_node,
    claim_ref,
)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs (root only)")

NAMESPACE = "gpu-dra"


class Node:
    def __init__(self, tmp: Path, api: FakeKubeApi, kubelet: DeploymentKubelet) -> None:
        self.tmp, self.api, self.kubelet = tmp, api, kubelet
        self.smi_dir = tmp / "driver-root/usr/bin"
        self.mps_base = tmp / "plugins/gpu.nvidia.com/mps"

    def mounts(self) -> list[str]:
        prefix = str(self.tmp) + "/"
        return [
            line.split(" ")[4]
            for line in Path("/proc/self/mountinfo").read_text().splitlines()
            if line.split(" ")[4].startswith(prefix)
        ]

    def deployments(self) -> list[str]:
        return [d["metadata"]["name"] for d in self.api.objects("deployments")]

    def assert_clean(self) -> None:
        """Nothing of any daemon is left, and every GPU is back in DEFAULT compute mode."""
        deadline = time.monotonic() + 10
        while self.kubelet.running():
            assert time.monotonic() < deadline, f"daemons left: {self.kubelet.running()}"
            time.sleep(0.02)
        assert self.deployments() == []
        assert self.mounts() == []
        assert not self.mps_base.exists() or list(self.mps_base.iterdir()) == []
        assert set(read_compute_modes(self.smi_dir).values()) <= {"DEFAULT"}


@pytest.fixture
def node(kubeapi: FakeKubeApi) -> Iterator[tuple[Node, PluginProcess]]:
    with tempfile.TemporaryDirectory(prefix="mpsf-", dir="/tmp") as d:
        tmp = Path(d)
        inventory = simulated_inventory(f"h100:{GPUS}", node_name="node1")
        fake = make_fake_driver(tmp, gpu_uuids=[g.uuid for g in inventory.gpus])
        (tmp / "boot_id").write_text("boot-1\n")
        assert kubeapi.kubeconfig_path is not None
        settings = {
            "simulate": f"h100:{GPUS}",
            "kubeconfig": str(kubeapi.kubeconfig_path),
            "driver_root": str(fake.root),
            "proc_root": str(fake.proc_root),
            "boot_id": str(tmp / "boot_id"),
            "registry": str(tmp / "registry"),
            "plugins": str(tmp / "plugins"),
            "cdi": str(tmp / "cdi"),
            "mps_image": "gpu-dra:test",
            "mps_start_timeout": "20",
            "namespace": NAMESPACE,
        }
        kubelet = DeploymentKubelet(kubeapi, node_name="node1", log_dir=tmp / "pods").start()
        process = PluginProcess(settings, tmp)
        state = Node(tmp, kubeapi, kubelet)
        try:
            yield state, process
        finally:
            process.close()
            kubelet.stop()
            for mount in reversed(state.mounts()):
                subprocess.run(["umount", "--lazy", mount], check=False)


def _call(process: PluginProcess, claim: dict[str, Any], *, unprepare: bool = False) -> Any:
    with grpc.insecure_channel(f"unix://{process.dra_socket}") as ch:
        stub = v1_grpc.DRAPluginStub(ch)
        if unprepare:
            return stub.NodeUnprepareResources(
                v1.NodeUnprepareResourcesRequest(claims=[claim_ref(claim)]), timeout=30
            )
        return stub.NodePrepareResources(
            v1.NodePrepareResourcesRequest(claims=[claim_ref(claim)]), timeout=30
        )


def _quietly(process: PluginProcess, claim: dict[str, Any], *, unprepare: bool = False) -> None:
    with contextlib.suppress(grpc.RpcError):
        _call(process, claim, unprepare=unprepare)


def _mps_claim(name: str, device: str) -> dict[str, Any]:
    parameters = {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "GpuConfig",
        "sharing": {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 30}},
    }
    return allocated_claim(name=name, devices=[device], configs=[opaque(parameters)])


def test_kill_9_at_each_mps_step_leaves_no_orphan_and_a_prepared_daemon_is_adopted(
    node: tuple[Node, PluginProcess], kubeapi: FakeKubeApi
) -> None:
    state, process = node
    uuid = simulated_inventory(f"h100:{GPUS}", node_name="node1").gpus[1].uuid
    claim = kubeapi.add_claim(_mps_claim("shared", "gpu-1"))
    uid = claim["metadata"]["uid"]
    deployment = (NAMESPACE, f"mps-{uid}")
    # 1. killed while nvidia-smi sets EXCLUSIVE_PROCESS (the record is PrepareStarted): the next
    # instance rolls the claim back and sets the GPU back to DEFAULT
    process.spawn()
    told = _kill_while_nvidia_smi_hangs(process, lambda: _quietly(process, claim), calls_before=0)
    assert told == f"-i {uuid} -c EXCLUSIVE_PROCESS"
    process.spawn()
    assert check_node(process.settings) == {}
    state.assert_clean()
    assert read_compute_modes(state.smi_dir) == {uuid: "DEFAULT"}

    # 2. killed while waiting for the daemon to answer (its Deployment created, its tmpfs
    # mounted, the daemon started but not listening): the rollback removes all of it
    (state.smi_dir / MPS_CONTROL_HANG).touch()
    caller = threading.Thread(target=_quietly, args=(process, claim))
    caller.start()
    deadline = time.monotonic() + 20
    while deployment not in state.kubelet.running() or not any(
        line.endswith(" start " + uuid) for line in read_mps_control_calls(state.smi_dir)
    ):
        assert time.monotonic() < deadline, "the daemon was not started"
        time.sleep(0.01)
    assert state.mounts() == [str(state.mps_base / uid / "shm")]
    process.kill()
    caller.join(30)
    (state.smi_dir / MPS_CONTROL_HANG).unlink()
    process.spawn()
    assert check_node(process.settings) == {}
    state.assert_clean()

    # 3. prepared, then the agent is killed: the next instance adopts the running daemon (same
    # process, no second Deployment) and asks it to answer again
    answer = _call(process, claim)
    assert answer.claims[uid].error == ""
    pid = state.kubelet.running()[deployment]
    starts = state.kubelet.starts[deployment]  # step 2's Deployment of the same name counts too
    creates = sum(1 for r in kubeapi.writes() if r.resource == "deployments" and r.verb == "create")
    process.kill()
    process.spawn()
    assert set(check_node(process.settings)) == {uid}
    assert state.kubelet.running() == {deployment: pid}
    assert state.kubelet.starts[deployment] == starts
    assert creates == sum(
        1 for r in kubeapi.writes() if r.resource == "deployments" and r.verb == "create"
    )
    pipe = str(state.mps_base / uid / "pipe")
    told_daemon = [c.split(" ", 1)[1] for c in read_mps_control_calls(state.smi_dir)
                   if c.startswith(pipe + " ")]  # fmt: skip
    assert told_daemon[-2:] == ["get_server_list", "set_default_active_thread_percentage 30"]
    assert read_compute_modes(state.smi_dir) == {uuid: "EXCLUSIVE_PROCESS"}
    assert _call(process, claim).claims[uid].error == ""  # answered from the record
    assert state.kubelet.starts[deployment] == starts

    # 4. killed during unprepare while nvidia-smi restores DEFAULT (the record is gone, the
    # daemon quit, its Deployment deleted): the next instance finishes the removal
    calls = len((state.smi_dir / "nvidia-smi.log").read_text().splitlines())
    told = _kill_while_nvidia_smi_hangs(
        process, lambda: _quietly(process, claim, unprepare=True), calls_before=calls
    )
    assert told == f"-i {uuid} -c DEFAULT"
    assert (state.mps_base / uid / "gpus").exists()  # the trace the next instance follows
    process.spawn()
    assert check_node(process.settings) == {}
    state.assert_clean()
    assert read_compute_modes(state.smi_dir) == {uuid: "DEFAULT"}
