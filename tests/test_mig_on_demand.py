"""MIG mode on demand (dynamic MIG; mig/ondemand_step.py) through prepare.Preparer: a Hopper GPU
that is not in MIG mode is published partitionable, prepare of a placement turns MIG mode on
behind a durable mark, unprepare of the last one turns it off again (only where the driver
turned it on), Ampere GPUs are never toggled, and every crash leftover is repaired.

Real parts: the simulated NVML library through pynvml and gpus/migmanager.py (the MIG mode the
agent sets is the one discovery reads back), the checkpoint and CDI spec directory on disk. The
kill -9 loop through nvmlDeviceSetMigMode is in tests/test_mig_on_demand_faults.py.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from dra_driver.devices import mig_device_name, node_devices
from dra_driver.errors import DeviceConflict, PrepareError
from dra_driver.gpus import nvml
from dra_driver.gpus.info import GpuInfo, Inventory
from dra_driver.mig import modeswitch, ondemand_step
from dra_driver.mig.instances import DynamicMig
from dra_driver.mig.targets import dynamic_targets, is_placement, leaves_mig
from dra_driver.prepare import device_targets
from dra_driver.prepare.repair import Repair
from dra_driver.prepare.state.checkpoint import PREPARE_STARTED, ClaimRecord, PreparedDevice
from dra_driver.sim.nvml import simulated_nvml
from tests.claimdata import ClaimStore, allocated_claim
from tests.dynamicnode import DynamicNode, open_node

SPEC = "h100:2,a100-80gb:1"  # two H100 and one A100, none in MIG mode


def placement(gpu: GpuInfo, profile: str, start: int) -> str:
    found = next(p for p in gpu.mig_profiles if p.name == profile)
    return mig_device_name(
        parent_minor=gpu.minor, profile=profile, profile_id=found.profile_id, placement_start=start
    )


class Env(DynamicNode):
    @property
    def mig_on(self) -> modeswitch.MigOffMarks:
        return modeswitch.MigOffMarks(self.mig_off.directory.parent / ondemand_step.MARKS_DIRECTORY)

    def gpu(self, minor: int = 0) -> GpuInfo:
        return next(g for g in self.raw().gpus if g.minor == minor)

    def mig_mode(self, minor: int = 0) -> tuple[bool, bool]:
        return self.manager.mig_mode(self.gpu(minor).uuid)

    def turned_on(self) -> set[int]:
        """Minors of the GPUs marked as put into MIG mode by the driver."""
        marked = self.mig_on.uuids()
        return {g.minor for g in self.raw().gpus if g.uuid in marked}

    def marked_any(self) -> set[int]:
        """Minors of the GPUs with a mark of either switch (put into or taken out of MIG mode)."""
        marked = self.mig_on.uuids() | self.mig_off.uuids()
        return {g.minor for g in self.raw().gpus if g.uuid in marked}

    def uuid(self, minor: int = 0) -> str:
        return self.gpu(minor).uuid

    def claim(self, name: str, *devices: str) -> dict[str, Any]:
        return self.store.add(allocated_claim(name=name, devices=list(devices)))


@contextmanager
def open_env(tmp: Path, store: ClaimStore | None = None, spec: str = SPEC) -> Iterator[Env]:
    """A Preparer in dynamic MIG mode over ``tmp``; a second one over the same ``tmp`` is the
    agent restarted (the simulated node keeps its MIG state in ``tmp``)."""
    with open_node(tmp, spec, store) as node:
        yield Env(**vars(node))


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    with open_env(tmp_path) as e:
        yield e


def published(inventory: Inventory, managed: frozenset[str] = frozenset()) -> Any:
    """What dynamic MIG publishes; ``managed``: the MIG devices the driver made (recorded)."""
    return node_devices(
        inventory, driver_name="gpu.nvidia.com", mig_mode="dynamic", managed_mig=managed
    )


def test_a_hopper_not_in_mig_mode_is_partitionable_and_an_ampere_one_stays_a_gpu(env: Env) -> None:
    raw = env.raw()
    h100 = env.gpu(0)
    assert not h100.mig_enabled and h100.mig_profiles  # profiles read in either mode
    devices = published(raw)
    by_name = {d.name: d for d in devices.devices}
    assert [c.name for c in devices.counter_sets] == ["gpu-0-counter-set", "gpu-1-counter-set"]
    three_g = placement(h100, "3g.40gb", 4)
    assert by_name[three_g].attributes["profile"] == "3g.40gb"
    assert by_name["gpu-0"].consumes_counters  # the whole GPU consumes every counter
    assert not by_name["gpu-2"].consumes_counters  # Ampere: a plain GPU, never toggled
    assert not any(n.startswith("gpu-2-mig-") for n in by_name)
    targets = dynamic_targets(raw)
    assert is_placement(targets[three_g]) and leaves_mig(targets["gpu-0"])
    assert not targets["gpu-2"].partitioned
    # static mode: as before, a GPU not in MIG mode is a plain GPU
    assert not any("-mig-" in n for n in device_targets(raw))


def test_prepare_turns_mig_mode_on_and_unprepare_of_the_last_placement_off(env: Env) -> None:
    before = published(env.raw())
    gpu = env.gpu(0)
    big, small = placement(gpu, "3g.40gb", 4), placement(gpu, "1g.10gb", 0)
    c1, c2 = env.claim("big", big), env.claim("small", small)
    assert env.mig_mode(0) == (False, False)

    (device,) = env.preparer.prepare(env.ref(c1))

    assert env.mig_mode(0) == (True, True) and env.turned_on() == {0}
    assert [m.placement.start for m in env.gpu(0).mig_instances] == [4]
    assert device.device == big
    # the same slices, MIG mode on or off
    assert published(env.raw(), frozenset({big})) == before
    env.rediscover()
    env.preparer.prepare(env.ref(c2))
    env.preparer.unprepare(env.ref(c1))
    assert env.mig_mode(0) == (True, True)  # the other claim still holds a MIG device
    env.preparer.unprepare(env.ref(c2))

    assert env.mig_mode(0) == (False, False) and env.turned_on() == set()
    assert env.gpu(0).mig_instances == () and env.checkpoint.snapshot() == {}
    assert env.mig_mode(1) == (False, False)  # the other GPU never changed
    assert published(env.raw()) == before


def test_a_gpu_the_administrator_put_in_mig_mode_stays_in_it(tmp_path: Path) -> None:
    with open_env(tmp_path, spec="h100:1:mig") as env:
        claim = env.claim("c", placement(env.gpu(0), "3g.40gb", 0))
        env.preparer.prepare(env.ref(claim))
        env.preparer.unprepare(env.ref(claim))
        assert env.mig_mode(0) == (True, True) and env.turned_on() == set()


def test_a_whole_gpu_claim_on_a_gpu_not_in_mig_mode_changes_no_mode(env: Env) -> None:
    claim = env.claim("whole", "gpu-0")
    env.preparer.prepare(env.ref(claim))
    assert env.mig_mode(0) == (False, False) and env.marked_any() == set()
    assert env.spec_nodes(claim["metadata"]["uid"]) == ["/dev/nvidia0"]
    small = env.claim("small", placement(env.gpu(0), "1g.10gb", 0))
    with pytest.raises(DeviceConflict, match="overlaps device gpu-0"):
        env.preparer.prepare(env.ref(small))
    env.preparer.unprepare(env.ref(claim))
    assert env.mig_mode(0) == (False, False) and env.marked_any() == set()
    env.preparer.prepare(env.ref(small))  # now it may: MIG mode on, then off again after
    env.preparer.unprepare(env.ref(small))
    assert env.mig_mode(0) == (False, False) and env.marked_any() == set()


def test_a_whole_gpu_claim_after_placements_takes_the_gpu_back_out_without_a_mark(
    env: Env,
) -> None:
    """Turning MIG mode off after the last placement failed (processes ran): the GPU stays in
    MIG mode with its mark; a whole-GPU claim then takes it out, and its unprepare leaves it
    out, the administrator's mode."""
    gpu = env.gpu(0)
    small = env.claim("small", placement(gpu, "1g.10gb", 0))
    env.preparer.prepare(env.ref(small))
    env.node.library.put_process(gpu.uuid, 4242)  # on the full GPU: MIG mode stays on
    env.preparer.unprepare(env.ref(small))
    assert env.mig_mode(0) == (True, True) and env.turned_on() == {0}
    assert Repair(env.preparer).reconcile()["mig_modes_turned_off"] == 0  # still running
    env.node.library.end_processes(gpu.uuid)

    whole = env.claim("whole", "gpu-0")
    env.preparer.prepare(env.ref(whole))
    assert env.mig_mode(0) == (False, False) and env.marked_any() == set()
    env.preparer.unprepare(env.ref(whole))
    assert env.mig_mode(0) == (False, False) and env.marked_any() == set()


def test_processes_on_the_gpu_refuse_the_placement_and_change_nothing(env: Env) -> None:
    gpu = env.gpu(0)
    env.node.library.put_process(gpu.uuid, 4242)
    claim = env.claim("c", placement(gpu, "3g.40gb", 0))
    with pytest.raises(PrepareError, match="PIDs 4242"):
        env.preparer.prepare(env.ref(claim))
    assert env.mig_mode(0) == (False, False) and env.turned_on() == set()
    assert env.checkpoint.snapshot() == {}
    env.node.library.end_processes(gpu.uuid)
    env.preparer.prepare(env.ref(claim))
    assert env.mig_mode(0) == (True, True)


def record(uid: str, device: str) -> ClaimRecord:
    return ClaimRecord(
        uid=uid, namespace="default", name="c", phase=PREPARE_STARTED,
        devices=(PreparedDevice(request_names=("gpus",), pool="node1", device=device,
                                cdi_device_ids=()),),
    )  # fmt: skip


@pytest.mark.parametrize("mode_changed", [False, True], ids=["before-set", "after-set"])
def test_a_claim_left_prepare_started_is_rolled_back_out_of_mig_mode(
    env: Env, mode_changed: bool
) -> None:
    """As a kill -9 after the mark and before (or after) nvmlDeviceSetMigMode."""
    gpu = env.gpu(0)
    name = placement(gpu, "3g.40gb", 0)
    uid = str(uuid.uuid4())
    env.checkpoint.transact(lambda claims: claims.__setitem__(uid, record(uid, name)))
    env.mig_on.write(gpu)
    if mode_changed:
        env.manager.set_mig_mode(gpu.uuid, True, why="the killed prepare")

    done = Repair(env.preparer).reconcile()

    assert done["rolled_back"] == 1
    assert env.mig_mode(0) == (False, False) and env.turned_on() == set()
    assert env.checkpoint.snapshot() == {}


@pytest.mark.parametrize("mode_changed", [False, True], ids=["before-set", "after-set"])
def test_a_mark_no_claim_stands_for_is_repaired_at_the_restart(
    tmp_path: Path, mode_changed: bool
) -> None:
    """A kill -9 of an unprepare after the record went, before (or after) the mode went off."""
    store = ClaimStore()
    with open_env(tmp_path, store) as env:
        gpu = env.gpu(0)
        claim = env.claim("c", placement(gpu, "3g.40gb", 0))
        env.preparer.prepare(env.ref(claim))
        DynamicMig(env.manager).destroy(gpu, placement(gpu, "3g.40gb", 0))
        env.checkpoint.transact(lambda claims: claims.discard(claim["metadata"]["uid"]))
        if mode_changed:
            env.manager.set_mig_mode(gpu.uuid, False, why="the killed unprepare")
    with open_env(tmp_path, store) as env:
        assert env.turned_on() == {0}
        done = Repair(env.preparer).reconcile()
        assert done["mig_modes_turned_off"] == (0 if mode_changed else 1)
        assert env.mig_mode(0) == (False, False) and env.turned_on() == set()


def test_a_prepared_claim_survives_a_restart_and_its_gpu_is_put_back_in_mig_mode(
    tmp_path: Path,
) -> None:
    store = ClaimStore()
    with open_env(tmp_path, store) as env:
        claim = env.claim("c", placement(env.gpu(0), "3g.40gb", 4))
        (device,) = env.preparer.prepare(env.ref(claim))
    with open_env(tmp_path, store) as env:
        assert Repair(env.preparer).reconcile()["mig_modes_turned_off"] == 0
        assert env.mig_mode(0) == (True, True)  # the claim still holds its MIG device
        # taken out of MIG mode behind the agent's back (its instance gone with it)
        DynamicMig(env.manager).destroy(env.gpu(0), device.device)
        env.manager.set_mig_mode(env.uuid(0), False, why="by hand")
        Repair(env.preparer).reconcile()
        assert env.mig_mode(0) == (True, True)
        assert [m.placement.start for m in env.gpu(0).mig_instances] == [4]
        env.preparer.unprepare(env.ref(claim))
        assert env.mig_mode(0) == (False, False) and env.turned_on() == set()


def test_an_ampere_gpu_not_in_mig_mode_is_never_toggled(tmp_path: Path) -> None:
    with simulated_nvml("a100-80gb:1", node_name="node1") as node:
        inventory = nvml.discover(driver_root=Path("/"), sysfs_root=node.sysfs_root)
    assert inventory.gpus[0].mig_profiles  # it reports them, yet stays a plain GPU
    assert list(dynamic_targets(inventory)) == ["gpu-0"]
