"""The step protocol (prepare/step.py) as the preparer core calls it, with recording steps: the
order of plan, record, apply, CDI edits and completion; undo in reverse on unprepare and
rollback; reconcile asking each step; a step with nothing to do never called again.

The five features' steps are tested through the preparer in tests/test_prepare.py (time
slicing), test_mps*.py, test_share_step.py, test_mig_instance_step.py and
test_mig_modeswitch_step.py; this file holds the core to its side of the contract alone.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from dra_driver import cdi
from dra_driver.errors import DeviceConflict, MpsFailed
from dra_driver.prepare import (
    ClaimPlan,
    ClaimRef,
    NodeState,
    PlannedDevice,
    Preparer,
    Step,
    device_targets,
)
from dra_driver.prepare.repair import Repair
from dra_driver.prepare.state.checkpoint import (
    PREPARE_COMPLETED,
    PREPARE_STARTED,
    ClaimRecord,
    Claims,
)
from dra_driver.sim.fakedriver import make_fake_driver, simulated_inventory
from tests.claimdata import ClaimStore, allocated_claim
from tests.nodestorage import open_node_storage

VENDOR = "k8s.gpu.nvidia.com"


class Recording(Step):
    """A step that applies to every claim and writes down each call (with the claim's phase in
    the checkpoint when it matters), into a log shared by the steps of one preparer."""

    def __init__(
        self, name: str, node: NodeState, calls: list[str], *, keeps: bool = False
    ) -> None:
        self.name = name
        self.node = node
        self.calls = calls
        self.keeps = keeps
        self.fail_apply: Exception | None = None
        self.conflict = False
        self.skip = False

    def _phase(self, uid: str) -> str:
        record = self.node.record(uid)
        return "none" if record is None else record.phase

    def plan(self, claim: ClaimPlan) -> str | None:
        self.calls.append(f"{self.name}.plan {self._phase(claim.ref.uid)}")
        return None if self.skip else f"{self.name}-plan"

    def check(self, plan: str, claim: ClaimPlan, *, claims: Claims) -> None:
        self.calls.append(f"{self.name}.check")
        if self.conflict:
            raise DeviceConflict(f"{self.name} refuses", holders=())

    def apply(self, plan: str, claim: ClaimPlan, *, started: Callable[[], None]) -> None:
        assert plan == f"{self.name}-plan"
        started()
        self.calls.append(f"{self.name}.apply {self._phase(claim.ref.uid)}")
        if self.fail_apply is not None:
            raise self.fail_apply

    def edit(self, plan: str, device: PlannedDevice, *, spec: cdi.ClaimDevice) -> cdi.ClaimDevice:
        return replace(spec, env=(*spec.env, f"STEP_{self.name.upper()}={device.target.name}"))

    def keeps_record(self, record: ClaimRecord) -> bool:
        return self.keeps

    def release(self, record: ClaimRecord) -> None:
        self.calls.append(f"{self.name}.release {self._phase(record.uid)}")

    def restore(self, record: ClaimRecord) -> None:
        self.calls.append(f"{self.name}.restore {self._phase(record.uid)}")

    def reconcile(self) -> Mapping[str, int]:
        self.calls.append(f"{self.name}.reconcile")
        return {f"{self.name}_repaired": 1, "shared_counter": 1}


@dataclass
class Env:
    preparer: Preparer
    store: ClaimStore
    specs: cdi.CdiSpecDir
    steps: Sequence[Recording]
    calls: list[str]

    def ref(self, claim: dict[str, Any]) -> ClaimRef:
        meta = claim["metadata"]
        return ClaimRef(namespace=meta["namespace"], name=meta["name"], uid=meta["uid"])

    def env_of(self, uid: str) -> list[str]:
        spec = json.loads(self.specs.path_for(uid).read_bytes())
        (device,) = spec["devices"]
        return list(device["containerEdits"].get("env", []))


def open_env(tmp: Path, *, keeps: bool = False) -> Env:
    inventory = simulated_inventory("h100:2", node_name="node1")
    make_fake_driver(tmp, gpu_uuids=[g.uuid for g in inventory.gpus])
    (tmp / "boot_id").write_text("boot-1\n")
    files = cdi.find_driver_files(
        driver_root=tmp / "driver-root",
        driver_version=inventory.gpus[0].driver_version,
        proc_root=tmp / "proc",
    )
    specs, checkpoint, locks = open_node_storage(tmp, vendor=VENDOR, boot_id_path=tmp / "boot_id")
    calls: list[str] = []
    built: list[Recording] = []

    def steps(node: NodeState) -> list[Recording]:
        built.extend([Recording("a", node, calls), Recording("b", node, calls, keeps=keeps)])
        return built

    store = ClaimStore()
    preparer = Preparer(
        driver_name="gpu.nvidia.com",
        node_name="node1",
        cdi_vendor=VENDOR,
        targets=device_targets(inventory),
        files=files,
        specs=specs,
        checkpoint=checkpoint,
        locks=locks,
        claims=store,
        steps=steps,
    )
    return Env(preparer, store, specs, built, calls)


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    e = open_env(tmp_path)
    yield e
    e.preparer.close()


def test_steps_plan_first_then_apply_in_order_after_one_durable_started_record(env: Env) -> None:
    claim = env.store.add(allocated_claim(name="c1"))
    uid = claim["metadata"]["uid"]
    env.preparer.prepare(env.ref(claim))
    assert env.calls == [
        "a.plan none",
        "b.plan none",
        "a.check",  # PrepareStarted, recorded once, when the first step changes the node
        "b.check",
        f"a.apply {PREPARE_STARTED}",
        f"b.apply {PREPARE_STARTED}",
        "a.check",  # PrepareCompleted, with the same checks
        "b.check",
    ]
    record = env.preparer.checkpoint.get(uid)
    assert record is not None and record.phase == PREPARE_COMPLETED
    assert env.env_of(uid) == ["STEP_A=gpu-0", "STEP_B=gpu-0"]  # each step's edits, in order


def test_unprepare_drops_the_record_then_releases_and_restores_in_reverse(env: Env) -> None:
    claim = env.store.add(allocated_claim(name="c1"))
    env.preparer.prepare(env.ref(claim))
    env.calls.clear()
    env.preparer.unprepare(env.ref(claim))
    assert env.calls == ["b.release none", "a.release none", "b.restore none", "a.restore none"]
    assert not env.specs.path_for(claim["metadata"]["uid"]).exists()


def test_a_step_that_keeps_the_record_is_released_before_the_record_goes(tmp_path: Path) -> None:
    env = open_env(tmp_path, keeps=True)
    try:
        claim = env.store.add(allocated_claim(name="c1"))
        env.preparer.prepare(env.ref(claim))
        env.calls.clear()
        env.preparer.unprepare(env.ref(claim))
        assert env.calls == [
            f"b.release {PREPARE_COMPLETED}",
            f"a.release {PREPARE_COMPLETED}",
            "b.restore none",
            "a.restore none",
        ]
    finally:
        env.preparer.close()


def test_a_failed_apply_rolls_the_claim_back_through_every_step(env: Env) -> None:
    env.steps[1].fail_apply = MpsFailed("no daemon today")
    claim = env.store.add(allocated_claim(name="c1"))
    uid = claim["metadata"]["uid"]
    with pytest.raises(MpsFailed, match="no daemon today"):
        env.preparer.prepare(env.ref(claim))
    assert env.calls[-4:] == [
        f"b.release {PREPARE_STARTED}",  # a rollback releases while the record names the claim
        f"a.release {PREPARE_STARTED}",
        "b.restore none",
        "a.restore none",
    ]
    assert env.preparer.checkpoint.get(uid) is None
    assert not env.specs.path_for(uid).exists()


def test_a_step_check_refuses_the_claim_before_anything_is_applied(env: Env) -> None:
    env.steps[1].conflict = True
    claim = env.store.add(allocated_claim(name="c1"))
    with pytest.raises(DeviceConflict, match="b refuses"):
        env.preparer.prepare(env.ref(claim))
    assert not any(".apply" in call for call in env.calls)
    assert env.preparer.checkpoint.get(claim["metadata"]["uid"]) is None


def test_a_step_with_nothing_to_do_is_not_called_again_for_the_claim(env: Env) -> None:
    env.steps[0].skip = True
    claim = env.store.add(allocated_claim(name="c1"))
    env.preparer.prepare(env.ref(claim))
    assert [c for c in env.calls if c.startswith("a.")] == ["a.plan none"]
    assert env.env_of(claim["metadata"]["uid"]) == ["STEP_B=gpu-0"]


def test_reconcile_asks_every_step_and_adds_up_their_counters(env: Env) -> None:
    done = Repair(env.preparer).reconcile()
    assert env.calls == ["a.reconcile", "b.reconcile"]
    assert done["a_repaired"] == 1 and done["b_repaired"] == 1 and done["shared_counter"] == 2
    assert done["rolled_back"] == 0  # the core's own counters are there too


def test_a_missing_spec_is_written_again_with_the_steps_edits(env: Env) -> None:
    claim = env.store.add(allocated_claim(name="c1"))
    uid = claim["metadata"]["uid"]
    env.preparer.prepare(env.ref(claim))
    env.specs.path_for(uid).unlink()
    assert Repair(env.preparer).reconcile()["specs_rewritten"] == 1
    # Recording steps have no plan for a recorded claim (Step.recorded's default): no edits.
    assert env.env_of(uid) == []
