"""A running pod's container started again, with podman (a real CDI consumer), through the
``.yaml`` spec NVIDIA's driver wrote for a claim gpu-dra adopted (prepare/switchover.py); the
adopted claim's unprepare removes that spec."""

from __future__ import annotations

import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from dra_driver._proto.dra_v1 import api_pb2 as v1
from dra_driver._proto.dra_v1 import api_pb2_grpc as v1_grpc
from dra_driver.kube import KubeClient
from dra_driver.node.wiring import kubelet_plugin
from dra_driver.prepare.state.checkpoint import read_state
from dra_driver.sim.fakedriver import make_fake_driver, simulated_inventory
from dra_driver.sim.localapi import FakeKubeApi
from tests.claimdata import allocated_claim
from tests.podman import (
    busybox_rootfs,
    containers_conf,
    missing,
    podman_node_config,
    run_busybox,
)
from tests.test_switchover import nvidia_checkpoint

pytestmark = [pytest.mark.podman, pytest.mark.skipif(bool(missing()), reason=missing() or "-")]

# NVIDIA's spec as its plugin writes it: YAML, kind k8s.<driver>/claim, <uid>-<device> names
NVIDIA_SPEC = """---
cdiVersion: 0.5.0
kind: {vendor}/claim
devices:
- name: {uid}-gpu-1
  containerEdits:
    env:
    - NVIDIA_VISIBLE_DEVICES=void
    - PREPARED_BY=nvidia-dra-driver-gpu
"""


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="dra-switch-", dir="/tmp") as d:
        yield Path(d)


def test_a_container_starts_again_through_the_adopted_spec_until_unprepare(
    short_tmp: Path, kubeapi: FakeKubeApi
) -> None:
    driver = f"t{uuid.uuid4().hex[:8]}.gpu-dra.test"
    vendor = f"k8s.{driver}"
    fake = make_fake_driver(short_tmp, gpu_minors=range(2))
    (short_tmp / "boot_id").write_text("boot-1\n")
    rootfs = busybox_rootfs(short_tmp / "rootfs")
    conf = containers_conf(short_tmp)
    kubeapi.add_node("node1")
    claim = kubeapi.add_claim(allocated_claim(name="running", driver=driver, devices=["gpu-1"]))
    uid = claim["metadata"]["uid"]
    plugin_dir = short_tmp / "plugins" / driver
    plugin_dir.mkdir(parents=True)
    (plugin_dir / "checkpoint.json").write_bytes(nvidia_checkpoint([claim], vendor=vendor))
    spec = Path("/var/run/cdi") / f"{vendor}-claim_{uid}.yaml"
    spec.parent.mkdir(parents=True, exist_ok=True)
    spec.write_text(NVIDIA_SPEC.format(vendor=vendor, uid=uid))
    cdi_id = f"{vendor}/claim={uid}-gpu-1"
    kube = KubeClient.from_config(kubeconfig=kubeapi.kubeconfig_path)
    plugin = kubelet_plugin(
        config=podman_node_config(
            short_tmp,
            driver=driver,
            driver_root=fake.root,
        ),
        inventory=simulated_inventory("h100:2", node_name="node1"),
        claims=kube,
        proc_root=fake.proc_root,
        boot_id_path=short_tmp / "boot_id",
    )
    plugin.start()
    try:
        assert set(read_state(plugin_dir / "gpu-dra-checkpoint.json")[1]) == {uid}
        assert not (plugin_dir / "checkpoint.json").exists()
        # the pod's container restarts: the runtime resolves the same ID through NVIDIA's spec
        run = run_busybox(rootfs=rootfs, conf=conf, cdi_ids=[cdi_id], script="echo $PREPARED_BY")
        assert run.returncode == 0, run.stderr
        assert run.stdout.split() == ["nvidia-dra-driver-gpu"]
        ref = v1.Claim(namespace="default", name="running", uid=uid)
        with grpc.insecure_channel(f"unix://{plugin.paths.dra}") as ch:
            stub = v1_grpc.DRAPluginStub(ch)
            again = stub.NodePrepareResources(
                v1.NodePrepareResourcesRequest(claims=[ref]), timeout=10
            )
            assert [list(d.cdi_device_ids) for d in again.claims[uid].devices] == [[cdi_id]]
            assert spec.exists()
            stub.NodeUnprepareResources(v1.NodeUnprepareResourcesRequest(claims=[ref]), timeout=10)
        assert not spec.exists()
        gone = run_busybox(rootfs=rootfs, conf=conf, cdi_ids=[cdi_id], script="true")
        assert gone.returncode != 0  # no spec names the device any more
    finally:
        plugin.stop()
        kube.close()
        spec.unlink(missing_ok=True)
        plugin.specs.path_for(uid).unlink(missing_ok=True)
