"""A real Kubernetes control plane on loopback: etcd, kube-apiserver, kube-controller-manager and
kube-scheduler, the programs ``make kube`` builds from Kubernetes' own Go modules.

What it has, as a production cluster has it: TLS everywhere (one test CA), the Node and RBAC
authorizers, the NodeRestriction and ServiceAccount admission plugins (with the default set),
bound ServiceAccount tokens signed by the cluster's key, the controller-manager with every
default controller (the resourceclaim controller makes claims from templates, the garbage
collector removes what an owner leaves, the DaemonSet controller makes the agent's pods, the
device-taint eviction controller) each with its own ServiceAccount credentials, and the
scheduler with its DRA plugin and the 1.37 feature defaults (nothing turned on or off).

Each process has its own ports (free loopback ports) and its data under ``work``; :meth:`stop`
stops every one by its pid. etcd runs with ``--unsafe-no-fsync`` (test data; what envtest does).
"""

from __future__ import annotations

import json
import os
import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dra_driver.sim.localapi import free_port
from tests.cluster.pki import Identity, Pki

START_TIMEOUT_S = 120.0


class ClusterError(RuntimeError):
    """A control-plane process failed to start or answer; the message ends with its log."""


def tail(log: Path, lines: int = 40) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


@dataclass
class Process:
    """One program of the cluster: how to start it again, and its process while it runs."""

    name: str
    argv: list[str]
    log: Path
    env: dict[str, str] | None = None
    popen: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.popen = subprocess.Popen(
                self.argv, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                stdin=subprocess.DEVNULL,
            )  # fmt: skip

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def check(self) -> None:
        if self.popen is not None and self.popen.poll() is not None:
            raise ClusterError(
                f"{self.name} exited {self.popen.returncode}; its log ends:\n{tail(self.log)}"
            )

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.popen is None:
            return
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self.popen = None


def write_kubeconfig(path: Path, *, url: str, ca: Path, identity: Identity) -> Path:
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {"name": "local", "cluster": {"server": url, "certificate-authority": str(ca)}}
                ],
                "users": [
                    {
                        "name": identity.user,
                        "user": {
                            "client-certificate": str(identity.cert),
                            "client-key": str(identity.key),
                        },
                    }
                ],
                "contexts": [
                    {"name": "local", "context": {"cluster": "local", "user": identity.user}}
                ],
                "current-context": "local",
            }
        )
    )
    return path


@dataclass
class ControlPlane:
    """The started control plane; ``admin_kubeconfig`` is a cluster admin's (system:masters)."""

    bin: Path
    work: Path
    pki: Pki = field(init=False)
    url: str = field(init=False)
    admin_kubeconfig: Path = field(init=False)
    processes: dict[str, Process] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        self.logs = self.work / "logs"
        self.logs.mkdir(exist_ok=True)
        self.pki = Pki(self.work / "pki")
        self.admin = self.pki.client("cluster-admin", "system:masters")
        self.apiserver_port = free_port()
        self.url = f"https://127.0.0.1:{self.apiserver_port}"
        self.admin_kubeconfig = self.kubeconfig("admin", self.admin)
        self._ssl = ssl.create_default_context(cafile=str(self.pki.ca))
        self._ssl.load_cert_chain(str(self.admin.cert), str(self.admin.key))

    def kubeconfig(self, name: str, identity: Identity) -> Path:
        return write_kubeconfig(
            self.work / f"{name}.kubeconfig", url=self.url, ca=self.pki.ca, identity=identity
        )

    # --- the programs ---------------------------------------------------------------------

    def start(self) -> ControlPlane:
        try:
            self._start_etcd()
            self._start_apiserver()
            self.wait_ready()
            self._start_controller_manager()
            self._start_scheduler()
            self._wait_component("kube-controller-manager")
            self._wait_component("kube-scheduler")
        except BaseException:
            self.stop()
            raise
        return self

    def _add(self, name: str, argv: list[str]) -> Process:
        process = Process(name=name, argv=argv, log=self.logs / f"{name}.log")
        self.processes[name] = process
        process.start()
        return process

    def _start_etcd(self) -> None:
        self.etcd_port, peer = free_port(), free_port()
        self._add(
            "etcd",
            [
                str(self.bin / "etcd"),
                "--name=default",
                f"--data-dir={self.work / 'etcd'}",
                f"--listen-client-urls=http://127.0.0.1:{self.etcd_port}",
                f"--advertise-client-urls=http://127.0.0.1:{self.etcd_port}",
                f"--listen-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-cluster=default=http://127.0.0.1:{peer}",
                "--unsafe-no-fsync=true",
                "--log-level=warn",
            ],
        )

    def _start_apiserver(self) -> None:
        pki = self.pki
        self._add(
            "kube-apiserver",
            [
                str(self.bin / "kube-apiserver"),
                f"--etcd-servers=http://127.0.0.1:{self.etcd_port}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={self.apiserver_port}",
                f"--cert-dir={self.work / 'apiserver-certs'}",
                f"--tls-cert-file={pki.server_cert}",
                f"--tls-private-key-file={pki.server_key}",
                f"--client-ca-file={pki.ca}",
                f"--service-account-key-file={pki.sa_pub}",
                f"--service-account-signing-key-file={pki.sa_key}",
                "--service-account-issuer=https://kubernetes.default.svc",
                "--service-cluster-ip-range=10.0.0.0/24",
                "--authorization-mode=Node,RBAC",
                "--enable-admission-plugins=NodeRestriction",
                "--allow-privileged=true",
                # the API server's own clients of the kubelets (logs, exec) are not used here
                "--kubelet-preferred-address-types=InternalIP,Hostname",
                "--endpoint-reconciler-type=none",
                "--v=1",
            ],
        )

    def _start_controller_manager(self) -> None:
        identity = self.pki.client("system:kube-controller-manager")
        kubeconfig = self.kubeconfig("controller-manager", identity)
        self.cm_port = free_port()
        self._add(
            "kube-controller-manager",
            [
                str(self.bin / "kube-controller-manager"),
                f"--kubeconfig={kubeconfig}",
                f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}",
                "--bind-address=127.0.0.1",
                f"--secure-port={self.cm_port}",
                f"--cert-dir={self.work / 'cm-certs'}",
                f"--service-account-private-key-file={self.pki.sa_key}",
                f"--root-ca-file={self.pki.ca}",
                "--use-service-account-credentials=true",
                "--leader-elect=false",
                "--controllers=*",
                # pods of a node that stops answering are evicted after 300 s by default; the
                # tests stop the API server for 30 s, which must not look like a dead node
                "--node-monitor-grace-period=120s",
                "--v=1",
            ],
        )

    def _start_scheduler(self) -> None:
        identity = self.pki.client("system:kube-scheduler")
        kubeconfig = self.kubeconfig("scheduler", identity)
        self.scheduler_port = free_port()
        self._add(
            "kube-scheduler",
            [
                str(self.bin / "kube-scheduler"),
                f"--kubeconfig={kubeconfig}",
                f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}",
                "--bind-address=127.0.0.1",
                f"--secure-port={self.scheduler_port}",
                f"--cert-dir={self.work / 'scheduler-certs'}",
                "--leader-elect=false",
                "--v=2",
            ],
        )

    def stop(self) -> None:
        for process in reversed(list(self.processes.values())):
            process.stop()

    def stop_apiserver_and_etcd(self) -> None:
        self.processes["kube-apiserver"].stop()
        self.processes["etcd"].stop()

    def start_apiserver_and_etcd(self) -> None:
        self.processes["etcd"].start()
        self.processes["kube-apiserver"].start()
        self.wait_ready()

    def check(self) -> None:
        """Raise if a program of the control plane has exited."""
        for process in self.processes.values():
            process.check()

    # --- readiness --------------------------------------------------------------------------

    def wait_ready(self) -> None:
        """Until ``/readyz`` says ok and the ``default`` namespace exists."""
        deadline = time.monotonic() + START_TIMEOUT_S
        last = ""
        for path in ("/readyz", "/api/v1/namespaces/default"):
            while True:
                self.check()
                try:
                    answer = self.request_bytes("GET", path)
                    if path != "/readyz" or answer.strip() == b"ok":
                        break
                except urllib.error.HTTPError as exc:
                    last = f"{path}: {exc.code} {exc.read()[-300:].decode(errors='replace')}"
                    exc.close()
                except (urllib.error.URLError, OSError) as exc:
                    last = f"{path}: {exc}"
                if time.monotonic() > deadline:
                    raise ClusterError(
                        f"kube-apiserver not ready after {START_TIMEOUT_S:.0f} s ({last}); its "
                        f"log ends:\n{tail(self.processes['kube-apiserver'].log)}"
                    )
                time.sleep(0.2)

    def _wait_component(self, name: str) -> None:
        port = {"kube-controller-manager": self.cm_port, "kube-scheduler": self.scheduler_port}[
            name
        ]
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE  # its self-signed serving certificate
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            self.processes[name].check()
            try:
                with urllib.request.urlopen(
                    f"https://127.0.0.1:{port}/healthz", context=context, timeout=5
                ) as answer:
                    if answer.read().strip() == b"ok":
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"{name} not healthy after {START_TIMEOUT_S:.0f} s; its log ends:\n"
                    f"{tail(self.processes[name].log)}"
                )
            time.sleep(0.2)

    # --- admin requests (set-up and checks; the code under test uses its own client) ---------

    def request(self, method: str, path: str, body: Any = None, *, patch: str = "") -> Any:
        return json.loads(self.request_bytes(method, path, body, patch=patch) or b"{}")

    def request_bytes(self, method: str, path: str, body: Any = None, *, patch: str = "") -> bytes:
        data = json.dumps(body).encode() if body is not None else None
        content = patch or "application/json"
        req = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"Content-Type": content}
        )
        with urllib.request.urlopen(req, context=self._ssl, timeout=30) as response:
            answer: bytes = response.read()
            return answer

    def env(self) -> dict[str, str]:
        """The environment of a program that should talk to this cluster as its admin."""
        return {**os.environ, "KUBECONFIG": str(self.admin_kubeconfig)}
