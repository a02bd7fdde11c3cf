"""A real CDI consumer: podman (with runc) runs a busybox container with the CDI IDs a real
prepare returned over the gRPC socket, and we look inside the container.

Needs root, podman, runc and busybox-static (Debian: ``apt-get install podman runc
busybox-static``); skipped with the reason otherwise. podman reads specs only from /etc/cdi and
/var/run/cdi, so the spec goes to /var/run/cdi under a driver name unique to this test run (the
plugin only ever touches its own vendor's files there) and is removed by unprepare.
"""

from __future__ import annotations

import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from dra_driver import cdi
from dra_driver._proto.dra_v1 import api_pb2 as v1
from dra_driver._proto.dra_v1 import api_pb2_grpc as v1_grpc
from dra_driver.gpus import nvml
from dra_driver.kube import KubeClient
from dra_driver.node.wiring import kubelet_plugin
from dra_driver.sim.fakedriver import make_fake_driver, make_node, simulated_inventory
from dra_driver.sim.localapi import FakeKubeApi
from dra_driver.sim.nvml import simulated_nvml
from dra_driver.sim.profiles import DRIVER_VERSION
from tests.claimdata import allocated_claim
from tests.podman import (
    busybox_rootfs,
    containers_conf,
    missing,
    podman_node_config,
    run_busybox,
)
from tests.shareenforcer import RecordingEnforcer

pytestmark = [pytest.mark.podman, pytest.mark.skipif(bool(missing()), reason=missing() or "-")]


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="dra-podman-", dir="/tmp") as d:
        yield Path(d)


def test_container_gets_device_nodes_environment_and_driver_files(
    short_tmp: Path, kubeapi: FakeKubeApi
) -> None:
    driver = f"t{uuid.uuid4().hex[:8]}.gpu-dra.test"
    fake = make_fake_driver(short_tmp, gpu_minors=range(2))
    assert fake.real_nodes
    (short_tmp / "boot_id").write_text("boot-1\n")
    rootfs = busybox_rootfs(short_tmp / "rootfs")
    conf = containers_conf(short_tmp)

    kubeapi.add_node("node1")
    claim = kubeapi.add_claim(allocated_claim(name="podman", driver=driver, devices=["gpu-1"]))
    uid = claim["metadata"]["uid"]
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
    spec = Path("/var/run/cdi") / f"k8s.{driver}-claim_{uid}.json"
    try:
        ref = v1.Claim(namespace="default", name="podman", uid=uid)
        with grpc.insecure_channel(f"unix://{plugin.paths.dra}") as ch:
            stub = v1_grpc.DRAPluginStub(ch)
            answer = stub.NodePrepareResources(
                v1.NodePrepareResourcesRequest(claims=[ref]), timeout=10
            )
            entry = answer.claims[uid]
            assert entry.error == ""
            cdi_ids = [i for d in entry.devices for i in d.cdi_device_ids]
            assert cdi_ids == [f"k8s.{driver}/claim={uid}-gpu-1"]
            assert spec.exists()

            lib = cdi.CONTAINER_LIB_DIR
            script = (
                "for n in /dev/nvidia1 /dev/nvidiactl /dev/nvidia-uvm /dev/nvidia-uvm-tools; do "
                "[ -c $n ] && echo node-ok $n; done; "
                "[ -e /dev/nvidia0 ] || echo no-other-gpu; "
                'echo "env NVIDIA_VISIBLE_DEVICES=$NVIDIA_VISIBLE_DEVICES"; '
                f"cat {lib}/libcuda.so {lib}/libcuda.so.1 {lib}/libnvidia-ml.so.1 "
                f"{lib}/libnvidia-nvvm.so.4 {lib}/libnvidia-gpucomp.so.{DRIVER_VERSION}; "
                f"readlink {lib}/libcuda.so; readlink {lib}/libcuda.so.1; "
                f"[ -e {lib}/libnvcuvid.so.1 ] || echo no-video-libs; "
                "cat /etc/ld.so.conf.d/00-gpu-dra.conf | grep -v '^#'; "
                "[ -x /usr/bin/nvidia-smi ] && echo tool-ok; "
                f"touch {lib}/libcuda.so.{DRIVER_VERSION} 2>/dev/null || echo read-only-ok"
            )
            run = run_busybox(rootfs=rootfs, conf=conf, cdi_ids=cdi_ids, script=script)
            assert run.returncode == 0, run.stderr
            lines = run.stdout.splitlines()
            assert lines == [
                "node-ok /dev/nvidia1",
                "node-ok /dev/nvidiactl",
                "node-ok /dev/nvidia-uvm",
                "node-ok /dev/nvidia-uvm-tools",
                "no-other-gpu",
                "env NVIDIA_VISIBLE_DEVICES=void",
                f"libcuda {DRIVER_VERSION}",
                f"libcuda {DRIVER_VERSION}",
                f"libnvidia-ml {DRIVER_VERSION}",
                f"libnvidia-nvvm {DRIVER_VERSION}",
                f"libnvidia-gpucomp {DRIVER_VERSION}",
                "libcuda.so.1",  # the chain libcuda.so -> libcuda.so.1 -> the versioned file
                f"libcuda.so.{DRIVER_VERSION}",
                "no-video-libs",
                lib,
                "tool-ok",
                "read-only-ok",
            ]
            stub.NodeUnprepareResources(v1.NodeUnprepareResourcesRequest(claims=[ref]), timeout=10)
        assert not spec.exists()
    finally:
        plugin.stop()
        kube.close()
        spec.unlink(missing_ok=True)


def test_each_share_of_one_gpu_gets_its_own_mps_limit_in_the_container(
    short_tmp: Path, kubeapi: FakeKubeApi
) -> None:
    """Two claims holding shares of gpu-0 (KEP-5075), prepared over gRPC by a plugin with
    --consumable-shares and an injected enforcer: each container sees the GPU and its own limit."""
    driver = f"t{uuid.uuid4().hex[:8]}.gpu-dra.test"
    fake = make_fake_driver(short_tmp, gpu_minors=range(2))
    (short_tmp / "boot_id").write_text("boot-1\n")
    rootfs = busybox_rootfs(short_tmp / "rootfs")
    conf = containers_conf(short_tmp)
    kubeapi.add_node("node1")
    claims = []
    for name, memory in (("small", "10Gi"), ("large", "30Gi")):
        claim = allocated_claim(name=name, driver=driver, devices=["gpu-0"])
        result = claim["status"]["allocation"]["devices"]["results"][0]
        result["shareID"] = str(uuid.uuid4())
        result["consumedCapacity"] = {"memory": memory}
        claims.append(kubeapi.add_claim(claim))
    inventory = simulated_inventory("h100:2", node_name="node1")
    kube = KubeClient.from_config(kubeconfig=kubeapi.kubeconfig_path)
    plugin = kubelet_plugin(
        config=podman_node_config(
            short_tmp,
            driver=driver,
            driver_root=fake.root,
            consumable_shares="unlimited",
        ),
        inventory=inventory,
        claims=kube,
        proc_root=fake.proc_root,
        boot_id_path=short_tmp / "boot_id",
        share_enforcer=RecordingEnforcer(),
    )
    plugin.start()
    specs = [
        Path("/var/run/cdi") / f"k8s.{driver}-claim_{c['metadata']['uid']}.json" for c in claims
    ]
    try:
        refs = [
            v1.Claim(namespace="default", name=c["metadata"]["name"], uid=c["metadata"]["uid"])
            for c in claims
        ]
        with grpc.insecure_channel(f"unix://{plugin.paths.dra}") as ch:
            stub = v1_grpc.DRAPluginStub(ch)
            answer = stub.NodePrepareResources(
                v1.NodePrepareResourcesRequest(claims=refs), timeout=10
            )
            seen = []
            for claim in claims:
                entry = answer.claims[claim["metadata"]["uid"]]
                assert entry.error == ""
                (device,) = entry.devices
                share = claim["status"]["allocation"]["devices"]["results"][0]["shareID"]
                assert device.share_id == share
                (cdi_id,) = device.cdi_device_ids
                script = (
                    '[ -c /dev/nvidia0 ] && echo gpu-0; echo "$CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"'
                )
                run = run_busybox(rootfs=rootfs, conf=conf, cdi_ids=[cdi_id], script=script)
                assert run.returncode == 0, run.stderr
                seen.append(run.stdout.splitlines())
            gpu = inventory.gpus[0].uuid
            assert seen == [["gpu-0", f"{gpu}=10240M"], ["gpu-0", f"{gpu}=30720M"]]
            stub.NodeUnprepareResources(
                v1.NodeUnprepareResourcesRequest(claims=refs[:1]), timeout=10
            )
            assert not specs[0].exists() and specs[1].exists()
            stub.NodeUnprepareResources(
                v1.NodeUnprepareResourcesRequest(claims=refs[1:]), timeout=10
            )
        assert not specs[1].exists()
    finally:
        plugin.stop()
        kube.close()
        for spec in specs:
            spec.unlink(missing_ok=True)


def test_container_runs_on_a_mig_device_created_by_prepare(
    short_tmp: Path, kubeapi: FakeKubeApi
) -> None:
    """Dynamic MIG: prepare creates the instance (simulated NVML), the spec gives the container
    the parent GPU and the new instance's capability nodes; unprepare destroys it."""
    driver = f"t{uuid.uuid4().hex[:8]}.gpu-dra.test"
    fake = make_fake_driver(short_tmp, gpu_minors=range(2))
    assert fake.real_nodes
    # the capability nodes nvidia-modprobe makes for the MIG capabilities in the driver's table
    for line in (fake.proc_root / "driver/nvidia-caps/mig-minors").read_text().splitlines():
        make_node(fake.root / "dev/nvidia-caps" / f"nvidia-cap{line.split()[1]}")
    (short_tmp / "boot_id").write_text("boot-1\n")
    rootfs = busybox_rootfs(short_tmp / "rootfs")
    conf = containers_conf(short_tmp)
    device = "gpu-1-mig-3g20gb-9-4"  # A100 40GB: 3g.20gb (GI profile 9) at memory slice 4
    kubeapi.add_node("node1")
    claim = kubeapi.add_claim(allocated_claim(name="dynmig", driver=driver, devices=[device]))
    uid = claim["metadata"]["uid"]
    kube = KubeClient.from_config(kubeconfig=kubeapi.kubeconfig_path)
    config = podman_node_config(
        short_tmp,
        driver=driver,
        driver_root=fake.root,
        mig_mode="dynamic",
    )
    spec = Path("/var/run/cdi") / f"k8s.{driver}-claim_{uid}.json"
    with simulated_nvml(
        "a100-40gb:2:mig", node_name="node1", state_path=config.simulated_mig_state_path
    ) as node:
        plugin = kubelet_plugin(
            config=config,
            inventory=nvml.discover(driver_root=Path("/"), sysfs_root=node.sysfs_root),
            claims=kube,
            proc_root=fake.proc_root,
            boot_id_path=short_tmp / "boot_id",
        )
        plugin.start()
        try:
            ref = v1.Claim(namespace="default", name="dynmig", uid=uid)
            with grpc.insecure_channel(f"unix://{plugin.paths.dra}") as ch:
                stub = v1_grpc.DRAPluginStub(ch)
                answer = stub.NodePrepareResources(
                    v1.NodePrepareResourcesRequest(claims=[ref]), timeout=10
                )
                entry = answer.claims[uid]
                assert entry.error == ""
                (mig,) = (
                    nvml.discover(driver_root=Path("/"), sysfs_root=node.sysfs_root)
                    .gpus[1]
                    .mig_instances
                )
                assert (mig.placement.start, mig.profile.name) == (4, "3g.20gb")
                assert plugin.preparer is not None
                files = plugin.preparer.files
                gi = files.mig_cap_minor(f"gpu1/gi{mig.gpu_instance_id}/access")
                ci = files.mig_cap_minor(
                    f"gpu1/gi{mig.gpu_instance_id}/ci{mig.compute_instance_id}/access"
                )
                cdi_ids = [i for d in entry.devices for i in d.cdi_device_ids]
                script = (
                    f"for n in /dev/nvidia1 /dev/nvidia-caps/nvidia-cap{gi} "
                    f"/dev/nvidia-caps/nvidia-cap{ci}; do [ -c $n ] && echo node-ok $n; done; "
                    "ls /dev/nvidia-caps | wc -l; [ -e /dev/nvidia0 ] || echo no-other-gpu"
                )
                run = run_busybox(rootfs=rootfs, conf=conf, cdi_ids=cdi_ids, script=script)
                assert run.returncode == 0, run.stderr
                assert run.stdout.split("\n")[:-1] == [
                    "node-ok /dev/nvidia1",
                    f"node-ok /dev/nvidia-caps/nvidia-cap{gi}",
                    f"node-ok /dev/nvidia-caps/nvidia-cap{ci}",
                    "2",  # only this instance's capabilities
                    "no-other-gpu",
                ]
                stub.NodeUnprepareResources(
                    v1.NodeUnprepareResourcesRequest(claims=[ref]), timeout=10
                )
            assert not spec.exists()
            gpu1 = nvml.discover(driver_root=Path("/"), sysfs_root=node.sysfs_root).gpus[1]
            assert gpu1.mig_instances == ()
        finally:
            plugin.stop()
            kube.close()
            spec.unlink(missing_ok=True)
