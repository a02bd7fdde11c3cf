"""What the tests that start containers with a real CDI consumer (podman + runc) share."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from dra_driver.node.config import Config

BUSYBOX = Path("/bin/busybox")
# podman as this machine runs it: no ulimits to copy, cgroupfs, runc (which runs CDI hooks)
CONTAINERS_CONF = """[containers]
default_ulimits = []
[engine]
cgroup_manager = "cgroupfs"
runtime = "runc"
"""


def missing(*tools: str) -> str:
    """Why containers cannot be started here ("" when they can): root, podman, runc, busybox,
    and any other ``tools``."""
    if os.geteuid() != 0:
        return "needs root (device nodes, mount namespaces, rootful podman)"
    for tool in ("podman", "runc", *tools):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install podman runc busybox-static)"
    if not BUSYBOX.exists():
        return "busybox-static is not installed (/bin/busybox)"
    return ""


def busybox_rootfs(where: Path) -> Path:
    """A rootfs at ``where`` holding only busybox (static), with the directories a container
    needs to start."""
    for d in ("bin", "dev", "proc", "sys", "etc", "tmp"):
        (where / d).mkdir(parents=True)
    shutil.copy2(BUSYBOX, where / "bin/busybox")
    return where


def containers_conf(directory: Path) -> Path:
    """``directory/containers.conf`` with CONTAINERS_CONF, for podman's ``CONTAINERS_CONF``."""
    conf = directory / "containers.conf"
    conf.write_text(CONTAINERS_CONF)
    return conf


def podman_env(conf: Path) -> dict[str, str]:
    """This process's environment, with podman reading ``conf``."""
    return {**os.environ, "CONTAINERS_CONF": str(conf)}


def run_busybox(
    *, rootfs: Path, conf: Path, cdi_ids: Iterable[str], script: str
) -> subprocess.CompletedProcess[str]:
    """``sh -c script`` in a container of ``rootfs`` given the ``cdi_ids`` devices (podman
    resolves them from /etc/cdi and /var/run/cdi), without a network; its result, unchecked."""
    return subprocess.run(
        ["podman", "run", "--rm", "--network=none", *(f"--device={i}" for i in cdi_ids),
         "--rootfs", str(rootfs), "/bin/busybox", "sh", "-c", script],
        env=podman_env(conf), capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def podman_node_config(
    directory: Path, *, driver: str, driver_root: Path, **settings: Any
) -> Config:
    """The agent's Config for node ``node1`` whose kubelet directories are under ``directory``
    and whose CDI specs go where podman reads them (/var/run/cdi); ``settings``: more fields."""
    return Config(
        node_name="node1",
        driver_name=driver,
        nvidia_driver_root=driver_root,
        kubelet_registrar_directory_path=directory / "registry",
        kubelet_plugins_directory_path=directory / "plugins",
        cdi_root=Path("/var/run/cdi"),
        **settings,
    )
