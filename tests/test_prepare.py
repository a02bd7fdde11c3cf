"""prepare.Preparer on simulated GPUs, a fake driver root and real files (CDI dir, checkpoint).

Claims come from an in-memory ClaimSource here, to test the decisions alone; tests/test_plugin_*
drive the same code through gRPC and the real Kubernetes client.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from dra_driver import cdi
from dra_driver.errors import (
    CdiError,
    CheckpointError,
    ConfigDecodeError,
    ConfigNotSupported,
    KubeUnavailable,
    PrepareError,
)
from dra_driver.node.wiring import prepare_steps
from dra_driver.prepare import ClaimRef, Preparer, device_targets
from dra_driver.prepare.repair import Repair
from dra_driver.prepare.state import checkpoint
from dra_driver.prepare.state.checkpoint import (
    PREPARE_COMPLETED,
    PREPARE_STARTED,
    Checkpoint,
    ClaimRecord,
    PreparedDevice,
)
from dra_driver.prepare.state.nodestate import prepared_devices_by_type, recorded_device_names
from dra_driver.sharing.shares import DISABLED, ShareEnforcer, SharesMode
from dra_driver.sharing.timeslice import NvidiaSmi, TimeSlicer
from dra_driver.sim.fakedriver import (
    make_fake_driver,
    simulated_inventory,
)
from tests.claimdata import ClaimStore, allocated_claim, new_uid, opaque, uid_sharing_the_lock_of
from tests.nodestorage import open_node_storage

VENDOR = "k8s.gpu.nvidia.com"
SPEC = "h100:4,a100-40gb:1:mig=3g.20gb+2g.10gb"
MIG_3G = "gpu-4-mig-3g20gb-9-0"


@dataclass
class Env:
    preparer: Preparer
    store: ClaimStore
    specs: cdi.CdiSpecDir
    checkpoint: Checkpoint
    tmp: Path

    def ref(self, claim: dict[str, object]) -> ClaimRef:
        meta = claim["metadata"]
        assert isinstance(meta, dict)
        return ClaimRef(namespace=meta["namespace"], name=meta["name"], uid=meta["uid"])


def build_env(
    tmp: Path,
    store: ClaimStore | None = None,
    *,
    timeslicer: TimeSlicer | None = None,
    consumable_shares: SharesMode = DISABLED,
    share_enforcer: ShareEnforcer | None = None,
) -> Env:
    """A Preparer over ``tmp`` (a second one over the same ``tmp`` is the agent restarted); time
    slices are set by the fake driver's stand-in nvidia-smi unless ``timeslicer`` is given."""
    inventory = simulated_inventory(SPEC, node_name="node1")
    if not (tmp / "driver-root").exists():
        make_fake_driver(tmp, gpu_uuids=[g.uuid for g in inventory.gpus])
        (tmp / "boot_id").write_text("boot-1\n")
    fake_root = tmp / "driver-root"
    files = cdi.find_driver_files(
        driver_root=fake_root, driver_version=inventory.gpus[0].driver_version,
        proc_root=tmp / "proc",
    )  # fmt: skip
    specs, checkpoint, locks = open_node_storage(tmp, vendor=VENDOR, boot_id_path=tmp / "boot_id")
    store = store or ClaimStore()
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
        steps=prepare_steps(
            timeslicer=timeslicer or NvidiaSmi(fake_root, timeout_s=5),
            consumable_shares=consumable_shares,
            share_enforcer=share_enforcer,
        ),
    )
    return Env(preparer, store, specs, checkpoint, tmp)


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    e = build_env(tmp_path)
    yield e
    e.preparer.close()


def test_prepare_answers_one_device_per_result_with_cdi_ids(env: Env) -> None:
    claim = env.store.add(allocated_claim(name="c1", devices=["gpu-0", ("big/fast", "gpu-1")]))
    uid = claim["metadata"]["uid"]
    devices = env.preparer.prepare(env.ref(claim))
    assert [(d.request_names, d.pool, d.device, d.cdi_device_ids) for d in devices] == [
        (("gpus",), "node1", "gpu-0", (f"{VENDOR}/claim={uid}-gpu-0",)),
        (("big",), "node1", "gpu-1", (f"{VENDOR}/claim={uid}-gpu-1",)),
    ]
    spec = json.loads(env.specs.path_for(uid).read_bytes())
    assert spec["kind"] == f"{VENDOR}/claim"
    assert [d["name"] for d in spec["devices"]] == [f"{uid}-gpu-0", f"{uid}-gpu-1"]
    record = env.checkpoint.get(uid)
    assert record is not None and record.phase == PREPARE_COMPLETED
    assert record.devices[0].config == {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "GpuConfig",
    }


def test_prepare_twice_returns_the_same_devices_without_side_effects(env: Env) -> None:
    claim = env.store.add(allocated_claim(name="c1"))
    first = env.preparer.prepare(env.ref(claim))
    path = env.specs.path_for(claim["metadata"]["uid"])
    mtime = path.stat().st_mtime_ns
    gets = env.store.gets
    assert env.preparer.prepare(env.ref(claim)) == first
    assert path.stat().st_mtime_ns == mtime
    assert env.store.gets == gets  # not even the API is asked again


def test_results_of_other_drivers_are_ignored(env: Env) -> None:
    claim = env.store.add(
        allocated_claim(
            name="c1",
            extra_results=[
                {"request": "nic", "driver": "net.example.com", "pool": "node1", "device": "eth3"}
            ],
        )
    )
    assert [d.device for d in env.preparer.prepare(env.ref(claim))] == ["gpu-0"]


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda c: c["metadata"].update(uid=new_uid()), "has UID"),
        (lambda c: c["status"].pop("allocation"), "is not allocated"),
        (
            lambda c: c["status"]["allocation"]["nodeSelector"]["nodeSelectorTerms"][0][
                "matchFields"
            ][0].update(values=["node2"]),
            "allocated on node node2",
        ),
        (
            lambda c: c["status"]["allocation"]["devices"]["results"][0].update(device="gpu-99"),
            "node1/gpu-99, which this node does not have",
        ),
        (
            lambda c: c["status"]["allocation"]["devices"]["results"][0].update(pool="node2"),
            "node2/gpu-0",
        ),
    ],
)
def test_prepare_refuses_claims_that_do_not_fit(env: Env, mutate, message: str) -> None:  # type: ignore[no-untyped-def]
    claim = allocated_claim(name="c1")
    ref = env.ref(claim)
    mutate(claim)
    env.store.add(claim)
    with pytest.raises(PrepareError, match=message):
        env.preparer.prepare(ref)
    assert env.specs.claim_uids() == set()
    assert env.checkpoint.snapshot() == {}


def test_prepare_of_a_missing_claim_is_an_error(env: Env) -> None:
    with pytest.raises(PrepareError, match="does not exist"):
        env.preparer.prepare(ClaimRef("default", "gone", new_uid()))


@pytest.mark.parametrize(
    ("ref", "message"),
    [
        (ClaimRef("default", "c1", "../../etc/x"), "not a lowercase UUID"),
        (ClaimRef("default", "c1", "ABCDEF00-0000-0000-0000-000000000000"), "not a lowercase UUID"),
        (ClaimRef("Bad_NS", "c1", "0f0f0f0f-0000-0000-0000-000000000000"), "namespace"),
        (ClaimRef("default", "a/../b", "0f0f0f0f-0000-0000-0000-000000000000"), "claim name"),
    ],
)
def test_bad_claim_references_never_reach_a_path_or_the_api(
    env: Env, ref: ClaimRef, message: str
) -> None:
    with pytest.raises(PrepareError, match=message):
        env.preparer.prepare(ref)
    assert env.store.gets == 0
    assert list((env.tmp / "cdi").iterdir()) == []


API = "resource.nvidia.com/v1beta1"


def caps(*names: str, kind: str = "GpuConfig") -> dict[str, object]:
    return {"apiVersion": API, "kind": kind, "driverCapabilities": list(names)}


def test_class_configs_apply_before_claim_configs_and_the_last_wins(env: Env) -> None:
    claim = env.store.add(
        allocated_claim(
            name="c1",
            configs=[
                opaque(caps("video"), source="FromClaim", requests=["gpus"]),  # listed first
                opaque(caps("graphics"), source="FromClass", requests=["gpus"]),
                opaque({"anything": 1}, driver="other.example.com"),  # other drivers: ignored
            ],
        )
    )
    (device,) = env.preparer.prepare(env.ref(claim))
    assert device.config["driverCapabilities"] == ["video"]


def test_a_config_for_another_request_does_not_apply(env: Env) -> None:
    claim = env.store.add(
        allocated_claim(
            name="c1",
            devices=[("a/sub", "gpu-0"), ("b", "gpu-1")],
            configs=[opaque(caps("compute", "video"), requests=["a"])],
        )
    )
    a, b = env.preparer.prepare(env.ref(claim))
    assert a.config["driverCapabilities"] == ["compute", "video"]
    assert b.config == {"apiVersion": API, "kind": "GpuConfig"}


MPS = {"strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": 10 * 2**30}}


# This Preparer runs no MPS daemons (tests/test_mps.py has those that do), as an agent without
# --mps-image.
NO_DAEMONS = (
    "sharing (strategy MPS) is not available: this agent was started without --mps-image "
    "(MPS_IMAGE), so it cannot run MPS control daemons"
)


@pytest.mark.parametrize(
    ("device", "parameters", "why"),
    [
        ("gpu-0", {"apiVersion": API, "kind": "GpuConfig", "sharing": MPS}, NO_DAEMONS),
        (MIG_3G, {"apiVersion": API, "kind": "MigDeviceConfig", "sharing": MPS}, NO_DAEMONS),
    ],
)
def test_a_sharing_config_is_refused_with_the_field_named_and_other_claims_still_prepare(
    env: Env, device: str, parameters: dict[str, object], why: str
) -> None:
    shared = env.store.add(
        allocated_claim(name="shared", devices=[device], configs=[opaque(parameters)])
    )
    plain = env.store.add(allocated_claim(name="plain", devices=["gpu-1"]))
    outcomes = env.preparer.prepare_batch([env.ref(shared), env.ref(plain)])
    refused = outcomes[shared["metadata"]["uid"]]
    assert refused.error == f"ResourceClaim default/shared: {why}"
    assert refused.error_type == "config"
    assert refused.devices == ()
    with pytest.raises(ConfigNotSupported):  # the same refusal, outside a batch
        env.preparer.prepare(env.ref(shared))
    ok = outcomes[plain["metadata"]["uid"]]
    assert (ok.error, [d.device for d in ok.devices]) == ("", ["gpu-1"])
    # nothing of the refused claim is left behind: no spec, no record, its device still free
    assert env.specs.claim_uids() == {plain["metadata"]["uid"]}
    assert shared["metadata"]["uid"] not in env.checkpoint.snapshot()
    again = env.store.add(allocated_claim(name="exclusive", devices=[device]))
    assert [d.device for d in env.preparer.prepare(env.ref(again))] == [device]


def test_time_slicing_of_a_mig_device_is_accepted_with_no_effect_as_nvidias_driver_does(
    env: Env,
) -> None:
    config = {"apiVersion": API, "kind": "MigDeviceConfig", "sharing": {"strategy": "TimeSlicing"}}
    claim = env.store.add(allocated_claim(name="c", devices=[MIG_3G], configs=[opaque(config)]))
    (device,) = env.preparer.prepare(env.ref(claim))
    assert device.device == MIG_3G
    assert device.config["sharing"] == {"strategy": "TimeSlicing"}


def test_a_sharing_config_that_a_later_config_replaces_is_not_refused(env: Env) -> None:
    sharing = {"apiVersion": API, "kind": "GpuConfig", "sharing": MPS}
    claim = env.store.add(
        allocated_claim(
            name="c1",
            configs=[
                opaque(sharing, source="FromClass"),  # what the class says is overridden
                opaque({"apiVersion": API, "kind": "GpuConfig"}, source="FromClaim"),
            ],
        )
    )
    (device,) = env.preparer.prepare(env.ref(claim))
    assert device.config == {"apiVersion": API, "kind": "GpuConfig"}


def test_an_invalid_sharing_config_reports_its_mistake_not_that_sharing_is_unsupported(
    env: Env,
) -> None:
    typo = {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentag": 50}}
    claim = env.store.add(
        allocated_claim(
            name="c1", configs=[opaque({"apiVersion": API, "kind": "GpuConfig", "sharing": typo})]
        )
    )
    with pytest.raises(ConfigDecodeError) as info:
        env.preparer.prepare(env.ref(claim))
    assert "sharing.mpsConfig.defaultActiveThreadPercentag: Extra inputs" in str(info.value)
    assert "not supported" not in str(info.value)


def test_the_driver_capabilities_of_a_mig_device_are_recorded_in_the_checkpoint(env: Env) -> None:
    mig = caps("all", kind="MigDeviceConfig")
    claim = env.store.add(allocated_claim(name="c1", devices=[MIG_3G], configs=[opaque(mig)]))
    (device,) = env.preparer.prepare(env.ref(claim))
    assert device.config == mig
    record = env.checkpoint.get(claim["metadata"]["uid"])
    assert record is not None and record.devices[0].config == mig


BAD_LIMIT = {"strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": "lots"}}


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"apiVersion": API, "kind": "TpuConfig"}, "kind 'TpuConfig' is unknown"),
        ({"apiVersion": API, "kind": "GpuConfig", "shareing": {}}, "shareing: Extra inputs"),
        ({"apiVersion": "resource.nvidia.com/v1", "kind": "GpuConfig"}, "apiVersion"),
        ({"apiVersion": API, "kind": "GpuConfig", "sharing": BAD_LIMIT}, "not a valid quantity"),
        ({"apiVersion": API, "kind": "GpuConfig", "sharing": {"strategy": "Spatial"}}, "strategy"),
        (caps("compute", "vidoe"), r"unknown driver capability 'vidoe' \(allowed: compute, "),
        (["not", "an", "object"], "must be a JSON object"),
    ],
)
def test_invalid_opaque_configs_are_a_clear_claim_error(
    env: Env, parameters: dict[str, object], message: str
) -> None:
    claim = env.store.add(allocated_claim(name="c1", configs=[opaque(parameters)]))
    with pytest.raises(ConfigDecodeError, match=message):
        env.preparer.prepare(env.ref(claim))
    assert env.specs.claim_uids() == set()


def test_gpu_config_on_a_mig_device_is_refused(env: Env) -> None:
    gpu_config = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig"}
    claim = env.store.add(
        allocated_claim(name="c1", devices=[MIG_3G], configs=[opaque(gpu_config)])
    )
    with pytest.raises(ConfigDecodeError, match="mig device: GpuConfig does not apply"):
        env.preparer.prepare(env.ref(claim))


def test_mig_device_gets_its_capability_nodes(env: Env) -> None:
    claim = env.store.add(allocated_claim(name="c1", devices=[MIG_3G]))
    (device,) = env.preparer.prepare(env.ref(claim))
    spec = json.loads(env.specs.path_for(claim["metadata"]["uid"]).read_bytes())
    paths = [n["path"] for n in spec["devices"][0]["containerEdits"]["deviceNodes"]]
    # gpu4, GPU instance 2 of the simulated layout: the kernel table's minors for it
    assert paths == [
        "/dev/nvidia4",
        "/dev/nvidia-caps/nvidia-cap561",
        "/dev/nvidia-caps/nvidia-cap562",
    ]
    assert device.config == {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "MigDeviceConfig"}


def test_a_device_held_by_another_claim_is_refused(env: Env) -> None:
    first = env.store.add(allocated_claim(name="c1", devices=["gpu-2"]))
    second = env.store.add(allocated_claim(name="c2", devices=["gpu-2"]))
    env.preparer.prepare(env.ref(first))
    with pytest.raises(PrepareError, match=r"gpu-2 is already prepared for claim default/c1"):
        env.preparer.prepare(env.ref(second))
    assert env.specs.claim_uids() == {first["metadata"]["uid"]}
    assert env.specs.temp_files() == []  # its spec was being written: dropped with the claim
    assert set(env.checkpoint.snapshot()) == {first["metadata"]["uid"]}


@pytest.mark.parametrize("failing", ["spec fsync", "PrepareCompleted append"])
def test_a_failed_write_leaves_no_spec_temp_file_or_record(
    env: Env, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    claim = env.store.add(allocated_claim(name="c1", devices=["gpu-1"]))
    if failing == "spec fsync":

        def sync(self: cdi.PendingSpec) -> None:
            raise CdiError(f"cannot write CDI spec {self.final}: [Errno 5] Input/output error")

        monkeypatch.setattr(cdi.PendingSpec, "sync", sync)
        error: type[Exception] = CdiError
    else:
        real = env.checkpoint.transact

        def transact(op: Any, *, durable: bool = True) -> Any:
            if durable and op.__qualname__.startswith("Preparer._record"):
                raise CheckpointError("cannot write checkpoint.journal: [Errno 28] No space left")
            return real(op, durable=durable)

        monkeypatch.setattr(env.checkpoint, "transact", transact)
        error = CheckpointError
    with pytest.raises(error):
        env.preparer.prepare(env.ref(claim))
    assert list(env.specs.root.iterdir()) == []
    assert env.checkpoint.snapshot() == {}
    monkeypatch.undo()
    # nothing left half-done: the kubelet's retry prepares it normally
    assert [d.device for d in env.preparer.prepare(env.ref(claim))] == ["gpu-1"]
    assert env.specs.claim_uids() == {claim["metadata"]["uid"]}


def test_admin_access_may_share_a_prepared_device(env: Env) -> None:
    first = env.store.add(allocated_claim(name="c1", devices=["gpu-2"]))
    admin = allocated_claim(name="admin", devices=["gpu-2"])
    admin["status"]["allocation"]["devices"]["results"][0]["adminAccess"] = True
    env.store.add(admin)
    env.preparer.prepare(env.ref(first))
    assert [d.device for d in env.preparer.prepare(env.ref(admin))] == ["gpu-2"]


def test_unprepare_removes_spec_and_record_and_frees_the_device(env: Env) -> None:
    claim = env.store.add(allocated_claim(name="c1", devices=["gpu-3"]))
    prepared = env.preparer.prepare(env.ref(claim))
    assert env.preparer.unprepare(env.ref(claim)) == prepared  # what it held (for the log)
    assert [d.device for d in prepared] == ["gpu-3"]
    assert env.specs.claim_uids() == set()
    assert env.checkpoint.snapshot() == {}
    other = env.store.add(allocated_claim(name="c2", devices=["gpu-3"]))
    env.preparer.prepare(env.ref(other))


def test_unprepare_of_unknown_or_deleted_claims_succeeds(env: Env) -> None:
    assert env.preparer.unprepare(ClaimRef("default", "never", new_uid())) == ()
    claim = env.store.add(allocated_claim(name="c1"))
    prepared = env.preparer.prepare(env.ref(claim))
    env.store.delete(claim)
    assert env.preparer.unprepare(env.ref(claim)) == prepared
    outcome = env.preparer.unprepare_batch([env.ref(claim)])[claim["metadata"]["uid"]]
    assert outcome.devices == () and not outcome.error  # a retry: it holds nothing any more
    assert env.specs.claim_uids() == set()


def test_one_bad_claim_never_fails_the_others_in_a_batch(env: Env) -> None:
    good = [env.store.add(allocated_claim(name=f"g{i}", devices=[f"gpu-{i}"])) for i in range(3)]
    bad = env.store.add(allocated_claim(name="bad", devices=["gpu-77"]))
    outcomes = env.preparer.prepare_batch([env.ref(c) for c in [*good, bad]])
    assert {uid: bool(o.error) for uid, o in outcomes.items()} == {
        **{c["metadata"]["uid"]: False for c in good},
        bad["metadata"]["uid"]: True,
    }


def test_each_failed_claim_of_a_batch_says_what_kind_of_error_it_was(env: Env) -> None:
    held = env.store.add(allocated_claim(name="held", devices=["gpu-1"]))
    env.preparer.prepare(env.ref(held))
    unallocated = allocated_claim(name="unallocated")
    del unallocated["status"]["allocation"]
    recreated = allocated_claim(name="recreated")
    env.store.add({**recreated, "metadata": {**recreated["metadata"], "uid": new_uid()}})
    bad_config = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "TpuConfig"}
    cases = {
        "ok": (env.store.add(allocated_claim(name="ok", devices=["gpu-0"])), ""),
        "missing": (allocated_claim(name="missing"), "claim_not_found"),
        "recreated": (recreated, "claim_not_found"),
        "unallocated": (env.store.add(unallocated), "invalid_claim"),
        "elsewhere": (env.store.add(allocated_claim(name="elsewhere", node="n2")), "invalid_claim"),
        "conflict": (
            env.store.add(allocated_claim(name="conflict", devices=["gpu-1"])),
            "device_conflict",
        ),
        "config": (
            env.store.add(
                allocated_claim(name="config", devices=["gpu-2"], configs=[opaque(bad_config)])
            ),
            "config",
        ),
    }
    outcomes = env.preparer.prepare_batch([env.ref(claim) for claim, _ in cases.values()])
    got = {
        name: (
            outcomes[claim["metadata"]["uid"]].error_type,
            bool(outcomes[claim["metadata"]["uid"]].error),
        )
        for name, (claim, _) in cases.items()
    }
    assert got == {name: (kind, bool(kind)) for name, (_, kind) in cases.items()}


def test_a_claim_the_api_cannot_show_is_an_api_error(env: Env) -> None:
    class Failing(ClaimStore):
        def get_resource_claim(self, *, namespace: str, name: str) -> dict[str, object] | None:
            raise KubeUnavailable("connection refused", verb="get", resource="resourceclaims")

    failing = build_env(env.tmp / "other", Failing())
    try:
        ref = ClaimRef("default", "c1", new_uid())
        (outcome,) = failing.preparer.prepare_batch([ref]).values()
        assert outcome.error_type == "api_error"
        assert "connection refused" in outcome.error
        (outcome,) = failing.preparer.unprepare_batch([ClaimRef("", "", "BAD")]).values()
        assert outcome.error_type == "invalid_claim"
    finally:
        failing.preparer.close()


def test_prepared_devices_are_counted_by_type_once_each(env: Env) -> None:
    assert prepared_devices_by_type(env.checkpoint.snapshot().values(), env.preparer.targets) == {
        "gpu": 0,
        "mig": 0,
    }
    both = env.store.add(allocated_claim(name="c1", devices=["gpu-0", MIG_3G]))
    env.preparer.prepare(env.ref(both))
    admin = allocated_claim(name="admin", devices=["gpu-0"])
    admin["status"]["allocation"]["devices"]["results"][0]["adminAccess"] = True
    env.preparer.prepare(env.ref(env.store.add(admin)))
    one = env.store.add(allocated_claim(name="c2", devices=["gpu-1"]))
    env.preparer.prepare(env.ref(one))
    assert prepared_devices_by_type(env.checkpoint.snapshot().values(), env.preparer.targets) == {
        "gpu": 2,
        "mig": 1,
    }
    # a claim still being prepared holds nothing yet
    uid = one["metadata"]["uid"]
    record = env.checkpoint.get(uid)
    assert record is not None
    env.checkpoint.transact(
        lambda claims: claims.__setitem__(
            uid, record.__class__(**{**record.__dict__, "phase": PREPARE_STARTED})
        )
    )
    assert prepared_devices_by_type(env.checkpoint.snapshot().values(), env.preparer.targets) == {
        "gpu": 1,
        "mig": 1,
    }
    env.preparer.unprepare(env.ref(both))
    assert prepared_devices_by_type(env.checkpoint.snapshot().values(), env.preparer.targets) == {
        "gpu": 1,
        "mig": 0,
    }  # the admin claim
    # devices this node no longer has (a GPU gone since the claim was prepared): typed by name
    gone = ClaimRecord(
        uid=new_uid(),
        namespace="default",
        name="old",
        phase=PREPARE_COMPLETED,
        devices=tuple(
            PreparedDevice(request_names=("gpus",), pool="node1", device=name, cdi_device_ids=())
            for name in ("gpu-9", "gpu-9-mig-1g10gb-19-6")
        ),
    )
    env.checkpoint.transact(lambda claims: claims.__setitem__(gone.uid, gone))
    assert prepared_devices_by_type(env.checkpoint.snapshot().values(), env.preparer.targets) == {
        "gpu": 2,
        "mig": 1,
    }


def test_empty_batch_gives_an_empty_answer(env: Env) -> None:
    assert env.preparer.prepare_batch([]) == {}
    assert env.preparer.unprepare_batch([]) == {}


def test_concurrent_prepares_of_the_same_claim_prepare_it_once(env: Env) -> None:
    claim = env.store.add(allocated_claim(name="c1"))
    results = []

    def run() -> None:
        results.append(env.preparer.prepare(env.ref(claim)))

    threads = [threading.Thread(target=run) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 16 and all(r == results[0] for r in results)
    assert env.store.gets == 1


def test_reconcile_rolls_back_half_done_prepares_and_removes_orphaned_specs(env: Env) -> None:
    claim = env.store.add(allocated_claim(name="c1"))
    env.preparer.prepare(env.ref(claim))
    uid = claim["metadata"]["uid"]
    record = env.checkpoint.get(uid)
    assert record is not None
    env.checkpoint.transact(
        lambda claims: claims.__setitem__(
            uid, record.__class__(**{**record.__dict__, "phase": PREPARE_STARTED})
        )
    )
    orphan = new_uid()
    env.specs.write(orphan, b'{"cdiVersion":"0.5.0"}')
    unrelated = env.tmp / "cdi" / "other-vendor.json"
    unrelated.write_text("{}")
    done = Repair(env.preparer).reconcile()
    assert done["rolled_back"] == 1 and done["orphan_specs_removed"] == 1
    assert env.specs.claim_uids() == set()
    assert env.checkpoint.snapshot() == {}
    assert unrelated.exists()  # never touch files that are not ours
    # and the claim prepares again with the same answer
    assert env.preparer.prepare(env.ref(claim))[0].device == "gpu-0"


def test_reconcile_removes_temp_files_of_crashed_writes_but_not_of_writes_in_flight(
    env: Env,
) -> None:
    crashed, busy = new_uid(), new_uid()
    cdi_dir = env.tmp / "cdi"
    leftover = cdi_dir / f".k8s.gpu.nvidia.com-claim_{crashed}.json.0badf00d.tmp"
    in_flight = cdi_dir / f".k8s.gpu.nvidia.com-claim_{busy}.json.cafef00d.tmp"
    leftover.write_text("half")
    in_flight.write_text("being written")
    holding, release = threading.Event(), threading.Event()

    def writer() -> None:  # a prepare of `busy` holds its claim lock while it writes
        with env.preparer.locks.hold(busy):
            holding.set()
            release.wait(5)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        assert holding.wait(5)
        assert Repair(env.preparer).reconcile()["temp_files_removed"] == 1
        assert not leftover.exists() and in_flight.exists()
    finally:
        release.set()
        thread.join()
    assert Repair(env.preparer).reconcile()["temp_files_removed"] == 1
    assert not in_flight.exists()


def test_reconcile_unprepares_claims_deleted_or_replaced_in_the_api(env: Env) -> None:
    deleted = env.store.add(allocated_claim(name="c1", devices=["gpu-0"]))
    replaced = env.store.add(allocated_claim(name="c2", devices=["gpu-1"]))
    kept = env.store.add(allocated_claim(name="c3", devices=["gpu-2"]))
    for c in (deleted, replaced, kept):
        env.preparer.prepare(env.ref(c))
    env.store.delete(deleted)
    env.store.add(allocated_claim(name="c2", devices=["gpu-1"]))  # same name, new UID
    assert Repair(env.preparer).reconcile()["unprepared_gone"] == 2
    assert env.specs.claim_uids() == {kept["metadata"]["uid"]}


def test_reconcile_unprepares_claims_no_pod_can_use_and_keeps_the_others(env: Env) -> None:
    """A claim deallocated, allocated elsewhere, or reserved for no pod any more is stale (its
    unprepare was lost); one still reserved for a pod is kept, as is any claim while the API
    server cannot be asked."""
    names = ["deallocated", "moved", "unreserved", "kept"]
    claims = {
        n: env.store.add(allocated_claim(name=n, devices=[f"gpu-{i}"])) for i, n in enumerate(names)
    }
    for c in claims.values():
        env.preparer.prepare(env.ref(c))
    del claims["deallocated"]["status"]["allocation"]
    claims["moved"]["status"]["allocation"]["devices"]["results"][0]["pool"] = "node2"
    claims["unreserved"]["status"]["reservedFor"] = []
    real_get = env.store.get_resource_claim

    def unavailable(*, namespace: str, name: str) -> dict[str, Any] | None:
        raise KubeUnavailable("API server unreachable", verb="get", resource="resourceclaims")

    env.store.get_resource_claim = unavailable  # type: ignore[method-assign]
    assert Repair(env.preparer).reconcile()["unprepared_gone"] == 0
    env.store.get_resource_claim = real_get  # type: ignore[method-assign]
    assert Repair(env.preparer).reconcile()["unprepared_gone"] == 3
    assert set(env.checkpoint.snapshot()) == {claims["kept"]["metadata"]["uid"]}
    assert env.specs.claim_uids() == {claims["kept"]["metadata"]["uid"]}


def test_a_lost_unprepare_never_blocks_the_device(env: Env) -> None:
    """The unprepare record is not synced (docs/plugin.md, "Durability"): had one been lost,
    the stale claim would hold its device. A prepare that wants the device asks the API server
    about the holder and clears it; a holder still in use keeps the device."""
    old = env.store.add(allocated_claim(name="old", devices=["gpu-1"]))
    env.preparer.prepare(env.ref(old))
    env.store.delete(old)  # its pod is gone, the kubelet's unprepare never reached the disk
    new = env.store.add(allocated_claim(name="new", devices=["gpu-1"]))
    assert [d.device for d in env.preparer.prepare(env.ref(new))] == ["gpu-1"]
    assert set(env.checkpoint.snapshot()) == {new["metadata"]["uid"]}
    assert env.specs.claim_uids() == {new["metadata"]["uid"]}
    # the holder is in use: refused as before, and the holder keeps its spec
    third = env.store.add(allocated_claim(name="third", devices=["gpu-1"]))
    with pytest.raises(PrepareError, match="gpu-1 is already prepared for claim default/new"):
        env.preparer.prepare(env.ref(third))
    assert env.specs.claim_uids() == {new["metadata"]["uid"]}


def test_a_lost_unprepare_is_cleared_even_when_its_claim_shares_the_lock_of_the_new_one(
    env: Env,
) -> None:
    """Claim locks are striped: two UIDs share one of 4,096 locks now and then. The prepare
    holds its own claim's lock; a stale holder on the same stripe is not "being worked on"
    and is cleared (it was refused, for that pair of claims on every retry, and failed CI)."""
    new_uid_ = new_uid()
    old = env.store.add(
        allocated_claim(name="old", uid=uid_sharing_the_lock_of(new_uid_), devices=["gpu-1"])
    )
    env.preparer.prepare(env.ref(old))
    env.store.delete(old)
    new = env.store.add(allocated_claim(name="new", uid=new_uid_, devices=["gpu-1"]))
    assert [d.device for d in env.preparer.prepare(env.ref(new))] == ["gpu-1"]
    assert set(env.checkpoint.snapshot()) == {new_uid_}
    assert env.specs.claim_uids() == {new_uid_}
    assert env.preparer.locks._threads == {}  # nothing left held


def test_unprepare_appends_without_a_sync_and_prepare_syncs_before_the_spec_appears(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What must be durable before the kubelet hears of success, and in which order: a
    prepare's record is fdatasync'd before its spec is renamed into place (a spec visible to
    the runtime always has a durable record); an unprepare syncs nothing, yet its change is in
    the file (a crash of the process cannot lose it)."""
    import os  # noqa: PLC0415

    events: list[str] = []
    real_fdatasync, real_rename = os.fdatasync, os.rename
    journal = env.checkpoint.journal_path

    def fdatasync(fd: int) -> None:
        events.append("sync journal" if os.fstat(fd).st_ino == journal.stat().st_ino else "?")
        real_fdatasync(fd)

    def rename(src: Any, dst: Any) -> None:
        events.append(f"rename {Path(dst).name}")
        real_rename(src, dst)

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    monkeypatch.setattr(os, "rename", rename)
    claim = env.store.add(allocated_claim(name="c1", devices=["gpu-0"]))
    uid = claim["metadata"]["uid"]
    env.preparer.prepare(env.ref(claim))
    spec_name = env.specs.path_for(uid).name
    assert events == ["sync journal", f"rename {spec_name}"]
    events.clear()
    monkeypatch.setattr(os, "fsync", lambda fd: events.append("fsync"))
    env.preparer.unprepare(env.ref(claim))
    assert [e for e in events if "sync" in e] == []
    assert not env.specs.path_for(uid).exists()
    _, on_disk = checkpoint.read_state(env.checkpoint.path)
    assert uid not in on_disk  # read from the files, as a restarted plugin reads them


@pytest.mark.parametrize("in_memory", [False, True], ids=["disk", "tmpfs"])
def test_a_lone_prepare_hands_its_spec_fsync_to_a_helper_thread_only_on_a_disk(
    env: Env, monkeypatch: pytest.MonkeyPatch, in_memory: bool
) -> None:
    """On a disk the spec's fsync overlaps the record's fdatasync in a helper thread; on a
    tmpfs (a node's /run/cdi) fsync returns at once and the handoff would only cost, so it
    runs in the prepare's own thread. Synced either way, before the spec appears."""
    synced_in: list[int] = []
    real = cdi.PendingSpec.sync

    def sync(self: cdi.PendingSpec) -> None:
        synced_in.append(threading.get_ident())
        assert not self.final.exists()
        real(self)

    monkeypatch.setattr(cdi.PendingSpec, "sync", sync)
    env.specs.in_memory = in_memory
    claim = env.store.add(allocated_claim(name="c1", devices=["gpu-0"]))
    env.preparer.prepare(env.ref(claim))
    assert len(synced_in) == 1
    assert (synced_in[0] == threading.get_ident()) is in_memory
    assert env.specs.path_for(claim["metadata"]["uid"]).exists()


def test_the_pods_of_prepared_claims_are_known_without_requests_of_their_own(env: Env) -> None:
    claim = env.store.add(allocated_claim(name="c1", devices=["gpu-0"]))
    uid = claim["metadata"]["uid"]
    env.preparer.prepare(env.ref(claim))
    assert env.preparer.claim_pods() == {uid: ("pod-0",)}  # status.reservedFor at prepare
    # A restarted plugin learns them from the reconcile pass it runs at start.
    again = build_env(env.tmp, env.store)
    try:
        assert again.preparer.claim_pods() == {}
        claim["status"]["reservedFor"].append(
            {"resource": "pods", "name": "pod-1", "uid": new_uid()}
        )
        claim["status"]["reservedFor"].append(
            {"apiGroup": "example.com", "resource": "jobs", "name": "j", "uid": new_uid()}
        )
        Repair(again.preparer).reconcile()
        assert again.preparer.claim_pods() == {uid: ("pod-0", "pod-1")}
        # Unprepared by the other instance: forgotten at the next reconcile.
        env.preparer.unprepare(env.ref(claim))
        assert env.preparer.claim_pods() == {}
        Repair(again.preparer).reconcile()
        assert again.preparer.claim_pods() == {}
    finally:
        again.preparer.close()


def test_after_a_reboot_nothing_counts_as_prepared(env: Env) -> None:
    claim = env.store.add(allocated_claim(name="c1"))
    env.preparer.prepare(env.ref(claim))
    env.preparer.close()
    env.checkpoint.close()
    (env.tmp / "boot_id").write_text("boot-2\n")
    again = build_env(env.tmp, env.store)
    try:
        assert again.checkpoint.snapshot() == {}
        Repair(again.preparer).reconcile()
        assert again.specs.claim_uids() == set()
    finally:
        again.preparer.close()


def test_damaged_checkpoint_is_rebuilt_from_the_cdi_specs(env: Env) -> None:
    a = env.store.add(allocated_claim(name="a", devices=["gpu-0"]))
    b = env.store.add(allocated_claim(name="b", devices=["gpu-1"]))
    first_a = env.preparer.prepare(env.ref(a))
    env.preparer.prepare(env.ref(b))
    env.preparer.close()
    env.checkpoint.close()
    path = env.tmp / "plugin/gpu-dra-checkpoint.json"
    path.write_bytes(path.read_bytes()[:-40])  # truncated
    again = build_env(env.tmp, env.store)
    try:
        assert again.checkpoint.snapshot() == {}
        assert Repair(again.preparer).rebuild_from_specs() == 2
        assert list((env.tmp / "plugin").glob("gpu-dra-checkpoint.json.corrupt-*"))
        # the rebuilt claims still hold their devices ...
        thief = again.store.add(allocated_claim(name="thief", devices=["gpu-0"]))
        with pytest.raises(PrepareError, match="gpu-0 is already prepared"):
            again.preparer.prepare(again.ref(thief))
        # ... and prepare again with the same answer
        assert again.preparer.prepare(again.ref(a)) == first_a
    finally:
        again.preparer.close()


def test_specs_from_before_the_boot_are_not_rebuilt_as_prepared(env: Env) -> None:
    claim = env.store.add(allocated_claim(name="a", devices=["gpu-0"]))
    env.preparer.prepare(env.ref(claim))
    env.checkpoint.transact(lambda claims: claims.discard(claim["metadata"]["uid"]))
    assert Repair(env.preparer).rebuild_from_specs(booted_at_s=time.time() + 60) == 0
    Repair(env.preparer).reconcile()
    assert env.specs.claim_uids() == set()


@pytest.mark.parametrize("device_type", ["gpu", "mig"])
def test_the_default_config_is_recorded_as_deviceconfig_writes_it(device_type: str) -> None:
    from dra_driver import prepare  # noqa: PLC0415
    from dra_driver.prepare import deviceconfig  # noqa: PLC0415

    default = deviceconfig.default_for("gpu" if device_type == "gpu" else "mig")
    assert prepare.default_config_json(device_type) == deviceconfig.to_json(default)


def test_claims_without_opaque_configs_never_load_the_config_models(tmp_path: Path) -> None:
    # A fresh interpreter: the agent's modules, then a prepare without configs.
    script = f"""
import sys
from pathlib import Path
import dra_driver.node.agent
assert "dra_driver.prepare.deviceconfig" not in sys.modules, "loaded at import"
from tests.test_prepare import build_env
from tests.claimdata import allocated_claim
env = build_env(Path({str(tmp_path)!r}))
claim = env.store.add(allocated_claim(name="c", devices=["gpu-0"]))
assert env.preparer.prepare(env.ref(claim))[0].config["kind"] == "GpuConfig"
env.preparer.close()
assert "dra_driver.prepare.deviceconfig" not in sys.modules, "loaded by a prepare without configs"
print("ok")
"""
    repo = Path(__file__).resolve().parents[1]
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=repo, timeout=60,
        check=False,
    )  # fmt: skip
    assert run.stdout.strip() == "ok", run.stderr


# -- dynamic MIG: devices published before they exist --------------------------------------------


def test_a_mig_placement_that_does_not_exist_fails_only_its_claim_saying_why(
    env: Env,
) -> None:
    placement = "gpu-4-mig-1g5gb-19-6"  # published in dynamic mode; no such MIG device exists
    dynamic = env.store.add(allocated_claim(name="dyn", devices=[placement]))
    whole = env.store.add(allocated_claim(name="whole", devices=["gpu-4"]))  # a GPU in MIG mode
    plain = env.store.add(allocated_claim(name="plain", devices=["gpu-0"]))

    outcomes = env.preparer.prepare_batch([env.ref(c) for c in (dynamic, whole, plain)])

    failed = outcomes[dynamic["metadata"]["uid"]]
    assert f"node1/{placement}, which this node does not have: no such MIG device" in failed.error
    assert "a GPU with MIG devices this driver did not create offers only those" in failed.error
    assert not failed.devices
    refused = outcomes[whole["metadata"]["uid"]]
    assert "node1/gpu-4, which this node does not have as a whole GPU" in refused.error
    assert [d.device for d in outcomes[plain["metadata"]["uid"]].devices] == ["gpu-0"]
    assert env.checkpoint.get(dynamic["metadata"]["uid"]) is None
    assert not env.specs.path_for(dynamic["metadata"]["uid"]).exists()


def test_recorded_device_names_are_every_device_of_every_recorded_claim(env: Env) -> None:
    assert recorded_device_names(env.checkpoint.snapshot().values()) == frozenset()
    first = env.store.add(allocated_claim(name="c1", devices=["gpu-0", MIG_3G]))
    env.preparer.prepare(env.ref(first))
    started = ClaimRecord(
        uid=new_uid(),
        namespace="ns",
        name="half-done",
        phase=PREPARE_STARTED,
        devices=(
            PreparedDevice(
                request_names=("mig",), pool="node1", device="gpu-4-mig-1g5gb-19-6",
                cdi_device_ids=(),
            ),
        ),
    )  # fmt: skip
    env.checkpoint.transact(lambda claims: claims.__setitem__(started.uid, started))

    assert recorded_device_names(env.checkpoint.snapshot().values()) == {
        "gpu-0",
        MIG_3G,
        "gpu-4-mig-1g5gb-19-6",
    }
    env.preparer.unprepare(env.ref(first))
    assert recorded_device_names(env.checkpoint.snapshot().values()) == {"gpu-4-mig-1g5gb-19-6"}
