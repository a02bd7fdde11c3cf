"""Installing simulated GPUs leaves nothing behind: the sysfs tree lives as long as its block, and
an agent on simulated GPUs removes what it made when it stops on SIGTERM, even during start-up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dra_driver.sim.localapi import FakeKubeApi
from dra_driver.sim.nvml import simulated_nvml


def test_the_sysfs_tree_is_removed_when_the_block_ends() -> None:
    with simulated_nvml("l4:1", node_name="n") as node:
        root = node.sysfs_root
        assert (root / "bus" / "pci" / "devices").is_dir()

    assert not root.exists()


def test_the_sysfs_tree_is_removed_when_the_block_fails() -> None:
    with pytest.raises(RuntimeError), simulated_nvml("l4:1", node_name="n") as node:
        root = node.sysfs_root
        raise RuntimeError

    assert not root.exists()


@pytest.mark.parametrize("when", ["starting", "serving"])
def test_an_agent_on_simulated_gpus_stopped_with_sigterm_leaves_nothing_in_its_temporary_directory(
    tmp_path: Path, kubeapi: FakeKubeApi, when: str
) -> None:
    """``starting``: SIGTERM as soon as the simulated node's files exist, before the agent
    serves; ``serving``: once the kubelet sockets serve."""
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    assert kubeapi.kubeconfig_path is not None
    argv = [
        sys.executable, "-m", "dra_driver", "--node-name", "node1",
        "--simulate", "h100:1:mig=1g.10gb,l4:1", "--kubeconfig", str(kubeapi.kubeconfig_path),
        "--kubelet-plugins-directory-path", str(tmp_path / "plugins"),
        "--kubelet-registrar-directory-path", str(tmp_path / "registry"),
        "--cdi-root", str(tmp_path / "cdi"), "--healthcheck-port", "0",
    ]  # fmt: skip
    registration = tmp_path / "registry" / "gpu.nvidia.com-reg.sock"

    def sysfs_tree_exists() -> bool:
        # the tree, not just any entry: the agent's other temporary files come and go meanwhile
        return any(p.name.startswith("gpu-dra-sysfs-") for p in temporary.iterdir())

    agent = subprocess.Popen(
        argv, env={**os.environ, "TMPDIR": str(temporary)}, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 60
        while not (registration.is_socket() if when == "serving" else sysfs_tree_exists()):
            assert agent.poll() is None and time.monotonic() < deadline, "the agent did not start"
            time.sleep(0.005)
        assert sysfs_tree_exists()  # in the agent's TMPDIR, until it stops
    finally:
        agent.send_signal(signal.SIGTERM)
        _, stderr = agent.communicate(timeout=30)

    assert agent.returncode == 0, stderr
    assert sorted(p.name for p in temporary.iterdir()) == []
