"""kube/ through the real kubernetes client, over HTTP, against dra_driver/sim/localapi/: the
connection (discovery, errors, configuration), the ResourceSlice, claim, Node and Event calls."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dra_driver.errors import (
    ConfigError,
    KubeConflict,
    KubeError,
    KubeForbidden,
    KubeGone,
    KubeInvalid,
    KubeNotFound,
    KubeUnavailable,
)
from dra_driver.kube import KubeClient
from dra_driver.kube.permissions import API_PERMISSIONS
from dra_driver.sim.localapi import FakeKubeApi
from tests.kubedata import DRIVER, claim, client, slice_body


@pytest.fixture
def kube(kubeapi: FakeKubeApi) -> Iterator[KubeClient]:
    assert kubeapi.kubeconfig_path is not None
    client = KubeClient.from_config(kubeconfig=kubeapi.kubeconfig_path, timeout_s=2)
    yield client
    client.close()


# --- discovery and shapes ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("served", "chosen"),
    [
        (("v1", "v1beta2", "v1beta1"), "v1"),
        (("v1beta2", "v1beta1"), "v1beta2"),
        (("v1beta1",), "v1beta1"),
    ],
)
def test_discovery_prefers_v1_then_v1beta2_then_v1beta1(
    tmp_path: Path, served: tuple[str, ...], chosen: str
) -> None:
    api = FakeKubeApi(versions=served).start()
    try:
        kube = client(api, tmp_path)
        assert kube.resource_api_version == chosen
        stored = kube.create_slice(slice_body())
        assert stored["apiVersion"] == "resource.k8s.io/v1"
        assert stored["spec"]["devices"][0]["capacity"] == {"memory": {"value": "80Gi"}}
        assert ("create", "resourceslices", "", "") in api.requests
        listed = kube.list_slices(driver_name=DRIVER, node_name="node1").items
        assert [s["spec"]["devices"] for s in listed] == [stored["spec"]["devices"]]
    finally:
        api.stop()


def test_a_v1beta1_server_stores_the_devices_it_was_sent_wrapped_in_basic(tmp_path: Path) -> None:
    api = FakeKubeApi(versions=("v1beta1",)).start()
    try:
        kube = client(api, tmp_path)
        body = slice_body()
        kube.create_slice(body)
        (kept,) = api.slices()
        assert [d["name"] for d in kept["spec"]["devices"]] == ["gpu-0", "gpu-1"]
        assert kept["spec"]["devices"][1]["attributes"] == {"type": {"string": "gpu"}}
    finally:
        api.stop()


def test_a_server_without_resource_k8s_io_is_reported_clearly(tmp_path: Path) -> None:
    api = FakeKubeApi(versions=()).start()
    try:
        with pytest.raises(KubeNotFound, match=r"does not serve resource\.k8s\.io"):
            _ = client(api, tmp_path).resource_api_version
    finally:
        api.stop()


def test_list_uses_the_driver_and_node_field_selector(
    kubeapi: FakeKubeApi, kube: KubeClient
) -> None:
    kube.create_slice(slice_body("node1"))
    kube.create_slice(slice_body("node2"))
    kube.create_slice(slice_body("node1", driver="other.example.com"))
    listed = kube.list_slices(driver_name=DRIVER, node_name="node1")
    assert [(s["spec"]["driver"], s["spec"]["nodeName"]) for s in listed.items] == [
        (DRIVER, "node1")
    ]
    assert int(listed.resource_version) > 0


def test_taints_come_back_with_the_server_set_time(kube: KubeClient) -> None:
    stored = kube.create_slice(slice_body())
    assert stored["spec"]["devices"][0]["taints"][0]["timeAdded"].endswith("Z")


# --- writes --------------------------------------------------------------------------------------


def test_update_with_a_stale_resource_version_is_a_conflict(kube: KubeClient) -> None:
    stored = kube.create_slice(slice_body())
    fresh = kube.update_slice(stored)
    assert int(fresh["metadata"]["resourceVersion"]) > int(stored["metadata"]["resourceVersion"])
    with pytest.raises(KubeConflict, match="has been modified"):
        kube.update_slice(stored)


def test_delete_checks_preconditions_and_ignores_missing_slices(
    kubeapi: FakeKubeApi, kube: KubeClient
) -> None:
    stored = kube.create_slice(slice_body())
    meta = stored["metadata"]
    with pytest.raises(KubeConflict, match="Precondition failed"):
        kube.delete_slice(name=meta["name"], uid="someone-else", resource_version="")
    assert kube.delete_slice(
        name=meta["name"], uid=meta["uid"], resource_version=meta["resourceVersion"]
    )
    assert kubeapi.slices() == []
    assert not kube.delete_slice(
        name=meta["name"], uid=meta["uid"], resource_version=meta["resourceVersion"]
    )


def test_an_invalid_slice_is_rejected_with_the_servers_reason(kube: KubeClient) -> None:
    body = slice_body(devices=60)
    more = slice_body(devices=10)["spec"]["devices"]
    # 70 devices, one of them tainted: over the limit of 64 that taints impose.
    body["spec"]["devices"] += [{**d, "name": d["name"] + "-b"} for d in more]
    with pytest.raises(KubeInvalid, match="must have at most 64 items"):
        kube.create_slice(body)


# --- error mapping -------------------------------------------------------------------------------


def test_forbidden_names_the_verb_and_resource_to_grant(
    kubeapi: FakeKubeApi, kube: KubeClient
) -> None:
    kubeapi.forbid("create", "resourceslices")
    with pytest.raises(KubeForbidden) as info:
        kube.create_slice(slice_body())
    assert str(info.value).startswith(
        "forbidden: the ServiceAccount may not 'create' resourceslices.resource.k8s.io; "
        "grant it in the ClusterRole"
    )
    assert (info.value.verb, info.value.resource, info.value.status) == (
        "create",
        "resourceslices",
        403,
    )


@pytest.mark.parametrize(
    ("verb", "status", "error"),
    [
        ("list", 404, KubeNotFound),
        ("list", 409, KubeConflict),
        ("list", 410, KubeGone),
        ("list", 500, KubeUnavailable),
        ("list", 503, KubeUnavailable),
        ("list", 429, KubeUnavailable),
        ("watch", 410, KubeGone),
        ("watch", 500, KubeUnavailable),
    ],
)
def test_http_errors_become_kube_errors_without_hidden_retries(
    kubeapi: FakeKubeApi, kube: KubeClient, verb: str, status: int, error: type[KubeError]
) -> None:
    kubeapi.fail(verb, "resourceslices", status, times=1)
    with pytest.raises(error) as info:
        if verb == "list":
            kube.list_slices(driver_name=DRIVER, node_name="node1")
        else:
            kube.watch_slices(driver_name=DRIVER, node_name="node1", resource_version="1")
    assert info.value.status == status
    assert sum(1 for r in kubeapi.requests if r.verb == verb) == 1


def test_a_stopped_server_is_unavailable(tmp_path: Path) -> None:
    api = FakeKubeApi().start()
    kube = client(api, tmp_path)
    _ = kube.resource_api_version
    api.stop()
    began = time.monotonic()
    with pytest.raises(KubeUnavailable, match="unreachable"):
        kube.get_node("node1")
    assert time.monotonic() - began < 2


def test_a_rejected_token_is_reported_as_unauthorized(tmp_path: Path) -> None:
    api = FakeKubeApi(token="right").start()
    try:
        kube = KubeClient.from_config(
            kubeconfig=api.write_kubeconfig(tmp_path / "kc", token="wrong")
        )
        with pytest.raises(KubeError, match="unauthorized") as info:
            kube.get_node("node1")
        assert info.value.status == 401
    finally:
        api.stop()


# --- other objects -------------------------------------------------------------------------------


def test_get_node_returns_the_node_and_raises_not_found(
    kubeapi: FakeKubeApi, kube: KubeClient
) -> None:
    node = kubeapi.add_node("node1")
    assert kube.get_node("node1")["metadata"]["uid"] == node["metadata"]["uid"]
    with pytest.raises(KubeNotFound, match='nodes "node9" not found'):
        kube.get_node("node9")


@pytest.mark.parametrize("served", [("v1",), ("v1beta2",), ("v1beta1",)])
def test_claims_are_returned_in_v1_shape_from_every_version(
    tmp_path: Path, served: tuple[str, ...]
) -> None:
    api = FakeKubeApi(versions=served).start()
    try:
        stored = api.add_claim(claim())
        kube = client(api, tmp_path)
        got = kube.get_resource_claim(namespace="ns1", name="claim-a")
        kube.close()
        assert got is not None
        assert got["apiVersion"] == "resource.k8s.io/v1"
        assert got["spec"] == stored["spec"]
        assert got["status"] == stored["status"]
        assert got["metadata"]["uid"] == stored["metadata"]["uid"]
    finally:
        api.stop()


def test_a_missing_claim_is_none(kubeapi: FakeKubeApi, kube: KubeClient) -> None:
    kubeapi.add_claim(claim("other"))
    assert kube.get_resource_claim(namespace="ns1", name="claim-a") is None
    assert ("get", "resourceclaims", "ns1", "claim-a") in kubeapi.requests


def deep_json(depth: int) -> bytes:
    """A claim whose opaque parameters are nested ``depth`` lists deep, as an API server that
    stored it returns it (its own decoder allows 10,000 levels)."""
    head = b'{"metadata": {"name": "claim-a", "uid": "u"}, "status": {"x": '
    return head + b"[" * depth + b"]" * depth + b"}}"


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        (b"<html>502 Bad Gateway</html>", "the body is not JSON"),
        (b'{"metadata": {"name": "claim-a"', "the body is not JSON"),
        (b"[1, 2]", "the body is a JSON list, not an object"),
        (b'"claim"', "the body is a JSON str, not an object"),
        (deep_json(10_000), "the body is JSON nested deeper than this agent decodes"),
    ],
)
def test_a_success_whose_body_is_no_json_object_is_a_broken_answer_not_a_claim(
    kubeapi: FakeKubeApi, kube: KubeClient, body: bytes, problem: str
) -> None:
    """Issue 37: a 200 with an HTML page became the claim ``{"message": ...}`` (then refused as
    "has UID None"), and JSON nested 10,000 deep raised RecursionError out of the client."""
    kubeapi.add_claim(claim())
    kubeapi.answer_raw("get", "resourceclaims", body, name="claim-a")
    with pytest.raises(KubeUnavailable) as info:
        kube.get_resource_claim(namespace="ns1", name="claim-a")
    assert str(info.value).startswith(
        "get resourceclaims/claim-a in namespace ns1: broken answer from the API server (HTTP 200)"
    )
    assert problem in str(info.value)


def test_an_error_status_with_a_body_that_is_no_json_object_keeps_its_status(
    kubeapi: FakeKubeApi, kube: KubeClient
) -> None:
    kubeapi.answer_raw("get", "resourceclaims", b"[]", name="claim-a", status=404)
    assert kube.get_resource_claim(namespace="ns1", name="claim-a") is None
    kubeapi.answer_raw("get", "resourceclaims", deep_json(5000), name="claim-b", status=403)
    with pytest.raises(KubeForbidden, match=r"may not 'get' resourceclaims\.resource\.k8s\.io"):
        kube.get_resource_claim(namespace="ns1", name="claim-b")


def test_events_are_recorded_on_the_node(kubeapi: FakeKubeApi, kube: KubeClient) -> None:
    node = kubeapi.add_node("node1")
    kube.create_event(
        node_name="node1",
        node_uid=node["metadata"]["uid"],
        reason="CheckpointDamaged",
        message="checkpoint set aside",
    )
    (event,) = kubeapi.objects("events")
    assert event["metadata"]["namespace"] == "default"
    assert event["involvedObject"] == {
        "apiVersion": "v1",
        "kind": "Node",
        "name": "node1",
        "uid": node["metadata"]["uid"],
    }
    assert (event["reason"], event["type"]) == ("CheckpointDamaged", "Warning")


def test_every_request_the_client_makes_is_listed_in_api_permissions(
    kubeapi: FakeKubeApi, kube: KubeClient
) -> None:
    node = kubeapi.add_node("node1")
    kubeapi.add_claim(claim())
    kube.get_node("node1")
    kube.get_resource_claim(namespace="ns1", name="claim-a")
    uid = kubeapi.objects("resourceclaims")[0]["metadata"]["uid"]
    kube.apply_resource_claim_status(  # the claim's status.devices (claimstatus/)
        namespace="ns1", name="claim-a", uid=uid, devices=[], field_manager=DRIVER
    )
    assert kube.get_pod("ns1", "pod-0") is None  # telemetry: the containers of a claim's pods
    kube.create_event(node_name="node1", node_uid=node["metadata"]["uid"], reason="R", message="m")
    stored = kube.create_slice(slice_body())
    stored = kube.update_slice(stored)
    listed = kube.list_slices(driver_name=DRIVER, node_name="node1")
    with kube.watch_slices(
        driver_name=DRIVER, node_name="node1", resource_version=listed.resource_version, timeout_s=1
    ) as stream:
        list(stream)
    meta = stored["metadata"]
    kube.delete_slice(name=meta["name"], uid=meta["uid"], resource_version=meta["resourceVersion"])
    assert kubeapi.permissions_used() == set(API_PERMISSIONS)


# --- configuration -------------------------------------------------------------------------------


def test_kubeconfig_comes_from_the_environment(
    kubeapi: FakeKubeApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(kubeapi.kubeconfig_path))
    kubeapi.add_node("node1")
    assert KubeClient.from_config().get_node("node1")["metadata"]["name"] == "node1"


def test_a_missing_kubeconfig_names_the_flag(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"--kubeconfig \(KUBECONFIG\).*nope"):
        KubeClient.from_config(kubeconfig=tmp_path / "nope")


def test_without_kubeconfig_outside_a_pod_the_error_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ConfigError, match="not running in a Pod"):
        KubeClient.from_config()


def test_the_agent_path_loads_none_of_the_clients_model_machinery(tmp_path: Path) -> None:
    """The node agent speaks JSON dicts through the official transport: importing it and talking
    to the API server must not load ApiClient's pydantic/dateutil/model stack (10.5 MiB), the
    kubeconfig loader's OIDC stack, YAML or the CEL engine. Names of the package are still there
    for whoever asks (the kubeconfig loader does)."""
    api = FakeKubeApi().start()
    api.add_node("node1")
    script = f"""
import sys
import dra_driver.node.agent, dra_driver.cli
from kubernetes.client.configuration import Configuration
from dra_driver.kube import KubeClient
configuration = Configuration(host={api.url!r})
kube = KubeClient(configuration)
assert kube.get_node("node1")["metadata"]["name"] == "node1"
kube.list_slices(driver_name="gpu.nvidia.com", node_name="node1")
kube.close()
heavy = ["pydantic", "dateutil", "kubernetes.client.api_client", "kubernetes.client.models",
         "multiprocessing.pool", "yaml", "oauthlib", "requests", "celpy",
         "dra_driver.scheduling", "dra_driver.prepare.deviceconfig", "kubernetes.watch"]
loaded = [name for name in heavy if name in sys.modules]
assert not loaded, loaded
from kubernetes.client import ApiClient  # the package's names on demand
import kubernetes
assert ApiClient.__name__ == "ApiClient" and kubernetes.__version__
print("ok")
"""
    try:
        run = subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True, text=True, timeout=60, check=False,
            cwd=Path(__file__).resolve().parents[1],
        )  # fmt: skip
    finally:
        api.stop()
    assert run.stdout.strip() == "ok", run.stderr


def test_the_stand_in_server_answers_a_get_after_the_latency_asked_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The benchmarks' API server (``get_latency_s``) answers a GET of one object when the
    latency asked for has passed since the request arrived, its own work included (here made
    10 ms long: not that work plus a sleep of the whole latency), and records what each answer
    took."""
    from dra_driver.sim import localapi  # noqa: PLC0415
    from tests.claimdata import allocated_claim  # noqa: PLC0415

    serve = localapi._Handler._serve

    def slow_serve(self: Any, *args: Any) -> Any:
        time.sleep(0.01)
        return serve(self, *args)

    monkeypatch.setattr(localapi._Handler, "_serve", slow_serve)
    api = FakeKubeApi(get_latency_s=0.02)
    claim = api.add_claim(allocated_claim(name="c1", devices=["gpu-0"]))
    api.start()
    kube = client(api, tmp_path)
    try:
        took = []
        for _ in range(10):
            started = time.perf_counter()
            got = kube.get_resource_claim(namespace="default", name="c1")
            took.append(time.perf_counter() - started)
            assert got is not None and got["metadata"]["uid"] == claim["metadata"]["uid"]
    finally:
        kube.close()
        api.stop()
    # the first GETs learn how early to end the sleep, 2 us per answer: never early by more
    assert min(took) >= 0.02 - 10 * 2e-6
    assert len(api.get_seconds) == 10
    assert 0.02 - 10 * 2e-6 <= sorted(api.get_seconds)[5] < 0.027
