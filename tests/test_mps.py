"""MPS sharing end to end below gRPC: prepare.Preparer with real MPS daemons.

The daemons run as the cluster would run them: prepare creates a Deployment through the real
Kubernetes client against the local API server (sim/localapi/), the stand-in kubelet
(localkubelet.py) runs its pod's command (the fake driver root's stand-in
nvidia-cuda-mps-control -f) as a process of its own session, and the agent talks to it through
its pipe directory with the stand-in client. Compute mode is set by the stand-in nvidia-smi, and
the shm tmpfs is a real mount (root). Claims come from an in-memory ClaimSource.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import pytest

from dra_driver import cdi
from dra_driver.errors import ConfigDecodeError, ConfigNotSupported, DeviceConflict, MpsFailed
from dra_driver.gpus.info import Inventory
from dra_driver.kube import KubeClient
from dra_driver.node.wiring import prepare_steps
from dra_driver.prepare import ClaimRef, Preparer, device_targets
from dra_driver.prepare.repair import Repair
from dra_driver.prepare.state.checkpoint import PREPARE_COMPLETED
from dra_driver.sharing import mps
from dra_driver.sharing.mpsdaemon import MpsDaemons
from dra_driver.sharing.shares import DISABLED, SharesMode
from dra_driver.sharing.timeslice import NvidiaSmi
from dra_driver.sim.demo import DEMO_SIMULATE
from dra_driver.sim.fakedriver import (
    MPS_CONTROL_FAIL,
    MPS_CONTROL_HANG,
    FakeDriver,
    make_fake_driver,
    simulated_inventory,
)
from dra_driver.sim.localapi import FakeKubeApi
from dra_driver.sim.localkubelet import DeploymentKubelet
from tests.claimdata import ClaimStore, allocated_claim, opaque
from tests.nodestorage import open_node_storage

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs (root only)")

VENDOR = "k8s.gpu.nvidia.com"
SPEC = DEMO_SIMULATE  # the examples' node: tests/test_examples.py prepares them here
MIG_3G = "gpu-4-mig-3g40gb-9-4"
NAMESPACE = "gpu-dra"
API = "resource.nvidia.com/v1beta1"


def mps_config(kind: str = "GpuConfig", **limits: Any) -> dict[str, Any]:
    sharing: dict[str, Any] = {"strategy": "MPS"}
    if limits:
        sharing["mpsConfig"] = limits
    return opaque({"apiVersion": API, "kind": kind, "sharing": sharing})


def mounts_under(path: Path) -> list[str]:
    prefix = str(path) + "/"
    return [
        line.split(" ")[4]
        for line in Path("/proc/self/mountinfo").read_text().splitlines()
        if line.split(" ")[4].startswith(prefix)
    ]


@dataclass
class Env:
    tmp: Path
    fake: FakeDriver
    inventory: Inventory
    api: FakeKubeApi
    kube: KubeClient
    kubelet: DeploymentKubelet
    store: ClaimStore
    preparers: list[Preparer]
    start_timeout_s: float = 10.0
    consumable_shares: SharesMode = DISABLED
    without_mps: bool = False  # the next restart() builds no MPS daemons (no --mps-image)
    daemons: MpsDaemons | None = None  # the last restart()'s

    @property
    def preparer(self) -> Preparer:
        return self.preparers[-1]

    @property
    def mps_base(self) -> Path:
        return self.tmp / "plugin/mps"

    def restart(self) -> Preparer:
        """A new Preparer over the same files: the agent restarted (the old one is dropped
        without any cleanup, as a killed agent does none)."""
        files = cdi.find_driver_files(
            driver_root=self.fake.root,
            driver_version=self.inventory.gpus[0].driver_version,
            proc_root=self.fake.proc_root,
        )
        specs, checkpoint, locks = open_node_storage(
            self.tmp, vendor=VENDOR, boot_id_path=self.tmp / "boot"
        )
        daemons = MpsDaemons(
            api=self.kube,
            namespace=NAMESPACE,
            node_name="node1",
            driver_name="gpu.nvidia.com",
            image="gpu-dra:test",
            base=self.mps_base,
            driver_root=self.fake.root,
            host_driver_root=self.fake.root,
            smi=NvidiaSmi(self.fake.root, timeout_s=5),
            start_timeout_s=self.start_timeout_s,
        )
        preparer = Preparer(
            driver_name="gpu.nvidia.com",
            node_name="node1",
            cdi_vendor=VENDOR,
            targets=device_targets(self.inventory),
            files=files,
            specs=specs,
            checkpoint=checkpoint,
            locks=locks,
            claims=self.store,
            steps=prepare_steps(
                timeslicer=NvidiaSmi(self.fake.root, timeout_s=5),
                mps_daemons=None if self.without_mps else daemons,
                consumable_shares=self.consumable_shares,
            ),
        )
        self.daemons = daemons
        self.preparers.append(preparer)
        return preparer

    def ref(self, claim: dict[str, Any]) -> ClaimRef:
        meta = claim["metadata"]
        return ClaimRef(namespace=meta["namespace"], name=meta["name"], uid=meta["uid"])

    def uuid(self, device: str) -> str:
        target = self.preparer.targets[device]
        return target.mig.uuid if target.mig is not None else target.gpu.uuid

    def deployments(self) -> list[str]:
        return [d["metadata"]["name"] for d in self.api.objects("deployments")]

    def daemon_calls(self, uid: str) -> list[str]:
        """What the daemon of claim ``uid`` was told (pipe directory prefix removed)."""
        prefix = f"{self.mps_base / uid / 'pipe'} "
        return [c[len(prefix) :] for c in self.fake.mps_control_calls() if c.startswith(prefix)]

    def wait_no_process(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.kubelet.running():
            assert time.monotonic() < deadline, f"daemons still running: {self.kubelet.running()}"
            time.sleep(0.02)

    def assert_nothing_left(self) -> None:
        """No daemon, Deployment, mount, directory or exclusive compute mode is left."""
        self.wait_no_process()
        assert self.deployments() == []
        assert mounts_under(self.tmp) == []
        assert not self.mps_base.exists() or list(self.mps_base.iterdir()) == []
        assert set(self.fake.compute_modes().values()) <= {"DEFAULT"}


@pytest.fixture
def env() -> Iterator[Env]:
    with mps_node() as e:
        yield e


@contextlib.contextmanager
def mps_node(spec: str = SPEC) -> Iterator[Env]:
    """A node with the GPUs of ``spec`` and MPS daemons that run: fake driver root, local API
    server, stand-in kubelet, and a Preparer (``Env.restart`` makes another, as a restarted
    agent)."""
    # a short path: a Unix socket's path has at most 107 bytes
    with tempfile.TemporaryDirectory(prefix="mps-", dir="/tmp") as d:
        tmp = Path(d)
        inventory = simulated_inventory(spec, node_name="node1")
        fake = make_fake_driver(tmp, gpu_uuids=[g.uuid for g in inventory.gpus])
        (tmp / "boot").write_text("boot-1\n")
        api = FakeKubeApi().start()
        kube = KubeClient.from_config(kubeconfig=api.write_kubeconfig(tmp / "kubeconfig"))
        kubelet = DeploymentKubelet(api, node_name="node1", log_dir=tmp / "pods").start()
        e = Env(tmp, fake, inventory, api, kube, kubelet, ClaimStore(), [])
        e.restart()
        try:
            yield e
        finally:
            for preparer in e.preparers:
                preparer.close()
            kubelet.stop()
            for mount in reversed(mounts_under(tmp)):
                subprocess.run(["umount", "--lazy", mount], check=False)
            kube.close()
            api.stop()


# -- pure parts ---------------------------------------------------------------------------------

GPU = mps.MpsDevice(uuid="GPU-a", memory_bytes=80 * 2**30, exclusive_gpu="GPU-a")
GPU_B = mps.MpsDevice(uuid="GPU-b", memory_bytes=40 * 2**30, exclusive_gpu="GPU-b")


def test_limits_apply_the_default_then_per_device_keys_by_uuid_or_index() -> None:
    limits = mps.limits(
        {
            "defaultActiveThreadPercentage": 50,
            "defaultPinnedDeviceMemoryLimit": "10Gi",
            "defaultPerDevicePinnedMemoryLimit": {"1": "512Mi", "GPU-a": "20Gi"},
        },
        [GPU, GPU_B],
    )
    assert limits.commands() == [
        "set_default_active_thread_percentage 50",
        "set_default_device_pinned_mem_limit GPU-a 20480M",
        "set_default_device_pinned_mem_limit GPU-b 512M",
    ]
    assert mps.limits({}, [GPU]).commands() == []


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"defaultActiveThreadPercentage": 0},
            "defaultActiveThreadPercentage: 0 is outside 1..100",
        ),
        ({"defaultActiveThreadPercentage": 101}, "101 is outside 1..100"),
        (
            {"defaultPinnedDeviceMemoryLimit": "41Gi"},
            "the pinned memory limit 41984Mi of device GPU-b is above its memory (40960Mi)",
        ),
        (
            {"defaultPerDevicePinnedMemoryLimit": {"2": "1Gi"}},
            "defaultPerDevicePinnedMemoryLimit[2]: names no device of the claim (use a device "
            "UUID, GPU-a, GPU-b, or an index 0..1)",
        ),
        (
            {"defaultPerDevicePinnedMemoryLimit": {"GPU-x": "1Gi"}},
            "defaultPerDevicePinnedMemoryLimit[GPU-x]: names no device of the claim",
        ),
        ({"defaultPinnedDeviceMemoryLimit": "100Ki"}, "100Ki is below the smallest MPS limit"),
    ],
)
def test_limits_refuse_what_does_not_fit_naming_the_field(
    config: dict[str, Any], message: str
) -> None:
    with pytest.raises(mps.MpsConfigError) as info:
        mps.limits(config, [GPU, GPU_B])
    assert message in str(info.value)


def test_deployment_runs_the_driver_roots_control_daemon_pinned_to_the_node() -> None:
    daemon = mps.MpsDaemon(owner="abc", devices=(GPU, GPU_B), base=Path("/plugins/d/mps"))
    body = mps.deployment(
        daemon,
        namespace="ns",
        node_name="n1",
        driver_name="gpu.nvidia.com",
        image="img:1",
        host_driver_root=Path("/run/nvidia/driver"),
        control=PurePosixPath("usr/bin/nvidia-cuda-mps-control"),
    )
    pod = body["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert body["metadata"]["name"] == "mps-abc"
    assert body["metadata"]["labels"]["gpu.nvidia.com/mps-owner"] == "abc"
    assert pod["nodeName"] == "n1"
    assert container["image"] == "img:1"
    assert container["command"] == ["/driver-root/usr/bin/nvidia-cuda-mps-control", "-f"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-a,GPU-b"
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/mps/pipe"
    volumes = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert {mounts[n]: volumes[n] for n in volumes} == {
        "/driver-root": "/run/nvidia/driver",
        "/mps/pipe": "/plugins/d/mps/abc/pipe",
        "/mps/log": "/plugins/d/mps/abc/log",
        "/dev/shm": "/plugins/d/mps/abc/shm",
    }
    assert mps.deployment_owner(body, "gpu.nvidia.com") == "abc"
    assert mps.adoptable(body, body)
    # a daemon an older agent started (another image) is adopted after an upgrade
    upgraded = mps.deployment(
        daemon, namespace="ns", node_name="n1", driver_name="gpu.nvidia.com", image="img:2",
        host_driver_root=Path("/run/nvidia/driver"),
        control=PurePosixPath("usr/bin/nvidia-cuda-mps-control"),
    )  # fmt: skip
    assert mps.adoptable(body, upgraded)
    assert "imagePullSecrets" not in pod and "imagePullPolicy" not in container
    private = mps.deployment(
        daemon, namespace="ns", node_name="n1", driver_name="gpu.nvidia.com", image="img:1",
        host_driver_root=Path("/run/nvidia/driver"),
        control=PurePosixPath("usr/bin/nvidia-cuda-mps-control"),
        image_pull_secrets=("regcred",), image_pull_policy="Always",
    )  # fmt: skip
    private_pod = private["spec"]["template"]["spec"]
    assert private_pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert private_pod["containers"][0]["imagePullPolicy"] == "Always"
    assert mps.adoptable(body, private)  # pulling differently serves the same daemon
    other = mps.MpsDaemon(owner="abc", devices=(GPU,), base=Path("/plugins/d/mps"))
    assert not mps.adoptable(
        mps.deployment(other, namespace="ns", node_name="n1", driver_name="gpu.nvidia.com",
                       image="img:2", host_driver_root=Path("/run/nvidia/driver"),
                       control=PurePosixPath("usr/bin/nvidia-cuda-mps-control")),
        body,
    )  # fmt: skip


# -- prepare and unprepare --------------------------------------------------------------------


def test_prepare_starts_a_daemon_the_claims_containers_are_clients_of(env: Env) -> None:
    claim = env.store.add(
        allocated_claim(
            name="shared",
            devices=["gpu-0", "gpu-1"],
            configs=[
                mps_config(
                    defaultActiveThreadPercentage=25,
                    defaultPinnedDeviceMemoryLimit="8Gi",
                    defaultPerDevicePinnedMemoryLimit={"1": "4Gi"},
                )
            ],
        )
    )
    uid = claim["metadata"]["uid"]
    gpu0, gpu1 = env.uuid("gpu-0"), env.uuid("gpu-1")
    env.preparer.prepare(env.ref(claim))
    # one Deployment, its daemon running, told its limits after it answered
    assert env.deployments() == [f"mps-{uid}"]
    assert list(env.kubelet.running()) == [(NAMESPACE, f"mps-{uid}")]
    assert env.daemon_calls(uid) == [
        f"start {gpu0},{gpu1}",
        "get_server_list",
        "set_default_active_thread_percentage 25",
        f"set_default_device_pinned_mem_limit {gpu0} 8192M",
        f"set_default_device_pinned_mem_limit {gpu1} 4096M",
    ]
    assert env.fake.compute_modes() == {gpu0: "EXCLUSIVE_PROCESS", gpu1: "EXCLUSIVE_PROCESS"}
    assert mounts_under(env.tmp) == [str(env.mps_base / uid / "shm")]
    # the spec makes each device's container a client: the pipe directory, /dev/shm, the env
    spec = json.loads(env.preparer.specs.path_for(uid).read_bytes())
    for device in spec["devices"]:
        edits = device["containerEdits"]
        assert edits["env"] == ["CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps"]
        assert edits["mounts"] == [
            {"hostPath": str(env.mps_base / uid / "pipe"), "containerPath": "/tmp/nvidia-mps",
             "options": ["rw", "nosuid", "nodev", "rbind"]},
            {"hostPath": str(env.mps_base / uid / "shm"), "containerPath": "/dev/shm",
             "options": ["rw", "nosuid", "nodev", "rbind"]},
        ]  # fmt: skip
    # the client reaches the daemon through the pipe directory the spec mounts
    client = subprocess.run(
        [str(env.fake.root / "usr/bin/nvidia-cuda-mps-control")],
        input="get_default_active_thread_percentage\n",
        env={**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(env.mps_base / uid / "pipe")},
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert client.stdout == "25.0\n"
    record = env.preparer.checkpoint.get(uid)
    assert record is not None and record.phase == PREPARE_COMPLETED
    # unprepare: quit, Deployment deleted, tmpfs unmounted, directories gone, compute mode back
    env.preparer.unprepare(env.ref(claim))
    assert env.daemon_calls(uid)[-2:] == ["quit", "exit 0"]
    env.assert_nothing_left()
    assert env.fake.compute_modes() == {gpu0: "DEFAULT", gpu1: "DEFAULT"}


def test_a_mig_device_is_shared_by_mps_without_changing_its_gpus_compute_mode(env: Env) -> None:
    claim = env.store.add(
        allocated_claim(
            name="mig",
            devices=[MIG_3G],
            configs=[mps_config("MigDeviceConfig", defaultPinnedDeviceMemoryLimit="10Gi")],
        )
    )
    uid = claim["metadata"]["uid"]
    mig = env.uuid(MIG_3G)
    assert mig.startswith("MIG-")
    env.preparer.prepare(env.ref(claim))
    assert env.daemon_calls(uid)[0] == f"start {mig}"
    assert env.daemon_calls(uid)[-1] == f"set_default_device_pinned_mem_limit {mig} 10240M"
    assert env.fake.compute_modes() == {}  # the parent GPU's other MIG devices are not ours
    env.preparer.unprepare(env.ref(claim))
    env.assert_nothing_left()


@pytest.mark.parametrize(
    ("configs", "error", "message"),
    [
        (
            [mps_config(defaultPinnedDeviceMemoryLimit="100Gi")],
            ConfigDecodeError,
            "is above its memory (81559Mi)",
        ),
        (
            [mps_config(defaultPerDevicePinnedMemoryLimit={"3": "1Gi"})],
            ConfigDecodeError,
            "defaultPerDevicePinnedMemoryLimit[3]: names no device of the claim",
        ),
        (
            [mps_config(defaultActiveThreadPercentage=0)],
            ConfigNotSupported,
            "mpsConfig.defaultActiveThreadPercentage 0 is refused: NVIDIA's driver passes 0 to "
            "the MPS control daemon",
        ),
        (
            [mps_config(defaultActiveThreadPercentage=101)],
            ConfigDecodeError,
            "defaultActiveThreadPercentage: Input should be less than or equal to 100",
        ),
        (
            [opaque({"apiVersion": API, "kind": "GpuConfig", "sharing": {"strategy": "MPS",
                     "mpsConfig": {"threads": 3}}})],
            ConfigDecodeError,
            "sharing.mpsConfig.threads: Extra inputs are not permitted",
        ),
        (
            [mps_config("MigDeviceConfig")],
            ConfigDecodeError,
            "MigDeviceConfig does not apply to it (use GpuConfig)",
        ),
    ],
)  # fmt: skip
def test_bad_mps_configs_are_refused_with_nothing_started(
    env: Env, configs: list[dict[str, Any]], error: type[Exception], message: str
) -> None:
    claim = env.store.add(allocated_claim(name="bad", configs=configs))
    with pytest.raises(error) as info:
        env.preparer.prepare(env.ref(claim))
    assert message in str(info.value)
    assert str(info.value).startswith("ResourceClaim default/bad")
    assert env.deployments() == [] and env.fake.compute_modes() == {}
    assert env.preparer.checkpoint.get(claim["metadata"]["uid"]) is None


def test_mps_and_time_slicing_of_one_gpu_by_two_claims_is_refused(env: Env) -> None:
    shared = env.store.add(allocated_claim(name="mps", configs=[mps_config()]))
    env.preparer.prepare(env.ref(shared))
    sliced = env.store.add(
        allocated_claim(
            name="sliced",
            configs=[opaque({"apiVersion": API, "kind": "GpuConfig",
                             "sharing": {"strategy": "TimeSlicing"}})],
            extra_results=[],
        )
    )  # fmt: skip
    # adminAccess: the only way a second claim can have an exclusively allocated GPU
    sliced["status"]["allocation"]["devices"]["results"][0]["adminAccess"] = True
    with pytest.raises(DeviceConflict) as info:
        env.preparer.prepare(env.ref(sliced))
    assert "device gpu-0 is prepared for claim default/mps" in str(info.value)
    assert "with sharing strategy MPS; this claim asks for TimeSlicing" in str(info.value)
    # and MPS with admin access is refused outright
    watcher = env.store.add(
        allocated_claim(name="watch", devices=["gpu-1"], configs=[mps_config()])
    )
    watcher["status"]["allocation"]["devices"]["results"][0]["adminAccess"] = True
    with pytest.raises(ConfigNotSupported, match="refused with admin access"):
        env.preparer.prepare(env.ref(watcher))
    assert env.deployments() == [f"mps-{shared['metadata']['uid']}"]


def test_an_agent_without_an_mps_image_refuses_mps_naming_the_flag(env: Env) -> None:
    env.without_mps = True  # as the plugin builds it without --mps-image
    preparer = env.restart()
    claim = env.store.add(allocated_claim(name="c", configs=[mps_config()]))
    with pytest.raises(ConfigNotSupported, match=r"started without --mps-image \(MPS_IMAGE\)"):
        preparer.prepare(env.ref(claim))


# -- restarts ---------------------------------------------------------------------------------


def test_a_restarted_agent_adopts_the_running_daemon_instead_of_starting_another(env: Env) -> None:
    claim = env.store.add(
        allocated_claim(name="c", configs=[mps_config(defaultActiveThreadPercentage=40)])
    )
    uid = claim["metadata"]["uid"]
    env.preparer.prepare(env.ref(claim))
    pid = env.kubelet.running()[(NAMESPACE, f"mps-{uid}")]
    creates = [r for r in env.api.writes() if r.resource == "deployments"]
    assert [r.verb for r in creates] == ["create"]
    # the agent dies (no cleanup) and a new one starts: its first reconcile adopts the daemon
    restarted = env.restart()
    done = Repair(restarted).reconcile()
    assert done["mps_daemons_adopted"] == 1 and done["mps_daemons_removed"] == 0
    assert env.kubelet.running() == {(NAMESPACE, f"mps-{uid}"): pid}  # the same process
    assert env.kubelet.starts[(NAMESPACE, f"mps-{uid}")] == 1
    assert [r.verb for r in env.api.writes() if r.resource == "deployments"] == ["create"]
    # asked to answer and told its limits again
    assert env.daemon_calls(uid)[-2:] == [
        "get_server_list",
        "set_default_active_thread_percentage 40",
    ]
    # a second pass leaves a daemon with a Deployment alone
    calls = len(env.daemon_calls(uid))
    assert Repair(restarted).reconcile()["mps_daemons_adopted"] == 0
    assert len(env.daemon_calls(uid)) == calls
    # preparing the claim again (the kubelet does after a restart) is answered from the record
    restarted.prepare(env.ref(claim))
    assert env.kubelet.starts[(NAMESPACE, f"mps-{uid}")] == 1
    # a Deployment deleted behind the agent's back is created again at the next pass
    env.kube.delete_deployment(namespace=NAMESPACE, name=f"mps-{uid}")
    assert Repair(restarted).reconcile()["mps_daemons_adopted"] == 1
    assert env.deployments() == [f"mps-{uid}"]
    restarted.unprepare(env.ref(claim))
    env.assert_nothing_left()


def test_reconcile_removes_a_daemon_no_recorded_claim_owns(env: Env) -> None:
    claim = env.store.add(allocated_claim(name="c", devices=["gpu-2"], configs=[mps_config()]))
    uid = claim["metadata"]["uid"]
    env.preparer.prepare(env.ref(claim))
    # the record goes (an unprepare killed before it stopped the daemon)
    env.preparer.checkpoint.transact(lambda claims: claims.discard(uid))
    # not ours: another app's Deployment and a stray file under the MPS directory stay
    env.api.put("deployments", {"metadata": {"name": "other", "namespace": NAMESPACE,
                "labels": {"app": "x"}}, "spec": {"template": {"spec": {}}}})  # fmt: skip
    (env.mps_base / "README").write_text("not an owner\n")
    done = Repair(env.restart()).reconcile()
    assert done["mps_daemons_removed"] == 1
    env.wait_no_process()
    assert env.deployments() == ["other"]
    assert mounts_under(env.tmp) == []
    assert sorted(p.name for p in env.mps_base.iterdir()) == ["README"]
    assert env.fake.compute_modes() == {env.uuid("gpu-2"): "DEFAULT"}


# -- faults -----------------------------------------------------------------------------------


def test_a_daemon_that_never_answers_fails_the_claim_in_time_and_leaves_nothing(env: Env) -> None:
    env.start_timeout_s = 1.0
    preparer = env.restart()
    (env.fake.root / "usr/bin" / MPS_CONTROL_HANG).touch()
    claim = env.store.add(allocated_claim(name="slow", configs=[mps_config()]))
    started = time.monotonic()
    outcome = preparer.prepare_batch([env.ref(claim)])[claim["metadata"]["uid"]]
    assert time.monotonic() - started < 8
    assert outcome.error_type == "mps"
    assert f"MPS control daemon mps-{claim['metadata']['uid']} did not answer within 1 s" in (
        outcome.error
    )
    assert "control.log: '[" in outcome.error  # what the daemon logged is in the error
    assert preparer.checkpoint.get(claim["metadata"]["uid"]) is None
    env.assert_nothing_left()
    assert env.fake.compute_modes() == {env.uuid("gpu-0"): "DEFAULT"}


def test_a_daemon_that_fails_names_why_in_the_claims_error(env: Env) -> None:
    env.start_timeout_s = 1.5
    preparer = env.restart()
    (env.fake.root / "usr/bin" / MPS_CONTROL_FAIL).write_text("cannot open /dev/nvidiactl\n")
    claim = env.store.add(allocated_claim(name="broken", configs=[mps_config()]))
    with pytest.raises(MpsFailed) as info:
        preparer.prepare(env.ref(claim))
    assert "cannot open /dev/nvidiactl" in str(info.value)
    env.assert_nothing_left()


def test_a_refused_limit_fails_the_claim_and_leaves_nothing(env: Env) -> None:
    claim = env.store.add(allocated_claim(name="c", configs=[mps_config()]))
    uid = claim["metadata"]["uid"]
    # a Deployment of the same name serving other devices is replaced, not adopted
    stale = mps.MpsDaemon(
        owner=uid,
        devices=(mps.MpsDevice(uuid=env.uuid("gpu-3"), memory_bytes=2**30, exclusive_gpu=None),),
        base=env.mps_base,
    )
    env.kube.create_deployment(
        namespace=NAMESPACE,
        body=mps.deployment(stale, namespace=NAMESPACE, node_name="elsewhere",
                            driver_name="gpu.nvidia.com", image="x", host_driver_root=env.fake.root,
                            control=PurePosixPath("usr/bin/nvidia-cuda-mps-control")),
    )  # fmt: skip
    env.preparer.prepare(env.ref(claim))
    served = env.api.objects("deployments")[0]["spec"]["template"]["spec"]
    assert served["nodeName"] == "node1"
    env.preparer.unprepare(env.ref(claim))
    env.assert_nothing_left()
    # a limit the daemon refuses (the stand-in takes <n>M only) fails the claim
    bad = mps.Limits(pinned_mib=((env.uuid("gpu-0"), -1),))
    daemon = mps.MpsDaemon(
        owner=uid,
        devices=(mps.MpsDevice(uuid=env.uuid("gpu-0"), memory_bytes=2**34, exclusive_gpu=None),),
        base=env.mps_base,
    )
    assert env.daemons is not None
    with pytest.raises(MpsFailed, match=r"refused its limits .*Invalid value -1M"):
        env.daemons.start(daemon, bad)
    env.daemons.stop(uid)
    env.assert_nothing_left()


def test_the_simulated_nvml_reports_the_compute_mode_the_stand_in_nvidia_smi_set(env: Env) -> None:
    import pynvml  # noqa: PLC0415

    from dra_driver.sim.fakedriver import NVIDIA_SMI_COMPUTE_MODES  # noqa: PLC0415
    from dra_driver.sim.nvml import simulated_nvml  # noqa: PLC0415

    claim = env.store.add(allocated_claim(name="c", devices=["gpu-2"], configs=[mps_config()]))
    modes = env.fake.nvidia_smi_dir / NVIDIA_SMI_COMPUTE_MODES
    with simulated_nvml(SPEC, node_name="node1", compute_modes=modes):
        pynvml.nvmlInit()
        try:
            by_uuid = {}
            for i in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(i)
                by_uuid[pynvml.nvmlDeviceGetUUID(handle)] = handle
            handle = by_uuid[env.uuid("gpu-2")]
            assert pynvml.nvmlDeviceGetComputeMode(handle) == pynvml.NVML_COMPUTEMODE_DEFAULT
            env.preparer.prepare(env.ref(claim))
            assert (
                pynvml.nvmlDeviceGetComputeMode(handle) == pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
            )
            env.preparer.unprepare(env.ref(claim))
            assert pynvml.nvmlDeviceGetComputeMode(handle) == pynvml.NVML_COMPUTEMODE_DEFAULT
        finally:
            pynvml.nvmlShutdown()


def test_one_daemon_per_claim_serves_only_the_devices_that_ask_for_mps(env: Env) -> None:
    def mps_for(request: str, percentage: int) -> dict[str, Any]:
        config = mps_config(defaultActiveThreadPercentage=percentage)
        config["requests"] = [request]
        return config

    devices = [("a", "gpu-0"), ("b", "gpu-1"), ("plain", "gpu-2")]
    # the devices of one claim share one daemon: different mpsConfigs are refused
    differ = env.store.add(
        allocated_claim(
            name="differ", devices=devices, configs=[mps_for("a", 50), mps_for("b", 60)]
        )
    )
    with pytest.raises(ConfigDecodeError, match="needs the same mpsConfig"):
        env.preparer.prepare(env.ref(differ))
    assert env.deployments() == []
    same = env.store.add(
        allocated_claim(name="same", devices=devices, configs=[mps_for("a", 50), mps_for("b", 50)])
    )
    uid = same["metadata"]["uid"]
    env.preparer.prepare(env.ref(same))
    assert env.deployments() == [f"mps-{uid}"]
    assert env.daemon_calls(uid)[0] == f"start {env.uuid('gpu-0')},{env.uuid('gpu-1')}"
    assert set(env.fake.compute_modes()) == {env.uuid("gpu-0"), env.uuid("gpu-1")}
    spec = json.loads(env.preparer.specs.path_for(uid).read_bytes())
    clients = {
        d["name"].removeprefix(f"{uid}-"): "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps"
        in d["containerEdits"].get("env", [])
        for d in spec["devices"]
    }
    assert clients == {"gpu-0": True, "gpu-1": True, "gpu-2": False}
    env.preparer.unprepare(env.ref(same))
    env.assert_nothing_left()


def test_one_failed_api_call_is_tried_once_more_and_two_fail_the_claim_cleanly(env: Env) -> None:
    claim = env.store.add(allocated_claim(name="c", configs=[mps_config()]))
    for verb in ("get", "create"):
        env.api.fail(verb, "deployments", 503, times=1)
    env.preparer.prepare(env.ref(claim))
    assert env.deployments() == [f"mps-{claim['metadata']['uid']}"]
    env.preparer.unprepare(env.ref(claim))
    env.assert_nothing_left()
    env.api.fail("create", "deployments", 503, times=2)
    with pytest.raises(MpsFailed, match="injected 503"):
        env.preparer.prepare(env.ref(claim))
    env.assert_nothing_left()
    assert env.preparer.checkpoint.get(claim["metadata"]["uid"]) is None


def test_strategy_reads_a_recorded_config() -> None:
    from dra_driver.sharing.mps import strategy  # noqa: PLC0415

    assert strategy({"sharing": {"strategy": "MPS"}}) == "MPS"
    assert strategy({"sharing": {"strategy": "TimeSlicing"}}) == "TimeSlicing"
    assert strategy({"sharing": "MPS"}) is None
    assert strategy({}) is None
    assert strategy(None) is None
