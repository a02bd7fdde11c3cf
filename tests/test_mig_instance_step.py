"""Dynamic MIG instances (mig/instance_step.py) through prepare.Preparer: instances created on
prepare and destroyed on unprepare by the real NVML call sequence (gpus/migmanager.py through
pynvml into the simulated library), crash recovery from the checkpoint's records, and the rules
(foreign instances, processes, overlaps). The kill -9 loops are in tests/test_plugin_faults.py."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from dra_driver.devices import mig_device_name
from dra_driver.errors import DeviceConflict, MigFailed, PrepareError
from dra_driver.gpus.info import GpuInfo
from dra_driver.mig.instance_step import MigInstanceStep
from dra_driver.mig.instances import DynamicMig, overlaps
from dra_driver.mig.targets import dynamic_targets, is_placement
from dra_driver.prepare import device_targets
from dra_driver.prepare.repair import Repair
from dra_driver.prepare.state.checkpoint import (
    PREPARE_COMPLETED,
    PREPARE_STARTED,
    ClaimRecord,
    PreparedDevice,
)
from dra_driver.prepare.state.nodestate import recorded_device_names
from tests.claimdata import ClaimStore, allocated_claim
from tests.dynamicnode import DynamicNode, open_node

VENDOR = "k8s.gpu.nvidia.com"
SPEC = "h100:1,a100-40gb:1:mig"  # gpu-0 a full GPU, gpu-1 in MIG mode without instances


def name(profile: str, start: int, *, minor: int = 1) -> str:
    ids = {"1g.5gb": 19, "2g.10gb": 14, "3g.20gb": 9, "4g.20gb": 5, "7g.40gb": 0}
    return mig_device_name(
        parent_minor=minor, profile=profile, profile_id=ids[profile], placement_start=start
    )


THREE_G_AT_4 = name("3g.20gb", 4)
ONE_G_AT_5 = name("1g.5gb", 5)
ONE_G_AT_0 = name("1g.5gb", 0)


class Env(DynamicNode):
    def gpu(self) -> GpuInfo:
        return self.inventory().gpus[1]

    def instances(self) -> dict[str, tuple[int, int | None]]:
        """Device name -> (GPU instance id, compute instance id) of gpu-1's instances."""
        gpu = self.gpu()
        return {
            n: (s.gpu_instance_id, s.compute_instance_id)
            for n, s in DynamicMig(self.manager).existing(gpu).items()
        }


@contextmanager
def open_env(tmp: Path, store: ClaimStore | None = None) -> Iterator[Env]:
    """A Preparer in dynamic MIG mode over ``tmp`` on a simulated node whose MIG instances are
    kept in ``tmp`` (a second one over the same ``tmp`` is the agent restarted)."""
    with open_node(tmp, SPEC, store) as node:
        yield Env(**vars(node))


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    with open_env(tmp_path) as e:
        yield e


def cap_nodes(env: Env, gi: int, ci: int) -> list[str]:
    return [
        "/dev/nvidia1",
        f"/dev/nvidia-caps/nvidia-cap{env.files.mig_cap_minor(f'gpu1/gi{gi}/access')}",
        f"/dev/nvidia-caps/nvidia-cap{env.files.mig_cap_minor(f'gpu1/gi{gi}/ci{ci}/access')}",
    ]


def test_every_placement_of_every_profile_is_a_target_and_no_full_gpu_in_mig_mode(
    env: Env,
) -> None:
    targets = dynamic_targets(env.inventory())
    gpu = env.gpu()
    placements = sum(len(p.placements) for p in gpu.mig_profiles)
    assert len([t for t in targets.values() if t.gpu.minor == 1]) == placements
    assert "gpu-1" not in targets and "gpu-0" in targets  # gpu-0 is not in MIG mode
    assert all(is_placement(t) and t.mig is None for t in targets.values() if t.gpu.minor)
    assert not [t for t in device_targets(env.inventory()).values() if t.gpu.minor == 1]


def test_prepare_creates_the_instance_at_its_placement_and_unprepare_destroys_it(
    env: Env,
) -> None:
    claim = env.store.add(allocated_claim(name="c1", devices=[THREE_G_AT_4]))
    uid = claim["metadata"]["uid"]
    (device,) = env.preparer.prepare(env.ref(claim))
    assert device.device == THREE_G_AT_4
    made = env.instances()
    assert list(made) == [THREE_G_AT_4]
    gi, ci = made[THREE_G_AT_4]
    assert ci is not None
    assert env.spec_nodes(uid) == cap_nodes(env, gi, ci)
    record = env.checkpoint.get(uid)
    assert record is not None and record.phase == PREPARE_COMPLETED
    # discovery now shows the instance: still the one target of that name, with the instance
    env.rediscover()
    target = env.preparer.targets[THREE_G_AT_4]
    assert target.mig is not None and (target.mig.gpu_instance_id, target.mig.placement.start) == (
        gi,
        4,
    )
    assert sum(1 for t in env.preparer.targets.values() if t.mig is not None) == 1
    assert env.preparer.prepare(env.ref(claim)) == (device,)  # idempotent: nothing more made
    assert list(env.instances()) == [THREE_G_AT_4]
    env.preparer.unprepare(env.ref(claim))
    assert env.instances() == {}
    assert env.checkpoint.get(uid) is None and not env.specs.path_for(uid).exists()
    env.preparer.unprepare(env.ref(claim))  # again: nothing to do


def test_overlapping_placements_exclude_each_other_and_the_loser_creates_nothing(
    env: Env,
) -> None:
    first = env.store.add(allocated_claim(name="first", devices=[THREE_G_AT_4]))
    second = env.store.add(allocated_claim(name="second", devices=[ONE_G_AT_5]))
    env.preparer.prepare(env.ref(first))
    with pytest.raises(DeviceConflict, match=f"{ONE_G_AT_5} overlaps device {THREE_G_AT_4}"):
        env.preparer.prepare(env.ref(second))
    assert list(env.instances()) == [THREE_G_AT_4]
    assert env.checkpoint.get(second["metadata"]["uid"]) is None
    assert overlaps(env.gpu(), ONE_G_AT_5, THREE_G_AT_4)
    assert not overlaps(env.gpu(), ONE_G_AT_0, THREE_G_AT_4)


def test_nvml_refusals_are_the_claims_error_and_leave_nothing(env: Env) -> None:
    """The +me profile exists once per GPU: a second one elsewhere is NVML's
    INSUFFICIENT_RESOURCES, named in the claim's error, and its record is rolled back."""
    me = next(p for p in env.gpu().mig_profiles if p.name == "1g.5gb+me")
    at = [
        mig_device_name(
            parent_minor=1, profile=me.name, profile_id=me.profile_id, placement_start=s
        )
        for s in (0, 2)
    ]
    first = env.store.add(allocated_claim(name="first", devices=[at[0]]))
    second = env.store.add(allocated_claim(name="second", devices=[at[1]]))
    env.preparer.prepare(env.ref(first))
    outcome = env.preparer.prepare_batch([env.ref(second)])[second["metadata"]["uid"]]
    assert "insufficient resources" in outcome.error and outcome.error_type == "mig"
    assert list(env.instances()) == [at[0]]
    assert env.checkpoint.get(second["metadata"]["uid"]) is None
    assert not env.specs.path_for(second["metadata"]["uid"]).exists()


def test_a_gpu_with_an_instance_the_driver_did_not_create_is_refused_and_never_touched(
    env: Env,
) -> None:
    gpu = env.gpu()
    env.manager.create(gpu.uuid, profile_id=19, start=0, size=1, slices=1, name="by hand")
    foreign = env.instances()
    claim = env.store.add(allocated_claim(name="c1", devices=[THREE_G_AT_4]))
    with pytest.raises(MigFailed, match=f"did not create \\({ONE_G_AT_0}\\)"):
        env.preparer.prepare(env.ref(claim))
    # the device that exists but no record names is the foreign one: not prepared either
    same = env.store.add(allocated_claim(name="c2", devices=[ONE_G_AT_0]))
    with pytest.raises(MigFailed, match="did not create"):
        env.preparer.prepare(env.ref(same))
    Repair(env.preparer).reconcile()
    env.preparer.unprepare(env.ref(same))
    assert env.instances() == foreign
    assert recorded_device_names(env.checkpoint.snapshot().values()) == frozenset()


def test_processes_stop_repartitioning(env: Env) -> None:
    gpu = env.gpu()
    claim = env.store.add(allocated_claim(name="c1", devices=[THREE_G_AT_4]))
    env.node.library.put_process(gpu.uuid, 4242)  # on the full GPU, outside MIG instances
    with pytest.raises(MigFailed, match="runs processes outside MIG instances \\(PIDs 4242\\)"):
        env.preparer.prepare(env.ref(claim))
    assert env.instances() == {} and env.checkpoint.get(claim["metadata"]["uid"]) is None
    env.node.library.end_processes(gpu.uuid)
    env.preparer.prepare(env.ref(claim))
    env.rediscover()
    mig = env.preparer.targets[THREE_G_AT_4].mig
    assert mig is not None
    env.node.library.put_process(mig.uuid, 77)  # the claim's pod is still running
    with pytest.raises(MigFailed, match="processes run in it \\(PIDs 77\\)"):
        env.preparer.unprepare(env.ref(claim))
    assert list(env.instances()) == [THREE_G_AT_4]  # kept, and still named by the record
    assert THREE_G_AT_4 in recorded_device_names(env.checkpoint.snapshot().values())
    env.node.library.end_processes(mig.uuid)
    env.preparer.unprepare(env.ref(claim))  # the kubelet's retry
    assert (
        env.instances() == {}
        and recorded_device_names(env.checkpoint.snapshot().values()) == frozenset()
    )


def _record(env: Env, claim: dict[str, Any], phase: str) -> None:
    meta = claim["metadata"]
    device = claim["status"]["allocation"]["devices"]["results"][0]["device"]
    record = ClaimRecord(
        uid=meta["uid"],
        namespace=meta["namespace"],
        name=meta["name"],
        phase=phase,  # type: ignore[arg-type]
        devices=(
            PreparedDevice(
                request_names=("gpus",),
                pool="node1",
                device=device,
                cdi_device_ids=(f"{VENDOR}/claim={meta['uid']}-{device}",),
                config={"apiVersion": "resource.nvidia.com/v1beta1", "kind": "MigDeviceConfig"},
            ),
        ),
    )
    env.checkpoint.transact(lambda claims: claims.__setitem__(meta["uid"], record))


def _half_made(env: Env, device_profile_id: int, start: int, size: int) -> None:
    """A GPU instance without its compute instance: a kill between the two NVML calls."""
    import ctypes  # noqa: PLC0415

    import pynvml  # noqa: PLC0415

    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByUUID(env.gpu().uuid.encode())
        placement = pynvml.c_nvmlGpuInstancePlacement_t()
        placement.start, placement.size = start, size
        pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(
            handle, device_profile_id, ctypes.byref(placement)
        )
    finally:
        pynvml.nvmlShutdown()


def test_a_claim_left_prepare_started_is_rolled_back_with_its_half_made_instance(
    env: Env,
) -> None:
    claim = env.store.add(allocated_claim(name="c1", devices=[THREE_G_AT_4]))
    _record(env, claim, PREPARE_STARTED)
    _half_made(env, 9, 4, 4)
    assert env.instances() == {THREE_G_AT_4: (1, None)}
    done = Repair(env.preparer).reconcile()
    assert done["rolled_back"] == 1
    assert env.instances() == {} and env.checkpoint.get(claim["metadata"]["uid"]) is None
    env.preparer.prepare(env.ref(claim))  # the kubelet's retry prepares it from scratch
    assert list(env.instances()) == [THREE_G_AT_4]


def test_a_prepared_claim_whose_instance_is_gone_or_half_made_is_completed_again(
    env: Env,
) -> None:
    claim = env.store.add(allocated_claim(name="c1", devices=[THREE_G_AT_4]))
    uid = claim["metadata"]["uid"]
    env.preparer.prepare(env.ref(claim))
    env.rediscover()
    assert Repair(env.preparer).reconcile()["specs_rewritten"] == 0  # all as it should be
    gpu = env.gpu()
    env.manager.destroy(gpu.uuid, profile_id=9, start=4, name=THREE_G_AT_4)  # a GPU reset
    env.specs.remove(uid)
    assert Repair(env.preparer).reconcile()["specs_rewritten"] == 1
    gi, ci = env.instances()[THREE_G_AT_4]
    assert ci is not None and env.spec_nodes(uid) == cap_nodes(env, gi, ci)
    env.manager.destroy(gpu.uuid, profile_id=9, start=4, name=THREE_G_AT_4)
    _half_made(env, 9, 4, 4)
    Repair(env.preparer).reconcile()
    assert env.instances()[THREE_G_AT_4][1] is not None


def test_reconcile_destroys_the_instance_of_a_claim_deleted_in_the_api(env: Env) -> None:
    claim = env.store.add(allocated_claim(name="c1", devices=[THREE_G_AT_4]))
    env.preparer.prepare(env.ref(claim))
    del env.store.claims[("default", "c1")]
    assert Repair(env.preparer).reconcile()["unprepared_gone"] == 1
    assert (
        env.instances() == {}
        and recorded_device_names(env.checkpoint.snapshot().values()) == frozenset()
    )


def test_instances_and_claims_survive_an_agent_restart(tmp_path: Path) -> None:
    store = ClaimStore()
    claim = store.add(allocated_claim(name="c1", devices=[THREE_G_AT_4]))
    with open_env(tmp_path, store) as first:
        first.preparer.prepare(first.ref(claim))
        made = first.instances()
    with open_env(tmp_path, store) as again:  # a new simulated library reads the state file
        assert again.instances() == made
        Repair(again.preparer).reconcile()
        assert again.instances() == made
        again.preparer.unprepare(again.ref(claim))
        assert again.instances() == {}


def test_a_device_another_claim_holds_with_admin_access_is_not_destroyed_under_it(
    env: Env,
) -> None:
    owner = env.store.add(allocated_claim(name="owner", devices=[THREE_G_AT_4]))
    admin = allocated_claim(name="admin", devices=[THREE_G_AT_4])
    admin["status"]["allocation"]["devices"]["results"][0]["adminAccess"] = True
    env.store.add(admin)
    env.preparer.prepare(env.ref(owner))
    env.preparer.prepare(env.ref(admin))
    env.preparer.unprepare(env.ref(admin))
    assert list(env.instances()) == [THREE_G_AT_4]
    env.preparer.unprepare(env.ref(owner))
    assert env.instances() == {}


def test_a_mig_placement_is_refused_in_static_mode(tmp_path: Path) -> None:
    with open_env(tmp_path) as e:
        e.preparer.set_targets(device_targets(e.inventory()), e.files)
        claim = e.store.add(allocated_claim(name="c1", devices=[THREE_G_AT_4]))
        with pytest.raises(PrepareError, match="which this node does not have"):
            e.preparer.prepare(e.ref(claim))
        assert e.instances() == {}


def test_an_instance_made_by_hand_between_the_check_and_the_create_is_never_destroyed(
    env: Env,
) -> None:
    """Someone creates the very instance a claim is about to create, after prepare checked the
    GPU and before it creates: the claim is refused and rolled back without destroying it."""

    class Racing(DynamicMig):
        def check_foreign(self, gpu: GpuInfo, name: str, **kwargs: Any) -> None:
            super().check_foreign(gpu, name, **kwargs)
            env.manager.create(gpu.uuid, profile_id=9, start=4, size=4, slices=3, name="by hand")

    (step,) = [s for s in env.preparer.steps if isinstance(s, MigInstanceStep)]
    step.mig = Racing(env.manager)
    claim = env.store.add(allocated_claim(name="c1", devices=[THREE_G_AT_4]))
    with pytest.raises(MigFailed, match="did not create"):
        env.preparer.prepare(env.ref(claim))
    assert list(env.instances()) == [THREE_G_AT_4]
    assert env.checkpoint.get(claim["metadata"]["uid"]) is None


def test_a_mig_mode_other_than_static_or_dynamic_is_refused_naming_the_flag() -> None:
    from dra_driver.errors import ConfigError  # noqa: PLC0415
    from dra_driver.node.config import Config  # noqa: PLC0415

    with pytest.raises(
        ConfigError, match=r"--mig-mode \(MIG_MODE\): 'auto': use static or dynamic"
    ):
        Config(node_name="n", mig_mode="auto")  # type: ignore[arg-type]


def test_an_xid_of_a_created_instance_marks_that_dynamic_device_once_rediscovered(
    env: Env,
) -> None:
    """The health monitor maps an event's GPU/compute instance ids to device names from the
    inventory: after the re-discovery that sees the new instance, an XID of that instance marks
    the dynamic device of the same name prepare accepts, and no other device."""
    import time  # noqa: PLC0415

    from dra_driver.devices import Taint  # noqa: PLC0415
    from dra_driver.health.decisions import HealthPolicy  # noqa: PLC0415
    from dra_driver.health.monitor import HealthMonitor  # noqa: PLC0415
    from dra_driver.sim.faults import SimulatedFault  # noqa: PLC0415

    class Taints:
        def set_taints(self, taints: Any) -> None:
            self.last: dict[str, tuple[Taint, ...]] = dict(taints)

    claim = env.store.add(allocated_claim(name="c1", devices=[THREE_G_AT_4]))
    env.preparer.prepare(env.ref(claim))
    inventory = env.inventory()
    env.rediscover()
    mig = env.preparer.targets[THREE_G_AT_4].mig
    assert mig is not None
    sink = Taints()
    monitor = HealthMonitor(
        policy=HealthPolicy(driver_name="gpu.nvidia.com", min_change_interval_s=0),
        inventory=inventory,
        taints=sink,
        events=lambda *a, **k: None,
        check_interval_s=0.1,
    )
    monitor.start()
    try:
        # events that come before the watch registered its GPUs are lost (as on real NVML):
        # inject once the first check of the instance is in
        deadline = time.monotonic() + 10

        def checked() -> bool:  # a state is Unknown until its first check is in
            state = monitor.states().get(THREE_G_AT_4)
            return state is not None and state.status != "Unknown"

        while not checked() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert monitor.states()[THREE_G_AT_4].status == "Healthy"
        env.node.library.health.inject(
            SimulatedFault(
                kind="xid",
                gpu=1,
                xid=94,
                gpu_instance_id=mig.gpu_instance_id,
                compute_instance_id=mig.compute_instance_id,
            )
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            unhealthy = {n for n, s in monitor.states().items() if s.status == "Unhealthy"}
            if unhealthy:
                break
            time.sleep(0.02)
        assert unhealthy == {THREE_G_AT_4}
    finally:
        monitor.stop()
