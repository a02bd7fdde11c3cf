"""HTTP probes of health.py against a real plugin (real sockets)."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from dra_driver.errors import DraError
from dra_driver.health import ProbeServer, SocketChecker
from dra_driver.kube import KubeClient
from dra_driver.localapi import FakeKubeApi
from tests.test_plugin_server import start_plugin


@pytest.fixture
def kube(kubeapi: FakeKubeApi) -> Iterator[KubeClient]:
    kubeapi.add_node("node1")
    client = KubeClient.from_config(kubeconfig=kubeapi.kubeconfig_path)
    yield client
    client.close()


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        body = exc.read().decode()
        exc.close()
        return exc.code, body


def test_probes_pass_while_both_sockets_answer_and_fail_when_one_does_not(
    tmp_path: Path, kube: KubeClient
) -> None:
    plugin = start_plugin(tmp_path, kube)
    probes = ProbeServer(
        SocketChecker(
            registration_socket=plugin.paths.registration,
            dra_socket=plugin.paths.dra,
            driver_name="gpu.nvidia.com",
        ),
        port=0,
        host="127.0.0.1",
    )
    probes.start()
    try:
        assert get(probes.port, "/healthz") == (200, "ok\n")
        assert get(probes.port, "/readyz") == (200, "ok\n")
        assert get(probes.port, "/other")[0] == 404
        plugin.stop()
        status, body = get(probes.port, "/healthz")
        assert status == 503 and "does not exist" in body
        plugin.paths.dra.touch()  # a file, but nobody serves it
        plugin.paths.registration.touch()
        status, body = get(probes.port, "/readyz")
        assert status == 503 and "GetInfo failed" in body and "NodePrepareResources failed" in body
    finally:
        probes.stop()
        plugin.stop()


def test_a_probe_port_in_use_is_a_clear_error_naming_the_flag(tmp_path: Path) -> None:
    checker = SocketChecker(
        registration_socket=tmp_path / "reg.sock",
        dra_socket=tmp_path / "dra.sock",
        driver_name="gpu.nvidia.com",
    )
    first = ProbeServer(checker, port=0, host="127.0.0.1")
    try:
        with pytest.raises(DraError, match=r"--healthcheck-port \(HEALTHCHECK_PORT\): .*in use"):
            ProbeServer(checker, port=first.port, host="127.0.0.1")
    finally:
        first.stop()
