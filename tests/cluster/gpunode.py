"""A GPU node of the test cluster: a hollow kubelet with the real DRA manager, and the agent Pod
the chart's DaemonSet put on it, run as the kubelet would run it.

The kubelet is ``hollownode`` (hack/kube/hollownode: kubemark's hollow kubelet, the real kubelet
code with a fake container runtime, given the kubelet's own DRA manager). It runs in a mount
namespace of its own where the node's kubelet directory (``<work>/k``) is ``/var/lib/kubelet``,
with a client certificate of ``system:node:<name>`` (the Node authorizer and NodeRestriction
judge it as a real node), and registers the Node labelled as a GPU node.

The agent is the Pod the DaemonSet controller created for that node, as the API server holds it:
its container's command, environment (downward-API fields resolved from the Pod), hostPath
volumes and mounts are run by tests/podsim.py in the node's mount namespace, where the same
``<work>/k`` is ``/var/lib/kubelet`` (tests/test_deployed.py ``start_node``), with a ServiceAccount
token the API server issued bound to that Pod (TokenRequest with the Pod as bound object, as the
kubelet's projected token volume gets it). The kubelet and the agent meet where they would on a
node: the registration socket in ``/var/lib/kubelet/plugins_registry`` and the DRA socket it names.

What differs from a node, and why: the GPUs are simulated (``SIMULATE``, the chart's ``simulate``
value) over a fake driver install; the Pod shares this machine's network, so each node's agent
gets its own health and metrics ports (``HEALTHCHECK_PORT``, ``METRICS_PORT``); and the API
server is reached on loopback (``KUBERNETES_SERVICE_HOST``/``PORT``) rather than through the
``kubernetes`` Service's cluster IP.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from dra_driver.sim.localapi import free_port
from tests.cluster import objects
from tests.cluster.controlplane import ControlPlane, Process, tail
from tests.test_deployed import ApiAccess, PodSource, start_node

GPU_NODE_LABELS = {
    "feature.node.kubernetes.io/pci-10de.present": "true",
    "nvidia.com/gpu.present": "true",
}


@dataclass
class HollowNode:
    """The node's kubelet (hollownode) in its own mount namespace."""

    name: str
    work: Path
    cluster: ControlPlane
    kubelet: Process | None = None
    cdi_log: Path = field(init=False)

    def __post_init__(self) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        self.kubelet_dir = self.work / "k"
        self.kubelet_dir.mkdir(exist_ok=True)
        self.cdi_log = self.work / "created-containers.jsonl"
        self.tmp = self.work / "kubelet-tmp"
        self.tmp.mkdir(exist_ok=True)
        self.port = free_port()  # the kubelet's server (/metrics, anonymous on loopback)

    def start(self) -> HollowNode:
        identity = self.cluster.pki.client(f"system:node:{self.name}", "system:nodes")
        kubeconfig = self.cluster.kubeconfig(f"node-{self.name}", identity)
        labels = ",".join(f"{k}={v}" for k, v in GPU_NODE_LABELS.items())
        runtime = "/run/hollow-runtime.sock"  # in the namespace's own /run: a short path
        script = (
            "set -e; mount -t tmpfs tmpfs /run; mount -t tmpfs tmpfs /var/lib; "
            "mkdir -p /var/lib/kubelet; "
            f'mount --bind "{self.kubelet_dir}" /var/lib/kubelet; exec "$@"'
        )
        argv = [
            "unshare", "--mount", "--propagation", "private", "sh", "-c", script, "hollownode",
            str(self.cluster.bin / "hollownode"),
            f"--kubeconfig={kubeconfig}", f"--name={self.name}", "--root-dir=/var/lib/kubelet",
            f"--runtime-endpoint=unix://{runtime}", f"--cdi-log={self.cdi_log}",
            f"--port={self.port}", f"--node-labels={labels}", "--v=2",
        ]  # fmt: skip
        # kubemark makes its scratch directories in TMPDIR: keep them in the node's folder
        env = {**os.environ, "TMPDIR": str(self.tmp)}
        self.kubelet = Process(f"kubelet-{self.name}", argv, self.work / "kubelet.log", env=env)
        self.kubelet.start()
        objects.wait(f"node {self.name} Ready", self._ready, timeout_s=120)
        return self

    def _ready(self) -> bool:
        assert self.kubelet is not None
        self.kubelet.check()
        node = objects.get(self.cluster, "Node", self.name)
        ready = node is not None and objects.condition(node, "Ready")
        return bool(ready and ready.get("status") == "True")

    def scratch_dirs(self) -> list[Path]:
        """The root directories kubemark made for this node's hollow kubelet. It makes them in
        /tmp whatever TMPDIR says (``MakeTempDirOrDie("hollow-kubelet.", "")``), and says so in
        its log: ``Using /tmp/hollow-kubelet.NNN as root dir for hollow-kubelet``."""
        log = self.work / "kubelet.log"
        text = log.read_text(errors="replace") if log.exists() else ""
        found = re.findall(r"Using (/tmp/hollow-kubelet\.\d+) as root dir for hollow-kubelet", text)
        return [Path(p) for p in dict.fromkeys(found)]

    def stop(self) -> None:
        if self.kubelet is not None:
            self.kubelet.stop()
            for scratch in self.scratch_dirs():  # nothing of ours left in /tmp
                shutil.rmtree(scratch, ignore_errors=True)

    def created_containers(self) -> list[dict[str, Any]]:
        """Every CreateContainer the kubelet sent the runtime (pod, container, CDI devices)."""
        if not self.cdi_log.exists():
            return []
        return [json.loads(line) for line in self.cdi_log.read_text().splitlines() if line]

    def cdi_devices(self, pod: dict[str, Any]) -> list[str]:
        """The CDI devices the kubelet had the runtime inject into ``pod``'s containers."""
        uid = pod["metadata"]["uid"]
        return sorted(
            {d for c in self.created_containers() if c["podUID"] == uid for d in c["cdiDevices"]}
        )


def bound_token(cluster: ControlPlane, pod: dict[str, Any], *, seconds: int = 3600) -> str:
    """A ServiceAccount token for ``pod``'s account, bound to the Pod (the kubelet's projected
    token: it carries the Pod's node name, which the chart's admission policy checks)."""
    meta, spec = pod["metadata"], pod["spec"]
    review = cluster.request(
        "POST",
        f"/api/v1/namespaces/{meta['namespace']}/serviceaccounts/"
        f"{spec['serviceAccountName']}/token",
        {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "audiences": ["https://kubernetes.default.svc"],
                "expirationSeconds": seconds,
                "boundObjectRef": {
                    "kind": "Pod",
                    "apiVersion": "v1",
                    "name": meta["name"],
                    "uid": meta["uid"],
                },
            },
        },
    )
    token: str = review["status"]["token"]
    return token


class NodeHost(Protocol):
    """What an agent Pod needs of its node: a hollow one here, or tests/realnode's real one."""

    name: str
    work: Path
    cluster: ControlPlane


@dataclass
class AgentPod:
    """The agent of one node: the DaemonSet's Pod run in the node's namespace (podsim)."""

    node: NodeHost
    pod: dict[str, Any]
    process: Any = None  # tests.test_deployed.Node
    health_port: int = 0
    metrics_port: int = 0
    runs: int = 0
    # tests/test_deployed.py LAYOUTS: where the node's driver is (the chart's nvidiaDriverRoot)
    layout: str = "host-multiarch"

    @property
    def log(self) -> Path:
        return self.node.work / f"pod-{self.runs}" / "node.log"

    def start(self, *, builds: Any, simulate: str, gpus: int) -> AgentPod:
        cluster = self.node.cluster
        access = ApiAccess(
            port=cluster.apiserver_port,
            token=bound_token(cluster, self.pod),
            ca_file=cluster.pki.ca,
        )
        self.health_port, self.metrics_port = free_port(), free_port()
        overrides = {
            "SIMULATE": simulate,
            "HEALTHCHECK_PORT": str(self.health_port),
            "METRICS_PORT": str(self.metrics_port),
        }
        self.runs += 1  # a restarted container: a new Pod sandbox, the same node disk
        work = self.node.work / f"pod-{self.runs}"
        work.mkdir()
        self.process, _ = start_node(
            work,
            host_state=self.node.work,
            layout=self.layout,
            builds=builds,
            api=access,
            pod=PodSource.of(self.pod),
            env_overrides=overrides,
            gpus=gpus,
        )
        return self

    def pid(self) -> int:
        """The agent's own pid, for kill -9: the node process's child (podsim's ``pod`` role
        runs ``unshare``, which execs podsim, which execs the container's command)."""
        assert self.process is not None
        children = _children(self.process.pid)
        if not children:
            raise AssertionError(f"no agent process in the node namespace:\n{tail(self.log)}")
        return children[0]

    def pod_env(self, name: str) -> str:
        """A plain value of the Pod's container environment (as the chart set it)."""
        for entry in self.pod["spec"]["containers"][0].get("env", []):
            if entry["name"] == name:
                return str(entry.get("value", ""))
        return ""

    def ready(self) -> bool:
        """The agent's ``/readyz`` answers 200: the kubelet registered it, its slices are
        published and current, NVML answered (what the DaemonSet's readiness probe asks)."""
        try:
            url = f"http://127.0.0.1:{self.health_port}/readyz"
            with urllib.request.urlopen(url, timeout=5) as answer:
                return bool(answer.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout_s: float = 120) -> None:
        def probe() -> bool:
            if not self.alive():
                raise AssertionError(f"the agent exited:\n{tail(self.log)}")
            return self.ready()

        objects.wait(f"the agent on {self.node.name} ready", probe, timeout_s=timeout_s)

    def alive(self) -> bool:
        return self.process is not None and self.process.process.poll() is None

    def stop(self) -> int:
        if self.process is None:
            return 0
        return int(self.process.stop())

    def kill9(self) -> None:
        os.kill(self.pid(), signal.SIGKILL)


def _children(pid: int) -> list[int]:
    out = subprocess.run(
        ["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True, check=False
    ).stdout
    return [int(p) for p in out.split()]
