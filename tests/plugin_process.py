"""The kubelet plugin as a separate process, for tests that kill it with SIGKILL.

Run ``python -m tests.plugin_process <settings.json>``. It imports everything once and then acts
as a zygote: each line ``spawn`` on stdin forks a child that starts a real ``KubeletPlugin``
(simulated GPUs from the settings, claims from the API server named by the kubeconfig) and
serves until killed; the child's PID is printed on stdout. With ``"mig_mode": "dynamic"`` in the
settings the child runs on live simulated NVML (its MIG state in the plugin directory), and
``spawn <NVML function>:before|after`` makes it kill itself at that call (a crash point).
Forking an already-imported interpreter keeps a restart at a few milliseconds, so a test can
kill and restart the plugin a hundred times within seconds. gRPC is only ever initialised in
the children. Nothing outlives the test: the zygote dies with the process that started it and
each instance with the zygote (``die_with_parent``), and the instances, killed with SIGKILL by
design, make their temporary files (the simulated sysfs tree) in the test's directory.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

from dra_driver.gpus import nvml
from dra_driver.kube import KubeClient
from dra_driver.mig import modeswitch
from dra_driver.node.config import Config
from dra_driver.node.wiring import kubelet_plugin
from dra_driver.sim.fakedriver import simulated_inventory
from dra_driver.sim.nvml import SimulatedNvmlLibrary, _CFunction, simulated_nvml


def child(settings: dict[str, str], crash: str) -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    kube = KubeClient.from_config(kubeconfig=Path(settings["kubeconfig"]))
    config = Config(
        node_name="node1",
        nvidia_driver_root=Path(settings["driver_root"]),
        kubelet_registrar_directory_path=Path(settings["registry"]),
        kubelet_plugins_directory_path=Path(settings["plugins"]),
        cdi_root=Path(settings["cdi"]),
        mig_mode="dynamic" if settings.get("mig_mode") == "dynamic" else "static",
        # MPS daemons (tests/test_mps_faults.py): Deployments in this namespace
        mps_image=settings.get("mps_image"),
        mps_start_timeout_s=float(settings.get("mps_start_timeout", 30)),
        pod_namespace=settings.get("namespace", "default"),
    )
    with ExitStack() as stack:
        inventory = INVENTORY
        if config.mig_mode == "dynamic":
            # NVML answers live, from the node's MIG state file, as in the agent
            node = stack.enter_context(
                simulated_nvml(
                    settings["simulate"],
                    node_name="node1",
                    state_path=config.simulated_mig_state_path,
                )
            )
            # GPUs taken out of MIG mode for a whole-GPU claim shown as they were, as in the agent
            inventory = modeswitch.discover_with_marks(
                lambda: nvml.discover(driver_root=Path("/"), sysfs_root=node.sysfs_root),
                modeswitch.MigOffMarks(config.checkpoint_path.parent / modeswitch.MARKS_DIRECTORY),
            )
            if crash:
                die_at(node.library, crash)
        plugin = kubelet_plugin(
            config=config,
            inventory=inventory,
            claims=kube,
            deployments=kube,
            proc_root=Path(settings["proc_root"]),
            boot_id_path=Path(settings["boot_id"]),
        )
        plugin.serve_until_signal()


def die_with_parent() -> None:
    """Get SIGKILL when the parent process exits (prctl PR_SET_PDEATHSIG, linux/prctl.h)."""
    pr_set_pdeathsig = 1
    if ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")


def die_at(library: SimulatedNvmlLibrary, crash: str) -> None:
    """``crash`` is ``<NVML function>:before`` or ``:after``: the process kills itself with
    SIGKILL at the first call of that function, before it runs or once it has run."""
    function, when = crash.split(":")
    real = library._functions[function]

    def dying(*args: object) -> object:
        if when == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        rc = real(*args)
        os.kill(os.getpid(), signal.SIGKILL)
        return rc

    library._functions[function] = _CFunction(function, dying)


if __name__ == "__main__":
    die_with_parent()
    # An instance killed with SIGKILL cannot remove what it made; the test removes its directory.
    tempfile.tempdir = os.environ["TMPDIR"] = str(Path(sys.argv[1]).resolve().parent)
    SETTINGS = json.loads(Path(sys.argv[1]).read_text())
    INVENTORY = simulated_inventory(SETTINGS["simulate"], node_name="node1")
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # killed children are reaped at once
    ZYGOTE = os.getpid()
    for line in sys.stdin:
        command, _, crash = line.strip().partition(" ")
        if command != "spawn":
            continue
        pid = os.fork()
        if pid == 0:
            try:
                die_with_parent()
                if os.getppid() == ZYGOTE:  # else the zygote died before prctl
                    child(SETTINGS, crash)
            finally:
                os._exit(0)
        print(pid, flush=True)
