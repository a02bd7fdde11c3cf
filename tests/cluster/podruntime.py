"""The container runtime's part for the pods the agent asks for: its MPS control daemons.

The hollow kubelet runs every pod in a fake runtime: a pod is Running, but nothing runs. The
agent's pods (the DaemonSet's) are run by the tests themselves (gpunode.AgentPod); so are the
pods of the MPS control daemon Deployments the agent creates at prepare: each such pod the real
scheduler and kubelet made Running on a node has its container's command run in that node's
mount namespace (``nsenter`` into the agent's node, where the hostPath volumes are the node's
paths; dra_driver/sim/localkubelet.py ``pod_command`` maps each mountPath to its host path), and
stopped (SIGTERM, then SIGKILL, to its process group) when the pod goes, as the kubelet would.
"""

from __future__ import annotations

import contextlib
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dra_driver.sharing.mps import APP, APP_LABEL
from dra_driver.sim.localkubelet import pod_command, stop_process_group
from tests.cluster import objects
from tests.cluster.controlplane import ControlPlane

_POLL_S = 0.3
_STOP_GRACE_S = 3.0


@dataclass
class MpsPodRuntime:
    """Runs the MPS daemon pods of one node's agent namespace (``start``/``stop``)."""

    cluster: ControlPlane
    namespace: str
    node: str
    node_pid: Any  # () -> the pid of the node's mount-namespace process (it changes on restart)
    log_dir: Path
    extra_env: dict[str, str] = field(default_factory=dict)
    started: dict[str, int] = field(default_factory=dict)  # pod name -> processes run
    _running: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> MpsPodRuntime:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._loop, name=f"mps-{self.node}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        for uid in list(self._running):
            self._kill(uid)

    def running(self) -> list[str]:
        return [uid for uid, p in self._running.items() if p.poll() is None]

    def _loop(self) -> None:
        while not self._stop.wait(_POLL_S):
            with contextlib.suppress(Exception):  # the API server may be stopped for a while
                self._sync()

    def _sync(self) -> None:
        wanted: dict[str, dict[str, Any]] = {}
        for pod in objects.items(self.cluster, "Pod", self.namespace, f"{APP_LABEL}={APP}"):
            if (
                pod["spec"].get("nodeName") == self.node
                and pod["metadata"].get("deletionTimestamp") is None
                and pod.get("status", {}).get("phase") == "Running"
            ):
                wanted[pod["metadata"]["uid"]] = pod
        for uid in list(self._running):
            if uid not in wanted:
                self._kill(uid)
        for uid, pod in wanted.items():
            process = self._running.get(uid)
            if process is None or process.poll() is not None:  # restartPolicy Always
                self._spawn(uid, pod)

    def _spawn(self, uid: str, pod: dict[str, Any]) -> None:
        argv, env = pod_command({"spec": {"template": {"spec": pod["spec"]}}})
        enter = ["nsenter", f"--mount=/proc/{self.node_pid()}/ns/mnt", "--"]
        name = pod["metadata"]["name"]
        with (self.log_dir / f"{name}.log").open("ab") as out:
            self._running[uid] = subprocess.Popen(
                [*enter, *argv], env={**env, **self.extra_env}, stdin=subprocess.DEVNULL,
                stdout=out, stderr=subprocess.STDOUT, cwd="/", start_new_session=True,
            )  # fmt: skip
        self.started[name] = self.started.get(name, 0) + 1

    def _kill(self, uid: str) -> None:
        stop_process_group(self._running.pop(uid), grace_s=_STOP_GRACE_S)
