"""The whole GPU of a partitionable GPU (dynamic MIG; mig/modeswitch_step.py) through
prepare.Preparer: prepare takes the
GPU out of MIG mode behind a durable mark, unprepare puts it back, discovery keeps showing the
partitionable GPU meanwhile, and every crash leftover is repaired.

Real parts: the simulated NVML library through pynvml and gpus/migmanager.py (the MIG mode the
agent sets is the one discovery reads back), the checkpoint and CDI spec directory on disk. The
kill -9 loop through nvmlDeviceSetMigMode is in tests/test_plugin_faults_dynamic_mig.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from dra_driver.devices import mig_device_name, node_devices
from dra_driver.errors import DeviceConflict, ForeignMigInstances, PrepareError
from dra_driver.gpus import nvml
from dra_driver.gpus.info import Inventory
from dra_driver.mig.instances import DynamicMig
from dra_driver.mig.targets import dynamic_targets, is_placement, leaves_mig
from dra_driver.prepare import device_targets
from dra_driver.prepare.repair import Repair
from dra_driver.prepare.state.checkpoint import (
    PREPARE_COMPLETED,
    PREPARE_STARTED,
    ClaimRecord,
    PreparedDevice,
)
from dra_driver.sharing import shares
from dra_driver.sim.nvml import simulated_nvml
from tests.claimdata import ClaimStore, allocated_claim
from tests.dynamicnode import DynamicNode, open_node
from tests.shareenforcer import RecordingEnforcer

VENDOR = "k8s.gpu.nvidia.com"
SPEC = "h100:2:mig,h100:1"  # gpu-0 and gpu-1 partitionable, gpu-2 not in MIG mode
WHOLE = "gpu-0"
ONE_G_AT_3 = mig_device_name(parent_minor=0, profile="1g.10gb", profile_id=19, placement_start=3)


class Env(DynamicNode):
    def mig_mode(self, minor: int = 0) -> tuple[bool, bool]:
        gpu = next(g for g in self.raw().gpus if g.minor == minor)
        return self.manager.mig_mode(gpu.uuid)

    def marked(self) -> frozenset[str]:
        return self.mig_off.uuids()

    def uuid(self, minor: int = 0) -> str:
        return next(g.uuid for g in self.raw().gpus if g.minor == minor)


@contextmanager
def open_env(
    tmp: Path, store: ClaimStore | None = None, *, consumable_shares: str = "disabled"
) -> Iterator[Env]:
    """A Preparer in dynamic MIG mode over ``tmp``; a second one over the same ``tmp`` is the
    agent restarted (the simulated node keeps its MIG state in ``tmp``)."""
    with open_node(
        tmp,
        SPEC,
        store,
        consumable_shares=shares.parse_mode(consumable_shares),
        share_enforcer=RecordingEnforcer(),
    ) as node:
        yield Env(**vars(node))


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    with open_env(tmp_path) as e:
        yield e


def published(inventory: Inventory) -> Any:
    return node_devices(inventory, driver_name="gpu.nvidia.com", mig_mode="dynamic")


def test_the_whole_gpu_of_a_partitionable_hopper_gpu_is_a_target_that_leaves_mig_mode(
    env: Env,
) -> None:
    targets = dynamic_targets(env.inventory())
    assert leaves_mig(targets["gpu-0"]) and leaves_mig(targets["gpu-1"])
    # not in MIG mode, Hopper: partitionable too (MIG mode on demand, mig/ondemand_step.py)
    assert leaves_mig(targets["gpu-2"]) and any(
        is_placement(t) for n, t in targets.items() if "2-mig" in n
    )
    assert targets["gpu-0"].type == "gpu" and not is_placement(targets["gpu-0"])
    assert "gpu-0" not in device_targets(env.inventory())  # static: MIG devices only


def test_prepare_takes_the_gpu_out_of_mig_mode_and_unprepare_puts_it_back(env: Env) -> None:
    before = env.inventory()
    claim = env.store.add(allocated_claim(name="whole", devices=[WHOLE]))
    uid = claim["metadata"]["uid"]

    (device,) = env.preparer.prepare(env.ref(claim))

    assert device.device == WHOLE
    assert env.mig_mode(0) == (False, False) and env.mig_mode(1) == (True, True)
    assert env.marked() == {env.uuid(0)}
    record = env.checkpoint.get(uid)
    assert record is not None and record.phase == PREPARE_COMPLETED
    assert env.spec_nodes(uid) == ["/dev/nvidia0"]  # the whole GPU, as out of MIG mode
    # NVML shows a plain GPU now; discovery (with the mark) shows the partitionable GPU it was,
    # so what is published and what prepare accepts do not change
    raw_gpu = env.raw().gpus[0]
    assert not raw_gpu.mig_enabled and not raw_gpu.mig_instances
    assert published(env.inventory()) == published(before)
    env.rediscover()
    assert leaves_mig(env.preparer.targets["gpu-0"])
    assert env.preparer.prepare(env.ref(claim)) == (device,)  # idempotent

    env.preparer.unprepare(env.ref(claim))

    assert env.mig_mode(0) == (True, True) and env.marked() == frozenset()
    assert env.checkpoint.get(uid) is None and not env.specs.path_for(uid).exists()
    assert env.raw() == before  # MIG mode on, the same profiles, no instances
    env.preparer.unprepare(env.ref(claim))  # again: nothing to do


def test_the_whole_gpu_and_its_placements_exclude_each_other(env: Env) -> None:
    small = env.store.add(allocated_claim(name="small", devices=[ONE_G_AT_3]))
    whole = env.store.add(allocated_claim(name="whole", devices=[WHOLE]))
    env.preparer.prepare(env.ref(small))
    with pytest.raises(DeviceConflict, match=f"{WHOLE} overlaps device {ONE_G_AT_3}"):
        env.preparer.prepare(env.ref(whole))
    assert env.mig_mode(0) == (True, True) and env.marked() == frozenset()
    assert env.checkpoint.get(whole["metadata"]["uid"]) is None
    env.preparer.unprepare(env.ref(small))

    env.preparer.prepare(env.ref(whole))
    with pytest.raises(DeviceConflict, match=f"{ONE_G_AT_3} overlaps device {WHOLE}"):
        env.preparer.prepare(env.ref(small))
    assert env.mig_mode(0) == (False, False)


def test_a_gpu_with_a_foreign_instance_or_processes_never_leaves_mig_mode(env: Env) -> None:
    gpu = env.raw().gpus[0]
    claim = env.store.add(allocated_claim(name="whole", devices=[WHOLE]))
    env.manager.create(gpu.uuid, profile_id=19, start=3, size=1, slices=1, name="by hand")
    with pytest.raises(ForeignMigInstances, match=f"did not create \\({ONE_G_AT_3}\\)"):
        env.preparer.prepare(env.ref(claim))
    assert env.mig_mode(0) == (True, True) and env.marked() == frozenset()
    assert env.checkpoint.get(claim["metadata"]["uid"]) is None
    assert list(DynamicMig(env.manager).existing(gpu)) == [ONE_G_AT_3]  # never touched
    env.manager.destroy(gpu.uuid, profile_id=19, start=3, name="by hand")

    env.node.library.put_process(gpu.uuid, 4242)
    outcome = env.preparer.prepare_batch([env.ref(claim)])[claim["metadata"]["uid"]]
    assert outcome.error_type == "mig" and "runs processes (PIDs 4242)" in outcome.error
    assert env.mig_mode(0) == (True, True) and env.marked() == frozenset()
    env.node.library.end_processes(gpu.uuid)
    env.preparer.prepare(env.ref(claim))
    assert env.mig_mode(0) == (False, False)


def test_processes_keep_the_gpu_out_of_mig_mode_until_they_end(env: Env) -> None:
    claim = env.store.add(allocated_claim(name="whole", devices=[WHOLE]))
    env.preparer.prepare(env.ref(claim))
    env.node.library.put_process(env.uuid(0), 99)  # the pod's process has not ended yet
    env.preparer.unprepare(env.ref(claim))  # succeeds: the record is gone, the GPU is not back
    assert env.checkpoint.get(claim["metadata"]["uid"]) is None
    assert env.mig_mode(0) == (False, False) and env.marked() == {env.uuid(0)}
    assert Repair(env.preparer).reconcile()["mig_modes_restored"] == 0  # still running: left marked
    env.node.library.end_processes(env.uuid(0))
    assert Repair(env.preparer).reconcile()["mig_modes_restored"] == 1
    assert env.mig_mode(0) == (True, True) and env.marked() == frozenset()


def test_an_admin_access_claim_of_the_whole_gpu_changes_no_mig_mode(env: Env) -> None:
    small = env.store.add(allocated_claim(name="small", devices=[ONE_G_AT_3]))
    env.preparer.prepare(env.ref(small))
    admin = allocated_claim(name="admin", devices=[WHOLE])
    admin["status"]["allocation"]["devices"]["results"][0]["adminAccess"] = True
    env.store.add(admin)
    (device,) = env.preparer.prepare(env.ref(admin))
    assert device.admin_access and env.mig_mode(0) == (True, True)
    assert env.marked() == frozenset()
    env.preparer.unprepare(env.ref(admin))
    env.preparer.unprepare(env.ref(small))
    assert env.mig_mode(0) == (True, True)


def test_a_claim_left_prepare_started_is_rolled_back_into_mig_mode(env: Env) -> None:
    """As a kill -9 after the GPU left MIG mode and before PrepareCompleted leaves it."""
    claim = env.store.add(allocated_claim(name="whole", devices=[WHOLE]))
    uid = claim["metadata"]["uid"]
    gpu = env.inventory().gpus[0]
    env.checkpoint.transact(
        lambda claims: claims.__setitem__(
            uid,
            ClaimRecord(
                uid=uid, namespace="default", name="whole", phase=PREPARE_STARTED,
                devices=(PreparedDevice(request_names=("gpus",), pool="node1", device=WHOLE,
                                        cdi_device_ids=()),),
            ),
        )
    )  # fmt: skip
    DynamicMig(env.manager).leave_mig_mode(gpu, WHOLE, env.mig_off, recorded=frozenset)
    assert env.mig_mode(0) == (False, False)

    assert Repair(env.preparer).reconcile()["rolled_back"] == 1

    assert env.mig_mode(0) == (True, True) and env.marked() == frozenset()
    assert env.checkpoint.get(uid) is None


def test_a_mark_no_claim_stands_for_puts_the_gpu_back_at_the_next_repair(tmp_path: Path) -> None:
    """A kill -9 after an unprepare removed the record, before the GPU went back: the restart
    finds the mark alone."""
    store = ClaimStore()
    with open_env(tmp_path, store) as env:
        claim = store.add(allocated_claim(name="whole", devices=[WHOLE]))
        env.preparer.prepare(env.ref(claim))
        env.checkpoint.transact(lambda claims: claims.discard(claim["metadata"]["uid"]))
    with open_env(tmp_path, store) as env:
        # the restarted agent's discovery shows the partitionable GPU (from the mark)
        assert leaves_mig(env.preparer.targets["gpu-0"])
        assert env.mig_mode(0) == (False, False)
        assert Repair(env.preparer).reconcile()["mig_modes_restored"] == 1
        assert env.mig_mode(0) == (True, True) and env.marked() == frozenset()


def test_a_prepared_whole_gpu_survives_a_restart_and_is_completed_if_put_back(
    tmp_path: Path,
) -> None:
    store = ClaimStore()
    with open_env(tmp_path, store) as env:
        claim = store.add(allocated_claim(name="whole", devices=[WHOLE]))
        (device,) = env.preparer.prepare(env.ref(claim))
    with open_env(tmp_path, store) as env:
        assert Repair(env.preparer).reconcile()["mig_modes_restored"] == 0
        assert env.mig_mode(0) == (False, False)  # the claim still holds it
        assert env.preparer.prepare(env.ref(claim)) == (device,)
        # put back into MIG mode behind the agent's back (or an unprepare killed after it):
        # the claim is completed again
        env.manager.set_mig_mode(env.uuid(0), True, why="by hand")
        Repair(env.preparer).reconcile()
        assert env.mig_mode(0) == (False, False) and env.marked() == {env.uuid(0)}
        env.preparer.unprepare(env.ref(claim))
        assert env.mig_mode(0) == (True, True) and env.marked() == frozenset()


def test_an_ampere_gpu_in_mig_mode_is_never_prepared_whole(tmp_path: Path) -> None:
    with simulated_nvml("a100-80gb:1:mig", node_name="node1") as node:
        inventory = nvml.discover(driver_root=Path("/"), sysfs_root=node.sysfs_root)
    assert "gpu-0" not in dynamic_targets(inventory)


def test_a_mark_that_cannot_be_read_is_reported_and_the_gpu_shown_as_nvml_says(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    claim = env.store.add(allocated_claim(name="whole", devices=[WHOLE]))
    env.preparer.prepare(env.ref(claim))
    env.mig_off.path(env.uuid(0)).write_text("{not json")
    assert env.mig_off.read() == {}
    assert "cannot read the mark" in caplog.text
    assert not env.inventory().gpus[0].mig_enabled  # shown as NVML says
    assert env.marked() == {env.uuid(0)}  # but still found by the repair
    env.rediscover()
    small = env.store.add(allocated_claim(name="small", devices=[ONE_G_AT_3]))
    with pytest.raises(DeviceConflict, match="overlaps device gpu-0"):
        env.preparer.prepare(env.ref(small))  # no placement of it is prepared meanwhile


def test_with_consumable_shares_the_whole_gpu_of_a_partitionable_gpu_stays_whole(
    tmp_path: Path,
) -> None:
    """As published (shares.shareable leaves devices that consume counters whole): the whole GPU
    is prepared without a shareID, and a shareID on it is refused."""
    with open_env(tmp_path, consumable_shares="memory") as env:
        claim = env.store.add(allocated_claim(name="whole", devices=[WHOLE]))
        (device,) = env.preparer.prepare(env.ref(claim))
        assert device.share_id is None and env.mig_mode(0) == (False, False)
        env.preparer.unprepare(env.ref(claim))
        shared = allocated_claim(name="shared", devices=[WHOLE])
        result = shared["status"]["allocation"]["devices"]["results"][0]
        result["shareID"] = "c0905442-c822-5bf7-9e9f-e009fe9ec365"
        result["consumedCapacity"] = {"memory": "20Gi"}
        env.store.add(shared)
        with pytest.raises(PrepareError, match="placement or whole GPU, which stay whole"):
            env.preparer.prepare(env.ref(shared))
        assert env.mig_mode(0) == (True, True)
