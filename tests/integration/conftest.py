"""A real etcd + kube-apiserver on loopback, for the opt-in integration tier (envtest style).

Set ``KUBEBUILDER_ASSETS`` to a directory holding the ``etcd`` and ``kube-apiserver`` binaries
(for example what ``setup-envtest use -p path`` prints). Without it every test here is skipped
with a message saying so. The server gets a throw-away CA and serving certificate and a
ServiceAccount signing key made with the ``openssl`` command, a static token for an admin user
(group system:masters), and the resource.k8s.io version and DynamicResourceAllocation gate its
Kubernetes version needs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

TOKEN = "integration-admin-token"
_START_TIMEOUT_S = 90.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _assets() -> Path:
    value = os.environ.get("KUBEBUILDER_ASSETS", "")
    if not value:
        pytest.skip(
            "KUBEBUILDER_ASSETS is not set: point it at a directory with the etcd and "
            "kube-apiserver binaries to run the real-apiserver tier"
        )
    assets = Path(value)
    missing = [b for b in ("etcd", "kube-apiserver") if not os.access(assets / b, os.X_OK)]
    if missing:
        pytest.skip(f"KUBEBUILDER_ASSETS={assets} has no executable {' or '.join(missing)}")
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make the test certificates")
    return assets


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _make_certs(pki: Path) -> None:
    pki.mkdir()
    _openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=test-ca",
        "-keyout", "ca.key", "-out", "ca.crt", cwd=pki,
    )  # fmt: skip
    _openssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
        "-keyout", "server.key", "-out", "server.csr", cwd=pki,
    )  # fmt: skip
    (pki / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl(
        "x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "1", "-extfile", "san.cnf", "-out", "server.crt", cwd=pki,
    )  # fmt: skip
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=pki)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)
    (pki / "tokens.csv").write_text(f'{TOKEN},admin,admin-uid,"system:masters"\n')


def _minor_version(apiserver: Path) -> int:
    version = subprocess.run(
        [str(apiserver), "--version"], capture_output=True, text=True, check=False
    )
    out = version.stdout
    match = re.search(r"v1\.(\d+)", out)
    if match is None:
        pytest.skip(f"cannot tell the Kubernetes version of {apiserver}: {out!r}")
    return int(match.group(1))


def _dra_flags(minor: int) -> list[str]:
    """resource.k8s.io versions and gates per release (spec D.0)."""
    if minor < 32:
        pytest.skip(f"kube-apiserver 1.{minor} predates resource.k8s.io/v1beta1 (needs 1.32+)")
    if minor >= 34:
        return ["--runtime-config=resource.k8s.io/v1=true"]
    versions = "resource.k8s.io/v1beta1=true" + (
        ",resource.k8s.io/v1beta2=true" if minor >= 33 else ""
    )
    return [f"--runtime-config={versions}", "--feature-gates=DynamicResourceAllocation=true"]


@dataclass
class RealApiServer:
    url: str
    kubeconfig: Path
    ca_file: Path
    minor: int

    def request(self, method: str, path: str, body: Any = None) -> Any:
        """An admin request (test set-up and checks; the code under test uses kube.py)."""
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            self.url + path,
            data=data,
            method=method,
            headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
        )
        context = ssl.create_default_context(cafile=str(self.ca_file))
        with urllib.request.urlopen(req, context=context, timeout=10) as response:
            return json.loads(response.read() or b"{}")

    def create_node(self, name: str) -> dict[str, Any]:
        node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}}
        result: dict[str, Any] = self.request("POST", "/api/v1/nodes", node)
        return result


def _wait_ready(server: RealApiServer, procs: list[subprocess.Popen[bytes]], log: Path) -> None:
    deadline = time.monotonic() + _START_TIMEOUT_S
    last = ""
    while time.monotonic() < deadline:
        for proc in procs:
            if proc.poll() is not None:
                pytest.fail(f"{proc.args[0]} exited {proc.returncode}; see {log}")
        try:
            server.request("GET", "/readyz")
            return
        except (urllib.error.URLError, OSError, ValueError) as exc:
            last = str(exc)
        time.sleep(0.5)
    pytest.fail(f"kube-apiserver not ready after {_START_TIMEOUT_S:.0f} s ({last}); see {log}")


@pytest.fixture(scope="session")
def real_apiserver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealApiServer]:
    assets = _assets()
    work = tmp_path_factory.mktemp("apiserver")
    pki = work / "pki"
    _make_certs(pki)
    minor = _minor_version(assets / "kube-apiserver")
    etcd_client, etcd_peer, secure = _free_port(), _free_port(), _free_port()
    log = work / "logs.txt"
    procs: list[subprocess.Popen[bytes]] = []
    with log.open("wb") as out:
        procs.append(
            subprocess.Popen(
                [
                    str(assets / "etcd"),
                    "--name=default",
                    f"--data-dir={work / 'etcd'}",
                    f"--listen-client-urls=http://127.0.0.1:{etcd_client}",
                    f"--advertise-client-urls=http://127.0.0.1:{etcd_client}",
                    f"--listen-peer-urls=http://127.0.0.1:{etcd_peer}",
                    f"--initial-advertise-peer-urls=http://127.0.0.1:{etcd_peer}",
                    f"--initial-cluster=default=http://127.0.0.1:{etcd_peer}",
                    "--unsafe-no-fsync=true",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        )
        procs.append(
            subprocess.Popen(
                [
                    str(assets / "kube-apiserver"),
                    f"--etcd-servers=http://127.0.0.1:{etcd_client}",
                    "--bind-address=127.0.0.1",
                    "--advertise-address=127.0.0.1",
                    f"--secure-port={secure}",
                    f"--cert-dir={work / 'certs'}",
                    f"--tls-cert-file={pki / 'server.crt'}",
                    f"--tls-private-key-file={pki / 'server.key'}",
                    f"--client-ca-file={pki / 'ca.crt'}",
                    f"--service-account-key-file={pki / 'sa.pub'}",
                    f"--service-account-signing-key-file={pki / 'sa.key'}",
                    "--service-account-issuer=https://kubernetes.default.svc",
                    "--service-cluster-ip-range=10.0.0.0/24",
                    f"--token-auth-file={pki / 'tokens.csv'}",
                    "--authorization-mode=RBAC",
                    *_dra_flags(minor),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        )
    url = f"https://127.0.0.1:{secure}"
    kubeconfig = work / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {
                        "name": "envtest",
                        "cluster": {"server": url, "certificate-authority": str(pki / "ca.crt")},
                    }
                ],
                "users": [{"name": "admin", "user": {"token": TOKEN}}],
                "contexts": [
                    {"name": "envtest", "context": {"cluster": "envtest", "user": "admin"}}
                ],
                "current-context": "envtest",
            }
        )
    )
    server = RealApiServer(url=url, kubeconfig=kubeconfig, ca_file=pki / "ca.crt", minor=minor)
    try:
        _wait_ready(server, procs, log)
        yield server
    finally:
        for proc in reversed(procs):
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
