"""A fake NVIDIA driver installation, part of the simulated backend (the demo, tests, benchmarks,
and users trying ``--simulate`` without a GPU): files laid out as a real driver install lays them
out (versioned libraries, soname symlinks, tools), device nodes, and the
kernel's MIG capability table, all under one temporary directory.

Device nodes are real character devices when we are root (major/minor of /dev/null, so a real
CDI consumer accepts them and nothing can reach a GPU through them), regular files otherwise.
"""

from __future__ import annotations

import os
import platform
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dra_driver.gpus import nvml
from dra_driver.gpus.info import Inventory
from dra_driver.gpus.profiles import DRIVER_VERSION
from dra_driver.gpus.simulated import simulated_nvml

LIB_DIR = {
    "x86_64": "usr/lib/x86_64-linux-gnu",
    "aarch64": "usr/lib/aarch64-linux-gnu",
}.get(platform.machine(), "usr/lib64")

# library -> the symlinks a real install (ldconfig + the .run installer) creates for it
LIBRARIES: dict[str, tuple[str, ...]] = {
    "libcuda": ("libcuda.so.1", "libcuda.so"),
    "libnvidia-ml": ("libnvidia-ml.so.1",),
    "libnvidia-ptxjitcompiler": ("libnvidia-ptxjitcompiler.so.1",),
    "libnvidia-nvvm": ("libnvidia-nvvm.so.4",),
    "libcudadebugger": ("libcudadebugger.so.1",),
    "libnvidia-gpucomp": (),
    "libnvidia-allocator": ("libnvidia-allocator.so.1",),
    "libnvidia-cfg": ("libnvidia-cfg.so.1",),
    "libnvidia-opencl": ("libnvidia-opencl.so.1",),
    # the "video" capability's libraries: mounted only for claims that ask for video
    "libnvcuvid": ("libnvcuvid.so.1",),
    "libnvidia-encode": ("libnvidia-encode.so.1",),
    "libnvidia-opticalflow": ("libnvidia-opticalflow.so.1",),
}
TOOLS = ("nvidia-smi", "nvidia-debugdump", "nvidia-persistenced")
OLD_VERSION = "535.54.03"


@dataclass(frozen=True)
class FakeDriver:
    root: Path  # the driver root (NVIDIA_DRIVER_ROOT)
    proc_root: Path  # stands in for /proc
    real_nodes: bool  # device nodes are character devices
    lib_dir: str = LIB_DIR  # where the libraries are, relative to the root

    def library(self, name: str) -> Path:
        return self.root / self.lib_dir / f"{name}.so.{DRIVER_VERSION}"


def make_node(path: Path) -> bool:
    """A stand-in device node: char device 1:3 as root, else a regular file. True if char."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        return True
    path.write_text("fake device node\n")
    return False


def make_fake_driver(
    base: Path,
    *,
    gpu_minors: range = range(8),
    lib_dir: str = LIB_DIR,
    library_bytes: Callable[[str], bytes] | None = None,
    device_nodes: bool = True,
) -> FakeDriver:
    """A driver install under ``base/driver-root``: libraries in ``lib_dir`` (the Debian
    multiarch directory, or ``usr/lib64`` as RHEL-family hosts have it), each holding
    ``library_bytes(name)`` (default: a line of text naming it; tests that load them give real
    ELF objects), tools, and with ``device_nodes`` a ``dev/`` with the control and GPU nodes
    (as a driver container's root has; a host install keeps them in the host's /dev)."""
    root = base / "driver-root"
    libdir = root / lib_dir
    libdir.mkdir(parents=True)
    for lib, links in LIBRARIES.items():
        real = libdir / f"{lib}.so.{DRIVER_VERSION}"
        if library_bytes is None:
            real.write_text(f"{lib} {DRIVER_VERSION}\n")
        else:
            real.write_bytes(library_bytes(lib))
        for link in links:
            (libdir / link).symlink_to(real.name)
    # a library of an older driver left behind must not be mounted
    (libdir / f"libcuda.so.{OLD_VERSION}").write_text(f"libcuda {OLD_VERSION}\n")
    # unrelated libraries are not ours to mount
    (libdir / "libc.so.6").write_text("not nvidia\n")
    bindir = root / "usr/bin"
    bindir.mkdir(parents=True)
    for tool in TOOLS:
        (bindir / tool).write_text(f"#!/bin/sh\necho {tool}\n")
        (bindir / tool).chmod(0o755)
    real_nodes = os.geteuid() == 0
    if device_nodes:
        make_device_nodes(root / "dev", gpu_minors=gpu_minors)
    proc_root = base / "proc"
    caps = proc_root / "driver/nvidia-caps"
    caps.mkdir(parents=True)
    lines = ["config 1", "monitor 2"]
    minor = 3
    for gpu in range(8):
        for gi in range(15):
            lines.append(f"gpu{gpu}/gi{gi}/access {minor}")
            minor += 1
            for ci in range(8):
                lines.append(f"gpu{gpu}/gi{gi}/ci{ci}/access {minor}")
                minor += 1
    (caps / "mig-minors").write_text("\n".join(lines) + "\n")
    return FakeDriver(root=root, proc_root=proc_root, real_nodes=real_nodes, lib_dir=lib_dir)


def make_device_nodes(dev: Path, *, gpu_minors: range = range(8)) -> None:
    """The control nodes and one node per GPU minor under ``dev``."""
    for name in ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"):
        make_node(dev / name)
    for minor in gpu_minors:
        make_node(dev / f"nvidia{minor}")


def simulated_inventory(spec: str, *, node_name: str) -> Inventory:
    """Discovery run against simulated GPUs (the real pynvml call sequence)."""
    with simulated_nvml(spec, node_name=node_name) as node:
        return nvml.discover(driver_root=Path("/nonexistent"), sysfs_root=node.sysfs_root)
