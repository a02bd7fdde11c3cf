"""A stand-in kubelet for the Deployments of the local API server, localapi/ (``make demo``, tests).

Where there is no kubelet, something must run the pods the agent asks for through the API (the
MPS control daemons: mpsdaemon.py). ``DeploymentKubelet`` follows the server's Deployments whose
pod template is pinned to its node (``nodeName``) and runs each one's first container as a
process of its own session: not a child of the agent, so it outlives the agent being killed,
as a pod does. The container's command runs with the container's environment only; its hostPath
volumes are made visible by mapping paths: a command argument or environment value under a
volume's ``mountPath`` is rewritten to the same place under the volume's host path (this
process shares the host's file system; the deployed-form test runs the agent in podsim's mount
namespaces, but its daemons here too). A process that exits is started again (restartPolicy
Always) after a short pause; a Deployment deleted, or changed to another object (another UID),
has its process group sent SIGTERM, then SIGKILL. ``enter`` runs the command through a prefix
(the deployed-form test: ``nsenter --mount=...`` into podsim's node namespace, where the host
paths are the node's) and ``extra_env`` adds variables the stand-ins need there.

The kubelet's other side a plugin meets, its health stream (v1 preferred over v1alpha1, as a
1.37 kubelet picks), is kubelethealth.py.

Like localapi/, this module does not import the driver.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dra_driver.sim.localapi.server import FakeKubeApi

_RESTART_PAUSE_S = 0.5
_STOP_GRACE_S = 2.0


@dataclass
class _Pod:
    uid: str
    argv: list[str]
    env: dict[str, str]
    process: subprocess.Popen[bytes] | None = None
    exited_at: float = 0.0


def map_path(value: str, mounts: Mapping[str, str]) -> str:
    """``value`` with a leading volume mountPath replaced by its host path (longest first)."""
    for mount_path in sorted(mounts, key=len, reverse=True):
        if value == mount_path or value.startswith(mount_path.rstrip("/") + "/"):
            return mounts[mount_path] + value[len(mount_path) :]
    return value


def pod_command(deployment: Mapping[str, Any]) -> tuple[list[str], dict[str, str]]:
    """The first container's argv and environment, with paths mapped to the host's."""
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    host_paths = {
        v["name"]: v["hostPath"]["path"] for v in pod.get("volumes") or () if "hostPath" in v
    }
    mounts = {
        m["mountPath"]: host_paths[m["name"]]
        for m in container.get("volumeMounts") or ()
        if m["name"] in host_paths
    }
    argv = [
        map_path(a, mounts) for a in [*container.get("command", ()), *container.get("args", ())]
    ]
    env = {}
    for entry in container.get("env") or ():
        value = str(entry.get("value", ""))
        if entry["name"] == "PATH":
            value = ":".join(map_path(p, mounts) for p in value.split(":"))
        else:
            value = map_path(value, mounts)
        env[entry["name"]] = value
    return argv, env


class DeploymentKubelet:
    """Runs the pods of the Deployments pinned to ``node_name``. ``start()``, ``stop()``."""

    def __init__(
        self,
        api: FakeKubeApi,
        *,
        node_name: str,
        log_dir: Path,
        enter: Sequence[str] = (),
        extra_env: Mapping[str, str] | None = None,
    ) -> None:
        self.api = api
        self.node_name = node_name
        self.log_dir = log_dir
        self.enter = list(enter)
        self.extra_env = dict(extra_env or {})
        self.starts: Counter[tuple[str, str]] = Counter()  # (namespace, name) -> processes run
        self._pods: dict[tuple[str, str], _Pod] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> DeploymentKubelet:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._run, name="localkubelet", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop following the server and end every process started."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None
        with self._lock:
            pods, self._pods = list(self._pods.values()), {}
        for pod in pods:
            _kill(pod)

    def running(self) -> dict[tuple[str, str], int]:
        """(namespace, name) -> PID of the pod's process, for those running now."""
        with self._lock:
            return {
                key: pod.process.pid
                for key, pod in self._pods.items()
                if pod.process is not None and pod.process.poll() is None
            }

    def _run(self) -> None:
        rv = 0
        while not self._stopping.is_set():
            self._sync()
            rv = self.api.wait_for_change(rv, 0.1)

    def _sync(self) -> None:
        wanted = {}
        for obj in self.api.objects("deployments"):
            template = ((obj.get("spec") or {}).get("template") or {}).get("spec") or {}
            if template.get("nodeName") != self.node_name or obj["spec"].get("replicas") == 0:
                continue
            wanted[(obj["metadata"]["namespace"], obj["metadata"]["name"])] = obj
        with self._lock:
            for key in list(self._pods):
                found = wanted.get(key)
                if found is None or found["metadata"]["uid"] != self._pods[key].uid:
                    _kill(self._pods.pop(key))
            for key, obj in wanted.items():
                pod = self._pods.get(key)
                if pod is None:
                    argv, env = pod_command(obj)
                    pod = self._pods[key] = _Pod(
                        obj["metadata"]["uid"], [*self.enter, *argv], {**env, **self.extra_env}
                    )
                if pod.process is not None and pod.process.poll() is not None:
                    if not pod.exited_at:
                        pod.exited_at = time.monotonic()
                    if time.monotonic() - pod.exited_at < _RESTART_PAUSE_S:
                        continue
                    pod.process = None
                if pod.process is None:
                    self._spawn(key, pod)

    def _spawn(self, key: tuple[str, str], pod: _Pod) -> None:
        log = self.log_dir / f"{key[0]}_{key[1]}.log"
        with log.open("ab") as out:
            try:
                pod.process = subprocess.Popen(  # the pod's own command, as a kubelet runs it
                    pod.argv,
                    env=pod.env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    cwd="/",
                    start_new_session=True,
                )
            except OSError as exc:
                out.write(f"cannot start {pod.argv}: {exc}\n".encode())
                pod.exited_at = time.monotonic()
                return
        pod.exited_at = 0.0
        self.starts[key] += 1


def _kill(pod: _Pod) -> None:
    if pod.process is not None:
        stop_process_group(pod.process, grace_s=_STOP_GRACE_S)


def stop_process_group(process: subprocess.Popen[Any], *, grace_s: float) -> None:
    """Stop a pod's process group as the kubelet stops a container: SIGTERM, then SIGKILL
    after ``grace_s``; reaped either way (nothing to do if it has ended)."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(5)
