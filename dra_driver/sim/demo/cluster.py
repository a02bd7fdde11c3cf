"""The parts ``make demo`` plays itself around the real agent: the agent's command line (as the
DaemonSet would give it), a user's ResourceClaim, the scheduler's write of an allocation, and the
kubelet's registration of the plugin."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from dra_driver._proto.pluginregistration_v1 import api_pb2 as reg_pb2
from dra_driver._proto.pluginregistration_v1 import api_pb2_grpc as reg_grpc
from dra_driver.sim.demo.console import step


def resource_claim(
    name: str,
    request: str,
    device_class: str,
    *,
    selector: str | None = None,
    capacity: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A ResourceClaim of one device of ``device_class``, as a user would write it."""
    exactly: dict[str, Any] = {"deviceClassName": device_class}
    if selector is not None:
        exactly["selectors"] = [{"cel": {"expression": selector}}]
    if capacity is not None:
        exactly["capacity"] = {"requests": capacity}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"devices": {"requests": [{"name": request, "exactly": exactly}]}},
    }


def agent_command(
    node: str, simulate: str, *, kubeconfig: Path, driver_root: Path, workdir: Path
) -> tuple[list[str], Path, Path, Path]:
    """The agent's command line over ``workdir``: (argv, plugins, registry, CDI root)."""
    plugins, registry, cdi_root = workdir / "plugins", workdir / "registry", workdir / "cdi"
    command = [
        sys.executable, "-m", "dra_driver",
        "--node-name", node, "--simulate", simulate, "--kubeconfig", str(kubeconfig),
        "--nvidia-driver-root", str(driver_root),
        "--kubelet-plugins-directory-path", str(plugins),
        "--kubelet-registrar-directory-path", str(registry),
        "--cdi-root", str(cdi_root), "--healthcheck-port", "0", "--log-format", "text",
    ]  # fmt: skip
    return command, plugins, registry, cdi_root


def register(reg_socket: Path) -> None:
    """What the kubelet does with a new plugin: GetInfo, then NotifyRegistrationStatus."""
    with grpc.insecure_channel(f"unix://{reg_socket}") as channel:
        registration = reg_grpc.RegistrationStub(channel)
        registration.GetInfo(reg_pb2.InfoRequest(), timeout=1)
        registration.NotifyRegistrationStatus(
            reg_pb2.RegistrationStatus(plugin_registered=True), timeout=5
        )


def allocated(claim: dict[str, Any], allocation: dict[str, Any], node: str) -> dict[str, Any]:
    """``claim`` with the scheduler's write: its allocation on ``node``, reserved for a pod."""
    out: dict[str, Any] = json.loads(json.dumps(claim))
    out["metadata"]["uid"] = str(uuid.uuid4())
    out["status"] = {
        "allocation": {
            **allocation,
            "nodeSelector": {
                "nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
                ]
            },
        },
        "reservedFor": [
            {
                "resource": "pods",
                "name": f"{claim['metadata']['name']}-pod",
                "uid": str(uuid.uuid4()),
            }
        ],
    }
    return out


def run_agent(
    command: list[str],
    log_path: Path,
    body: Callable[[subprocess.Popen[bytes]], int],
    *,
    cleanup: Callable[[], None] = lambda: None,
) -> int:
    """Start the agent (``command``, its stderr to ``log_path``), run ``body`` with it, then stop
    it with SIGTERM and run ``cleanup``. The agent's log is printed when ``body`` raised. Returns
    1 when the agent exited other than by that SIGTERM, else what ``body`` returned."""
    with log_path.open("w") as log_file:
        agent = subprocess.Popen(command, stderr=log_file)
    shown = False
    try:
        rc = body(agent)
        shown = True
    finally:
        if agent.poll() is None:
            agent.send_signal(signal.SIGTERM)
            agent.wait(timeout=15)
        cleanup()
        if not shown:
            step("Agent log (structured logs, --log-format text)")
            print(log_path.read_text().rstrip())
    if agent.returncode not in (0, -signal.SIGTERM):
        print(f"agent exited with {agent.returncode}", file=sys.stderr)
        return 1
    return rc
