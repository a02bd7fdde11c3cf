"""keepalive.py: the claim GET of the prepare path over keep-alive connections.

Through KubeClient against tests/kubeapi.py (HTTP and HTTPS, token auth, faults), and the retry
rules against a scripted socket server that misbehaves on cue.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from kubernetes.client import Configuration
from urllib3.exceptions import InsecureRequestWarning

from dra_driver.errors import KubeError, KubeForbidden, KubeUnavailable
from dra_driver.keepalive import KeepAliveGetter
from dra_driver.kube import KubeClient
from tests.claimdata import allocated_claim
from tests.kubeapi import FakeKubeApi


def _client(kubeconfig: Path) -> KubeClient:
    return KubeClient.from_config(kubeconfig=kubeconfig, timeout_s=2, connect_timeout_s=1)


@pytest.fixture
def kube(kubeapi: FakeKubeApi) -> Iterator[KubeClient]:
    assert kubeapi.kubeconfig_path is not None
    client = _client(kubeapi.kubeconfig_path)
    assert client._getter is not None  # the path under test
    yield client
    client.close()


def _add(api: FakeKubeApi, name: str) -> dict[str, Any]:
    return api.add_claim(allocated_claim(name=name, devices=["gpu-0"]))


# --- through KubeClient --------------------------------------------------------------------------


def test_claim_gets_share_one_keep_alive_connection(kubeapi: FakeKubeApi, kube: KubeClient) -> None:
    stored = [_add(kubeapi, f"claim-{i}") for i in range(20)]
    _ = kube.resource_api_version  # discovery: the official client's own connection
    before = kubeapi.connections_accepted
    for claim in stored:
        meta = claim["metadata"]
        got = kube.get_resource_claim(namespace=meta["namespace"], name=meta["name"])
        assert got is not None
        assert got["metadata"]["uid"] == meta["uid"]
        assert got["apiVersion"] == "resource.k8s.io/v1"
    assert kubeapi.connections_accepted - before == 1
    assert sum(1 for r in kubeapi.requests if r.resource == "resourceclaims") == 20


def test_a_connection_the_server_dropped_while_idle_is_replaced(
    kubeapi: FakeKubeApi, kube: KubeClient
) -> None:
    meta = _add(kubeapi, "claim-a")["metadata"]
    assert kube.get_resource_claim(namespace=meta["namespace"], name=meta["name"]) is not None
    before = kubeapi.connections_accepted
    kubeapi.kill_connections()  # an API server restart, an idle timeout, a load balancer
    got = kube.get_resource_claim(namespace=meta["namespace"], name=meta["name"])
    assert got is not None and got["metadata"]["uid"] == meta["uid"]
    assert kubeapi.connections_accepted - before == 1


@pytest.mark.parametrize(
    ("status", "error", "message"),
    [
        (500, KubeUnavailable, "injected"),
        (503, KubeUnavailable, "injected"),
        (429, KubeUnavailable, "injected"),
    ],
)
def test_error_statuses_become_kube_errors(
    kubeapi: FakeKubeApi,
    kube: KubeClient,
    status: int,
    error: type[KubeError],
    message: str,
) -> None:
    meta = _add(kubeapi, "claim-a")["metadata"]
    kubeapi.fail("get", "resourceclaims", status, times=1, message="injected failure")
    with pytest.raises(error, match=message) as info:
        kube.get_resource_claim(namespace=meta["namespace"], name=meta["name"])
    assert info.value.status == status
    # no hidden retry of an answered request; the connection is still good afterwards
    assert sum(1 for r in kubeapi.requests if r.resource == "resourceclaims") == 1
    assert kube.get_resource_claim(namespace=meta["namespace"], name=meta["name"]) is not None


def test_a_forbidden_claim_get_names_the_rule_to_grant(
    kubeapi: FakeKubeApi, kube: KubeClient
) -> None:
    meta = _add(kubeapi, "claim-a")["metadata"]
    kubeapi.forbid("get", "resourceclaims")
    with pytest.raises(KubeForbidden, match=r"may not 'get' resourceclaims\.resource\.k8s\.io"):
        kube.get_resource_claim(namespace=meta["namespace"], name=meta["name"])


def test_a_missing_claim_is_none_and_a_stopped_server_is_unavailable(
    kubeapi: FakeKubeApi, kube: KubeClient
) -> None:
    assert kube.get_resource_claim(namespace="ns1", name="nothing") is None
    kubeapi.stop()
    with pytest.raises(KubeUnavailable, match="get resourceclaims/claim-a in namespace ns1: API"):
        kube.get_resource_claim(namespace="ns1", name="claim-a")


def test_the_token_is_taken_from_the_client_configuration_on_every_request(
    tmp_path: Path,
) -> None:
    api = FakeKubeApi(token="first").start()
    kube = _client(api.write_kubeconfig(tmp_path / "kc"))
    try:
        meta = _add(api, "claim-a")["metadata"]
        assert kube.get_resource_claim(namespace=meta["namespace"], name=meta["name"])
        api.token = "rotated"  # the ServiceAccount token was rotated on the server
        with pytest.raises(KubeError, match="unauthorized") as info:
            kube.get_resource_claim(namespace=meta["namespace"], name=meta["name"])
        assert info.value.status == 401
        # what the in-cluster loader's refresh hook does once the token file holds a new token
        kube._api.configuration.refresh_api_key_hook = lambda config: config.api_key.update(
            BearerToken="Bearer rotated"
        )
        assert kube.get_resource_claim(namespace=meta["namespace"], name=meta["name"])
    finally:
        kube.close()
        api.stop()


@pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning")
def test_https_verifies_the_server_against_the_configured_ca(tmp_path: Path) -> None:
    api = FakeKubeApi(tls_dir=tmp_path / "tls").start()
    try:
        meta = _add(api, "claim-a")["metadata"]
        kube = _client(api.write_kubeconfig(tmp_path / "kc"))
        try:
            assert kube._getter is not None and kube._getter._tls is not None
            got = kube.get_resource_claim(namespace=meta["namespace"], name=meta["name"])
            assert got is not None and got["metadata"]["uid"] == meta["uid"]
        finally:
            kube.close()

        # the same server presented to a client that trusts another CA
        other = FakeKubeApi(tls_dir=tmp_path / "other-ca")
        other._certificate(tmp_path / "other-ca")
        config = json.loads((tmp_path / "kc").read_text())
        config["clusters"][0]["cluster"]["certificate-authority"] = str(
            tmp_path / "other-ca" / "ca.crt"
        )
        (tmp_path / "kc-wrong-ca").write_text(json.dumps(config))
        kube = _client(tmp_path / "kc-wrong-ca")
        try:
            with pytest.raises(KubeUnavailable, match="CERTIFICATE_VERIFY_FAILED"):
                kube.get_resource_claim(namespace=meta["namespace"], name=meta["name"])
        finally:
            kube.close()

        # insecure-skip-tls-verify, as the official client honours it
        del config["clusters"][0]["cluster"]["certificate-authority"]
        config["clusters"][0]["cluster"]["insecure-skip-tls-verify"] = True
        (tmp_path / "kc-insecure").write_text(json.dumps(config))
        kube = _client(tmp_path / "kc-insecure")
        try:
            with pytest.warns(InsecureRequestWarning):  # as the official client warns
                assert kube.get_resource_claim(namespace=meta["namespace"], name=meta["name"])
        finally:
            kube.close()
    finally:
        api.stop()


def test_concurrent_gets_each_get_their_own_claim(kubeapi: FakeKubeApi, kube: KubeClient) -> None:
    stored = [_add(kubeapi, f"claim-{i}") for i in range(40)]
    _ = kube.resource_api_version
    before = kubeapi.connections_accepted

    def get(i: int) -> str:
        meta = stored[i % 40]["metadata"]
        got = kube.get_resource_claim(namespace=meta["namespace"], name=meta["name"])
        assert got is not None
        return str(got["metadata"]["uid"])

    with ThreadPoolExecutor(16) as pool:
        uids = list(pool.map(get, range(400)))
    assert uids == [stored[i % 40]["metadata"]["uid"] for i in range(400)]
    assert kubeapi.connections_accepted - before <= 16
    assert kube._getter is not None and 1 <= kube._getter.idle_connections <= 16


def _configuration(host: str, **settings: Any) -> Configuration:
    config = Configuration()
    config.host = host
    for key, value in settings.items():
        setattr(config, key, value)
    return config


@pytest.mark.parametrize(
    ("settings", "supported"),
    [
        ({}, True),
        ({"proxy": "http://proxy.example:3128"}, False),
        ({"proxy": "http://proxy.example:3128", "no_proxy": "127.0.0.1"}, True),
        ({"socket_options": [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]}, False),
        ({"assert_hostname": "api.example"}, False),
        ({"assert_hostname": False}, True),
    ],
)
def test_configurations_it_cannot_honour_keep_the_official_path(
    settings: dict[str, Any], supported: bool
) -> None:
    getter = KeepAliveGetter.for_configuration(
        _configuration("http://127.0.0.1:6443", **settings),
        connect_timeout_s=1,
        read_timeout_s=1,
    )
    assert (getter is not None) is supported


def test_with_a_proxy_the_claim_get_goes_through_the_official_client(
    kubeapi: FakeKubeApi, tmp_path: Path
) -> None:
    assert kubeapi.kubeconfig_path is not None
    config = json.loads(kubeapi.kubeconfig_path.read_text())
    config["clusters"][0]["cluster"]["proxy-url"] = "http://127.0.0.1:9"  # nothing listens
    (tmp_path / "kc-proxy").write_text(json.dumps(config))
    kube = _client(tmp_path / "kc-proxy")
    try:
        assert kube._getter is None
        with pytest.raises(KubeUnavailable):  # the official client tried the (dead) proxy
            kube.get_resource_claim(namespace="ns1", name="claim-a")
        assert not any(r.resource == "resourceclaims" for r in kubeapi.requests)
    finally:
        kube.close()


# --- retry rules, against a scripted server ------------------------------------------------------

_OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
_OK_CLOSE = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n"
    b"Connection: close\r\n\r\n{}"
)


class _Scripted:
    """Serves request n (counted over all connections) as ``script[n]``: "ok" answers, "ok-close"
    answers with Connection: close, "drop" closes the connection without answering, "hang"
    never answers."""

    def __init__(self, script: list[str]) -> None:
        self.script = script
        self.requests = 0
        self.connections = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            buffer = b""
            while True:
                while b"\r\n\r\n" not in buffer:
                    chunk = conn.recv(4096)
                    if not chunk:
                        return
                    buffer += chunk
                _, _, buffer = buffer.partition(b"\r\n\r\n")
                step = self.script[self.requests]
                self.requests += 1
                if step == "drop":
                    return
                if step == "hang":
                    self._held.append(conn)
                    threading.Event().wait(5)
                    return
                conn.sendall(_OK_CLOSE if step == "ok-close" else _OK)
                if step == "ok-close":
                    return

    def getter(self, *, read_timeout_s: float = 2) -> KeepAliveGetter:
        return KeepAliveGetter(
            host="127.0.0.1",
            port=self.port,
            tls=None,
            connect_timeout_s=1,
            read_timeout_s=read_timeout_s,
        )

    def close(self) -> None:
        self._listener.close()


@pytest.fixture
def scripted() -> Iterator[list[_Scripted]]:
    made: list[_Scripted] = []
    yield made
    for server in made:
        server.close()


def test_a_reused_connection_closed_under_the_request_is_retried_once_on_a_new_one(
    scripted: list[_Scripted],
) -> None:
    server = _Scripted(["ok", "drop", "ok"])
    scripted.append(server)
    getter = server.getter()
    try:
        assert getter.get("/a", {}) == (200, b"{}")
        assert getter.get("/b", {}) == (200, b"{}")  # sent twice: dropped, then answered
        assert (server.requests, server.connections) == (3, 2)
    finally:
        getter.close()


def test_a_new_connection_closed_under_the_request_is_an_error(
    scripted: list[_Scripted],
) -> None:
    server = _Scripted(["drop", "ok"])
    scripted.append(server)
    getter = server.getter()
    try:
        with pytest.raises(http.client.RemoteDisconnected):
            getter.get("/a", {})
        assert server.requests == 1
    finally:
        getter.close()


def test_a_timeout_is_not_retried(scripted: list[_Scripted]) -> None:
    server = _Scripted(["ok", "hang", "ok"])
    scripted.append(server)
    getter = server.getter(read_timeout_s=0.3)
    try:
        assert getter.get("/a", {}) == (200, b"{}")
        with pytest.raises(TimeoutError):
            getter.get("/b", {})
        assert server.requests == 2
        assert getter.idle_connections == 0  # the timed-out connection is not reused
    finally:
        getter.close()


def test_connection_close_answers_are_not_kept(scripted: list[_Scripted]) -> None:
    server = _Scripted(["ok-close", "ok"])
    scripted.append(server)
    getter = server.getter()
    try:
        assert getter.get("/a", {}) == (200, b"{}")
        assert getter.idle_connections == 0
        assert getter.get("/b", {}) == (200, b"{}")
        assert getter.idle_connections == 1
        assert server.connections == 2
    finally:
        getter.close()
