"""A real CDI consumer of an MPS claim: podman (with runc) runs a busybox container with the CDI
IDs a real prepare returned over the gRPC socket, and the container sees what makes it a client
of the claim's MPS control daemon: CUDA_MPS_PIPE_DIRECTORY, the daemon's control socket in the
pipe directory, and the daemon's tmpfs as /dev/shm (a file written there shows up on the host).

The daemon runs as the cluster would run it: the plugin creates its Deployment through the local
API server and the stand-in kubelet (localkubelet.py) runs the fake driver root's
nvidia-cuda-mps-control -f. Needs what tests/test_cdi_podman.py needs; skipped otherwise.
"""

from __future__ import annotations

import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from dra_driver._proto.dra_v1 import api_pb2 as v1
from dra_driver._proto.dra_v1 import api_pb2_grpc as v1_grpc
from dra_driver.kube import KubeClient
from dra_driver.node.config import Config
from dra_driver.node.wiring import kubelet_plugin
from dra_driver.sim.fakedriver import make_fake_driver, simulated_inventory
from dra_driver.sim.localapi import FakeKubeApi
from dra_driver.sim.localkubelet import DeploymentKubelet
from tests.claimdata import allocated_claim, opaque
from tests.podman import busybox_rootfs, containers_conf, missing, run_busybox

pytestmark = [pytest.mark.podman, pytest.mark.skipif(bool(missing()), reason=missing() or "-")]


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="dra-mps-", dir="/tmp") as d:
        yield Path(d)


def test_a_shared_claims_container_sees_the_mps_env_and_mounts(
    short_tmp: Path, kubeapi: FakeKubeApi
) -> None:
    driver = f"t{uuid.uuid4().hex[:8]}.gpu.test"
    inventory = simulated_inventory("h100:2", node_name="node1")
    fake = make_fake_driver(
        short_tmp, gpu_minors=range(2), gpu_uuids=[g.uuid for g in inventory.gpus]
    )
    (short_tmp / "boot_id").write_text("boot-1\n")
    rootfs = busybox_rootfs(short_tmp / "rootfs")
    conf = containers_conf(short_tmp)

    kubeapi.add_node("node1")
    parameters = {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "GpuConfig",
        "sharing": {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 50}},
    }
    claim = kubeapi.add_claim(
        allocated_claim(name="mps", driver=driver, devices=["gpu-1"], configs=[
            opaque(parameters, driver=driver)])
    )  # fmt: skip
    uid = claim["metadata"]["uid"]
    kube = KubeClient.from_config(kubeconfig=kubeapi.kubeconfig_path)
    kubelet = DeploymentKubelet(kubeapi, node_name="node1", log_dir=short_tmp / "pods").start()
    plugins = short_tmp / "p"
    plugin = kubelet_plugin(
        config=Config(
            node_name="node1",
            driver_name=driver,
            nvidia_driver_root=fake.root,
            kubelet_registrar_directory_path=short_tmp / "registry",
            kubelet_plugins_directory_path=plugins,
            cdi_root=Path("/var/run/cdi"),
            mps_image="gpu-dra:test",
            mps_start_timeout_s=20,
            pod_namespace="gpu-dra",
        ),
        inventory=inventory,
        claims=kube,
        deployments=kube,
        proc_root=fake.proc_root,
        boot_id_path=short_tmp / "boot_id",
    )
    plugin.start()
    spec = Path("/var/run/cdi") / f"k8s.{driver}-claim_{uid}.json"
    daemon_dir = plugins / driver / "mps" / uid
    try:
        ref = v1.Claim(namespace="default", name="mps", uid=uid)
        with grpc.insecure_channel(f"unix://{plugin.paths.dra}") as ch:
            stub = v1_grpc.DRAPluginStub(ch)
            answer = stub.NodePrepareResources(
                v1.NodePrepareResourcesRequest(claims=[ref]), timeout=30
            )
            entry = answer.claims[uid]
            assert entry.error == ""
            cdi_ids = [i for d in entry.devices for i in d.cdi_device_ids]
            assert cdi_ids == [f"k8s.{driver}/claim={uid}-gpu-1"]
            assert ("gpu-dra", f"mps-{uid}") in kubelet.running()

            script = (
                '[ -c /dev/nvidia1 ] && echo node-ok; '
                'echo "env $CUDA_MPS_PIPE_DIRECTORY"; '
                "[ -S /tmp/nvidia-mps/control ] && echo control-socket-ok; "
                "grep ' /dev/shm ' /proc/mounts | cut -d' ' -f3; "
                "echo from-container > /dev/shm/hello && echo shm-writable"
            )  # fmt: skip
            run = run_busybox(rootfs=rootfs, conf=conf, cdi_ids=cdi_ids, script=script)
            assert run.returncode == 0, run.stderr
            assert run.stdout.splitlines() == [
                "node-ok",
                "env /tmp/nvidia-mps",
                "control-socket-ok",
                "tmpfs",
                "shm-writable",
            ]
            # the container's /dev/shm is the daemon's tmpfs on the host
            assert (daemon_dir / "shm/hello").read_text() == "from-container\n"
            stub.NodeUnprepareResources(v1.NodeUnprepareResourcesRequest(claims=[ref]), timeout=30)
        assert not spec.exists()
        assert not daemon_dir.exists()
        assert kubeapi.objects("deployments") == []
    finally:
        plugin.stop()
        kubelet.stop()
        kube.close()
        spec.unlink(missing_ok=True)
        if (daemon_dir / "shm").is_mount():
            subprocess.run(["umount", "--lazy", str(daemon_dir / "shm")], check=False)
