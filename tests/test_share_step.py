"""Prepare and unprepare of consumable shares (KEP-5075): sharing/share_step.py and shares.py
through prepare.Preparer.

Simulated GPUs, the fake driver root and real files (CDI dir, checkpoint) as in test_prepare;
the share enforcer is tests/shareenforcer.py's RecordingEnforcer, standing in for the MPS
module the preparer will be connected to.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dra_driver.errors import ConfigNotSupported, DeviceConflict, PrepareError
from dra_driver.prepare import ClaimRef
from dra_driver.prepare.repair import Repair
from dra_driver.prepare.state.checkpoint import PREPARE_COMPLETED
from dra_driver.sharing.shares import parse_mode
from tests.claimdata import allocated_claim, new_uid
from tests.shareenforcer import RecordingEnforcer
from tests.test_prepare import MIG_3G, VENDOR, Env, build_env

H100_MIB = 81559  # the simulated h100's memory, whole MiB


def shared_claim(
    name: str, shares: list[tuple[str, dict[str, str]]], *, share_ids: list[str] | None = None
) -> dict[str, Any]:
    """A claim allocated one share per (device, consumedCapacity) entry."""
    claim = allocated_claim(name=name, devices=[device for device, _ in shares])
    ids = share_ids or [new_uid() for _ in shares]
    results = claim["status"]["allocation"]["devices"]["results"]
    for result, (_, consumed), share_id in zip(results, shares, ids, strict=True):
        result["shareID"] = share_id
        result["consumedCapacity"] = consumed
    return claim


def share_of(claim: dict[str, Any], index: int = 0) -> str:
    return str(claim["status"]["allocation"]["devices"]["results"][index]["shareID"])


@pytest.fixture
def enforcer() -> RecordingEnforcer:
    return RecordingEnforcer()


@pytest.fixture
def env(tmp_path: Path, enforcer: RecordingEnforcer) -> Iterator[Env]:
    e = build_env(tmp_path, consumable_shares=parse_mode("unlimited"), share_enforcer=enforcer)
    yield e
    e.preparer.close()


def spec_devices(env: Env, uid: str) -> dict[str, dict[str, Any]]:
    spec = json.loads(env.specs.path_for(uid).read_bytes())
    return {d["name"]: d["containerEdits"] for d in spec["devices"]}


def test_two_claims_share_one_gpu_each_with_its_own_cdi_device_and_memory_limit(
    env: Env, enforcer: RecordingEnforcer
) -> None:
    gpu = env.preparer.targets["gpu-0"].gpu
    a = env.store.add(shared_claim("a", [("gpu-0", {"memory": "20Gi"})]))
    b = env.store.add(shared_claim("b", [("gpu-0", {"memory": "20Gi"})]))
    outcomes = env.preparer.prepare_batch([env.ref(a), env.ref(b)])
    assert {uid: o.error for uid, o in outcomes.items()} == {
        a["metadata"]["uid"]: "",
        b["metadata"]["uid"]: "",
    }
    for claim in (a, b):
        uid, share = claim["metadata"]["uid"], share_of(claim)
        (device,) = outcomes[uid].devices
        assert device.device == "gpu-0" and device.share_id == share
        assert device.cdi_device_ids == (f"{VENDOR}/claim={uid}-gpu-0-share-{share}",)
        edits = spec_devices(env, uid)[f"{uid}-gpu-0-share-{share}"]
        assert edits["env"] == [f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={gpu.uuid}=20480M"]
        assert edits["deviceNodes"][0]["path"] == "/dev/nvidia0"
        record = env.checkpoint.get(uid)
        assert record is not None and record.phase == PREPARE_COMPLETED
        assert record.devices[0].share_id == share
        assert record.devices[0].consumed_capacity == {"memory": "20Gi"}
    # one daemon for the GPU, started once for both shares
    assert enforcer.calls == [("acquire", "shares-gpu-0", frozenset({gpu.uuid}))]


def test_unprepare_of_one_share_leaves_the_other_and_the_daemon_goes_with_the_last(
    env: Env, enforcer: RecordingEnforcer
) -> None:
    a = env.store.add(shared_claim("a", [("gpu-0", {"memory": "20Gi"})]))
    b = env.store.add(shared_claim("b", [("gpu-0", {"memory": "20Gi"})]))
    env.preparer.prepare(env.ref(a))
    env.preparer.prepare(env.ref(b))
    env.preparer.unprepare(env.ref(a))
    assert env.checkpoint.get(a["metadata"]["uid"]) is None
    assert not env.specs.path_for(a["metadata"]["uid"]).exists()
    assert env.specs.path_for(b["metadata"]["uid"]).exists()
    assert enforcer.verbs() == [("acquire", "shares-gpu-0")]
    assert "shares-gpu-0" in enforcer.running
    env.preparer.unprepare(env.ref(b))
    assert enforcer.verbs() == [("acquire", "shares-gpu-0"), ("release", "shares-gpu-0")]
    assert enforcer.running == {}
    # a new share after that starts the daemon again
    c = env.store.add(shared_claim("c", [("gpu-0", {"memory": "1Gi"})]))
    env.preparer.prepare(env.ref(c))
    assert enforcer.verbs()[-1] == ("acquire", "shares-gpu-0")


def test_preparing_a_share_twice_returns_the_same_answer_without_side_effects(
    env: Env, enforcer: RecordingEnforcer
) -> None:
    claim = env.store.add(shared_claim("a", [("gpu-1", {"memory": "10Gi"})]))
    first = env.preparer.prepare(env.ref(claim))
    path = env.specs.path_for(claim["metadata"]["uid"])
    mtime, gets, calls = path.stat().st_mtime_ns, env.store.gets, list(enforcer.calls)
    assert env.preparer.prepare(env.ref(claim)) == first
    assert path.stat().st_mtime_ns == mtime
    assert env.store.gets == gets
    assert enforcer.calls == calls


def test_a_share_on_a_gpu_whose_daemon_runs_is_recorded_once(env: Env) -> None:
    """The fast path: nothing to start, so no PrepareStarted record (one journal append)."""
    journal = env.checkpoint.path.with_suffix(".journal")
    a = env.store.add(shared_claim("a", [("gpu-0", {"memory": "1Gi"})]))
    env.preparer.prepare(env.ref(a))
    after_first = len(journal.read_bytes().splitlines())
    assert after_first == 2  # PrepareStarted, then PrepareCompleted
    b = env.store.add(shared_claim("b", [("gpu-0", {"memory": "1Gi"})]))
    env.preparer.prepare(env.ref(b))
    assert len(journal.read_bytes().splitlines()) == after_first + 1


def test_two_shares_of_one_claim_on_one_gpu_get_two_cdi_devices(env: Env) -> None:
    claim = env.store.add(
        shared_claim("a", [("gpu-2", {"memory": "1Gi"}), ("gpu-2", {"memory": "2Gi"})])
    )
    devices = env.preparer.prepare(env.ref(claim))
    uid = claim["metadata"]["uid"]
    names = sorted(spec_devices(env, uid))
    assert names == sorted(f"{uid}-gpu-2-share-{share_of(claim, i)}" for i in (0, 1))
    assert [d.share_id for d in devices] == [share_of(claim, 0), share_of(claim, 1)]


def test_compute_shares_get_their_thread_percentage_and_no_memory_limit_without_memory(
    tmp_path: Path,
) -> None:
    env = build_env(
        tmp_path, consumable_shares=parse_mode("compute"), share_enforcer=RecordingEnforcer()
    )
    try:
        claim = env.store.add(shared_claim("a", [("gpu-0", {"memory": "0", "compute": "30"})]))
        env.preparer.prepare(env.ref(claim))
        uid = claim["metadata"]["uid"]
        (edits,) = spec_devices(env, uid).values()
        assert edits["env"] == ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=30"]
        over = env.store.add(shared_claim("b", [("gpu-1", {"memory": "0", "compute": "101"})]))
        with pytest.raises(PrepareError, match="compute: shares consume 101 of device gpu-1"):
            env.preparer.prepare(env.ref(over))
    finally:
        env.preparer.close()


def test_a_mig_share_names_the_mig_device_to_mps(env: Env, enforcer: RecordingEnforcer) -> None:
    target = env.preparer.targets[MIG_3G]
    assert target.mig is not None
    claim = env.store.add(shared_claim("a", [(MIG_3G, {"memory": "5Gi", "multiprocessors": "0"})]))
    env.preparer.prepare(env.ref(claim))
    (edits,) = spec_devices(env, claim["metadata"]["uid"]).values()
    assert edits["env"] == [f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={target.mig.uuid}=5120M"]
    assert len(edits["deviceNodes"]) == 3  # the GPU and its GI and CI capability nodes
    assert enforcer.calls == [("acquire", f"shares-{MIG_3G}", frozenset({target.mig.uuid}))]


def _set(path: str, value: Any) -> Any:
    def mutate(result: dict[str, Any]) -> None:
        if value is None:
            result.pop(path, None)
        else:
            result[path] = value

    return mutate


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda r: (r.pop("shareID"), r.pop("consumedCapacity")),
            "allocated before sharing was turned on",
        ),
        (_set("shareID", "Share-1"), "shareID 'Share-1' is not a lowercase UUID"),
        (_set("consumedCapacity", None), "has no consumedCapacity"),
        (_set("consumedCapacity", {"memory": "lots"}), "consumedCapacity memory: 'lots'"),
        (_set("consumedCapacity", {"memory": "-1Gi"}), "consumedCapacity memory -1Gi is negative"),
        (
            _set("consumedCapacity", {"memory": "100Gi"}),
            f"memory: shares consume 100Gi of device gpu-0, which has {H100_MIB}Mi",
        ),
    ],
)
def test_a_bad_share_is_a_clear_error_of_its_claim_only(
    env: Env, mutate: Any, message: str
) -> None:
    bad = shared_claim("bad", [("gpu-0", {"memory": "1Gi"})])
    mutate(bad["status"]["allocation"]["devices"]["results"][0])
    env.store.add(bad)
    good = env.store.add(shared_claim("good", [("gpu-1", {"memory": "1Gi"})]))
    outcomes = env.preparer.prepare_batch([env.ref(bad), env.ref(good)])
    error = outcomes[bad["metadata"]["uid"]].error
    assert error.startswith("ResourceClaim default/bad: ") and message in error
    assert outcomes[good["metadata"]["uid"]].error == ""
    # nothing of the refused claim is left behind
    assert env.checkpoint.get(bad["metadata"]["uid"]) is None
    assert not env.specs.path_for(bad["metadata"]["uid"]).exists()


def test_consumed_capacity_without_a_share_id_is_refused_also_when_sharing_is_off(
    tmp_path: Path,
) -> None:
    env = build_env(tmp_path)
    try:
        claim = allocated_claim(name="c")
        claim["status"]["allocation"]["devices"]["results"][0]["consumedCapacity"] = {"memory": "1"}
        env.store.add(claim)
        with pytest.raises(PrepareError, match="consumedCapacity without a shareID"):
            env.preparer.prepare(env.ref(claim))
        shared = env.store.add(shared_claim("s", [("gpu-0", {"memory": "1Gi"})]))
        with pytest.raises(PrepareError, match=r"--consumable-shares is disabled"):
            env.preparer.prepare(env.ref(shared))
    finally:
        env.preparer.close()


def test_the_same_share_id_twice_in_a_claim_is_refused(env: Env) -> None:
    share = new_uid()
    claim = env.store.add(
        shared_claim(
            "a", [("gpu-0", {"memory": "1Gi"}), ("gpu-1", {"memory": "1Gi"})], share_ids=[share] * 2
        )
    )
    with pytest.raises(PrepareError, match=f"shareID {share} is allocated twice"):
        env.preparer.prepare(env.ref(claim))


def test_shares_that_do_not_fit_the_gpu_together_are_refused(env: Env) -> None:
    a = env.store.add(shared_claim("a", [("gpu-0", {"memory": "50Gi"})]))
    b = env.store.add(shared_claim("b", [("gpu-0", {"memory": "40Gi"})]))
    env.preparer.prepare(env.ref(a))
    with pytest.raises(DeviceConflict, match="memory: shares consume 90Gi of device gpu-0"):
        env.preparer.prepare(env.ref(b))
    assert env.checkpoint.get(a["metadata"]["uid"]) is not None
    assert env.checkpoint.get(b["metadata"]["uid"]) is None


def test_a_share_is_refused_on_a_gpu_a_claim_holds_whole(
    tmp_path: Path, enforcer: RecordingEnforcer
) -> None:
    """Sharing turned on while a claim allocated before holds the GPU whole (restart)."""
    before = build_env(tmp_path)
    whole = before.store.add(allocated_claim(name="whole", devices=["gpu-0"]))
    before.preparer.prepare(before.ref(whole))
    before.preparer.close()
    env = build_env(
        tmp_path, before.store, consumable_shares=parse_mode("memory"), share_enforcer=enforcer
    )
    try:
        share = env.store.add(shared_claim("s", [("gpu-0", {"memory": "1Gi"})]))
        with pytest.raises(DeviceConflict, match="device gpu-0 is already prepared for claim"):
            env.preparer.prepare(env.ref(share))
        # refused by the PrepareStarted record's checks: no daemon was started for it
        assert enforcer.calls == []
    finally:
        env.preparer.close()


def test_shares_are_refused_without_an_enforcer(tmp_path: Path) -> None:
    env = build_env(tmp_path, consumable_shares=parse_mode("4"))
    try:
        claim = env.store.add(shared_claim("a", [("gpu-0", {"memory": "0", "shares": "1"})]))
        with pytest.raises(ConfigNotSupported, match="no MPS daemon to enforce shares"):
            env.preparer.prepare(env.ref(claim))
    finally:
        env.preparer.close()


def test_a_daemon_that_does_not_start_fails_the_claim_and_leaves_nothing(tmp_path: Path) -> None:
    enforcer = RecordingEnforcer(fail_acquire=True)
    env = build_env(tmp_path, consumable_shares=parse_mode("unlimited"), share_enforcer=enforcer)
    try:
        claim = env.store.add(shared_claim("a", [("gpu-0", {"memory": "1Gi"})]))
        (outcome,) = env.preparer.prepare_batch([env.ref(claim)]).values()
        assert outcome.error_type == "share"
        assert "MPS daemon shares-gpu-0 did not start" in outcome.error
        assert env.checkpoint.get(claim["metadata"]["uid"]) is None
        assert not env.specs.path_for(claim["metadata"]["uid"]).exists()
        assert enforcer.verbs() == [("acquire", "shares-gpu-0"), ("release", "shares-gpu-0")]
    finally:
        env.preparer.close()


def test_a_restarted_agent_acquires_the_daemons_of_recorded_shares(
    tmp_path: Path, enforcer: RecordingEnforcer
) -> None:
    mode = parse_mode("unlimited")
    first = build_env(tmp_path, consumable_shares=mode, share_enforcer=enforcer)
    claim = first.store.add(shared_claim("a", [("gpu-3", {"memory": "1Gi"})]))
    first.preparer.prepare(first.ref(claim))
    first.preparer.close()
    again = RecordingEnforcer()
    second = build_env(tmp_path, first.store, consumable_shares=mode, share_enforcer=again)
    try:
        assert Repair(second.preparer).reconcile()["share_daemons_acquired"] == 1
        assert again.verbs() == [("acquire", "shares-gpu-3")]
        assert Repair(second.preparer).reconcile()["share_daemons_acquired"] == 0
    finally:
        second.preparer.close()


def test_a_lost_checkpoint_is_rebuilt_with_the_share_ids_of_the_specs(env: Env) -> None:
    claim = env.store.add(shared_claim("a", [("gpu-0", {"memory": "1Gi"})]))
    uid = claim["metadata"]["uid"]
    env.preparer.prepare(env.ref(claim))
    env.checkpoint.transact(lambda claims: claims.discard(uid))
    assert Repair(env.preparer).rebuild_from_specs() == 1
    record = env.checkpoint.get(uid)
    assert record is not None
    assert [(d.device, d.share_id) for d in record.devices] == [("gpu-0", share_of(claim))]
    # the kubelet's next prepare answers from scratch, with the same CDI device
    again = env.preparer.prepare(ClaimRef(namespace="default", name="a", uid=uid))
    assert again[0].cdi_device_ids == (f"{VENDOR}/claim={uid}-gpu-0-share-{share_of(claim)}",)


def test_a_daemon_that_does_not_stop_never_fails_the_unprepare(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    enforcer = RecordingEnforcer(fail_release=True)
    env = build_env(tmp_path, consumable_shares=parse_mode("memory"), share_enforcer=enforcer)
    try:
        claim = env.store.add(shared_claim("a", [("gpu-0", {"memory": "1Gi"})]))
        env.preparer.prepare(env.ref(claim))
        (outcome,) = env.preparer.unprepare_batch([env.ref(claim)]).values()
        assert outcome.error == ""
        assert env.checkpoint.get(claim["metadata"]["uid"]) is None
        assert enforcer.verbs()[-1] == ("release", "shares-gpu-0")
        assert "cannot release a device's shared MPS daemon" in caplog.text
    finally:
        env.preparer.close()
