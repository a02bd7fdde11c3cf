"""The kubelet plugin as a separate process, for tests that kill it with SIGKILL.

Run ``python -m tests.plugin_process <settings.json>``. It imports everything once and then acts
as a zygote: each line ``spawn`` on stdin forks a child that starts a real ``KubeletPlugin``
(simulated GPUs from the settings, claims from the API server named by the kubeconfig) and
serves until killed; the child's PID is printed on stdout. Forking an already-imported
interpreter keeps a restart at a few milliseconds, so a test can kill and restart the plugin a
hundred times within seconds. gRPC is only ever initialised in the children.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

from dra_driver.config import Config
from dra_driver.gpus.fakedriver import simulated_inventory
from dra_driver.kube import KubeClient
from dra_driver.plugin.server import KubeletPlugin


def child(settings: dict[str, str]) -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    kube = KubeClient.from_config(kubeconfig=Path(settings["kubeconfig"]))
    plugin = KubeletPlugin(
        config=Config(
            node_name="node1",
            nvidia_driver_root=Path(settings["driver_root"]),
            kubelet_registrar_directory_path=Path(settings["registry"]),
            kubelet_plugins_directory_path=Path(settings["plugins"]),
            cdi_root=Path(settings["cdi"]),
            # MPS daemons (tests/test_mps_faults.py): Deployments in this namespace
            mps_image=settings.get("mps_image"),
            mps_start_timeout_s=float(settings.get("mps_start_timeout", 30)),
            pod_namespace=settings.get("namespace", "default"),
        ),
        inventory=INVENTORY,
        claims=kube,
        deployments=kube,
        proc_root=Path(settings["proc_root"]),
        boot_id_path=Path(settings["boot_id"]),
    )
    plugin.serve_until_signal()


if __name__ == "__main__":
    SETTINGS = json.loads(Path(sys.argv[1]).read_text())
    INVENTORY = simulated_inventory(SETTINGS["simulate"], node_name="node1")
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # killed children are reaped at once
    for line in sys.stdin:
        if line.strip() != "spawn":
            continue
        pid = os.fork()
        if pid == 0:
            try:
                child(SETTINGS)
            finally:
                os._exit(0)
        print(pid, flush=True)
