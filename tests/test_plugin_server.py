"""NodePlugin end to end: real gRPC over real Unix sockets in tmp_path, claims fetched by the
real Kubernetes client from the local API server (dra_driver/sim/localapi/), real files."""

from __future__ import annotations

import json
import logging
import socket
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from dra_driver._proto.dra_v1 import api_pb2 as v1
from dra_driver._proto.dra_v1 import api_pb2_grpc as v1_grpc
from dra_driver._proto.dra_v1beta1 import api_pb2 as v1beta1
from dra_driver._proto.dra_v1beta1 import api_pb2_grpc as v1beta1_grpc
from dra_driver._proto.health_v1alpha1 import api_pb2 as health
from dra_driver._proto.health_v1alpha1 import api_pb2_grpc as health_grpc
from dra_driver._proto.pluginregistration_v1 import api_pb2 as reg
from dra_driver._proto.pluginregistration_v1 import api_pb2_grpc as reg_grpc
from dra_driver.errors import ConfigError
from dra_driver.fsutil import in_memory_fs
from dra_driver.gpus.info import Inventory
from dra_driver.kube import KubeClient
from dra_driver.kube.events import node_event_reporter
from dra_driver.metrics import DriverMetrics, Registry
from dra_driver.node.config import Config
from dra_driver.node.nodeplugin import NodePlugin
from dra_driver.node.wiring import kubelet_plugin
from dra_driver.plugin.health_stream import HealthStates
from dra_driver.prepare.limits import MAX_CLAIMS_PER_REQUEST
from dra_driver.prepare.repair import Repair
from dra_driver.sharing.shares import ShareEnforcer
from dra_driver.sim.fakedriver import make_fake_driver, simulated_inventory, write_capability
from dra_driver.sim.localapi import FakeKubeApi
from tests.claimdata import allocated_claim, new_uid
from tests.shareenforcer import RecordingEnforcer
from tests.spares import held, spares_in

INVENTORY: Inventory | None = None


def inventory() -> Inventory:
    global INVENTORY  # noqa: PLW0603 - discovery once per test session is enough
    if INVENTORY is None:
        INVENTORY = simulated_inventory("h100:8", node_name="node1")
    return INVENTORY


def make_config(
    tmp: Path, *, pod_uid: str | None = None, consumable_shares: str = "disabled"
) -> Config:
    if not (tmp / "driver-root").exists():
        make_fake_driver(tmp)
        (tmp / "boot_id").write_text("boot-1\n")
    return Config(
        node_name="node1",
        nvidia_driver_root=tmp / "driver-root",
        kubelet_registrar_directory_path=tmp / "registry",
        kubelet_plugins_directory_path=tmp / "plugins",
        cdi_root=tmp / "cdi",
        pod_uid=pod_uid,
        consumable_shares=consumable_shares,
    )


def start_plugin(
    tmp: Path,
    kube: KubeClient,
    *,
    pod_uid: str | None = None,
    metrics: DriverMetrics | None = None,
    gpus: Inventory | None = None,
    health_interval_s: float = 0.1,
    health: HealthStates | None = None,
    consumable_shares: str = "disabled",
    share_enforcer: ShareEnforcer | None = None,
) -> NodePlugin:
    plugin = kubelet_plugin(
        config=make_config(tmp, pod_uid=pod_uid, consumable_shares=consumable_shares),
        share_enforcer=share_enforcer,
        inventory=gpus or inventory(),
        claims=kube,
        report_event=node_event_reporter(kube, node_name="node1"),
        metrics=metrics,
        proc_root=tmp / "proc",
        boot_id_path=tmp / "boot_id",
        health_interval_s=health_interval_s,
        health=health,
    )
    plugin.start()
    return plugin


@pytest.fixture
def kube(kubeapi: FakeKubeApi) -> Iterator[KubeClient]:
    kubeapi.add_node("node1")
    client = KubeClient.from_config(kubeconfig=kubeapi.kubeconfig_path)
    yield client
    client.close()


@pytest.fixture
def plugin(tmp_path: Path, kube: KubeClient) -> Iterator[NodePlugin]:
    p = start_plugin(tmp_path, kube)
    yield p
    p.stop()


def channel(path: Path) -> grpc.Channel:
    return grpc.insecure_channel(f"unix://{path}")


def v1_claim(claim: dict[str, object]) -> v1.Claim:
    meta = claim["metadata"]
    assert isinstance(meta, dict)
    return v1.Claim(namespace=meta["namespace"], name=meta["name"], uid=meta["uid"])


def test_get_info_names_driver_endpoint_and_versions_v1_first(plugin: NodePlugin) -> None:
    assert (
        plugin.paths.registration
        == plugin.settings.plugin_data_dir.parents[1] / "registry/gpu.nvidia.com-reg.sock"
    )
    assert plugin.paths.dra == plugin.settings.plugin_data_dir / "dra.sock"
    with channel(plugin.paths.registration) as ch:
        info = reg_grpc.RegistrationStub(ch).GetInfo(reg.InfoRequest(), timeout=1)
    assert info.type == "DRAPlugin"
    assert info.name == "gpu.nvidia.com"
    assert info.endpoint == str(plugin.paths.dra)
    assert list(info.supported_versions) == [
        "v1.DRAPlugin",
        "v1beta1.DRAPlugin",
        "v1.DRAResourceHealth",
        "v1alpha1.DRAResourceHealth",
    ]


def test_registration_status_is_recorded_and_a_refusal_logged(
    plugin: NodePlugin, caplog: pytest.LogCaptureFixture
) -> None:
    with channel(plugin.paths.registration) as ch:
        stub = reg_grpc.RegistrationStub(ch)
        stub.NotifyRegistrationStatus(reg.RegistrationStatus(plugin_registered=True), timeout=1)
        assert plugin.registration is not None and plugin.registration.registered.is_set()
        with caplog.at_level(logging.ERROR):
            stub.NotifyRegistrationStatus(
                reg.RegistrationStatus(plugin_registered=False, error="no known service"), timeout=1
            )
    assert not plugin.registration.registered.is_set()
    refusal = [r for r in caplog.records if "REFUSED" in r.getMessage()]
    assert refusal and refusal[0].kubelet_error == "no known service"  # type: ignore[attr-defined]


def test_prepare_over_v1_and_v1beta1_gives_the_same_answer(
    tmp_path: Path, kube: KubeClient, kubeapi: FakeKubeApi
) -> None:
    plugin = start_plugin(
        tmp_path, kube, consumable_shares="unlimited", share_enforcer=RecordingEnforcer()
    )
    claim = allocated_claim(name="train", namespace="ml", devices=[("gpus/fast", "gpu-0"), "gpu-1"])
    shares = [new_uid(), new_uid()]
    for result, share in zip(
        claim["status"]["allocation"]["devices"]["results"], shares, strict=True
    ):
        result["shareID"] = share
        result["consumedCapacity"] = {"memory": "0"}
    kubeapi.add_claim(claim)
    uid = claim["metadata"]["uid"]
    try:
        with channel(plugin.paths.dra) as ch:
            answer = v1_grpc.DRAPluginStub(ch).NodePrepareResources(
                v1.NodePrepareResourcesRequest(claims=[v1_claim(claim)]), timeout=5
            )
            beta = v1beta1_grpc.DRAPluginStub(ch).NodePrepareResources(
                v1beta1.NodePrepareResourcesRequest(
                    claims=[v1beta1.Claim(namespace="ml", name="train", uid=uid)]
                ),
                timeout=5,
            )
    finally:
        plugin.stop()
    entry = answer.claims[uid]
    assert entry.error == ""
    got = [
        (list(d.request_names), d.pool_name, d.device_name, list(d.cdi_device_ids), d.share_id)
        for d in entry.devices
    ]
    assert got == [
        (
            ["gpus"],
            "node1",
            f"gpu-{i}",
            [f"k8s.gpu.nvidia.com/claim={uid}-gpu-{i}-share-{shares[i]}"],
            shares[i],
        )
        for i in (0, 1)
    ]
    # v1beta1 has no share_id; the rest of its answer is the same
    assert [
        (list(d.request_names), d.device_name, list(d.cdi_device_ids))
        for d in beta.claims[uid].devices
    ] == [(g[0], g[2], g[3]) for g in got]
    assert ("get", "resourceclaims", "ml", "train") in kubeapi.requests
    assert (plugin.settings.cdi_root / f"k8s.gpu.nvidia.com-claim_{uid}.json").exists()


def test_unprepare_over_grpc_succeeds_for_prepared_unknown_and_deleted_claims(
    plugin: NodePlugin, kubeapi: FakeKubeApi
) -> None:
    claim = kubeapi.add_claim(allocated_claim(name="c1"))
    with channel(plugin.paths.dra) as ch:
        stub = v1_grpc.DRAPluginStub(ch)
        stub.NodePrepareResources(
            v1.NodePrepareResourcesRequest(claims=[v1_claim(claim)]), timeout=5
        )
        unknown = v1.Claim(namespace="default", name="never", uid=new_uid())
        answer = stub.NodeUnprepareResources(
            v1.NodeUnprepareResourcesRequest(claims=[v1_claim(claim), unknown]), timeout=5
        )
    assert {uid: e.error for uid, e in answer.claims.items()} == {
        claim["metadata"]["uid"]: "",
        unknown.uid: "",
    }
    # the spec is gone; on a disk its file is kept as a hidden spare for the next prepare,
    # until stop (on a tmpfs, cdi.CdiSpecDir keeps none)
    if in_memory_fs(plugin.settings.cdi_root):
        assert list(plugin.settings.cdi_root.iterdir()) == []
    else:
        (spare,) = plugin.settings.cdi_root.iterdir()
        assert spares_in(plugin.settings.cdi_root) == [spare] and held(spare)
    plugin.stop()
    assert list(plugin.settings.cdi_root.iterdir()) == []


def test_one_bad_claim_gets_its_own_error_and_the_others_prepare(
    plugin: NodePlugin, kubeapi: FakeKubeApi
) -> None:
    good = kubeapi.add_claim(allocated_claim(name="good", devices=["gpu-2"]))
    elsewhere = kubeapi.add_claim(
        allocated_claim(name="elsewhere", node="node2", devices=["gpu-3"])
    )
    traversal = v1.Claim(namespace="default", name="x", uid="../../etc/passwd")
    with channel(plugin.paths.dra) as ch:
        answer = v1_grpc.DRAPluginStub(ch).NodePrepareResources(
            v1.NodePrepareResourcesRequest(claims=[v1_claim(good), v1_claim(elsewhere), traversal]),
            timeout=5,
        )
    assert answer.claims[good["metadata"]["uid"]].error == ""
    assert "node2" in answer.claims[elsewhere["metadata"]["uid"]].error
    assert "not a lowercase UUID" in answer.claims[traversal.uid].error
    assert ("get", "resourceclaims", "default", "x") not in kubeapi.requests


@pytest.mark.parametrize(
    "body",
    [
        b"<html>502 Bad Gateway</html>",
        b'{"metadata": {"uid": ' + b"[" * 10_000 + b"]" * 10_000 + b"}}",
        b'{"status": {"allocation": {"devices": {"config": '
        + b"[" * 10_000
        + b"]" * 10_000
        + b"}}}}",
    ],
)
def test_a_claim_the_api_server_answers_with_garbage_fails_alone(
    plugin: NodePlugin, kubeapi: FakeKubeApi, body: bytes
) -> None:
    """Issue 37: a claim whose JSON is nested 10,000 deep raised RecursionError out of the
    batch (gRPC said UNKNOWN and the good claims got no answer); a 200 with a body that is not
    JSON was taken for the claim and refused as "has UID None"."""
    good = kubeapi.add_claim(allocated_claim(name="good", devices=["gpu-2"]))
    bad = kubeapi.add_claim(allocated_claim(name="bad", devices=["gpu-3"]))
    kubeapi.answer_raw("get", "resourceclaims", body, name="bad")
    with channel(plugin.paths.dra) as ch:
        answer = v1_grpc.DRAPluginStub(ch).NodePrepareResources(
            v1.NodePrepareResourcesRequest(claims=[v1_claim(good), v1_claim(bad)]), timeout=5
        )
    assert answer.claims[good["metadata"]["uid"]].error == ""
    error = answer.claims[bad["metadata"]["uid"]].error
    assert error.startswith("cannot get ResourceClaim default/bad: get resourceclaims/bad")
    assert "broken answer from the API server (HTTP 200)" in error
    assert "UID None" not in error


def test_empty_request_gets_an_empty_answer(plugin: NodePlugin) -> None:
    with channel(plugin.paths.dra) as ch:
        stub = v1_grpc.DRAPluginStub(ch)
        assert (
            len(stub.NodePrepareResources(v1.NodePrepareResourcesRequest(), timeout=2).claims) == 0
        )
        assert (
            len(stub.NodeUnprepareResources(v1.NodeUnprepareResourcesRequest(), timeout=2).claims)
            == 0
        )


def test_a_batch_of_the_most_claims_a_request_may_carry_gets_an_answer_each(
    plugin: NodePlugin, kubeapi: FakeKubeApi
) -> None:
    most = MAX_CLAIMS_PER_REQUEST
    claims = []
    for i in range(most + 1):
        claim = allocated_claim(name=f"admin-{i}", devices=[f"gpu-{i % 8}"])
        claim["status"]["allocation"]["devices"]["results"][0]["adminAccess"] = True
        claims.append(kubeapi.add_claim(claim))
    with channel(plugin.paths.dra) as ch:
        stub = v1_grpc.DRAPluginStub(ch)
        too_many = stub.NodePrepareResources(
            v1.NodePrepareResourcesRequest(claims=[v1_claim(c) for c in claims]), timeout=45
        )
        assert len(too_many.claims) == most + 1
        assert {e.error for e in too_many.claims.values()} == {
            f"the request names {most + 1} claims, more than the {most} one request may carry "
            "(docs/plugin.md#limits); none of them was handled"
        }
        assert ("get", "resourceclaims", "default", "admin-0") not in kubeapi.requests
        claims = claims[:most]
        answer = stub.NodePrepareResources(
            v1.NodePrepareResourcesRequest(claims=[v1_claim(c) for c in claims]), timeout=45
        )
        assert len(answer.claims) == most
        assert all(e.error == "" and len(e.devices) == 1 for e in answer.claims.values())
        assert len(list(plugin.settings.cdi_root.glob("*.json"))) == most
        gone = stub.NodeUnprepareResources(
            v1.NodeUnprepareResourcesRequest(claims=[v1_claim(c) for c in claims]), timeout=45
        )
    assert len(gone.claims) == most and all(e.error == "" for e in gone.claims.values())
    assert list(plugin.settings.cdi_root.glob("*.json")) == []


def test_health_stream_lists_every_device_and_repeats(plugin: NodePlugin) -> None:
    with channel(plugin.paths.dra) as ch:
        stream = health_grpc.DRAResourceHealthStub(ch).NodeWatchResources(
            health.NodeWatchResourcesRequest(), timeout=5
        )
        first, second = next(stream), next(stream)
        stream.cancel()
    for report in (first, second):
        assert [(d.device.pool_name, d.device.device_name) for d in report.devices] == [
            ("node1", f"gpu-{i}") for i in range(8)
        ]
        # No health source (the agent passes its health monitor): nothing is claimed.
        assert all(d.health == health.UNKNOWN for d in report.devices)
        assert {d.message for d in report.devices} == {
            "the agent does not watch this device's health"
        }
        assert all(d.health_check_timeout_seconds == 30 for d in report.devices)


def test_stop_removes_both_sockets_and_start_replaces_stale_ones(
    tmp_path: Path, kube: KubeClient
) -> None:
    config = make_config(tmp_path)
    stale = config.kubelet_registrar_directory_path / "gpu.nvidia.com-reg.sock"
    stale.parent.mkdir(parents=True)
    leftover = socket.socket(socket.AF_UNIX)
    leftover.bind(str(stale))
    leftover.close()  # the file stays, nobody listens: what a crashed plugin leaves
    plugin = start_plugin(tmp_path, kube)
    with channel(plugin.paths.registration) as ch:
        assert (
            reg_grpc.RegistrationStub(ch).GetInfo(reg.InfoRequest(), timeout=1).name
            == "gpu.nvidia.com"
        )
    plugin.stop()
    assert not plugin.paths.registration.exists()
    assert not plugin.paths.dra.exists()


def test_a_non_socket_file_at_the_socket_path_is_not_deleted(
    tmp_path: Path, kube: KubeClient
) -> None:
    config = make_config(tmp_path)
    config.plugin_data_dir.mkdir(parents=True)
    precious = config.plugin_data_dir / "dra.sock"
    precious.write_text("not ours to delete")
    with pytest.raises(Exception, match="is not a socket"):
        start_plugin(tmp_path, kube)
    assert precious.read_text() == "not ours to delete"


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """pytest's tmp_path is too long for dra-<podUID>.sock (108-byte AF_UNIX limit)."""
    with tempfile.TemporaryDirectory(prefix="dra-", dir="/tmp") as d:
        yield Path(d)


def test_rolling_update_instances_serve_side_by_side_and_share_state(
    short_tmp: Path, kube: KubeClient, kubeapi: FakeKubeApi
) -> None:
    old_uid = new_uid()
    old = start_plugin(short_tmp, kube, pod_uid=old_uid)
    new = start_plugin(short_tmp, kube, pod_uid=new_uid())
    try:
        assert old.paths.registration.name == f"gpu.nvidia.com-{old_uid}-reg.sock"
        assert old.paths.dra.name == f"dra-{old_uid}.sock"
        assert old.paths.dra != new.paths.dra and old.paths.registration != new.paths.registration
        assert all(len(str(p)) < 108 for p in (old.paths.dra, old.paths.registration))
        claim = kubeapi.add_claim(allocated_claim(name="c1", devices=["gpu-5"]))
        thief = kubeapi.add_claim(allocated_claim(name="c2", devices=["gpu-5"]))
        with channel(old.paths.dra) as a, channel(new.paths.dra) as b:
            first = v1_grpc.DRAPluginStub(a).NodePrepareResources(
                v1.NodePrepareResourcesRequest(claims=[v1_claim(claim)]), timeout=5
            )
            again = v1_grpc.DRAPluginStub(b).NodePrepareResources(
                v1.NodePrepareResourcesRequest(claims=[v1_claim(claim), v1_claim(thief)]), timeout=5
            )
            uid = claim["metadata"]["uid"]
            assert again.claims[uid] == first.claims[uid]
            assert "gpu-5 is already prepared" in again.claims[thief["metadata"]["uid"]].error
            v1_grpc.DRAPluginStub(b).NodeUnprepareResources(
                v1.NodeUnprepareResourcesRequest(claims=[v1_claim(claim)]), timeout=5
            )
            retry = v1_grpc.DRAPluginStub(a).NodePrepareResources(
                v1.NodePrepareResourcesRequest(claims=[v1_claim(thief)]), timeout=5
            )
        assert retry.claims[thief["metadata"]["uid"]].error == ""
    finally:
        old.stop()
        new.stop()


def test_on_a_kubelet_root_as_long_as_microk8s_the_agent_serves_a_shortened_dra_socket(
    short_tmp: Path, kube: KubeClient
) -> None:
    """MicroK8s's kubelet root (/var/snap/microk8s/common/var/lib/kubelet, docs/install.md) and
    the pod UID the chart sets make dra-<podUID>.sock 110 bytes: the kubelet learns the shorter
    name from GetInfo and reaches the DRA service there."""
    microk8s_root = "/var/snap/microk8s/common/var/lib/kubelet"
    root = short_tmp / ("k" * (len(microk8s_root) - len(str(short_tmp)) - 1))
    assert len(str(root)) == len(microk8s_root)
    uid = new_uid()
    config = replace(
        make_config(short_tmp, pod_uid=uid),
        kubelet_registrar_directory_path=root / "plugins_registry",
        kubelet_plugins_directory_path=root / "plugins",
    )
    assert len(str(config.plugin_data_dir / f"dra-{uid}.sock")) == 110
    plugin = kubelet_plugin(
        config=config,
        inventory=inventory(),
        claims=kube,
        proc_root=short_tmp / "proc",
        boot_id_path=short_tmp / "boot_id",
    )
    plugin.start()
    try:
        assert plugin.paths.dra.parent == config.plugin_data_dir
        assert len(str(plugin.paths.dra)) < 108
        with channel(plugin.paths.registration) as ch:
            info = reg_grpc.RegistrationStub(ch).GetInfo(reg.InfoRequest(), timeout=1)
        assert info.endpoint == str(plugin.paths.dra)
        with channel(Path(info.endpoint)) as ch:
            answer = v1_grpc.DRAPluginStub(ch).NodeUnprepareResources(
                v1.NodeUnprepareResourcesRequest(
                    claims=[v1.Claim(namespace="default", name="gone", uid=new_uid())]
                ),
                timeout=5,
            )
        assert [r.error for r in answer.claims.values()] == [""]
    finally:
        plugin.stop()
    assert not plugin.paths.dra.exists()


def test_damaged_checkpoint_is_moved_aside_reported_and_rebuilt(
    tmp_path: Path, kube: KubeClient, kubeapi: FakeKubeApi
) -> None:
    plugin = start_plugin(tmp_path, kube)
    claim = kubeapi.add_claim(allocated_claim(name="c1", devices=["gpu-4"]))
    with channel(plugin.paths.dra) as ch:
        first = v1_grpc.DRAPluginStub(ch).NodePrepareResources(
            v1.NodePrepareResourcesRequest(claims=[v1_claim(claim)]), timeout=5
        )
    plugin.stop()
    path = plugin.settings.checkpoint_path
    data = json.loads(path.read_bytes())
    data["data"]["claims"][claim["metadata"]["uid"]]["devices"][0]["device"] = "gpu-7"
    path.write_text(json.dumps(data))  # content changed, checksum not: wrong checksum
    plugin = start_plugin(tmp_path, kube)
    try:
        moved = list(path.parent.glob("gpu-dra-checkpoint.json.corrupt-*"))
        assert len(moved) == 1
        events = kubeapi.objects("events")
        assert [e["reason"] for e in events] == ["CheckpointCorrupt"]
        assert events[0]["involvedObject"]["kind"] == "Node"
        assert "checksum" in events[0]["message"]
        with channel(plugin.paths.dra) as ch:
            again = v1_grpc.DRAPluginStub(ch).NodePrepareResources(
                v1.NodePrepareResourcesRequest(claims=[v1_claim(claim)]), timeout=5
            )
        assert again.claims[claim["metadata"]["uid"]] == first.claims[claim["metadata"]["uid"]]
    finally:
        plugin.stop()


def test_claims_deleted_from_the_api_are_unprepared_at_start(
    tmp_path: Path, kube: KubeClient, kubeapi: FakeKubeApi
) -> None:
    plugin = start_plugin(tmp_path, kube)
    claim = kubeapi.add_claim(allocated_claim(name="c1", devices=["gpu-4"]))
    with channel(plugin.paths.dra) as ch:
        v1_grpc.DRAPluginStub(ch).NodePrepareResources(
            v1.NodePrepareResourcesRequest(claims=[v1_claim(claim)]), timeout=5
        )
    plugin.stop()
    kubeapi.put("resourceclaims", replace_uid(claim))
    plugin = start_plugin(tmp_path, kube)
    try:
        assert list(plugin.settings.cdi_root.glob("*.json")) == []
        assert plugin.checkpoint.snapshot() == {}
    finally:
        plugin.stop()


def test_too_long_socket_paths_are_a_clear_config_error(tmp_path: Path, kube: KubeClient) -> None:
    deep = tmp_path / ("d" * 60)
    with pytest.raises(ConfigError, match="Unix socket path limit"):
        kubelet_plugin(
            config=make_config(deep, pod_uid=new_uid()), inventory=inventory(), claims=kube
        )


def replace_uid(claim: dict[str, object]) -> dict[str, object]:
    meta = dict(claim["metadata"])  # type: ignore[arg-type]
    meta["uid"] = new_uid()
    return {**claim, "metadata": meta}


def test_config_change_keeps_paths(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    assert (
        replace(config, pod_uid=None).checkpoint_path
        == tmp_path / "plugins/gpu.nvidia.com/gpu-dra-checkpoint.json"
    )


def test_the_reconcile_loop_survives_an_unexpected_error(
    tmp_path: Path, kube: KubeClient, caplog: pytest.LogCaptureFixture
) -> None:
    plugin = kubelet_plugin(
        config=make_config(tmp_path),
        inventory=inventory(),
        claims=kube,
        proc_root=tmp_path / "proc",
        boot_id_path=tmp_path / "boot_id",
        reconcile_interval_s=0.02,
    )
    caplog.set_level(logging.ERROR, logger="dra_driver.prepare.state.nodestate")
    plugin.start()
    try:
        assert plugin.state.repair is not None
        real = plugin.state.repair.reconcile
        passes: list[str] = []

        def reconcile() -> dict[str, int]:
            passes.append("pass")
            if len(passes) == 1:
                raise RuntimeError("a bug in one pass")
            return real()

        plugin.state.repair.reconcile = reconcile  # type: ignore[method-assign]
        deadline = time.monotonic() + 5
        while len(passes) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(passes) >= 3  # the loop went on after the failed pass
    finally:
        plugin.stop()
    (record,) = [r for r in caplog.records if "unexpectedly" in r.getMessage()]
    assert record.exc_info is not None and "a bug in one pass" in str(record.exc_info[1])


# -- re-discovery: set_inventory ---------------------------------------------------------------

MIG_SPEC = "a100-40gb:1:mig=3g.20gb+2g.10gb"


def prepare(plugin: NodePlugin, claim: dict[str, object]) -> v1.NodePrepareResourceResponse:
    with channel(plugin.paths.dra) as ch:
        answer = v1_grpc.DRAPluginStub(ch).NodePrepareResources(
            v1.NodePrepareResourcesRequest(claims=[v1_claim(claim)]), timeout=5
        )
    return answer.claims[claim["metadata"]["uid"]]  # type: ignore[index]


def spec_nodes(plugin: NodePlugin, uid: str) -> list[str]:
    spec = json.loads(plugin.specs.path_for(uid).read_bytes())
    return [n["path"] for n in spec["devices"][0]["containerEdits"]["deviceNodes"]]


def test_a_device_found_by_re_discovery_is_prepared_and_in_the_health_stream(
    tmp_path: Path, kube: KubeClient, kubeapi: FakeKubeApi
) -> None:
    plugin = start_plugin(tmp_path, kube, gpus=simulated_inventory("h100:4", node_name="node1"))
    try:
        early = kubeapi.add_claim(allocated_claim(name="early", devices=["gpu-6"]))
        assert "which this node does not have" in prepare(plugin, early).error
        plugin.set_inventory(inventory())  # h100:8: gpu-4 .. gpu-7 appeared
        claim = kubeapi.add_claim(allocated_claim(name="c1", devices=["gpu-6"]))
        assert prepare(plugin, claim).error == ""
        assert spec_nodes(plugin, claim["metadata"]["uid"]) == ["/dev/nvidia6"]
        with channel(plugin.paths.dra) as ch:
            stream = health_grpc.DRAResourceHealthStub(ch).NodeWatchResources(
                health.NodeWatchResourcesRequest(), timeout=5
            )
            report = next(stream)
            stream.cancel()
        assert [d.device.device_name for d in report.devices] == [f"gpu-{i}" for i in range(8)]
    finally:
        plugin.stop()


def test_open_health_streams_get_the_new_device_list_at_once(
    tmp_path: Path, kube: KubeClient
) -> None:
    plugin = start_plugin(tmp_path, kube, health_interval_s=60)
    try:
        with channel(plugin.paths.dra) as ch:
            stream = health_grpc.DRAResourceHealthStub(ch).NodeWatchResources(
                health.NodeWatchResourcesRequest(), timeout=5
            )
            assert len(next(stream).devices) == 8
            plugin.set_inventory(simulated_inventory("h100:2", node_name="node1"))
            began = time.monotonic()
            after = next(stream)  # not 60 s later
            stream.cancel()
        assert time.monotonic() - began < 2
        assert [d.device.device_name for d in after.devices] == ["gpu-0", "gpu-1"]
    finally:
        plugin.stop()


def test_prepares_beyond_the_serving_threads_wait_and_succeed_beside_open_health_streams(
    tmp_path: Path, kube: KubeClient, kubeapi: FakeKubeApi
) -> None:
    """dra.sock's threads (plugin/services.py ``_GRPC_WORKERS``) are fewer than the calls here:
    four health streams hold one each for their lifetime (the kubelet's, and three left open),
    and 24 prepares at once (three per GPU: admin access) share the rest, queued by gRPC,
    none refused."""
    plugin = start_plugin(tmp_path, kube, health_interval_s=60)
    claims = []
    for i in range(24):
        claim = allocated_claim(name=f"c{i}", devices=[f"gpu-{i % 8}"])
        claim["status"]["allocation"]["devices"]["results"][0]["adminAccess"] = True
        claims.append(kubeapi.add_claim(claim))
    try:
        with channel(plugin.paths.dra) as ch:
            streams = [
                health_grpc.DRAResourceHealthStub(ch).NodeWatchResources(
                    health.NodeWatchResourcesRequest(), timeout=30
                )
                for _ in range(4)
            ]
            assert all(len(next(s).devices) == 8 for s in streams)  # each holds its thread
            with ThreadPoolExecutor(len(claims)) as pool:
                answers = list(pool.map(lambda c: prepare(plugin, c), claims))
            for s in streams:
                s.cancel()
        assert [a.error for a in answers] == [""] * len(claims)
        assert all(len(a.devices) == 1 for a in answers)
    finally:
        plugin.stop()


def test_a_mig_device_re_created_under_the_same_name_gets_its_new_nodes(
    tmp_path: Path, kube: KubeClient, kubeapi: FakeKubeApi
) -> None:
    before = simulated_inventory(MIG_SPEC, node_name="node1")
    plugin = start_plugin(tmp_path, kube, gpus=before)
    try:
        (gpu,) = before.gpus
        big = gpu.mig_instances[0]
        name = "gpu-0-mig-3g20gb-9-0"
        first = kubeapi.add_claim(allocated_claim(name="first", devices=[name]))
        assert prepare(plugin, first).error == ""
        old_nodes = spec_nodes(plugin, first["metadata"]["uid"])
        # The same profile and placement (so the same name), other instance ids, and a driver
        # reload that renumbered the capability table.
        recreated = replace(big, uuid="MIG-recreated", gpu_instance_id=7, compute_instance_id=3)
        after = replace(before, gpus=(replace(gpu, mig_instances=(recreated,)),))
        table = tmp_path / "proc/driver/nvidia-caps/mig-minors"
        table.write_text(
            table.read_text()
            .replace("gpu0/gi7/access 66\n", "gpu0/gi7/access 900\n")
            .replace("gpu0/gi7/ci3/access 70\n", "gpu0/gi7/ci3/access 903\n")
        )
        # the driver's files of the new instance's capabilities: prepare makes their nodes
        write_capability(tmp_path / "proc", "gpu0/gi7/access", minor=900)
        write_capability(tmp_path / "proc", "gpu0/gi7/ci3/access", minor=903)
        plugin.set_inventory(after)
        with channel(plugin.paths.dra) as ch:  # the device is free again for the next claim
            v1_grpc.DRAPluginStub(ch).NodeUnprepareResources(
                v1.NodeUnprepareResourcesRequest(claims=[v1_claim(first)]), timeout=5
            )
        second = kubeapi.add_claim(allocated_claim(name="second", devices=[name]))
        assert prepare(plugin, second).error == ""
        new_nodes = spec_nodes(plugin, second["metadata"]["uid"])
        assert new_nodes == [
            "/dev/nvidia0",
            "/dev/nvidia-caps/nvidia-cap900",
            "/dev/nvidia-caps/nvidia-cap903",
        ]
        assert new_nodes != old_nodes
        assert "gpu-0-mig-2g10gb-14-4" not in plugin.preparer.targets  # type: ignore[union-attr]
    finally:
        plugin.stop()


def test_a_prepared_device_that_disappears_is_reported_and_its_claim_can_be_unprepared(
    tmp_path: Path,
    kube: KubeClient,
    kubeapi: FakeKubeApi,
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry = Registry()
    metrics = DriverMetrics(registry, driver_name="gpu.nvidia.com", node_name="node1")
    plugin = start_plugin(tmp_path, kube, metrics=metrics)
    missing = {"name": "gpu_dra_prepared_devices_missing", "node": "node1"}
    try:
        claim = kubeapi.add_claim(allocated_claim(name="c1", devices=["gpu-6", "gpu-1"]))
        uid = claim["metadata"]["uid"]
        assert prepare(plugin, claim).error == ""
        assert registry.sample_value(**missing, driver="gpu.nvidia.com") == 0
        with caplog.at_level(logging.WARNING, logger="dra_driver.prepare.state.nodestate"):
            plugin.set_inventory(simulated_inventory("h100:4", node_name="node1"))
            plugin.set_inventory(simulated_inventory("h100:5", node_name="node1"))  # still gone
        (warning,) = [r for r in caplog.records if "no longer has" in r.getMessage()]
        assert warning.devices == ["gpu-6"]  # type: ignore[attr-defined]
        (event,) = kubeapi.objects("events")  # once, not at every re-discovery
        assert event["reason"] == "PreparedDeviceMissing"
        assert event["type"] == "Warning"
        assert event["involvedObject"]["kind"] == "Node"
        assert "default/c1" in event["message"] and "gpu-6" in event["message"]
        assert registry.sample_value(**missing, driver="gpu.nvidia.com") == 1
        # reconcile rewrites a lost spec with the devices that are left, and does not fail
        plugin.specs.path_for(uid).unlink()
        assert plugin.preparer is not None
        assert Repair(plugin.preparer).reconcile()["specs_rewritten"] == 1
        assert spec_nodes(plugin, uid) == ["/dev/nvidia1"]
        with channel(plugin.paths.dra) as ch:
            answer = v1_grpc.DRAPluginStub(ch).NodeUnprepareResources(
                v1.NodeUnprepareResourcesRequest(claims=[v1_claim(claim)]), timeout=5
            )
        assert answer.claims[uid].error == ""
        assert plugin.checkpoint.snapshot() == {}
        assert registry.sample_value(**missing, driver="gpu.nvidia.com") == 0
    finally:
        plugin.stop()


def test_a_claim_left_with_no_device_at_all_does_not_break_reconcile(
    tmp_path: Path, kube: KubeClient, kubeapi: FakeKubeApi
) -> None:
    plugin = start_plugin(tmp_path, kube)
    try:
        gone = kubeapi.add_claim(allocated_claim(name="gone", devices=["gpu-7"]))
        kept = kubeapi.add_claim(allocated_claim(name="kept", devices=["gpu-0"]))
        assert prepare(plugin, gone).error == "" and prepare(plugin, kept).error == ""
        plugin.set_inventory(simulated_inventory("h100:2", node_name="node1"))
        for claim in (gone, kept):
            plugin.specs.path_for(claim["metadata"]["uid"]).unlink()
        assert plugin.preparer is not None
        done = Repair(plugin.preparer).reconcile()  # no spec can be made for "gone": skipped
        assert done["specs_rewritten"] == 1
        assert plugin.specs.claim_uids() == {kept["metadata"]["uid"]}
    finally:
        plugin.stop()
