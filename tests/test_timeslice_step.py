"""Time slicing as a prepare step (sharing/timeslice_step.py), through the Preparer of
tests/test_prepare.py: a GPU's time slice set by the fake driver's stand-in nvidia-smi, the
claim recorded PrepareStarted first, restored after the last claim, repaired by reconcile.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from dra_driver import cdi
from dra_driver.errors import CdiError, TimeSliceFailed
from dra_driver.prepare.repair import Repair
from dra_driver.prepare.state.checkpoint import PREPARE_COMPLETED, PREPARE_STARTED
from dra_driver.sharing.timeslice import NvidiaSmi
from dra_driver.sim.fakedriver import (
    NVIDIA_SMI_FAIL,
    NVIDIA_SMI_HANG,
    NVIDIA_SMI_STATE,
    FakeDriver,
)
from tests.claimdata import allocated_claim, opaque
from tests.test_prepare import API, Env, build_env


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    e = build_env(tmp_path)
    yield e
    e.preparer.close()


def slicing(interval: str | None = None) -> dict[str, object]:
    sharing: dict[str, object] = {"strategy": "TimeSlicing"}
    if interval is not None:
        sharing["timeSlicingConfig"] = {"interval": interval}
    return {"apiVersion": API, "kind": "GpuConfig", "sharing": sharing}


def fake(env: Env) -> FakeDriver:
    return FakeDriver(root=env.tmp / "driver-root", proc_root=env.tmp / "proc", real_nodes=False)


def gpu_uuid(env: Env, device: str) -> str:
    return env.preparer.targets[device].gpu.uuid


def marked(env: Env) -> set[str]:
    marks = env.tmp / "plugin" / "timeslice"
    return {p.name for p in marks.iterdir()} if marks.exists() else set()


def test_a_time_slicing_claim_sets_its_gpus_interval_and_unprepare_restores_default(
    env: Env,
) -> None:
    claim = env.store.add(allocated_claim(name="c1", configs=[opaque(slicing("Long"))]))
    (device,) = env.preparer.prepare(env.ref(claim))
    uuid = gpu_uuid(env, "gpu-0")
    assert device.config["sharing"] == {
        "strategy": "TimeSlicing",
        "timeSlicingConfig": {"interval": "Long"},
    }
    assert fake(env).time_slices() == {uuid: 3}
    assert fake(env).nvidia_smi_calls() == [f"compute-policy -i {uuid} --set-timeslice 3"]
    assert marked(env) == {uuid}
    record = env.checkpoint.get(claim["metadata"]["uid"])
    assert record is not None and record.phase == PREPARE_COMPLETED
    env.preparer.unprepare(env.ref(claim))
    assert fake(env).time_slices() == {uuid: 0}
    assert marked(env) == set()
    # reconcile has nothing to do: every GPU is where the claims (none) want it
    assert Repair(env.preparer).reconcile()["time_slices_set"] == 0
    assert len(fake(env).nvidia_smi_calls()) == 2


def test_time_slicing_without_an_interval_means_default_and_needs_no_nvidia_smi_run(
    env: Env,
) -> None:
    claim = env.store.add(allocated_claim(name="c1", configs=[opaque(slicing())]))
    env.preparer.prepare(env.ref(claim))
    env.preparer.unprepare(env.ref(claim))
    assert fake(env).nvidia_smi_calls() == []  # the GPU was never set to anything else


def test_the_claim_is_recorded_prepare_started_before_the_gpu_is_changed(tmp_path: Path) -> None:
    seen: list[tuple[str, str, str | None]] = []
    env: Env

    class Spy:
        def set(self, gpu_uuid: str, interval: str) -> None:
            (record,) = env.checkpoint.snapshot().values()
            seen.append((gpu_uuid, interval, record.phase))
            assert not env.specs.claim_uids()  # the spec comes after

    env = build_env(tmp_path, timeslicer=Spy())
    try:
        claim = env.store.add(allocated_claim(name="c1", configs=[opaque(slicing("Short"))]))
        env.preparer.prepare(env.ref(claim))
        assert seen == [(gpu_uuid(env, "gpu-0"), "Short", PREPARE_STARTED)]
        assert env.checkpoint.get(claim["metadata"]["uid"]).phase == PREPARE_COMPLETED  # type: ignore[union-attr]
    finally:
        env.preparer.close()


def test_a_failing_nvidia_smi_is_the_claims_error_and_nothing_is_left_behind(env: Env) -> None:
    uuid = gpu_uuid(env, "gpu-0")
    (fake(env).nvidia_smi_dir / NVIDIA_SMI_FAIL).write_text("Unable to set the timeslice: busy\n")
    claim = env.store.add(allocated_claim(name="c1", configs=[opaque(slicing("Medium"))]))
    plain = env.store.add(allocated_claim(name="plain", devices=["gpu-1"]))
    outcomes = env.preparer.prepare_batch([env.ref(claim), env.ref(plain)])
    failed = outcomes[claim["metadata"]["uid"]]
    assert failed.error == (
        f"nvidia-smi compute-policy -i {uuid} --set-timeslice 2 (time slice Medium of GPU "
        f"{uuid}) failed with exit status 255: Unable to set the timeslice: busy"
    )
    assert failed.error_type == "timeslice"
    assert outcomes[plain["metadata"]["uid"]].error == ""
    assert set(env.checkpoint.snapshot()) == {plain["metadata"]["uid"]}
    assert env.specs.claim_uids() == {plain["metadata"]["uid"]}
    # the rollback tried to set Default back (and failed too); reconcile retries it
    assert fake(env).nvidia_smi_calls() == [
        f"compute-policy -i {uuid} --set-timeslice 2",
        f"compute-policy -i {uuid} --set-timeslice 0",
    ]
    (fake(env).nvidia_smi_dir / NVIDIA_SMI_FAIL).unlink()
    assert Repair(env.preparer).reconcile()["time_slices_set"] == 1
    assert fake(env).time_slices() == {uuid: 0}
    assert marked(env) == set()


def test_a_hanging_nvidia_smi_times_out_as_the_claims_error(tmp_path: Path) -> None:
    env = build_env(tmp_path, timeslicer=NvidiaSmi(tmp_path / "driver-root", timeout_s=0.5))
    try:
        (fake(env).nvidia_smi_dir / NVIDIA_SMI_HANG).touch()
        claim = env.store.add(allocated_claim(name="c1", configs=[opaque(slicing("Long"))]))
        started = time.monotonic()
        with pytest.raises(TimeSliceFailed) as info:
            env.preparer.prepare(env.ref(claim))
        assert time.monotonic() - started < 5  # the set and the rollback's restore, 0.5 s each
        uuid = gpu_uuid(env, "gpu-0")
        assert str(info.value) == (
            f"nvidia-smi compute-policy -i {uuid} --set-timeslice 3 (time slice Long of GPU "
            f"{uuid}) did not finish within 0.5 s"
        )
        assert env.checkpoint.snapshot() == {} and env.specs.claim_uids() == set()
    finally:
        env.preparer.close()


def test_claims_sharing_a_gpu_must_ask_for_the_same_interval(env: Env) -> None:
    first = env.store.add(allocated_claim(name="first", configs=[opaque(slicing("Long"))]))
    env.preparer.prepare(env.ref(first))

    def admin(name: str, interval: str) -> dict[str, Any]:
        claim = allocated_claim(name=name, configs=[opaque(slicing(interval))])
        claim["status"]["allocation"]["devices"]["results"][0]["adminAccess"] = True
        return env.store.add(claim)

    other = admin("other", "Short")
    outcome = env.preparer.prepare_batch([env.ref(other)])[other["metadata"]["uid"]]
    assert outcome.error == (
        f"device gpu-0 is prepared for claim default/first ({first['metadata']['uid']}) with "
        "time-slice interval Long; this claim asks for interval Short (a GPU has one time slice "
        "for all its claims)"
    )
    assert outcome.error_type == "device_conflict"
    same = admin("same", "Long")
    assert [d.device for d in env.preparer.prepare(env.ref(same))] == ["gpu-0"]
    uuid = gpu_uuid(env, "gpu-0")
    assert fake(env).nvidia_smi_calls() == [f"compute-policy -i {uuid} --set-timeslice 3"]
    # the GPU keeps Long while a claim asks for it, and goes back to Default after the last
    env.preparer.unprepare(env.ref(first))
    assert fake(env).time_slices() == {uuid: 3}
    env.preparer.unprepare(env.ref(same))
    assert fake(env).time_slices() == {uuid: 0}


def test_a_claim_left_prepare_started_is_rolled_back_and_its_gpu_restored(env: Env) -> None:
    claim = env.store.add(allocated_claim(name="c1", configs=[opaque(slicing("Long"))]))
    env.preparer.prepare(env.ref(claim))
    uid = claim["metadata"]["uid"]
    record = env.checkpoint.get(uid)
    assert record is not None
    # as a crash after nvidia-smi ran and before PrepareCompleted leaves it
    env.checkpoint.transact(
        lambda claims: claims.__setitem__(uid, replace(record, phase=PREPARE_STARTED))
    )
    env.specs.remove(uid)
    restarted = build_env(env.tmp, env.store)
    try:
        done = Repair(restarted.preparer).reconcile()
        assert done["rolled_back"] == 1
        assert fake(env).time_slices() == {gpu_uuid(env, "gpu-0"): 0}
        assert restarted.checkpoint.snapshot() == {}
    finally:
        restarted.preparer.close()


def test_after_a_restart_reconcile_sets_what_the_claims_ask_once(env: Env) -> None:
    kept = env.store.add(allocated_claim(name="kept", configs=[opaque(slicing("Medium"))]))
    gone = env.store.add(
        allocated_claim(name="gone", devices=["gpu-1"], configs=[opaque(slicing("Long"))])
    )
    env.preparer.prepare(env.ref(kept))
    env.preparer.prepare(env.ref(gone))
    # a crash right after the record of "gone" was removed, before Default was set again
    env.checkpoint.transact(lambda claims: claims.discard(gone["metadata"]["uid"]))
    (fake(env).nvidia_smi_dir / NVIDIA_SMI_STATE).unlink()  # and say the GPUs were reset
    restarted = build_env(env.tmp, env.store)
    try:
        assert Repair(restarted.preparer).reconcile()["time_slices_set"] == 2
        assert fake(env).time_slices() == {gpu_uuid(env, "gpu-0"): 2, gpu_uuid(env, "gpu-1"): 0}
        calls = len(fake(env).nvidia_smi_calls())
        assert (
            Repair(restarted.preparer).reconcile()["time_slices_set"] == 0
        )  # known: nothing to run
        assert len(fake(env).nvidia_smi_calls()) == calls
        assert marked(env) == {gpu_uuid(env, "gpu-0")}
    finally:
        restarted.preparer.close()


def test_the_stand_in_nvidia_smi_refuses_what_the_real_one_would(env: Env) -> None:
    smi = str(fake(env).nvidia_smi_dir / "nvidia-smi")
    for args, status, message in [
        (["--help"], 2, "Invalid combination of input arguments"),
        (["compute-policy", "-i", gpu_uuid(env, "gpu-0"), "--set-timeslice", "4"], 2, "valid"),
        (["compute-policy", "-i", "GPU-nope", "--set-timeslice", "1"], 6, "No devices were found"),
    ]:
        done = subprocess.run([smi, *args], capture_output=True, text=True, check=False)
        assert (done.returncode, message in done.stderr) == (status, True), done.stderr


def test_a_spec_that_cannot_be_written_sets_the_gpu_back(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The spec's temp file is the first thing written after the steps changed the node: when
    it fails, the claim is rolled back like any later failure (the interval set back, no
    record, no mark), not left for reconcile."""
    uuid = gpu_uuid(env, "gpu-0")
    claim = env.store.add(allocated_claim(name="c1", configs=[opaque(slicing("Long"))]))

    def begin(self: cdi.CdiSpecDir, uid: str, content: bytes) -> cdi.PendingSpec:
        raise CdiError(f"cannot write CDI spec of {uid}: [Errno 28] No space left on device")

    monkeypatch.setattr(cdi.CdiSpecDir, "begin", begin)
    with pytest.raises(CdiError, match="No space left"):
        env.preparer.prepare(env.ref(claim))
    assert fake(env).time_slices() == {uuid: 0}
    assert env.checkpoint.snapshot() == {} and marked(env) == set()
    monkeypatch.undo()
    env.preparer.prepare(env.ref(claim))  # the kubelet's retry
    assert fake(env).time_slices() == {uuid: 3}
