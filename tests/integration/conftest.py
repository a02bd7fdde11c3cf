"""A real etcd + kube-apiserver on loopback, for the opt-in integration tier (envtest style).

The ``etcd`` and ``kube-apiserver`` binaries are those ``make kube`` builds (tests/kubebins.py), or
any in ``KUBEBUILDER_ASSETS`` (for example what ``setup-envtest use -p path`` prints). Without
them every test here is skipped with a message saying so, except with ``CI=true`` (CI builds
them first), where that fails; anything else that keeps them from running (no ``openssl``, a
Kubernetes older than 1.32) fails them.

The server gets what controller-runtime's envtest gives it (its ``controlplane/apiserver.go``
and ``etcd.go``): a serving certificate, a ServiceAccount issuer and signing key, RBAC,
``--disable-admission-plugins=ServiceAccount`` (no controller-manager makes the default
ServiceAccounts), ``--unsafe-no-fsync`` for an etcd that has it (3.5+). Differences: the
certificates come from the ``openssl`` command (a CA with the key usages strict verifiers ask
for, Python 3.13 among them), clients authenticate with a static token of an admin user (group
system:masters), and the resource.k8s.io versions and DynamicResourceAllocation gate its
Kubernetes version needs are turned on. Ready means ``/readyz`` answers ``ok`` (plain text, not
JSON) and the ``default`` namespace exists (its controller creates it after start).
"""

from __future__ import annotations

import functools
import json
import re
import shutil
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

from dra_driver.kube import KubeClient
from dra_driver.sim.localapi import free_port
from tests.kubebins import kube_bin

TOKEN = "integration-admin-token"
_START_TIMEOUT_S = 90.0


def _assets() -> Path:
    # make kube's cache, or KUBEBUILDER_ASSETS (tests/kubebins.py): skipped without them, and
    # failed with CI=true, where .ci/run builds them first
    assets = kube_bin("etcd", "kube-apiserver")
    if shutil.which("openssl") is None:
        pytest.fail("the openssl command is needed to make the test certificates")
    return assets


def _openssl(*args: str, cwd: Path) -> None:
    done = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.fail(f"openssl {' '.join(args)} failed: {done.stderr.strip()}")


def _make_certs(pki: Path) -> None:
    pki.mkdir()
    _openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=test-ca",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        "-keyout", "ca.key", "-out", "ca.crt", cwd=pki,
    )  # fmt: skip
    _openssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
        "-keyout", "server.key", "-out", "server.csr", cwd=pki,
    )  # fmt: skip
    (pki / "san.cnf").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
        "basicConstraints=critical,CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth\n"
        "subjectKeyIdentifier=hash\n"
        "authorityKeyIdentifier=keyid\n"
    )
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
    out = version.stdout + version.stderr
    match = re.search(r"v1\.(\d+)", out)  # "Kubernetes v1.34.1"
    if match is None:
        pytest.fail(f"cannot tell the Kubernetes version of {apiserver}: {out!r}")
    return int(match.group(1))


def _has_flag(binary: Path, flag: str) -> bool:
    """Whether ``binary --help`` lists ``flag`` (envtest's flag discovery)."""
    done = subprocess.run([str(binary), "--help"], capture_output=True, text=True, check=False)
    return f"--{flag}" in done.stdout + done.stderr


def _dra_flags(minor: int) -> list[str]:
    """resource.k8s.io versions and gates per release (spec D.0): v1 is served by default from
    1.34 (turned on anyway, harmless); before, the beta versions and the beta gate, both off
    by default, are turned on. DRADeviceTaints (device taints in slices: alpha 1.33-1.35, on by
    default from 1.36) is turned on where it is off, as clusters that use GPU health taints do;
    so is DRAConsumableCapacity (allowMultipleAllocations, requestPolicy: alpha 1.34-1.35, on by
    default from 1.36), as clusters that share GPUs (--consumable-shares) do; so is
    DRAPartitionableDevices on 1.35 (alpha there, beta and on from 1.36; dynamic MIG needs the
    1.35 model of shared counters)."""
    if minor < 32:
        pytest.fail(f"kube-apiserver 1.{minor} predates resource.k8s.io/v1beta1 (needs 1.32+)")
    taints = ["DRADeviceTaints=true"] if 33 <= minor <= 35 else []
    if 34 <= minor <= 35:
        taints.append("DRAConsumableCapacity=true")
    taints += ["DRAPartitionableDevices=true"] if minor == 35 else []
    if minor >= 34:
        gates = [f"--feature-gates={','.join(taints)}"] if taints else []
        return ["--runtime-config=resource.k8s.io/v1=true", *gates]
    versions = "resource.k8s.io/v1beta1=true" + (
        ",resource.k8s.io/v1beta2=true" if minor >= 33 else ""
    )
    gates = ",".join(["DynamicResourceAllocation=true", *taints])
    return [f"--runtime-config={versions}", f"--feature-gates={gates}"]


@dataclass
class RealApiServer:
    url: str
    kubeconfig: Path
    ca_file: Path
    minor: int

    def request(self, method: str, path: str, body: Any = None) -> Any:
        """An admin request answered with JSON (test set-up and checks; the code under test
        uses kube/)."""
        return json.loads(self.request_bytes(method, path, body) or b"{}")

    def request_bytes(self, method: str, path: str, body: Any = None) -> bytes:
        """An admin request; the answer's body as it came (``/readyz`` answers plain text)."""
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            self.url + path,
            data=data,
            method=method,
            headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
        )
        context = ssl.create_default_context(cafile=str(self.ca_file))
        with urllib.request.urlopen(req, context=context, timeout=10) as response:
            body_bytes: bytes = response.read()
            return body_bytes

    @functools.cached_property
    def resource_api_version(self) -> str:
        """The resource.k8s.io version the driver's client picks on this server."""
        client = KubeClient.from_config(kubeconfig=self.kubeconfig)
        try:
            return client.resource_api_version
        finally:
            client.close()

    def create_node(self, name: str) -> dict[str, Any]:
        node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}}
        result: dict[str, Any] = self.request("POST", "/api/v1/nodes", node)
        return result


def _wait_ready(server: RealApiServer, procs: list[subprocess.Popen[bytes]], log: Path) -> None:
    """Until ``/readyz`` says ``ok`` (every post-start hook done: RBAC bootstrap, built-in API
    groups) and the ``default`` namespace exists (created by a controller after start)."""
    deadline = time.monotonic() + _START_TIMEOUT_S
    last = ""
    for path in ("/readyz", "/api/v1/namespaces/default"):
        while True:
            for proc in procs:
                if proc.poll() is not None:
                    pytest.fail(
                        f"{proc.args[0]} exited {proc.returncode}; its log ends:\n{_tail(log)}"
                    )
            try:
                answer = server.request_bytes("GET", path)
                if path != "/readyz" or answer.strip() == b"ok":
                    break
                last = f"{path}: {answer[-500:]!r}"
            except urllib.error.HTTPError as exc:  # 500 with the failing checks, 404, ...
                last = f"{path}: {exc.code} {exc.read()[-500:].decode(errors='replace')}"
                exc.close()
            except (urllib.error.URLError, OSError) as exc:  # not listening yet
                last = f"{path}: {exc}"
            if time.monotonic() > deadline:
                pytest.fail(
                    f"kube-apiserver not ready after {_START_TIMEOUT_S:.0f} s ({last}); "
                    f"its log ends:\n{_tail(log)}"
                )
            time.sleep(0.2)


def _tail(log: Path, lines: int = 30) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


@pytest.fixture(scope="session")
def real_apiserver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealApiServer]:
    assets = _assets()
    work = tmp_path_factory.mktemp("apiserver")
    pki = work / "pki"
    _make_certs(pki)
    minor = _minor_version(assets / "kube-apiserver")
    etcd = assets / "etcd"
    etcd_client, etcd_peer, secure = free_port(), free_port(), free_port()
    log = work / "logs.txt"
    procs: list[subprocess.Popen[bytes]] = []
    with log.open("wb") as out:
        procs.append(
            subprocess.Popen(
                [
                    str(etcd),
                    "--name=default",
                    f"--data-dir={work / 'etcd'}",
                    f"--listen-client-urls=http://127.0.0.1:{etcd_client}",
                    f"--advertise-client-urls=http://127.0.0.1:{etcd_client}",
                    f"--listen-peer-urls=http://127.0.0.1:{etcd_peer}",
                    f"--initial-advertise-peer-urls=http://127.0.0.1:{etcd_peer}",
                    f"--initial-cluster=default=http://127.0.0.1:{etcd_peer}",
                    # what envtest sets when etcd has it (3.5+): tests need no durability
                    *(["--unsafe-no-fsync=true"] if _has_flag(etcd, "unsafe-no-fsync") else []),
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
                    # as envtest: no controller-manager creates the default ServiceAccounts
                    "--disable-admission-plugins=ServiceAccount",
                    "--allow-privileged=true",
                    # the `kubernetes` Service's endpoint may not be loopback: not reconciled
                    "--endpoint-reconciler-type=none",
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
