"""kube/clusterreads.py: what gpu-dra explain and status read of the whole cluster."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from dra_driver.kube.clusterreads import ClusterClient
from dra_driver.kube.permissions import EXPLAIN_PERMISSIONS
from dra_driver.sim.localapi import FakeKubeApi
from tests.kubedata import DRIVER, claim, cluster_client


@pytest.fixture
def kube(kubeapi: FakeKubeApi) -> Iterator[ClusterClient]:
    assert kubeapi.kubeconfig_path is not None
    client = ClusterClient.from_config(kubeconfig=kubeapi.kubeconfig_path, timeout_s=2)
    yield client
    client.close()


@pytest.mark.parametrize("served", [("v1",), ("v1beta2",), ("v1beta1",)])
def test_list_resource_claims_returns_every_namespace_in_v1_shape(
    tmp_path: Path, served: tuple[str, ...]
) -> None:
    api = FakeKubeApi(versions=served).start()
    try:
        stored = [api.add_claim(claim("ns2")), api.add_claim(claim("ns1"))]
        kube = cluster_client(api, tmp_path)
        got = kube.list_resource_claims()
        kube.close()
        assert [(c["metadata"]["namespace"], c["kind"], c["apiVersion"]) for c in got] == [
            ("ns1", "ResourceClaim", "resource.k8s.io/v1"),
            ("ns2", "ResourceClaim", "resource.k8s.io/v1"),
        ]
        assert got[0]["spec"] == stored[1]["spec"]
        assert got[0]["status"] == stored[1]["status"]
        assert got[0]["metadata"]["uid"] == stored[1]["metadata"]["uid"]
        assert ("list", "resourceclaims", "", "") in api.requests
    finally:
        api.stop()


DEVICE_TAINT_RULE = {
    "metadata": {"name": "gpu-0-broken"},
    "spec": {
        "deviceSelector": {"driver": DRIVER, "pool": "node1", "device": "gpu-0"},
        "taint": {"key": "example.com/broken", "effect": "NoSchedule"},
    },
}


@pytest.mark.parametrize("version", ["v1alpha3", "v1beta2", "v1"])
def test_device_taint_rules_are_listed_in_the_version_the_cluster_serves(
    tmp_path: Path, version: str
) -> None:
    api = FakeKubeApi(device_taint_rule_versions=(version,)).start()
    try:
        api.put("devicetaintrules", DEVICE_TAINT_RULE)
        kube = cluster_client(api, tmp_path)
        rules = kube.list_device_taint_rules()
        kube.close()
        assert rules is not None
        (rule,) = rules
        assert rule["apiVersion"] == f"resource.k8s.io/{version}"
        assert rule["kind"] == "DeviceTaintRule"
        assert rule["spec"] == DEVICE_TAINT_RULE["spec"]
    finally:
        api.stop()


def test_device_taint_rules_not_served_are_none(kubeapi: FakeKubeApi, kube: ClusterClient) -> None:
    assert kube.list_device_taint_rules() is None
    assert not any(r.resource == "devicetaintrules" for r in kubeapi.requests)


def test_every_request_explain_makes_is_listed_in_explain_permissions(tmp_path: Path) -> None:
    api = FakeKubeApi(device_taint_rule_versions=("v1alpha3",)).start()
    try:
        kube = cluster_client(api, tmp_path)
        kube.list_all_slices()
        kube.list_device_classes()
        kube.list_resource_claims()
        kube.list_device_taint_rules()
        kube.close()
        assert api.permissions_used() == set(EXPLAIN_PERMISSIONS)
    finally:
        api.stop()
