"""The prepare path's claim GET against a real kube-apiserver: over HTTPS with a bearer token,
on keep-alive connections (keepalive.py), it reads what the official client reads."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from dra_driver.kube import KubeClient
from tests.integration.conftest import RealApiServer

pytestmark = pytest.mark.integration


@pytest.fixture
def kube(real_apiserver: RealApiServer) -> Iterator[KubeClient]:
    client = KubeClient.from_config(kubeconfig=real_apiserver.kubeconfig)
    yield client
    client.close()


def create_claim(server: RealApiServer, version: str, name: str) -> dict[str, Any]:
    request: dict[str, Any] = {"name": "gpu"}
    if version == "v1beta1":  # the exact request's fields are inline before v1beta2
        request["deviceClassName"] = "gpu.nvidia.com"
    else:
        request["exactly"] = {"deviceClassName": "gpu.nvidia.com"}
    claim = {
        "apiVersion": f"resource.k8s.io/{version}",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"devices": {"requests": [request]}},
    }
    created: dict[str, Any] = server.request(
        "POST", f"/apis/resource.k8s.io/{version}/namespaces/default/resourceclaims", claim
    )
    return created


def test_the_claim_get_reads_what_the_official_client_reads(
    real_apiserver: RealApiServer, kube: KubeClient
) -> None:
    assert kube._getter is not None and kube._getter._tls[0] is not None  # HTTPS, CA verified
    version = kube.resource_api_version
    name = f"claim-{uuid.uuid4().hex[:8]}"
    created = create_claim(real_apiserver, version, name)

    got = kube.get_resource_claim(namespace="default", name=name)
    assert got is not None
    assert got["metadata"]["uid"] == created["metadata"]["uid"]
    assert got["apiVersion"] == "resource.k8s.io/v1"
    assert got["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] == ("gpu.nvidia.com")
    assert kube.get_resource_claim(namespace="default", name="never-created") is None

    official = KubeClient.from_config(kubeconfig=real_apiserver.kubeconfig)
    official._getter = None  # the same GET through the official client's own request path
    try:
        assert official.get_resource_claim(namespace="default", name=name) == got
    finally:
        official.close()


def test_claim_gets_reuse_one_connection(real_apiserver: RealApiServer, kube: KubeClient) -> None:
    version = kube.resource_api_version
    name = f"claim-{uuid.uuid4().hex[:8]}"
    uid = create_claim(real_apiserver, version, name)["metadata"]["uid"]
    for _ in range(20):
        got = kube.get_resource_claim(namespace="default", name=name)
        assert got is not None and got["metadata"]["uid"] == uid
    assert kube._getter is not None and kube._getter.idle_connections == 1
