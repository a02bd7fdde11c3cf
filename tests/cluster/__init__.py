"""A real Kubernetes cluster on this machine, with the chart installed as a user installs it.

:class:`Cluster` is the control plane (tests/cluster/controlplane.py: etcd, kube-apiserver,
kube-controller-manager, kube-scheduler), two or more GPU nodes (tests/cluster/gpunode.py:
hollow kubelets with the kubelet's real DRA manager), and the chart installed with the real
``helm install`` into that API server; each node's agent runs from the Pod the DaemonSet
controller made for it. Used by the tests in this folder (conftest.py) and by ``make cluster``
(``python -m tests.cluster``) for people.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.cluster import objects
from tests.cluster.controlplane import ControlPlane, tail
from tests.cluster.gpunode import AgentPod, HollowNode
from tests.cluster.podruntime import MpsPodRuntime

REPO = Path(__file__).resolve().parent.parent.parent
CHART = REPO / "charts" / "gpu-dra"
RELEASE = "gpu-dra"
NAMESPACE = "gpu-dra"
DRIVER = "gpu.nvidia.com"


def simulate_value(spec: str) -> tuple[str, str]:
    """``--set simulate=SPEC`` with the commas of a mixed node escaped (helm splits on them)."""
    return "--set", "simulate=" + spec.replace(",", "\\,")


def helm_binary() -> str | None:
    local = REPO / ".tools" / "bin" / "helm"
    return str(local) if os.access(local, os.X_OK) else shutil.which("helm")


@dataclass
class Cluster:
    bin: Path
    work: Path
    node_names: tuple[str, ...] = ("gpu-node-a", "gpu-node-b")
    control: ControlPlane = field(init=False)
    nodes: dict[str, HollowNode] = field(default_factory=dict)
    agents: dict[str, AgentPod] = field(default_factory=dict)
    mps: dict[str, MpsPodRuntime] = field(default_factory=dict)
    simulate: str = ""  # the simulated GPUs the nodes have now

    def __post_init__(self) -> None:
        self.control = ControlPlane(bin=self.bin, work=self.work / "control")

    # --- bring-up ---------------------------------------------------------------------------

    def start(self) -> Cluster:
        self.control.start()
        for name in self.node_names:
            self.nodes[name] = HollowNode(name, self.work / name, self.control).start()
        return self

    def helm(self, *args: str) -> subprocess.CompletedProcess[str]:
        helm = helm_binary()
        if helm is None:
            raise RuntimeError("no helm binary (make helm)")
        done = subprocess.run(
            [helm, *args, "--kubeconfig", str(self.control.admin_kubeconfig)],
            capture_output=True, text=True, timeout=300, check=False,
            env={**os.environ, "HELM_CACHE_HOME": str(self.work / "helm/cache"),
                 "HELM_CONFIG_HOME": str(self.work / "helm/config"),
                 "HELM_DATA_HOME": str(self.work / "helm/data")},
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"helm {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")
        return done

    def install_chart(self, *values: str) -> None:
        """``helm install`` (or ``upgrade --install``) as the README says, plus ``values``."""
        self.helm(
            "upgrade", "--install", RELEASE, str(CHART), "--namespace", NAMESPACE,
            "--create-namespace", *values,
        )  # fmt: skip

    def agent_pod(self, node: str, *, not_uid: str = "") -> dict[str, Any]:
        """The DaemonSet's Pod on ``node`` (a new one when ``not_uid`` names the old)."""

        def probe() -> dict[str, Any] | None:
            for pod in objects.items(self.control, "Pod", NAMESPACE):
                if (
                    pod["spec"].get("nodeName") == node
                    and pod["metadata"]["uid"] != not_uid
                    and pod["metadata"].get("deletionTimestamp") is None
                    and any(
                        o["kind"] == "DaemonSet" for o in pod["metadata"].get("ownerReferences", [])
                    )
                ):
                    return pod
            return None

        return objects.wait(f"the DaemonSet's pod on {node}", probe, timeout_s=120)

    def start_agents(self, *, builds: Any, simulate: str, gpus: int) -> None:
        self.simulate = simulate
        for name, node in self.nodes.items():
            pod = self.agent_pod(name)
            agent = AgentPod(node, pod).start(builds=builds, simulate=simulate, gpus=gpus)
            self.agents[name] = agent
            if name not in self.mps:
                self.mps[name] = MpsPodRuntime(
                    self.control, NAMESPACE, name,
                    node_pid=lambda a=agent: a.process.pid, log_dir=node.work / "mps-pods",
                    # where the driver's stand-in tools keep what they were told
                    extra_env={"FAKE_NVIDIA_SMI_DIR": f"/var/lib/kubelet/plugins/{DRIVER}"},
                ).start()  # fmt: skip
        for name in self.nodes:
            self.agents[name].wait_ready()
            objects.wait(f"{name}'s ResourceSlices", lambda n=name: self.slices(n), timeout_s=90)

    def restart_agent(self, node: str, *, builds: Any, simulate: str, gpus: int) -> AgentPod:
        """The container runtime's restart of a dead agent container (same Pod)."""
        agent = self.agents[node]
        agent.stop()
        return agent.start(builds=builds, simulate=simulate, gpus=gpus)

    def upgrade(self, *values: str, builds: Any, simulate: str, gpus: int) -> None:
        """``helm upgrade`` with ``values``: the DaemonSet replaces each node's Pod; each old
        agent is stopped (SIGTERM, as the kubelet stops a deleted Pod's container) and the new
        Pod's agent started."""
        old = {name: agent.pod["metadata"]["uid"] for name, agent in self.agents.items()}
        swapped = simulate != self.simulate
        self.install_chart(*simulate_value(simulate), *values)
        for name, node in self.nodes.items():
            pod = self.agent_pod(name, not_uid=old[name])
            self.agents[name].stop()
            if swapped:
                _swap_gpus(node)
            self.agents[name] = AgentPod(node, pod, runs=self.agents[name].runs).start(
                builds=builds, simulate=simulate, gpus=gpus
            )
            self.mps[name].node_pid = lambda a=self.agents[name]: a.process.pid
        self.simulate = simulate
        for name in self.nodes:
            self.agents[name].wait_ready()

    def stop(self) -> None:
        for runtime in self.mps.values():
            runtime.stop()
        for agent in self.agents.values():
            agent.stop()
        for node in self.nodes.values():
            node.stop()
        self.control.stop()

    # --- reading ----------------------------------------------------------------------------

    def slices(self, node: str) -> list[dict[str, Any]]:
        return [
            s
            for s in objects.items(self.control, "ResourceSlice")
            if s["spec"].get("nodeName") == node and s["spec"]["driver"] == DRIVER
        ]

    def logs(self) -> str:
        """The end of every log, for a failing test's message."""
        parts = [f"--- {p.name}\n{tail(p.log, 15)}" for p in self.control.processes.values()]
        parts += [
            f"--- kubelet {n}\n{tail(node.work / 'kubelet.log', 15)}"
            for n, node in self.nodes.items()
        ]
        parts += [f"--- agent {n}\n{tail(a.log, 25)}" for n, a in self.agents.items()]
        return "\n".join(parts)


def _swap_gpus(node: HollowNode) -> None:
    """Other simulated GPUs in the node, as if its boards were replaced while the agent was
    down: what the simulated GPUs keep on the node's disk (their MIG instances and modes) and
    the agent's marks of the MIG modes it set on the old ones go; the rest of the agent's state
    stays, as it would."""
    plugin_dir = node.kubelet_dir / "plugins" / DRIVER
    (plugin_dir / "simulated-mig.json").unlink(missing_ok=True)
    (plugin_dir / "simulated-faults.jsonl").unlink(missing_ok=True)
    for marks in ("mig-on", "mig-off"):
        shutil.rmtree(plugin_dir / marks, ignore_errors=True)
