"""keepalive.py: the claim GET of the prepare path over keep-alive connections; with it
http1.py, the requests and response reading on those connections, and tlssettings.py, their TLS
settings and the files those are read from.

Through KubeClient against the local API server (HTTP and HTTPS, token auth, faults), the retry
rules and the whole-GET deadline against a scripted socket server that misbehaves on cue, and
the reload of rotated TLS files (CA, client certificate) against a server that checks them.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import os
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from kubernetes.client import ApiClient, Configuration
from kubernetes.config.incluster_config import InClusterConfigLoader
from urllib3.exceptions import InsecureRequestWarning

from dra_driver.errors import KubeError, KubeForbidden, KubeUnavailable
from dra_driver.kube import KubeClient, http1, keepalive
from dra_driver.kube.keepalive import KeepAliveGetter
from dra_driver.kube.tlssettings import TlsSource
from dra_driver.sim.localapi import FakeKubeApi
from tests.claimdata import allocated_claim


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
        kube.configuration.refresh_api_key_hook = lambda config: config.api_key.update(
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
            assert kube._getter is not None and kube._getter._tls[0] is not None
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
        timeout_s=1,
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
    never answers; bytes are sent as they are (a list of them in separate writes), then the
    connection stays open, or with ("close", bytes) is closed; ("drip", bytes, seconds) sends
    one byte every ``seconds`` until the client goes away (``dripped`` counts them). ``heads``
    keeps each request's header block."""

    def __init__(self, script: list[Any]) -> None:
        self.script = script
        self.heads: list[bytes] = []
        self.requests = 0
        self.connections = 0
        self.dripped = 0
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
                head, _, buffer = buffer.partition(b"\r\n\r\n")
                self.heads.append(head)
                step = self.script[self.requests]
                self.requests += 1
                if step == "drop":
                    return
                if step == "hang":
                    self._held.append(conn)
                    threading.Event().wait(5)
                    return
                if isinstance(step, tuple) and step[0] == "drip":
                    self._drip(conn, step[1], step[2])
                    return
                if isinstance(step, tuple):
                    conn.sendall(step[1])
                    return
                if isinstance(step, (bytes, list)):
                    for piece in [step] if isinstance(step, bytes) else step:
                        conn.sendall(piece)
                        time.sleep(0.01)
                    continue
                conn.sendall(_OK_CLOSE if step == "ok-close" else _OK)
                if step == "ok-close":
                    return

    def _drip(self, conn: socket.socket, data: bytes, interval_s: float) -> None:
        for i in range(len(data)):
            try:
                conn.sendall(data[i : i + 1])
            except OSError:
                return  # the client gave up
            self.dripped += 1
            time.sleep(interval_s)

    def getter(self, *, timeout_s: float = 2) -> KeepAliveGetter:
        return KeepAliveGetter(
            host="127.0.0.1",
            port=self.port,
            tls=None,
            connect_timeout_s=1,
            timeout_s=timeout_s,
        )

    def close(self) -> None:
        # shutdown wakes the thread blocked in accept(): a socket closed under it would go on
        # listening in the kernel and take a later test's connection
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
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
    getter = server.getter(timeout_s=0.3)
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


_CHUNKED = (
    b'HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\n{"a\r\n4\r\n":1}\r\n0\r\n\r\n'
)


@pytest.mark.parametrize(
    ("answer", "kept"),
    [
        (_CHUNKED, True),
        ([_CHUNKED[:20], _CHUNKED[20:45], _CHUNKED[45:]], True),  # in pieces, cut anywhere
        (b"HTTP/1.1 100 Continue\r\n\r\n" + _CHUNKED, True),  # an interim answer first
        (b"HTTP/1.1 200 OK\r\nContent-Length: 7\r\n\r\n" + b'{"a":1}', True),
        (b"HTTP/1.0 200 OK\r\nContent-Length: 7\r\n\r\n" + b'{"a":1}', False),
        (("close", b'HTTP/1.1 200 OK\r\n\r\n{"a":1}'), False),  # the body ends with the close
        (b"HTTP/1.1 200 OK\r\nContent-Length: 7\r\n\r\n" + b'{"a":1}HTTP/1.1', False),
        (  # chunk extensions and trailer fields are read and ignored
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            b'7;name=value\r\n{"a":1}\r\n0\r\nX-Trailer: 1\r\n\r\n',
            True,
        ),
        (  # HTTP/1.0 asking to keep the connection, names in any case
            b'HTTP/1.0 200 OK\r\ncontent-length: 7\r\nConnection: Keep-Alive\r\n\r\n{"a":1}',
            True,
        ),
        (  # another coding than chunked last: the body ends with the connection
            ("close", b'HTTP/1.1 200 OK\r\nTransfer-Encoding: identity\r\n\r\n{"a":1}'),
            False,
        ),
    ],
    ids=[
        "chunked",
        "in-pieces",
        "100-continue",
        "length",
        "http-1.0",
        "until-close",
        "extra",
        "chunk-extensions-and-trailers",
        "http-1.0-keep-alive",
        "other-coding",
    ],
)
def test_answers_are_read_as_http_1_1_frames_them(
    scripted: list[_Scripted], answer: Any, kept: bool
) -> None:
    server = _Scripted([answer])
    scripted.append(server)
    getter = server.getter()
    try:
        assert getter.get("/a", {}) == (200, b'{"a":1}')
        assert getter.idle_connections == (1 if kept else 0)
    finally:
        getter.close()


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (b"garbage\r\n\r\n", "malformed response from the API server"),
        (("close", b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n{}"), "IncompleteRead"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}", "Length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 4096\r\n\r\n" + b"x" * 4096, "larger than 1024"),
        (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\n\r\n", "switched protocols"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n{}", "malformed"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 1_0\r\n\r\n{}", "malformed"),
        (b"HTTP/1.1 200 OK\r\nBad Name: 1\r\nContent-Length: 2\r\n\r\n{}", "header line"),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0x2\r\n{}\r\n0\r\n\r\n",
            "chunk size",
        ),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}XX0\r\n\r\n",
            "not followed by CRLF",
        ),
        (b"HTTP/2 200 OK\r\nContent-Length: 2\r\n\r\n{}", "status line"),
        (b"HTTP/1.1 2000 OK\r\nContent-Length: 2\r\n\r\n{}", "status line"),
    ],
    ids=[
        "garbage",
        "truncated",
        "two-lengths",
        "too-big",
        "upgrade",
        "negative-length",
        "underscore-length",
        "space-in-name",
        "0x-chunk-size",
        "chunk-without-crlf",
        "http-2",
        "four-digit-status",
    ],
)
def test_broken_answers_are_errors_and_their_connection_is_not_kept(
    scripted: list[_Scripted],
    monkeypatch: pytest.MonkeyPatch,
    answer: Any,
    error: str,
) -> None:
    monkeypatch.setattr(http1, "MAX_RESPONSE_BYTES", 1024)
    server = _Scripted([answer])
    scripted.append(server)
    getter = server.getter()
    try:
        with pytest.raises(http.client.HTTPException) as info:
            getter.get("/a", {})
        assert error in f"{type(info.value).__name__}: {info.value}"
        assert getter.idle_connections == 0
    finally:
        getter.close()


def test_the_request_names_the_host_and_cannot_be_split_by_its_headers(
    scripted: list[_Scripted],
) -> None:
    server = _Scripted(["ok"])
    scripted.append(server)
    getter = server.getter()
    try:
        assert getter.get("/apis/x?y=1", {"Accept": "application/json", "Authorization": "B t"})
        assert server.heads == [
            b"GET /apis/x?y=1 HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nAccept-Encoding: identity\r\n"
            b"Accept: application/json\r\nAuthorization: B t" % server.port
        ]
        for path, headers in (
            ("/a b", {}),
            ("/a\r\nX: y", {}),
            ("/a", {"Authorization": "Bearer t\r\nX-Injected: 1"}),
            ("/a", {"Bad Name": "v"}),
        ):
            with pytest.raises(ValueError):
                getter.get(path, headers)
        assert server.requests == 1  # nothing else was sent
    finally:
        getter.close()
    ipv6 = KeepAliveGetter(host="::1", port=6443, tls=None, connect_timeout_s=1, timeout_s=1)
    assert ipv6._request("GET", "/a", {}, b"").startswith(
        b"GET /a HTTP/1.1\r\nHost: [::1]:6443\r\n"
    )
    default = KeepAliveGetter(host="api.example", port=80, tls=None, connect_timeout_s=1,
                              timeout_s=1)  # fmt: skip
    assert b"\r\nHost: api.example\r\n" in default._request("GET", "/a", {}, b"")


def test_kube_client_maps_broken_answers_and_unsendable_headers(
    scripted: list[_Scripted],
) -> None:
    server = _Scripted([b"garbage\r\n\r\n", "ok"])
    scripted.append(server)
    kube = KubeClient(_configuration(f"http://127.0.0.1:{server.port}"))
    try:
        kube._version = "v1"  # no discovery: the scripted server only answers claim GETs
        with pytest.raises(KubeUnavailable, match="broken answer from the API server: malformed"):
            kube.get_resource_claim(namespace="ns1", name="claim-a")
        kube.configuration.api_key = {"BearerToken": "t\r\nX-Injected: 1"}
        with pytest.raises(KubeError, match="not allowed in HTTP"):
            kube.get_resource_claim(namespace="ns1", name="claim-a")
        assert server.requests == 1
    finally:
        kube.close()


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"api_key": {"BearerToken": "abc"}, "api_key_prefix": {"BearerToken": "Bearer"}},
        {"api_key": {"authorization": "Bearer abc"}},
    ],
    ids=["no-token", "token-with-prefix", "kubeconfig-style"],
)
def test_request_headers_and_urls_are_those_of_the_official_client(
    settings: dict[str, Any],
) -> None:
    """KubeClient sends through the official transport without ApiClient: what it builds must
    be what ApiClient.param_serialize builds for the same call (GET, and a write with a query)."""
    configuration = _configuration("http://127.0.0.1:6443", **settings)
    api = ApiClient(configuration)
    api.user_agent = "gpu-dra/kubelet-plugin"
    kube = KubeClient(configuration)
    try:
        path = "/apis/resource.k8s.io/v1/namespaces/ns1/resourceclaims/a"
        _method, _url, official, _body, _ = api.param_serialize(
            method="GET",
            resource_path=path,
            header_params={"Accept": "application/json"},
            auth_settings=["BearerToken"],
        )
        assert kube._get_headers() == official
        sent: list[tuple[str, str, dict[str, str], Any]] = []
        kube._rest.request = lambda method, url, headers, body, _request_timeout: (  # type: ignore[method-assign]
            sent.append((method, url, headers, body)) or _FakeRestResponse()
        )
        query = {"labelSelector": "a=b,c in (d e)", "fieldSelector": "spec.nodeName=n/1"}
        kube._request("POST", path, verb="create", resource="r", query=query, body={"x": 1})
        _m, url, official, body, _ = api.param_serialize(
            method="POST",
            resource_path=path,
            query_params=query,
            header_params={"Accept": "application/json", "Content-Type": "application/json"},
            body={"x": 1},
            auth_settings=["BearerToken"],
        )
        assert sent == [("POST", url, official, body)]
    finally:
        kube.close()


@pytest.mark.parametrize(
    "settings",
    [{}, {"api_key": {"BearerToken": "abc"}, "api_key_prefix": {"BearerToken": "Bearer"}}],
    ids=["no-token", "token-with-prefix"],
)
def test_the_claim_status_apply_is_sent_as_the_official_client_sends_it(
    settings: dict[str, Any],
) -> None:
    """The status apply (once per claim) goes over the keep-alive path: the same method, URL,
    headers and body as through the official transport."""
    configuration = _configuration("http://127.0.0.1:6443", **settings)
    kube = KubeClient(configuration)
    try:
        kube._version = "v1"
        entry = {"driver": "gpu.nvidia.com", "pool": "n", "device": "gpu-0"}
        call = {"namespace": "ns1", "name": "a", "uid": "u-1", "field_manager": "gpu.nvidia.com",
                "devices": [entry]}  # fmt: skip
        sent: list[tuple[str, str, dict[str, str], Any]] = []
        kube._rest.request = lambda method, url, headers, body, _request_timeout: (  # type: ignore[method-assign]
            sent.append((method, url, headers, body)) or _FakeRestResponse()
        )
        getter, kube._getter = kube._getter, None  # the official path
        assert kube.apply_resource_claim_status(**call)
        kube._getter = getter
        assert getter is not None
        fast: list[tuple[str, str, dict[str, str], bytes]] = []
        getter.request = lambda method, path, headers, body=b"": (  # type: ignore[method-assign]
            fast.append((method, path, dict(headers), body)) or (200, b"{}")
        )
        assert kube.apply_resource_claim_status(**call)
        ((method, url, headers, body),) = sent
        ((fast_method, path, fast_headers, fast_body),) = fast
        assert (fast_method, configuration.host + path, fast_headers) == (method, url, headers)
        assert json.loads(fast_body) == body
        assert "fieldManager=gpu.nvidia.com&force=true" in path
    finally:
        kube.close()


def test_claim_status_applies_share_the_keep_alive_connection_with_the_gets(
    kubeapi: FakeKubeApi, kube: KubeClient
) -> None:
    stored = [_add(kubeapi, f"claim-{i}") for i in range(5)]
    entry = {"driver": "gpu.nvidia.com", "pool": "node1", "device": "gpu-0"}

    def apply(meta: dict[str, Any], devices: list[dict[str, str]]) -> bool:
        return kube.apply_resource_claim_status(
            namespace=meta["namespace"], name=meta["name"], uid=meta["uid"], devices=devices,
            field_manager="gpu.nvidia.com",
        )  # fmt: skip

    _ = kube.resource_api_version  # discovery: the official client's own connection
    before = kubeapi.connections_accepted
    for claim in stored:
        meta = claim["metadata"]
        assert kube.get_resource_claim(namespace=meta["namespace"], name=meta["name"])
        assert apply(meta, [entry])
    assert kubeapi.connections_accepted - before == 1
    for claim in kubeapi.objects("resourceclaims"):
        assert [d["device"] for d in claim["status"]["devices"]] == ["gpu-0"]
    assert apply({**stored[0]["metadata"], "name": "gone"}, []) is False  # 404: the claim is gone
    kubeapi.kill_connections()  # closed while idle: sent again on a new connection
    assert apply(stored[0]["metadata"], [])
    assert not kubeapi.objects("resourceclaims")[0]["status"].get("devices")


class _FakeRestResponse:
    status = 200
    data = b"{}"

    def read(self) -> bytes:
        return self.data


# --- the deadline of a whole GET -----------------------------------------------------------------


def test_a_server_dripping_its_answer_cannot_hold_the_get_past_the_deadline(
    scripted: list[_Scripted],
) -> None:
    # a byte every 0.5 s: every read gets something in time, the whole answer would take 35 s
    server = _Scripted([("drip", _OK, 0.5), "ok"])
    scripted.append(server)
    kube = KubeClient(
        _configuration(f"http://127.0.0.1:{server.port}"),
        timeout_s=1.5,
        connect_timeout_s=1,
    )
    try:
        kube._version = "v1"  # no discovery: the scripted server only answers claim GETs
        start = time.monotonic()
        with pytest.raises(
            KubeUnavailable,
            match=r"get resourceclaims/claim-a in namespace ns1: API server timed out: "
            r"no whole answer from the API server within 1\.5 s",
        ):
            kube.get_resource_claim(namespace="ns1", name="claim-a")
        elapsed = time.monotonic() - start
        assert 1.4 <= elapsed < 2.0
        assert 2 <= server.dripped < len(_OK)  # it was answering, a byte at a time
        assert server.requests == 1  # a timeout is not retried
        assert kube._getter is not None and kube._getter.idle_connections == 0
    finally:
        kube.close()


@pytest.mark.parametrize("tls", [False, True], ids=["http", "https-handshake"])
def test_a_server_that_accepts_but_never_answers_fails_the_get_at_the_deadline(
    tls: bool,
) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                accepted.append(listener.accept()[0])  # never read, never answered
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    getter = KeepAliveGetter(
        host="127.0.0.1",
        port=listener.getsockname()[1],
        tls=TlsSource(context=ssl.create_default_context) if tls else None,
        connect_timeout_s=5,  # the deadline is shorter: it wins
        timeout_s=0.5,
    )
    try:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=r"within 0\.5 s"):
            getter.get("/a", {})
        elapsed = time.monotonic() - start
        assert 0.45 <= elapsed < 1.0
        assert len(accepted) == 1
    finally:
        getter.close()
        listener.close()
        for conn in accepted:
            conn.close()


def test_the_deadline_covers_the_retry_on_a_new_connection(scripted: list[_Scripted]) -> None:
    server = _Scripted(["ok", "drop", "hang"])
    scripted.append(server)
    getter = server.getter(timeout_s=0.5)
    try:
        assert getter.get("/a", {}) == (200, b"{}")
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            getter.get("/b", {})  # dropped on the reused connection, then no answer
        assert time.monotonic() - start < 1.0
        assert (server.requests, server.connections) == (3, 2)
    finally:
        getter.close()


# --- rotated TLS files ---------------------------------------------------------------------------


def _openssl_certificate(directory: Path, name: str, *, ca: str | None = None) -> None:
    """``name``.crt and ``name``.key (P-256) with CN ``name``: self-signed (a CA) or signed by
    ``ca`` in ``directory`` (a leaf valid for 127.0.0.1)."""
    command = [
        "openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
        "-nodes", "-days", "1", "-subj", f"/CN={name}",
        "-keyout", str(directory / f"{name}.key"), "-out", str(directory / f"{name}.crt"),
    ]  # fmt: skip
    if ca is not None:
        command += [
            "-CA", str(directory / f"{ca}.crt"), "-CAkey", str(directory / f"{ca}.key"),
            "-addext", "basicConstraints=critical,CA:FALSE",
            "-addext", "subjectAltName=IP:127.0.0.1",
        ]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA, a server certificate for 127.0.0.1 and client certificates client-a and client-b,
    all from that CA; another CA with its own server certificate."""
    directory = tmp_path_factory.mktemp("pki")
    _openssl_certificate(directory, "ca")
    _openssl_certificate(directory, "server", ca="ca")
    _openssl_certificate(directory, "client-a", ca="ca")
    _openssl_certificate(directory, "client-b", ca="ca")
    _openssl_certificate(directory, "other-ca")
    _openssl_certificate(directory, "other-server", ca="other-ca")
    return directory


class _MutualTls:
    """HTTPS that requires a client certificate from the CA ``ca``; answers every GET with the
    common name of the client certificate its connection was made with."""

    def __init__(self, pki: Path, *, server: str = "server", ca: str = "ca") -> None:
        self._context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._context.load_cert_chain(pki / f"{server}.crt", pki / f"{server}.key")
        self._context.load_verify_locations(pki / f"{ca}.crt")
        self._context.verify_mode = ssl.CERT_REQUIRED
        self.connections = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, raw: socket.socket) -> None:
        try:
            with self._context.wrap_socket(raw, server_side=True) as conn:
                self.connections += 1
                cert: Any = conn.getpeercert()
                subject = dict(field[0] for field in cert["subject"])
                body = json.dumps({"cn": subject["commonName"]}).encode()
                buffer = b""
                while True:
                    while b"\r\n\r\n" not in buffer:
                        chunk = conn.recv(4096)
                        if not chunk:
                            return
                        buffer += chunk
                    buffer = buffer.partition(b"\r\n\r\n")[2]
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
                    )
        except OSError:  # ssl.SSLError too: a client that did not present a good certificate
            raw.close()

    def close(self) -> None:
        self._listener.close()


def _replace(path: Path, content: bytes) -> None:
    """Write ``path`` anew as a rotation does: a new file moved over the old one."""
    new = path.with_name(path.name + ".new")
    new.write_bytes(content)
    os.replace(new, path)


def _client_cn(getter: KeepAliveGetter) -> str:
    status, body = getter.get("/whoami", {})
    assert status == 200
    return str(json.loads(body)["cn"])


def test_a_rotated_client_certificate_is_used_from_the_next_get(
    pki: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server = _MutualTls(pki)
    for name, source in (("ca.crt", "ca.crt"), ("tls.crt", "client-a.crt"),
                         ("tls.key", "client-a.key")):  # fmt: skip
        (tmp_path / name).write_bytes((pki / source).read_bytes())
    configuration = _configuration(
        f"https://127.0.0.1:{server.port}",
        ssl_ca_cert=str(tmp_path / "ca.crt"),
        cert_file=str(tmp_path / "tls.crt"),
        key_file=str(tmp_path / "tls.key"),
    )
    getter = KeepAliveGetter.for_configuration(
        configuration, connect_timeout_s=1, timeout_s=2, tls_check_interval_s=0
    )
    assert getter is not None
    try:
        assert [_client_cn(getter), _client_cn(getter)] == ["client-a", "client-a"]
        assert server.connections == 1

        # a rotation half done: the new certificate beside the old key cannot be loaded, so
        # the old material (and the connection made with it) stays in use
        _replace(tmp_path / "tls.crt", (pki / "client-b.crt").read_bytes())
        with caplog.at_level(logging.WARNING, logger="dra_driver.kube.keepalive"):
            assert _client_cn(getter) == "client-a"
            assert _client_cn(getter) == "client-a"
        said = [r for r in caplog.records if "cannot be loaded" in r.getMessage()]
        assert len(said) == 1  # once, not at every check
        assert server.connections == 1

        _replace(tmp_path / "tls.key", (pki / "client-b.key").read_bytes())
        assert _client_cn(getter) == "client-b"
        assert server.connections == 2  # the connection with the old certificate was dropped
        assert getter.idle_connections == 1
    finally:
        getter.close()
        server.close()


def test_a_rotated_ca_file_is_trusted_from_the_next_get(pki: Path, tmp_path: Path) -> None:
    server = _MutualTls(pki, server="other-server", ca="ca")  # a server from another CA
    (tmp_path / "ca.crt").write_bytes((pki / "ca.crt").read_bytes())
    configuration = _configuration(
        f"https://127.0.0.1:{server.port}",
        ssl_ca_cert=str(tmp_path / "ca.crt"),
        cert_file=str(pki / "client-a.crt"),
        key_file=str(pki / "client-a.key"),
    )
    getter = KeepAliveGetter.for_configuration(
        configuration, connect_timeout_s=1, timeout_s=2, tls_check_interval_s=0
    )
    assert getter is not None
    try:
        with pytest.raises(ssl.SSLCertVerificationError):
            getter.get("/whoami", {})
        _replace(tmp_path / "ca.crt", (pki / "other-ca.crt").read_bytes())
        assert _client_cn(getter) == "client-a"
    finally:
        getter.close()
        server.close()


def _project(directory: Path, files: dict[str, bytes], *, version: int) -> None:
    """Write ``files`` as the kubelet updates a Secret or projected volume (the ServiceAccount's
    token and ca.crt): into a new directory, then one atomic swap of the ``..data`` symlink the
    files' own symlinks go through."""
    directory.mkdir(exist_ok=True)
    target = directory / f"..{version}"
    target.mkdir()
    for name, content in files.items():
        (target / name).write_bytes(content)
        if not (directory / name).is_symlink():
            (directory / name).symlink_to(f"..data/{name}")
    (directory / "..data_tmp").symlink_to(target.name)
    os.replace(directory / "..data_tmp", directory / "..data")


def test_the_in_cluster_ca_file_is_reloaded_when_its_volume_is_updated(tmp_path: Path) -> None:
    api = FakeKubeApi(tls_dir=tmp_path / "tls", token="sa-token").start()
    try:
        meta = _add(api, "claim-a")["metadata"]
        right_ca = FakeKubeApi._certificate(tmp_path / "tls")[0].read_bytes()
        wrong_ca = FakeKubeApi._certificate(tmp_path / "other-ca")[0].read_bytes()
        account = tmp_path / "serviceaccount"
        _project(account, {"token": b"sa-token", "ca.crt": wrong_ca}, version=1)
        configuration = Configuration()
        InClusterConfigLoader(
            token_filename=str(account / "token"),
            cert_filename=str(account / "ca.crt"),
            environ={
                "KUBERNETES_SERVICE_HOST": "127.0.0.1",
                "KUBERNETES_SERVICE_PORT": str(api.port),
            },
        ).load_and_set(configuration)
        # what the official client is given, and what the getter watches
        assert configuration.ssl_ca_cert == str(account / "ca.crt")
        kube = KubeClient(configuration, timeout_s=2, connect_timeout_s=1)
        try:
            kube._version = "v1"  # no discovery: the official client would fail the same way

            def get() -> dict[str, Any] | None:
                return kube.get_resource_claim(namespace=meta["namespace"], name=meta["name"])

            with pytest.raises(KubeUnavailable, match="CERTIFICATE_VERIFY_FAILED"):
                get()
            _project(account, {"token": b"sa-token", "ca.crt": right_ca}, version=2)
            # the files are looked at once a second at most, not at every GET
            with pytest.raises(KubeUnavailable, match="CERTIFICATE_VERIFY_FAILED"):
                get()
            time.sleep(keepalive.TLS_CHECK_INTERVAL_S + 0.05)
            claim = get()
            assert claim is not None and claim["metadata"]["uid"] == meta["uid"]
        finally:
            kube.close()
    finally:
        api.stop()
