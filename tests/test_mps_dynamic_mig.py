"""MPS on a dynamic MIG device: prepare.Preparer in ``--mig-mode dynamic`` with real MPS daemons.

The node of tests/test_mps.py (local API server, stand-in kubelet running the fake driver root's
nvidia-cuda-mps-control -f, stand-in nvidia-smi, a real tmpfs) over simulated GPUs whose MIG
instances are created and destroyed by the real NVML call sequence (gpus/migmanager.py through
pynvml into the simulated library, as tests/test_mig_instance_step.py). A claim allocated a
MIG placement with no instance and an MPS config: prepare creates the instance before it starts
the daemon (which must serve the new MIG UUID), unprepare and rollback stop the daemon before the
instance is destroyed. The order is read from what the stand-ins had recorded when NVML was asked
to destroy the instance (a recording wrapper around the real MigManager).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from dra_driver import cdi
from dra_driver.devices import mig_device_name, node_devices
from dra_driver.errors import MpsFailed, PrepareError
from dra_driver.gpus import nvml
from dra_driver.gpus.info import GpuInfo, Inventory
from dra_driver.gpus.migmanager import MigManager, MigSlot
from dra_driver.kube import KubeClient
from dra_driver.mig.instances import DynamicMig
from dra_driver.mig.targets import dynamic_targets
from dra_driver.node.wiring import prepare_steps
from dra_driver.prepare import ClaimRef, Preparer
from dra_driver.prepare.repair import Repair
from dra_driver.prepare.state.checkpoint import PREPARE_COMPLETED
from dra_driver.sharing import mps
from dra_driver.sharing.mpsdaemon import MpsDaemons
from dra_driver.sharing.shares import DISABLED, SharesMode, parse_mode, shareable
from dra_driver.sharing.timeslice import NvidiaSmi
from dra_driver.sim.fakedriver import MPS_CONTROL_FAIL, FakeDriver, make_fake_driver
from dra_driver.sim.localapi import FakeKubeApi
from dra_driver.sim.localkubelet import DeploymentKubelet
from dra_driver.sim.nvml import simulated_nvml
from tests.claimdata import ClaimStore, allocated_claim, new_uid
from tests.nodestorage import open_node_storage
from tests.test_mps import NAMESPACE, mounts_under, mps_config

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs (root only)")

VENDOR = "k8s.gpu.nvidia.com"
SPEC = "l4:1,a100-40gb:1:mig"  # gpu-0 a full GPU (no MIG), gpu-1 in MIG mode, no instances
THREE_G_AT_4 = mig_device_name(parent_minor=1, profile="3g.20gb", profile_id=9, placement_start=4)


@dataclass
class Destroyed:
    """What the node looked like when NVML was asked to destroy an instance."""

    name: str
    deployments: list[str]
    daemon_dirs: list[str]
    mounts: list[str]


@dataclass
class RecordingMig:
    """The real MigManager, noting the node's MPS state at each destroy (a MigBackend)."""

    manager: MigManager
    seen: Callable[[], tuple[list[str], list[str], list[str]]]  # deployments, daemon dirs, mounts
    destroyed: list[Destroyed] = field(default_factory=list)

    def instances(self, gpu_uuid: str, profile_ids: Iterable[int]) -> tuple[MigSlot, ...]:
        return self.manager.instances(gpu_uuid, profile_ids)

    def create(
        self, gpu_uuid: str, *, profile_id: int, start: int, size: int, slices: int, name: str
    ) -> tuple[MigSlot, bool]:
        return self.manager.create(
            gpu_uuid, profile_id=profile_id, start=start, size=size, slices=slices, name=name
        )

    def destroy(self, gpu_uuid: str, *, profile_id: int, start: int, name: str) -> bool:
        self.destroyed.append(Destroyed(name, *self.seen()))
        return self.manager.destroy(gpu_uuid, profile_id=profile_id, start=start, name=name)

    def processes(self, gpu_uuid: str, *, gpu_instance_id: int | None) -> tuple[int, ...]:
        return self.manager.processes(gpu_uuid, gpu_instance_id=gpu_instance_id)

    def set_mig_mode(self, gpu_uuid: str, enabled: bool, *, why: str) -> None:
        self.manager.set_mig_mode(gpu_uuid, enabled, why=why)

    def mig_mode(self, gpu_uuid: str) -> tuple[bool, bool]:
        return self.manager.mig_mode(gpu_uuid)

    def close(self) -> None:
        self.manager.close()


@dataclass
class Env:
    tmp: Path
    fake: FakeDriver
    api: FakeKubeApi
    kubelet: DeploymentKubelet
    store: ClaimStore
    preparer: Preparer
    mig: RecordingMig
    inventory: Inventory

    @property
    def gpu(self) -> GpuInfo:
        return self.inventory.gpus[1]

    @property
    def mps_base(self) -> Path:
        return self.tmp / "plugin/mps"

    def ref(self, claim: dict[str, Any]) -> ClaimRef:
        meta = claim["metadata"]
        return ClaimRef(namespace=meta["namespace"], name=meta["name"], uid=meta["uid"])

    def instances(self) -> dict[str, MigSlot]:
        return DynamicMig(self.mig.manager).existing(self.gpu)

    def deployments(self) -> list[str]:
        return [d["metadata"]["name"] for d in self.api.objects("deployments")]

    def daemon_calls(self, uid: str) -> list[str]:
        prefix = f"{self.mps_base / uid / 'pipe'} "
        return [c[len(prefix) :] for c in self.fake.mps_control_calls() if c.startswith(prefix)]

    def seen(self) -> tuple[list[str], list[str], list[str]]:
        dirs = sorted(p.name for p in self.mps_base.iterdir()) if self.mps_base.exists() else []
        return self.deployments(), dirs, mounts_under(self.tmp)


@contextlib.contextmanager
def dynamic_mps_node(
    *, start_timeout_s: float = 10.0, consumable_shares: SharesMode = DISABLED
) -> Iterator[Env]:
    # a short path: a Unix socket's path has at most 107 bytes
    with (
        tempfile.TemporaryDirectory(prefix="mpsmig-", dir="/tmp") as d,
        simulated_nvml(SPEC, node_name="node1", state_path=Path(d) / "simulated-mig.json") as node,
    ):
        tmp = Path(d)
        inventory = nvml.discover(driver_root=Path("/"), sysfs_root=node.sysfs_root)
        fake = make_fake_driver(tmp, gpu_uuids=[g.uuid for g in inventory.gpus])
        (tmp / "boot").write_text("boot-1\n")
        api = FakeKubeApi().start()
        kube = KubeClient.from_config(kubeconfig=api.write_kubeconfig(tmp / "kubeconfig"))
        kubelet = DeploymentKubelet(api, node_name="node1", log_dir=tmp / "pods").start()
        specs, checkpoint, locks = open_node_storage(tmp, vendor=VENDOR, boot_id_path=tmp / "boot")
        daemons = MpsDaemons(
            api=kube,
            namespace=NAMESPACE,
            node_name="node1",
            driver_name="gpu.nvidia.com",
            image="gpu-dra:test",
            base=tmp / "plugin/mps",
            driver_root=fake.root,
            host_driver_root=fake.root,
            smi=NvidiaSmi(fake.root, timeout_s=5),
            start_timeout_s=start_timeout_s,
        )
        recording = RecordingMig(MigManager(), seen=lambda: ([], [], []))
        store = ClaimStore()
        preparer = Preparer(
            driver_name="gpu.nvidia.com",
            node_name="node1",
            cdi_vendor=VENDOR,
            targets=dynamic_targets(inventory),
            files=cdi.find_driver_files(
                driver_root=fake.root,
                driver_version=inventory.gpus[0].driver_version,
                proc_root=fake.proc_root,
            ),
            specs=specs,
            checkpoint=checkpoint,
            locks=locks,
            claims=store,
            steps=prepare_steps(
                timeslicer=NvidiaSmi(fake.root, timeout_s=5),
                mps_daemons=daemons,
                mig=DynamicMig(recording),
                consumable_shares=consumable_shares,
            ),
        )
        env = Env(tmp, fake, api, kubelet, store, preparer, recording, inventory)
        recording.seen = env.seen
        try:
            yield env
        finally:
            preparer.close()
            checkpoint.close()
            locks.close()
            kubelet.stop()
            for mount in reversed(mounts_under(tmp)):
                subprocess.run(["umount", "--lazy", mount], check=False)
            kube.close()
            api.stop()


def mig_mps_claim(env: Env) -> dict[str, Any]:
    return env.store.add(
        allocated_claim(
            name="mig-mps",
            devices=[THREE_G_AT_4],
            configs=[
                mps_config(
                    "MigDeviceConfig",
                    defaultActiveThreadPercentage=50,
                    defaultPinnedDeviceMemoryLimit="10Gi",
                )
            ],
        )
    )


def test_the_daemon_serves_the_instance_prepare_made_and_stops_before_it_is_destroyed() -> None:
    with dynamic_mps_node() as env:
        claim = mig_mps_claim(env)
        uid = claim["metadata"]["uid"]
        assert env.instances() == {}
        (device,) = env.preparer.prepare(env.ref(claim))
        assert device.device == THREE_G_AT_4
        # the instance exists, and the daemon was started for its MIG UUID (and only it)
        made = env.instances()
        assert list(made) == [THREE_G_AT_4]
        slot = made[THREE_G_AT_4]
        assert slot.uuid is not None and slot.uuid.startswith("MIG-")
        assert slot.compute_instance_id is not None
        assert env.deployments() == [f"mps-{uid}"]
        assert list(env.kubelet.running()) == [(NAMESPACE, f"mps-{uid}")]
        (body,) = env.api.objects("deployments")
        container = body["spec"]["template"]["spec"]["containers"][0]
        assert {e["name"]: e["value"] for e in container["env"]}["CUDA_VISIBLE_DEVICES"] == (
            slot.uuid
        )
        assert env.daemon_calls(uid) == [
            f"start {slot.uuid}",
            "get_server_list",
            "set_default_active_thread_percentage 50",
            f"set_default_device_pinned_mem_limit {slot.uuid} 10240M",
        ]
        # a MIG device's daemon leaves the parent GPU's compute mode alone
        assert env.fake.compute_modes() == {}
        assert mps.gpus_file(env.mps_base, uid).read_text().split() == []
        # the CDI device: the GPU node and the new instance's caps, and the MPS client edits
        spec = json.loads(env.preparer.specs.path_for(uid).read_bytes())
        (cdi_device,) = spec["devices"]
        edits = cdi_device["containerEdits"]
        files = env.preparer.files
        gi, ci = slot.gpu_instance_id, slot.compute_instance_id
        assert [n["path"] for n in edits["deviceNodes"]] == [
            "/dev/nvidia1",
            f"/dev/nvidia-caps/nvidia-cap{files.mig_cap_minor(f'gpu1/gi{gi}/access')}",
            f"/dev/nvidia-caps/nvidia-cap{files.mig_cap_minor(f'gpu1/gi{gi}/ci{ci}/access')}",
        ]
        assert edits["env"] == ["CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps"]
        assert [(m["hostPath"], m["containerPath"]) for m in edits["mounts"]] == [
            (str(env.mps_base / uid / "pipe"), "/tmp/nvidia-mps"),
            (str(env.mps_base / uid / "shm"), "/dev/shm"),
        ]
        record = env.preparer.checkpoint.get(uid)
        assert record is not None and record.phase == PREPARE_COMPLETED
        # preparing again is answered from the record: no second instance or daemon
        assert env.preparer.prepare(env.ref(claim)) == (device,)
        assert list(env.instances()) == [THREE_G_AT_4]
        assert env.kubelet.starts[(NAMESPACE, f"mps-{uid}")] == 1
        # unprepare: when NVML was asked to destroy the instance, the daemon had quit and its
        # Deployment, tmpfs and directories were gone
        env.preparer.unprepare(env.ref(claim))
        assert env.daemon_calls(uid)[-2:] == ["quit", "exit 0"]
        assert env.mig.destroyed == [Destroyed(THREE_G_AT_4, [], [], [])]
        assert env.instances() == {}
        assert env.deployments() == [] and mounts_under(env.tmp) == []
        assert env.preparer.checkpoint.get(uid) is None
        assert not env.preparer.specs.path_for(uid).exists()


def test_reconcile_keeps_the_mps_client_edits_in_the_spec_of_a_dynamic_mig_device() -> None:
    """Reconcile compares the spec of a claim holding a dynamic MIG device with what it would
    write now (its instance may have been made again): that includes the daemon's client edits,
    so a correct spec is left alone rather than rewritten without them."""
    with dynamic_mps_node() as env:
        claim = mig_mps_claim(env)
        uid = claim["metadata"]["uid"]
        env.preparer.prepare(env.ref(claim))
        path = env.preparer.specs.path_for(uid)
        before = path.read_bytes()
        assert Repair(env.preparer).reconcile()["specs_rewritten"] == 0
        assert path.read_bytes() == before
        (cdi_device,) = json.loads(before)["devices"]
        assert cdi_device["containerEdits"]["env"] == ["CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps"]
        path.unlink()  # a lost spec is written again the same, client edits included
        assert Repair(env.preparer).reconcile()["specs_rewritten"] == 1
        assert path.read_bytes() == before
        env.preparer.unprepare(env.ref(claim))


def test_a_daemon_that_fails_to_start_rolls_back_and_destroys_the_instance() -> None:
    with dynamic_mps_node(start_timeout_s=1.5) as env:
        (env.fake.root / "usr/bin" / MPS_CONTROL_FAIL).write_text("cannot open /dev/nvidiactl\n")
        claim = mig_mps_claim(env)
        uid = claim["metadata"]["uid"]
        with pytest.raises(MpsFailed, match="cannot open /dev/nvidiactl"):
            env.preparer.prepare(env.ref(claim))
        # the daemon was asked for the instance prepare had made, then everything went: the
        # daemon's Deployment, tmpfs and directories before the instance
        (started, *_) = env.daemon_calls(uid)
        assert started.startswith("start MIG-")
        assert env.mig.destroyed == [Destroyed(THREE_G_AT_4, [], [], [])]
        assert env.instances() == {}
        assert env.deployments() == [] and mounts_under(env.tmp) == []
        assert env.preparer.checkpoint.get(uid) is None
        assert not env.preparer.specs.path_for(uid).exists()
        # the stand-in is fixed: the same claim prepares on the next try
        (env.fake.root / "usr/bin" / MPS_CONTROL_FAIL).unlink()
        env.preparer.prepare(env.ref(claim))
        slot = env.instances()[THREE_G_AT_4]
        assert env.daemon_calls(uid)[-4] == f"start {slot.uuid}"
        env.preparer.unprepare(env.ref(claim))
        assert env.instances() == {} and env.deployments() == []


def test_with_consumable_shares_a_placement_is_prepared_whole_as_it_is_published() -> None:
    # the published side: shares.shareable leaves a placement (it consumes counters) whole
    with dynamic_mps_node(consumable_shares=parse_mode("compute")) as env:
        published = shareable(
            node_devices(env.inventory, driver_name="gpu.nvidia.com", mig_mode="dynamic"),
            parse_mode("compute"),
        )
        by_name = {d.name: d for d in published.devices}
        assert not by_name[THREE_G_AT_4].allow_multiple_allocations
        assert by_name["gpu-0"].allow_multiple_allocations
        # so the scheduler allocates it without a shareID, and prepare takes it so: the
        # instance is made, the claim's own MPS daemon serves it
        claim = mig_mps_claim(env)
        uid = claim["metadata"]["uid"]
        (device,) = env.preparer.prepare(env.ref(claim))
        assert device.device == THREE_G_AT_4
        slot = env.instances()[THREE_G_AT_4]
        assert env.daemon_calls(uid)[0] == f"start {slot.uuid}"
        env.preparer.unprepare(env.ref(claim))
        assert env.instances() == {} and env.deployments() == []
        # a shareID on it names a share this node does not publish: refused, nothing made
        share = allocated_claim(name="share", devices=[THREE_G_AT_4])
        (result,) = share["status"]["allocation"]["devices"]["results"]
        result["shareID"], result["consumedCapacity"] = new_uid(), {"memory": "1Gi"}
        env.store.add(share)
        with pytest.raises(PrepareError, match="does not publish the device with"):
            env.preparer.prepare(env.ref(share))
        assert env.instances() == {} and env.deployments() == []
