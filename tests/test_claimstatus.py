"""ResourceClaim device status (KEP-4817): the agent writes ``status.devices`` after prepare
and removes it at unprepare, through the official client over HTTPS, against the local API
server's status subresource, which checks what the real one checks.

First the server-side apply itself (kube/resourceclaims.py against sim/localapi/claimstatus.py),
then the pure entries, then the agent as the chart's DaemonSet runs it: a prepare over the
kubelet's socket, the status in the claim, the unprepare clearing it, and a failing API server
that leaves the prepare unharmed and counts the failure."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from dra_driver._proto.dra_v1 import api_pb2 as v1
from dra_driver._proto.dra_v1 import api_pb2_grpc as v1_grpc
from dra_driver.claimstatus.entries import StatusDevice, device_data, status_entries
from dra_driver.claimstatus.reporter import ClaimStatusReporter
from dra_driver.errors import KubeConflict, KubeError
from dra_driver.kube import KubeClient
from dra_driver.sim.fakedriver import simulated_inventory
from dra_driver.sim.localapi import FakeKubeApi, free_port
from tests.claimdata import allocated_claim
from tests.kubedata import client
from tests.test_agent import _in_cluster, _register, _scrape, as_a_pod

NODE = "gpu-node-1"
DRIVER = "gpu.nvidia.com"
READY = {
    "type": "Ready",
    "status": "True",
    "reason": "Prepared",
    "lastTransitionTime": "2026-12-04T10:00:00Z",
}


@pytest.fixture
def api(tmp_path: Path) -> Iterator[FakeKubeApi]:
    server = FakeKubeApi(tls_dir=tmp_path / "tls").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def kube(api: FakeKubeApi, tmp_path: Path) -> Iterator[KubeClient]:
    """A client of ``api``, closed after the test (its keep-alive connections with it)."""
    made = client(api, tmp_path)
    try:
        yield made
    finally:
        made.close()


def stored_devices(api: FakeKubeApi, name: str) -> list[dict[str, Any]]:
    (claim,) = [c for c in api.objects("resourceclaims") if c["metadata"]["name"] == name]
    devices: list[dict[str, Any]] = (claim.get("status") or {}).get("devices") or []
    return devices


def entry(device: str, *, driver: str = DRIVER, **extra: Any) -> dict[str, Any]:
    return {"driver": driver, "pool": NODE, "device": device, "conditions": [READY], **extra}


def apply(kube: KubeClient, claim: dict[str, Any], devices: list[dict[str, Any]]) -> bool:
    meta = claim["metadata"]
    return kube.apply_resource_claim_status(
        namespace=meta["namespace"],
        name=meta["name"],
        uid=meta["uid"],
        devices=devices,
        field_manager=DRIVER,
    )


# -- the status subresource, server-side apply -----------------------------------------------


def test_apply_writes_our_entries_and_keeps_another_drivers(
    api: FakeKubeApi, kube: KubeClient
) -> None:
    claim = allocated_claim(
        name="c", node=NODE, devices=("gpu-0", "gpu-1"),
        extra_results=[{"request": "nic", "driver": "nic.example.com", "pool": NODE,
                        "device": "eth1"}],
    )  # fmt: skip
    api.add_claim(claim)
    # another driver's entry, applied under its own field manager
    other = kube.apply_resource_claim_status(
        namespace="default", name="c", uid=claim["metadata"]["uid"],
        devices=[entry("eth1", driver="nic.example.com")], field_manager="nic.example.com",
    )  # fmt: skip
    assert other
    assert apply(kube, claim, [entry("gpu-0", data={"uuid": "GPU-1"}), entry("gpu-1")])
    assert [(e["driver"], e["device"]) for e in stored_devices(api, "c")] == [
        ("nic.example.com", "eth1"), (DRIVER, "gpu-0"), (DRIVER, "gpu-1"),
    ]  # fmt: skip
    assert stored_devices(api, "c")[1]["data"] == {"uuid": "GPU-1"}
    # clearing removes ours only
    assert apply(kube, claim, [])
    assert [e["device"] for e in stored_devices(api, "c")] == ["eth1"]
    assert ("patch", "resource.k8s.io", "resourceclaims/status") in api.permissions_used()


@pytest.mark.parametrize(
    ("devices", "complaint"),
    [
        ([entry("gpu-7")], "must be an allocated device in the claim"),
        ([entry("gpu-0", data=["not", "an", "object"])], "data: Invalid value"),
        ([entry("gpu-0"), entry("gpu-0")], "Duplicate value"),
        ([entry("gpu-0", conditions=[{**READY, "status": "Maybe"}])], "Unsupported value"),
        ([entry("gpu-0", conditions=[{**READY, "reason": ""}])], "reason: Required value"),
        ([entry("gpu-0", shareID="0f6b8d5e-3c1a-4f0e-9d7b-2a4c6e8f0a1b")], "shareID"),
        ([entry("gpu-0", conditions=[{**READY, "type": f"T{i}"} for i in range(9)])], "Too many"),
    ],
)
def test_the_server_refuses_entries_the_real_one_refuses(
    api: FakeKubeApi, kube: KubeClient, devices: list[dict[str, Any]], complaint: str
) -> None:
    claim = allocated_claim(name="c", node=NODE)
    api.add_claim(claim)
    with pytest.raises(KubeError, match=complaint):
        apply(kube, claim, devices)
    assert stored_devices(api, "c") == []


def test_a_claim_recreated_under_the_same_name_is_not_written(
    api: FakeKubeApi, kube: KubeClient
) -> None:
    old = allocated_claim(name="c", node=NODE)
    api.add_claim(allocated_claim(name="c", node=NODE))  # same name, a new UID
    with pytest.raises(KubeConflict, match="Precondition failed: UID"):
        apply(kube, old, [entry("gpu-0")])


def test_a_claim_that_is_gone_needs_nothing(kube: KubeClient) -> None:
    assert not apply(kube, allocated_claim(name="gone", node=NODE), [])


def test_with_the_feature_off_the_server_drops_the_field(tmp_path: Path) -> None:
    server = FakeKubeApi(tls_dir=tmp_path / "tls", device_status=False).start()
    kube = client(server, tmp_path)
    try:
        claim = allocated_claim(name="c", node=NODE)
        server.add_claim(claim)
        assert apply(kube, claim, [entry("gpu-0")])
        assert stored_devices(server, "c") == []
    finally:
        kube.close()
        server.stop()


# -- the entries (pure) ---------------------------------------------------------------------


def test_entries_say_which_gpu_and_mig_device_the_claim_got() -> None:
    inventory = simulated_inventory("h100:1,a100-80gb:1:mig=3g.40gb", node_name=NODE)
    gpu, mig_gpu = inventory.gpus
    (mig,) = mig_gpu.mig_instances
    mig_name = f"gpu-{mig_gpu.minor}-mig-3g40gb-{mig.profile.profile_id}-{mig.placement.start}"
    entries = status_entries(
        driver=DRIVER,
        devices=[StatusDevice(NODE, "gpu-0"), StatusDevice(NODE, mig_name)],
        inventory=inventory,
        now="2026-12-04T10:00:00Z",
    )
    assert entries[0] == {
        "driver": DRIVER, "pool": NODE, "device": "gpu-0",
        "conditions": [{"type": "Ready", "status": "True", "reason": "Prepared",
                        "message": "prepared on the node by the DRA driver; its CDI devices are "
                                   "ready",
                        "lastTransitionTime": "2026-12-04T10:00:00Z"}],
        "data": {"uuid": gpu.uuid, "productName": gpu.product_name, "index": gpu.index,
                 "minor": gpu.minor, "pciBusID": gpu.pci_bus_id},
    }  # fmt: skip
    data = entries[1]["data"]
    assert data["uuid"] == mig.uuid and data["uuid"].startswith("MIG-")
    assert data["parentUUID"] == mig_gpu.uuid
    assert data["profile"] == "3g.40gb"
    assert data["index"] == mig_gpu.index


def test_a_dynamic_mig_device_not_discovered_yet_names_its_parent_and_profile() -> None:
    inventory = simulated_inventory("h100:1:mig", node_name=NODE)
    (gpu,) = inventory.gpus
    profile = next(p for p in gpu.mig_profiles if p.name.startswith("1g."))
    start = profile.placements[0].start
    slug = profile.name.replace(".", "").replace("+", "-")
    data = device_data(inventory, f"gpu-{gpu.minor}-mig-{slug}-{profile.profile_id}-{start}")
    assert data["parentUUID"] == gpu.uuid and data["profile"] == profile.name
    assert "uuid" not in data
    assert device_data(inventory, "gpu-99") == {}


# -- the reporter: retries, then counts and gives up; never raises ---------------------------


class FlakyClient:
    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls: list[tuple[str, int]] = []

    def apply_resource_claim_status(self, **call: Any) -> bool:
        self.calls.append((call["name"], len(call["devices"])))
        if self.failures:
            self.failures -= 1
            raise KubeError("injected", verb="patch", resource="resourceclaims/status")
        return True


def reporter_for(client: FlakyClient, **settings: Any) -> ClaimStatusReporter:
    """A reporter writing through ``client`` for a one-GPU node, with ``settings``."""
    inventory = simulated_inventory("h100:1", node_name=NODE)
    return ClaimStatusReporter(
        client=client, driver_name=DRIVER, inventory=lambda: inventory, **settings
    )


def test_the_reporter_retries_then_counts_a_failure_and_keeps_the_latest_wish() -> None:
    results: list[str] = []
    flaky = FlakyClient(failures=1)
    reporter = reporter_for(flaky, count=results.append, retry_delays_s=(0.01,))
    reporter.start()
    try:
        reporter.prepared(namespace="ns", name="a", uid="u1", devices=[(NODE, "gpu-0", None)])
        assert reporter.idle(5)
        assert flaky.calls == [("a", 1), ("a", 1)] and results == ["ok"]
        down = FlakyClient(failures=10)
        reporter._client = down
        reporter.prepared(namespace="ns", name="b", uid="u2", devices=[(NODE, "gpu-0", None)])
        assert reporter.idle(5)
        assert down.calls == [("b", 1), ("b", 1)] and results == ["ok", "failed"]
    finally:
        reporter.stop()


def test_writes_wait_for_a_pause_in_the_kubelets_calls_but_not_forever() -> None:
    client = FlakyClient(failures=0)
    reporter = reporter_for(client, quiet_s=0.3, max_delay_s=1.0)
    reporter.start()
    try:
        started = time.monotonic()
        reporter.prepared(namespace="ns", name="a", uid="u1", devices=[(NODE, "gpu-0", None)])
        while time.monotonic() - started < 0.6:  # a burst: a call every 0.1 s
            assert client.calls == []
            reporter.unprepared(namespace="ns", name="x", uid=f"x{time.monotonic()}")
            time.sleep(0.1)
        assert reporter.idle(2)  # written once the burst paused
        assert ("a", 1) in client.calls
        client.calls.clear()
        started = time.monotonic()
        reporter.prepared(namespace="ns", name="b", uid="u2", devices=[(NODE, "gpu-0", None)])
        while ("b", 1) not in client.calls:  # a burst that does not end: written at max_delay_s
            reporter.unprepared(namespace="ns", name="y", uid=f"y{time.monotonic()}")
            time.sleep(0.05)
            assert time.monotonic() - started < 3
        assert time.monotonic() - started >= 0.9
    finally:
        reporter.stop()


def test_a_burst_of_calls_wakes_the_writer_once_not_per_call() -> None:
    """A call only postpones the pending writes: the writer, asleep till they are due, is not
    woken by each (it would take the interpreter lock from the servicer's answer)."""
    client = FlakyClient(failures=0)
    reporter = reporter_for(client, quiet_s=0.2)
    passes = []
    next_due = reporter._next_due
    reporter._next_due = lambda: passes.append(1) or next_due()  # type: ignore[method-assign]
    reporter.start()
    try:
        time.sleep(0.05)  # the writer asleep, idle
        passes.clear()
        for i in range(50):  # the kubelet's calls, a millisecond apart
            reporter.prepared(
                namespace="ns", name=f"c{i}", uid=f"u{i}", devices=[(NODE, "gpu-0", None)]
            )
            time.sleep(0.001)
        assert reporter.idle(3)
        assert len(client.calls) == 50
        # a pass per write, and a few more: one for the first call, one at the pause (a wake
        # per call made that about 100)
        assert len(passes) <= 50 + 5, len(passes)
    finally:
        reporter.stop()


def test_a_wish_is_written_at_the_pause_even_while_a_retry_waits_long() -> None:
    """The writer asleep till a retry's far ``not_before`` is woken for a new wish due sooner."""
    flaky = FlakyClient(failures=1)
    reporter = reporter_for(flaky, retry_delays_s=(30.0,), quiet_s=0.05)
    reporter.start()
    try:
        reporter.prepared(namespace="ns", name="a", uid="u1", devices=[(NODE, "gpu-0", None)])
        deadline = time.monotonic() + 3
        while len(flaky.calls) < 1:  # failed once: its retry is 30 s away
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.1)  # the writer asleep till the retry
        started = time.monotonic()
        reporter.prepared(namespace="ns", name="b", uid="u2", devices=[(NODE, "gpu-0", None)])
        while ("b", 1) not in flaky.calls:
            assert time.monotonic() - started < 2, "the new wish waited for the retry"
            time.sleep(0.01)
    finally:
        reporter.stop(timeout_s=0.5)


def test_a_claim_unprepared_before_its_entries_were_written_costs_no_write() -> None:
    """A pod that comes and goes within a burst: its prepared wish is replaced by the removal,
    and with nothing of it on the server the removal is dropped too (no write at all); a claim
    whose entries were written, or that an earlier agent prepared, gets its removal."""
    client = FlakyClient(failures=0)
    reporter = reporter_for(client, quiet_s=0.05, max_delay_s=5.0)
    reporter.start(written_before={"earlier"})
    try:
        gpu = [(NODE, "gpu-0", None)]
        reporter.prepared(namespace="ns", name="brief", uid="u1", devices=gpu)
        reporter.unprepared(namespace="ns", name="brief", uid="u1")  # before the pause
        reporter.unprepared(namespace="ns", name="gone", uid="never-prepared")
        assert reporter.idle(3)
        time.sleep(0.1)  # past the pause: anything still queued would be written by now
        assert client.calls == []
        reporter.unprepared(namespace="ns", name="old", uid="earlier")  # an earlier agent's
        reporter.prepared(namespace="ns", name="long", uid="u2", devices=gpu)
        assert reporter.idle(3)
        assert sorted(client.calls) == [("long", 1), ("old", 0)]
        client.calls.clear()
        reporter.unprepared(namespace="ns", name="long", uid="u2")  # its entries are there
        assert reporter.idle(3)
        assert client.calls == [("long", 0)]
        client.calls.clear()
        reporter.unprepared(namespace="ns", name="long", uid="u2")  # removed already
        reporter.unprepared(namespace="ns", name="old", uid="earlier")
        assert reporter.idle(3)
        assert client.calls == []
    finally:
        reporter.stop()


def test_a_removal_is_written_when_the_prepared_write_was_tried_even_if_it_failed() -> None:
    """A failed write may have reached the server: its claim's removal is still written."""
    flaky = FlakyClient(failures=1)
    reporter = reporter_for(flaky, retry_delays_s=(30.0,), quiet_s=0.02)
    reporter.start(written_before=())
    try:
        reporter.prepared(namespace="ns", name="a", uid="u1", devices=[(NODE, "gpu-0", None)])
        wait_for(lambda: flaky.calls, timeout_s=3)  # tried once and failed; retry in 30 s
        reporter.unprepared(namespace="ns", name="a", uid="u1")  # replaces the retry
        wait_for(lambda: len(flaky.calls) >= 2, timeout_s=3)
        assert flaky.calls == [("a", 1), ("a", 0)]
    finally:
        reporter.stop(timeout_s=0.5)


def test_before_it_starts_the_reporter_writes_every_removal() -> None:
    """Until the agent tells it which claims an earlier agent prepared, nothing is known to be
    absent from the server: a removal queued meanwhile is written."""
    client = FlakyClient(failures=0)
    reporter = reporter_for(client, quiet_s=0.02)
    reporter.unprepared(namespace="ns", name="a", uid="u1")
    reporter.start(written_before=())
    try:
        assert reporter.idle(3)
        assert client.calls == [("a", 0)]
    finally:
        reporter.stop()


# -- the agent, as deployed ------------------------------------------------------------------


@as_a_pod
def test_the_agent_writes_the_status_after_prepare_and_clears_it_at_unprepare(
    tmp_path: Path,
) -> None:
    api = FakeKubeApi(tls_dir=tmp_path / "tls", token="sa-token").start()
    metrics_port = free_port()
    try:
        api.add_node(NODE)
        good = allocated_claim(name="train", namespace="ml", node=NODE, devices=("gpu-1",))
        bad = allocated_claim(name="infer", namespace="ml", node=NODE, devices=("gpu-0",))
        api.add_claim(good)
        api.add_claim(bad)
        command, env = _in_cluster(
            api, tmp_path, simulate="h100:2", node=NODE,
            extra=("--metrics-port", str(metrics_port), "--telemetry-interval", "0"),
        )  # fmt: skip
        agent = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
        try:
            _register(tmp_path / "registry" / f"{DRIVER}-reg.sock")
            dra = tmp_path / "plugins" / DRIVER / "dra.sock"
            with grpc.insecure_channel(f"unix://{dra}") as channel:
                stub = v1_grpc.DRAPluginStub(channel)
                ref = v1.Claim(namespace="ml", name="train", uid=good["metadata"]["uid"])
                answer = stub.NodePrepareResources(
                    v1.NodePrepareResourcesRequest(claims=[ref]), timeout=30
                )
                assert not answer.claims[ref.uid].error
                devices = wait_for(lambda: stored_devices(api, "train"))
                (written,) = devices
                assert (written["driver"], written["pool"], written["device"]) == (
                    DRIVER, NODE, "gpu-1",
                )  # fmt: skip
                assert written["conditions"][0]["type"] == "Ready"
                assert written["conditions"][0]["status"] == "True"
                assert written["data"]["uuid"].startswith("GPU-")
                assert written["data"]["productName"].startswith("NVIDIA H100")
                assert written["data"]["minor"] == 1
                stub.NodeUnprepareResources(
                    v1.NodeUnprepareResourcesRequest(claims=[ref]), timeout=30
                )
                wait_for(lambda: not stored_devices(api, "train"))
                # The API server refuses every status write: the prepare still succeeds.
                api.fail("patch", "resourceclaims/status", 500)
                ref = v1.Claim(namespace="ml", name="infer", uid=bad["metadata"]["uid"])
                answer = stub.NodePrepareResources(
                    v1.NodePrepareResourcesRequest(claims=[ref]), timeout=30
                )
                assert not answer.claims[ref.uid].error
                failed = 'gpu_dra_claim_status_writes_total{driver="gpu.nvidia.com",node='
                wait_for(
                    lambda: f'{failed}"{NODE}",result="failed"}} 1.0' in _scrape(metrics_port)[1],
                    timeout_s=30,
                )
                assert stored_devices(api, "infer") == []
        finally:
            agent.terminate()
            _, stderr = agent.communicate(timeout=30)
        assert agent.returncode == 0, stderr[-3000:]
        assert "could not write the claim's device status" in stderr
    finally:
        api.stop()


@as_a_pod
def test_an_agent_restarted_clears_the_status_its_predecessor_wrote(tmp_path: Path) -> None:
    """The entries of a claim prepared by the agent before a restart are on the server: the new
    agent, which never wrote them, still removes them when the kubelet unprepares the claim."""
    api = FakeKubeApi(tls_dir=tmp_path / "tls", token="sa-token").start()
    try:
        api.add_node(NODE)
        claim = allocated_claim(name="train", namespace="ml", node=NODE, devices=("gpu-0",))
        api.add_claim(claim)
        ref = v1.Claim(namespace="ml", name="train", uid=claim["metadata"]["uid"])
        command, env = _in_cluster(
            api, tmp_path, simulate="h100:1", node=NODE, extra=("--telemetry-interval", "0")
        )
        dra = tmp_path / "plugins" / DRIVER / "dra.sock"
        for call in ("prepare", "unprepare"):  # each by an agent of its own
            agent = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
            try:
                _register(tmp_path / "registry" / f"{DRIVER}-reg.sock")
                with grpc.insecure_channel(f"unix://{dra}") as channel:
                    stub = v1_grpc.DRAPluginStub(channel)
                    if call == "prepare":
                        answer = stub.NodePrepareResources(
                            v1.NodePrepareResourcesRequest(claims=[ref]), timeout=30
                        )
                        assert not answer.claims[ref.uid].error
                        wait_for(lambda: stored_devices(api, "train"))
                    else:
                        answer = stub.NodeUnprepareResources(
                            v1.NodeUnprepareResourcesRequest(claims=[ref]), timeout=30
                        )
                        assert not answer.claims[ref.uid].error
                        wait_for(lambda: not stored_devices(api, "train"))
            finally:
                agent.terminate()
                _, stderr = agent.communicate(timeout=30)
            assert agent.returncode == 0, stderr[-3000:]
    finally:
        api.stop()


def wait_for(check: Any, timeout_s: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        found = check()
        if found:
            return found
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


# -- gpu-dra status --kubeconfig shows it ------------------------------------------------------


class Cluster:
    """The three lists `gpu-dra status` reads (kube.ClusterClient's), as plain data."""

    def __init__(self, claim: dict[str, Any]) -> None:
        self.claim = claim

    def list_all_slices(self) -> list[dict[str, Any]]:
        device = {"name": "gpu-0", "attributes": {"type": {"string": "gpu"}}}
        spec = {"driver": DRIVER, "nodeName": NODE, "pool": {"name": NODE}, "devices": [device]}
        return [{"metadata": {"name": "s"}, "spec": spec}]

    def list_resource_claims(self) -> list[dict[str, Any]]:
        return [self.claim]

    def list_pods(self, *, label_selector: str, namespace: str = "") -> list[dict[str, Any]]:
        return []


def test_gpu_dra_status_shows_the_claims_device_status() -> None:
    from dra_driver.telemetry.status.cluster import cluster_report  # noqa: PLC0415

    claim = allocated_claim(name="c", node=NODE)
    written = entry("gpu-0", data={"uuid": "GPU-abc", "index": 0})
    claim["status"]["devices"] = [written, entry("eth0", driver="nic.example.com")]
    (row,) = cluster_report(Cluster(claim), read=lambda url: "").to_json()["devices"]
    (holder,) = row["claims"]
    assert holder["deviceStatus"] == {"conditions": [READY], "data": written["data"]}
    del claim["status"]["devices"]
    (row,) = cluster_report(Cluster(claim), read=lambda url: "").to_json()["devices"]
    assert "deviceStatus" not in row["claims"][0]
