"""The chart's agent, deployed as tests/test_deployed.py deploys it (the DaemonSet's command,
env and hostPath mounts in a Pod-like mount namespace), started on a node NVIDIA's driver
prepared a claim on: it adopts the claim (prepare/switchover.py), answers the kubelet's prepare
with NVIDIA's CDI IDs, removes NVIDIA's spec at the unprepare, and leaves nothing of its own at
the checkpoint path NVIDIA's plugin reads."""

from __future__ import annotations

from pathlib import Path

import grpc

from dra_driver._proto.dra_v1 import api_pb2 as v1
from dra_driver._proto.dra_v1 import api_pb2_grpc as v1_grpc
from dra_driver.prepare.state.checkpoint import read_state
from dra_driver.sim.localapi import FakeKubeApi
from tests.claimdata import allocated_claim
from tests.test_deployed import (  # noqa: F401 - the module's fixtures and skip marks
    NODE,
    Builds,
    builds,
    pytestmark,
    register,
    start_node,
    work,
)
from tests.test_switchover import nvidia_checkpoint, nvidia_spec

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def test_the_deployed_agent_adopts_a_claim_nvidias_driver_prepared(
    work: Path,  # noqa: F811
    builds: Builds,  # noqa: F811
) -> None:
    api = FakeKubeApi(tls_dir=work / "tls", token="agent-token").start()
    node = None
    try:
        api.add_node(NODE)
        claim = api.add_claim(allocated_claim(name="running", node=NODE, devices=["gpu-1"]))
        uid = claim["metadata"]["uid"]
        # what NVIDIA's driver left on the node: its checkpoint of this boot and the claim's spec
        plugin_dir = work / "k/plugins/gpu.nvidia.com"
        plugin_dir.mkdir(parents=True)
        checkpoint = nvidia_checkpoint([claim], boot_id=BOOT_ID.read_text().strip())
        (plugin_dir / "checkpoint.json").write_bytes(checkpoint)
        (work / "cdi").mkdir()
        spec = work / "cdi" / f"k8s.gpu.nvidia.com-claim_{uid}.yaml"
        spec.write_text(nvidia_spec(claim))
        node, _ = start_node(work, layout="host-multiarch", builds=builds, api=api)
        dra_socket = register(node)
        assert set(read_state(plugin_dir / "gpu-dra-checkpoint.json")[1]) == {uid}
        assert not (plugin_dir / "checkpoint.json").exists()
        assert list(plugin_dir.glob("checkpoint.json.nvidia-adopted-*"))
        ref = v1.Claim(namespace="default", name="running", uid=uid)
        with grpc.insecure_channel(f"unix://{dra_socket}") as channel:
            stub = v1_grpc.DRAPluginStub(channel)
            again = stub.NodePrepareResources(
                v1.NodePrepareResourcesRequest(claims=[ref]), timeout=30
            )
            entry = again.claims[uid]
            assert entry.error == "", node.log.read_text()
            assert [list(d.cdi_device_ids) for d in entry.devices] == [
                [f"k8s.gpu.nvidia.com/claim={uid}-gpu-1"]
            ]
            assert spec.exists() and not spec.with_suffix(".json").exists()
            undone = stub.NodeUnprepareResources(
                v1.NodeUnprepareResourcesRequest(claims=[ref]), timeout=30
            )
            assert undone.claims[uid].error == "", node.log.read_text()
        assert not spec.exists()
        assert node.stop() == 0, node.log.read_text()
        assert not (plugin_dir / "checkpoint.json").exists()  # NVIDIA's plugin starts clean
        assert "adopted the claims NVIDIA's DRA driver prepared" in node.log.read_text()
    finally:
        if node is not None:
            node.stop()
        api.stop()
