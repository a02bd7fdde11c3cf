"""Switching a node in place from NVIDIA's driver (prepare/switchover.py): NVIDIA-format
checkpoints built from shared/spec/nvidia-compat.md "Switching in place" (v1, v2, started and
completed claims, a full GPU, a MIG device, a shared claim, an MPS claim with its Deployment),
adopted by the real plugin over its real sockets against the local API server; our own earlier
``checkpoint.json`` migrated; kill -9 during the adoption."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dra_driver._proto.dra_v1 import api_pb2 as v1
from dra_driver._proto.dra_v1 import api_pb2_grpc as v1_grpc
from dra_driver.kube import KubeClient
from dra_driver.kube.events import node_event_reporter
from dra_driver.node.nodeplugin import NodePlugin
from dra_driver.node.wiring import kubelet_plugin
from dra_driver.prepare.repair import Repair
from dra_driver.prepare.state.checkpoint import (
    PREPARE_COMPLETED,
    Checkpoint,
    ClaimRecord,
    PreparedDevice,
    read_state,
)
from dra_driver.prepare.state.switchover import migrate_own_checkpoint
from dra_driver.sharing.mps_step import NVIDIA_MPS_KEY, NVIDIA_NAMESPACE
from dra_driver.sim.demo import DEMO_SIMULATE
from dra_driver.sim.fakedriver import simulated_inventory
from dra_driver.sim.localapi import FakeKubeApi
from tests.claimdata import allocated_claim, new_uid, opaque
from tests.test_plugin_server import (
    channel,
    inventory,
    make_config,
    prepare,
    start_plugin,
    v1_claim,
)

VENDOR = "k8s.gpu.nvidia.com"
API = "resource.nvidia.com/v1beta1"
MIG_DEVICE = "gpu-4-mig-3g40gb-9-4"  # DEMO_SIMULATE's A100 in MIG mode


# -- NVIDIA's checkpoint, as its plugin writes it (nvidia-compat.md "Switching in place") --------


def nvidia_device(
    claim: dict[str, Any], device: str, *, share_id: str = "", vendor: str = VENDOR
) -> dict[str, Any]:
    uid = claim["metadata"]["uid"]
    results = claim["status"]["allocation"]["devices"]["results"]
    requests = [r["request"] for r in results if r["device"] == device]
    pool = next(r["pool"] for r in results if r["device"] == device)
    d = {
        "Requests": requests,
        "PoolName": pool,
        "DeviceName": device,
        "CDIDeviceIDs": [f"{vendor}/claim={uid}-{device}"],
        "ShareID": share_id or None,
    }
    if "-mig-" in device:
        return {"gpu": None, "mig": {"concrete": {"profile": "3g.40gb"}, "device": d}, "vfio": None}
    return {"gpu": {"info": {"uuid": "GPU-x"}, "device": d}, "mig": None, "vfio": None}


def nvidia_claim(
    claim: dict[str, Any],
    *,
    state: str = "PrepareCompleted",
    share_id: str = "",
    vendor: str = VENDOR,
) -> dict[str, Any]:
    devices = [r["device"] for r in claim["status"]["allocation"]["devices"]["results"]]
    prepared = [
        {
            "devices": [nvidia_device(claim, d, share_id=share_id, vendor=vendor) for d in devices],
            "configState": {},
        }
    ]
    return {
        "checkpointState": state,
        "status": claim["status"],
        "preparedDevices": prepared if state == "PrepareCompleted" else None,
        "name": claim["metadata"]["name"],
        "namespace": claim["metadata"]["namespace"],
    }


def nvidia_checkpoint(
    claims: list[dict[str, Any]], *, boot_id: str = "boot-1", version: str = "v2", **kw: Any
) -> bytes:
    entries = {c["metadata"]["uid"]: nvidia_claim(c, **kw) for c in claims}
    if version == "v1":
        v1 = {
            uid: {"status": e["status"], "preparedDevices": e["preparedDevices"]}
            for uid, e in entries.items()
        }
        return json.dumps({"checksum": 1234, "v1": {"checksum": 5, "preparedClaims": v1}}).encode()
    v2 = {"checksum": 7, "preparedClaims": entries, "nodeBootID": boot_id}
    v1 = {"checksum": 5, "preparedClaims": {}}
    return json.dumps({"checksum": 1234, "v1": v1, "v2": v2}).encode()


def nvidia_spec(claim: dict[str, Any]) -> str:
    """NVIDIA's spec of the claim (a minimal one; JSON is YAML, which runtimes read)."""
    uid = claim["metadata"]["uid"]
    devices = [r["device"] for r in claim["status"]["allocation"]["devices"]["results"]]
    return json.dumps(
        {
            "cdiVersion": "0.5.0",
            "kind": f"{VENDOR}/claim",
            "devices": [
                {"name": f"{uid}-{d}", "containerEdits": {"env": [f"NVIDIA_DEVICE={d}"]}}
                for d in devices
            ],
        }
    )


def set_up_node(tmp: Path, claims: list[dict[str, Any]], *, specs: bool = True, **kw: Any) -> Path:
    """A node NVIDIA's driver prepared ``claims`` on: its checkpoint and its .yaml specs."""
    make_config(tmp)  # the fake driver and the boot ID
    plugin_dir = tmp / "plugins/gpu.nvidia.com"
    plugin_dir.mkdir(parents=True)
    (plugin_dir / "checkpoint.json").write_bytes(nvidia_checkpoint(claims, **kw))
    (tmp / "cdi").mkdir()
    if specs:
        for c in claims:
            yaml_spec(tmp, c["metadata"]["uid"]).write_text(nvidia_spec(c))
    return plugin_dir


def yaml_spec(tmp: Path, uid: str) -> Path:
    return tmp / "cdi" / f"{VENDOR}-claim_{uid}.yaml"


def records(tmp: Path) -> dict[str, ClaimRecord]:
    return read_state(tmp / "plugins/gpu.nvidia.com/gpu-dra-checkpoint.json")[1]


def set_aside(plugin_dir: Path, why: str) -> list[str]:
    return sorted(p.name for p in plugin_dir.glob(f"checkpoint.json.{why}-*"))


def events(api: FakeKubeApi, reason: str) -> list[str]:
    return [e["message"] for e in api.objects("events") if e.get("reason") == reason]


def unprepare(plugin: NodePlugin, claim: dict[str, Any]) -> None:
    with channel(plugin.paths.dra) as ch:
        answer = v1_grpc.DRAPluginStub(ch).NodeUnprepareResources(
            v1.NodeUnprepareResourcesRequest(claims=[v1_claim(claim)]), timeout=5
        )
    assert answer.claims[claim["metadata"]["uid"]].error == ""


@pytest.fixture
def kube(kubeapi: FakeKubeApi) -> Any:
    kubeapi.add_node("node1")
    client = KubeClient.from_config(kubeconfig=kubeapi.kubeconfig_path)
    yield client
    client.close()


# -- adoption -------------------------------------------------------------------------------


def test_a_completed_claim_is_adopted_keeps_its_spec_and_holds_its_gpu(
    tmp_path: Path, kube: KubeClient, kubeapi: FakeKubeApi
) -> None:
    claim = kubeapi.add_claim(allocated_claim(name="running", devices=["gpu-0"]))
    uid = claim["metadata"]["uid"]
    plugin_dir = set_up_node(tmp_path, [claim])
    plugin = start_plugin(tmp_path, kube)
    try:
        assert records(tmp_path)[uid].devices == (
            PreparedDevice(
                request_names=("gpus",),
                pool="node1",
                device="gpu-0",
                cdi_device_ids=(f"{VENDOR}/claim={uid}-gpu-0",),
                config={"apiVersion": API, "kind": "GpuConfig"},
            ),
        )
        assert records(tmp_path)[uid].phase == PREPARE_COMPLETED
        assert not (plugin_dir / "checkpoint.json").exists()  # NVIDIA's path is free
        assert len(set_aside(plugin_dir, "nvidia-adopted")) == 1  # renamed, never deleted
        assert yaml_spec(tmp_path, uid).exists()  # the running pod's containers restart with it
        assert not plugin.specs.path_for(uid).exists()  # no second spec of the same devices
        assert any("adopted 1 claim" in m for m in events(kubeapi, "NvidiaCheckpointAdopted"))
        # the kubelet prepares it again (its restart): the same answer, nothing rewritten
        again = prepare(plugin, claim)
        assert again.error == ""
        assert [list(d.cdi_device_ids) for d in again.devices] == [[f"{VENDOR}/claim={uid}-gpu-0"]]
        assert yaml_spec(tmp_path, uid).exists() and not plugin.specs.path_for(uid).exists()
        # its GPU is not free
        other = kubeapi.add_claim(allocated_claim(name="other", devices=["gpu-0"]))
        assert "gpu-0" in prepare(plugin, other).error
        Repair(plugin.preparer).reconcile()  # type: ignore[union-attr]
        assert yaml_spec(tmp_path, uid).exists()  # an adopted claim's spec is owned
        unprepare(plugin, claim)
        assert not yaml_spec(tmp_path, uid).exists()
        assert uid not in records(tmp_path)
        assert prepare(plugin, other).error == ""
        unprepare(plugin, other)
    finally:
        plugin.stop()
    assert not (plugin_dir / "checkpoint.json").exists()  # a clean stop writes ours elsewhere


def test_a_v1_checkpoint_mig_device_and_shared_claim_are_adopted(
    tmp_path: Path, kube: KubeClient, kubeapi: FakeKubeApi
) -> None:
    mig = kubeapi.add_claim(allocated_claim(name="mig", devices=[MIG_DEVICE]))
    plugin_dir = set_up_node(tmp_path, [mig], version="v1")
    plugin = start_plugin(
        tmp_path, kube, gpus=simulated_inventory(DEMO_SIMULATE, node_name="node1")
    )
    try:
        record = records(tmp_path)[mig["metadata"]["uid"]]
        assert [d.device for d in record.devices] == [MIG_DEVICE]
        assert record.devices[0].config == {"apiVersion": API, "kind": "MigDeviceConfig"}
        assert record.namespace == ""  # v1 has no names: the kubelet's next prepare fetches them
        assert not (plugin_dir / "checkpoint.json").exists()
    finally:
        plugin.stop()
    shared = allocated_claim(name="shared", devices=["gpu-1"])
    share = new_uid()
    shared["status"]["allocation"]["devices"]["results"][0]["shareID"] = share
    kubeapi.add_claim(shared)
    other = tmp_path / "second"
    other.mkdir()
    set_up_node(other, [shared], share_id=share)
    plugin = start_plugin(other, kube)
    try:
        device = records(other)[shared["metadata"]["uid"]].devices[0]
        assert (device.device, device.share_id) == ("gpu-1", share)
    finally:
        plugin.stop()


def test_time_slicing_is_recorded_as_in_force(
    tmp_path: Path, kube: KubeClient, kubeapi: FakeKubeApi
) -> None:
    sliced = {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}
    claim = kubeapi.add_claim(
        allocated_claim(
            name="ts",
            devices=["gpu-2"],
            configs=[opaque({"apiVersion": API, "kind": "GpuConfig", "sharing": sliced})],
        )
    )
    set_up_node(tmp_path, [claim])
    plugin = start_plugin(tmp_path, kube)
    try:
        config = records(tmp_path)[claim["metadata"]["uid"]].devices[0].config
        assert config["sharing"]["strategy"] == "TimeSlicing"
    finally:
        plugin.stop()


@pytest.mark.parametrize(
    ("mps_image", "namespace"), [("mps:1", NVIDIA_NAMESPACE), (None, "nvidia-elsewhere")]
)
def test_an_mps_claim_keeps_nvidias_daemon_until_its_unprepare_deletes_it(
    mps_image: str | None,
    namespace: str,
    tmp_path: Path,
    kube: KubeClient,
    kubeapi: FakeKubeApi,
) -> None:
    """Also on an agent without MPS daemons of its own (no --mps-image), and with NVIDIA's
    driver in another namespace (--nvidia-namespace)."""
    mps = {"apiVersion": API, "kind": "GpuConfig", "sharing": {"strategy": "MPS"}}
    claim = kubeapi.add_claim(allocated_claim(name="mps", devices=["gpu-3"], configs=[opaque(mps)]))
    uid = claim["metadata"]["uid"]
    deployment = f"mps-control-daemon-{uid}"
    kubeapi.put(
        "deployments",
        {"apiVersion": "apps/v1", "kind": "Deployment",
         "metadata": {"name": deployment, "namespace": namespace}, "spec": {}},
    )  # fmt: skip
    set_up_node(tmp_path, [claim])
    config = dataclasses.replace(
        make_config(tmp_path), mps_image=mps_image, nvidia_namespace=namespace
    )
    plugin = kubelet_plugin(
        config=config,
        inventory=inventory(),
        claims=kube,
        deployments=kube,
        report_event=node_event_reporter(kube, node_name="node1"),
        proc_root=tmp_path / "proc",
        boot_id_path=tmp_path / "boot_id",
    )
    plugin.start()
    try:
        device = records(tmp_path)[uid].devices[0]
        assert device.config["sharing"] == {"strategy": "MPS"}
        assert device.config[NVIDIA_MPS_KEY] == f"{namespace}/{deployment}"
        names = [d["metadata"]["name"] for d in kubeapi.objects("deployments")]
        assert names == [deployment]  # ours was not started beside NVIDIA's
        unprepare(plugin, claim)
        assert kubeapi.objects("deployments") == []
        assert not yaml_spec(tmp_path, uid).exists()
    finally:
        plugin.stop()


def test_a_started_claim_is_rolled_back_and_an_earlier_boots_is_dropped(
    tmp_path: Path, kube: KubeClient, kubeapi: FakeKubeApi
) -> None:
    half = kubeapi.add_claim(allocated_claim(name="half", devices=["gpu-0"]))
    plugin_dir = set_up_node(tmp_path, [half], state="PrepareStarted")
    plugin = start_plugin(tmp_path, kube)
    try:
        assert records(tmp_path) == {}
        assert not yaml_spec(tmp_path, half["metadata"]["uid"]).exists()  # rolled back as ours
        assert prepare(plugin, half).error == ""  # the kubelet's retry prepares it afresh
        unprepare(plugin, half)
    finally:
        plugin.stop()
    old = tmp_path / "old"
    old.mkdir()
    plugin_dir = set_up_node(old, [half], boot_id="boot-0")
    plugin = start_plugin(old, kube)
    try:
        assert records(old) == {}
        assert len(set_aside(plugin_dir, "nvidia-adopted")) == 1
        assert any("earlier boot" in m for m in events(kubeapi, "NvidiaCheckpointAdopted"))
    finally:
        plugin.stop()


def test_bad_input_is_reported_and_set_aside_and_start_never_fails(
    tmp_path: Path, kube: KubeClient, kubeapi: FakeKubeApi
) -> None:
    gone = kubeapi.add_claim(allocated_claim(name="gone", devices=["gpu-9"]))  # h100:8
    nospec = kubeapi.add_claim(allocated_claim(name="nospec", devices=["gpu-1"]))
    good = kubeapi.add_claim(allocated_claim(name="good", devices=["gpu-2"]))
    set_up_node(tmp_path, [gone, nospec, good])
    yaml_spec(tmp_path, nospec["metadata"]["uid"]).unlink()
    plugin = start_plugin(tmp_path, kube)
    try:
        assert set(records(tmp_path)) == {good["metadata"]["uid"]}
        (message,) = events(kubeapi, "NvidiaCheckpointAdopted")
        assert "which this node does not have" in message
        assert "is missing" in message
    finally:
        plugin.stop()
    torn = tmp_path / "torn"
    torn.mkdir()
    plugin_dir = set_up_node(torn, [good])
    raw = (plugin_dir / "checkpoint.json").read_bytes()
    (plugin_dir / "checkpoint.json").write_bytes(raw[: len(raw) // 2])  # half-written
    plugin = start_plugin(torn, kube)
    try:
        assert records(torn) == {}
        assert len(set_aside(plugin_dir, "unreadable")) == 1
    finally:
        plugin.stop()


# -- our own earlier checkpoint.json --------------------------------------------------------


def own_old_checkpoint(tmp: Path) -> tuple[Path, bytes, bytes]:
    make_config(tmp)
    plugin_dir = tmp / "plugins/gpu.nvidia.com"
    old = Checkpoint(plugin_dir / "checkpoint.json", boot_id_path=tmp / "boot_id")
    old.open()
    for name in ("a", "b"):
        uid = new_uid()
        old.transact(
            lambda claims, uid=uid, name=name: claims.__setitem__(
                uid,
                ClaimRecord(uid=uid, namespace="", name=name, phase=PREPARE_COMPLETED, devices=()),
            )
        )
    snapshot = (plugin_dir / "checkpoint.json").read_bytes()
    journal = (plugin_dir / "checkpoint.journal").read_bytes()
    os.close(old._files._journal_fd)  # a kill: nothing folded
    os.close(old._files._lock_fd)
    return plugin_dir, snapshot, journal


def test_our_earlier_checkpoint_moves_to_its_own_name_bytes_unchanged(
    tmp_path: Path, kube: KubeClient
) -> None:
    plugin_dir, snapshot, journal = own_old_checkpoint(tmp_path)
    assert journal  # not folded: the migration must carry the journal too
    names = {r.name for r in read_state(plugin_dir / "checkpoint.json")[1].values()}
    target = plugin_dir / "gpu-dra-checkpoint.json"
    assert migrate_own_checkpoint(plugin_dir / "checkpoint.json", target)
    assert target.read_bytes() == snapshot
    assert (plugin_dir / "gpu-dra-checkpoint.journal").read_bytes() == journal
    assert not (plugin_dir / "checkpoint.json").exists()
    assert not (plugin_dir / "checkpoint.journal").exists()
    assert not migrate_own_checkpoint(plugin_dir / "checkpoint.json", target)  # once
    plugin = start_plugin(tmp_path, kube)
    plugin.stop()
    assert {r.name for r in records(tmp_path).values()} == names == {"a", "b"}
    assert not (plugin_dir / "checkpoint.json").exists()


def test_a_migration_killed_between_its_renames_is_finished_by_the_next_start(
    tmp_path: Path, kube: KubeClient
) -> None:
    plugin_dir, _, _ = own_old_checkpoint(tmp_path)
    os.rename(plugin_dir / "checkpoint.journal", plugin_dir / "gpu-dra-checkpoint.journal")
    plugin = start_plugin(tmp_path, kube)
    plugin.stop()
    assert {r.name for r in records(tmp_path).values()} == {"a", "b"}
    assert not (plugin_dir / "checkpoint.json").exists()


# -- kill -9 during the adoption ------------------------------------------------------------

KILLED_ADOPTION = """
import os, signal, sys
from pathlib import Path
from dra_driver import cdi
from dra_driver.prepare import device_targets
from dra_driver.prepare.state import switchover
from dra_driver.prepare.state.checkpoint import Checkpoint
from dra_driver.sim.fakedriver import simulated_inventory

tmp = Path(sys.argv[1])
plugin_dir = tmp / "plugins/gpu.nvidia.com"
checkpoint = Checkpoint(plugin_dir / "gpu-dra-checkpoint.json", boot_id_path=tmp / "boot_id")
checkpoint.open()
kill = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)
if sys.argv[2] == "before-commit":
    checkpoint.transact = kill
else:  # right after the records are durable, before NVIDIA's file is renamed aside
    switchover._set_aside = kill
switchover.adopt_nvidia_checkpoint(
    plugin_dir / "checkpoint.json", checkpoint=checkpoint,
    specs=cdi.CdiSpecDir(tmp / "cdi", vendor="k8s.gpu.nvidia.com"),
    targets=device_targets(simulated_inventory("h100:8", node_name="node1")),
    driver_name="gpu.nvidia.com", node_name="node1", cdi_vendor="k8s.gpu.nvidia.com",
)
"""


@pytest.mark.parametrize("point", ["before-commit", "after-commit"])
def test_kill_9_during_adoption_the_next_start_finishes_it_exactly_once(
    point: str, tmp_path: Path, kube: KubeClient, kubeapi: FakeKubeApi
) -> None:
    claim = kubeapi.add_claim(allocated_claim(name="running", devices=["gpu-0"]))
    uid = claim["metadata"]["uid"]
    plugin_dir = set_up_node(tmp_path, [claim])
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_ADOPTION, str(tmp_path), point],
        check=False,
        capture_output=True,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert (plugin_dir / "checkpoint.json").exists()  # not yet renamed
    journal = (plugin_dir / "gpu-dra-checkpoint.journal").read_bytes()
    if point == "after-commit":
        assert journal.count(b"\n") == 1 and uid.encode() in journal  # durable before the rename
    else:
        assert journal == b""
    plugin = start_plugin(tmp_path, kube)
    try:
        assert set(records(tmp_path)) == {uid}
        lines = (plugin_dir / "gpu-dra-checkpoint.journal").read_bytes().splitlines()
        assert sum(uid in line.decode() for line in lines) == 1  # recorded exactly once
        assert not (plugin_dir / "checkpoint.json").exists()
        assert len(set_aside(plugin_dir, "nvidia-adopted")) == 1
        assert yaml_spec(tmp_path, uid).exists()
    finally:
        plugin.stop()


def test_unprepare_on_exit_leaves_no_claim_spec_or_state_for_nvidias_plugin(
    tmp_path: Path, kube: KubeClient, kubeapi: FakeKubeApi
) -> None:
    ours = kubeapi.add_claim(allocated_claim(name="ours", devices=["gpu-0"]))
    adopted = kubeapi.add_claim(allocated_claim(name="adopted", devices=["gpu-1"]))
    plugin_dir = set_up_node(tmp_path, [adopted])
    plugin = kubelet_plugin(
        config=dataclasses.replace(make_config(tmp_path), unprepare_on_exit=True),
        inventory=inventory(),
        claims=kube,
        proc_root=tmp_path / "proc",
        boot_id_path=tmp_path / "boot_id",
    )
    plugin.start()
    try:
        assert prepare(plugin, ours).error == ""
        assert plugin.specs.path_for(ours["metadata"]["uid"]).exists()
    finally:
        plugin.stop()
    assert records(tmp_path) == {}
    assert list((tmp_path / "cdi").iterdir()) == []  # ours and the adopted .yaml
    assert not (plugin_dir / "checkpoint.json").exists()


def test_our_state_from_before_nvidias_plugin_ran_is_set_aside_and_nvidias_adopted(
    tmp_path: Path, kube: KubeClient, kubeapi: FakeKubeApi
) -> None:
    gone, both, no_yaml, new = (
        kubeapi.add_claim(allocated_claim(name=n, devices=[d]))
        for n, d in (("gone", "gpu-0"), ("both", "gpu-1"), ("noyaml", "gpu-2"), ("new", "gpu-0"))
    )
    uid = {c["metadata"]["name"]: c["metadata"]["uid"] for c in (gone, both, no_yaml, new)}
    plugin = start_plugin(tmp_path, kube)  # gpu-dra first, its claims left prepared at stop
    try:
        for claim in (gone, both, no_yaml):
            assert prepare(plugin, claim).error == ""
    finally:
        plugin.stop()
    # then NVIDIA's plugin (the way back without --unprepare-on-exit): "gone" was unprepared
    # there (a no-op for it), gpu-0 went to "new"; it prepared "both" and "noyaml" again
    plugin_dir = tmp_path / "plugins/gpu.nvidia.com"
    (plugin_dir / "checkpoint.json").write_bytes(nvidia_checkpoint([both, no_yaml, new]))
    ours = max((plugin_dir / n).stat().st_mtime for n in ("gpu-dra-checkpoint.json",))
    os.utime(plugin_dir / "checkpoint.json", (ours + 1, ours + 1))
    for claim in (both, new):
        yaml_spec(tmp_path, claim["metadata"]["uid"]).write_text(nvidia_spec(claim))
    plugin = start_plugin(tmp_path, kube)
    try:
        assert set(records(tmp_path)) == {uid["both"], uid["noyaml"], uid["new"]}
        specs = sorted(p.name for p in (tmp_path / "cdi").glob("k8s*claim_*"))
        assert specs == sorted(
            [f"{VENDOR}-claim_{uid['both']}.yaml", f"{VENDOR}-claim_{uid['new']}.yaml",
             f"{VENDOR}-claim_{uid['noyaml']}.json"]  # ours serves NVIDIA's IDs: kept
        )  # fmt: skip
        assert sorted(p.name.split(".stale-")[0] for p in plugin_dir.glob("*.stale-*")) == [
            "gpu-dra-checkpoint.journal",
            "gpu-dra-checkpoint.json",
        ]
        (event,) = [
            e for e in kubeapi.objects("events") if e["reason"] == "NvidiaCheckpointAdopted"
        ]
        assert event["type"] == "Normal"
        assert "adopted 3 claim" in event["message"]
        assert "3 claim(s) of gpu-dra's own from before NVIDIA's driver ran" in event["message"]
        assert prepare(plugin, new).error == ""  # gpu-0 is "new"'s, not the stale "gone"'s
        assert "gpu-0" in prepare(plugin, gone).error
    finally:
        plugin.stop()
