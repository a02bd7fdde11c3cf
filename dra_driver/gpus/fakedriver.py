"""A fake NVIDIA driver installation, part of the simulated backend (the demo, tests, benchmarks,
and users trying ``--simulate`` without a GPU): files laid out as a real driver install lays them
out (versioned libraries, soname symlinks, tools), device nodes, and the
kernel's MIG capability table, all under one temporary directory.

Its ``usr/bin/nvidia-smi`` is a stand-in (``NVIDIA_SMI``, a Python script) for the one command the
agent runs, ``nvidia-smi compute-policy -i <uuid> --set-timeslice <0..3>`` (timeslice.py). It
keeps each GPU's time slice in ``nvidia-smi.state.json`` and appends every command line it was
given to ``nvidia-smi.log``, both in its state directory: next to it, or
``$FAKE_NVIDIA_SMI_DIR`` (a driver root mounted read-only). There ``nvidia-smi.gpus`` (one UUID
per line, written from ``gpu_uuids``) lists the GPUs it knows (without it: any ``GPU-<uuid>``);
a file ``nvidia-smi.fail`` makes it fail with that file's text, ``nvidia-smi.hang`` makes it
hang (writing its PID to ``nvidia-smi.hanging``): for tests of the error and timeout paths.

Device nodes are real character devices when we are root (major/minor of /dev/null, so a real
CDI consumer accepts them and nothing can reach a GPU through them), regular files otherwise.
"""

from __future__ import annotations

import json
import os
import platform
import stat
from collections.abc import Callable, Iterable
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
NVIDIA_SMI_STATE = "nvidia-smi.state.json"
NVIDIA_SMI_LOG = "nvidia-smi.log"
NVIDIA_SMI_GPUS = "nvidia-smi.gpus"
NVIDIA_SMI_FAIL = "nvidia-smi.fail"
NVIDIA_SMI_HANG = "nvidia-smi.hang"
NVIDIA_SMI_HANGING = "nvidia-smi.hanging"  # the PIDs of hanging runs, one a line

# The stand-in nvidia-smi; exit statuses as the real one documents them (2: an invalid argument,
# 6: no such GPU).
NVIDIA_SMI = r"""#!/usr/bin/env python3
import json, os, re, sys, time
here = os.environ.get("FAKE_NVIDIA_SMI_DIR") or os.path.dirname(os.path.abspath(__file__))
args = sys.argv[1:]
with open(os.path.join(here, "nvidia-smi.log"), "a") as log:
    log.write(" ".join(args) + "\n")
def usage(message):
    sys.stderr.write(message + "\nPlease run 'nvidia-smi -h' for help.\n")
    sys.exit(2)
if os.path.exists(os.path.join(here, "nvidia-smi.hang")):
    with open(os.path.join(here, "nvidia-smi.hanging"), "a") as pids:
        pids.write("%d\n" % os.getpid())
    time.sleep(3600)
fail = os.path.join(here, "nvidia-smi.fail")
if os.path.exists(fail):
    sys.stderr.write(open(fail).read())
    sys.exit(255)
if len(args) != 5 or args[0] != "compute-policy" or args[1] != "-i" or args[3] != "--set-timeslice":
    usage("Invalid combination of input arguments (this stand-in knows only "
          "'compute-policy -i <uuid> --set-timeslice <0..3>').")
uuid, level = args[2], args[4]
if level not in ("0", "1", "2", "3"):
    usage("Invalid value for --set-timeslice: %s (valid: 0, 1, 2, 3)." % level)
known_file = os.path.join(here, "nvidia-smi.gpus")
if os.path.exists(known_file):
    known = uuid in open(known_file).read().split()
else:
    known = re.match(r"^GPU-[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}$", uuid) is not None
if not known:
    sys.stderr.write("No devices were found matching %s\n" % uuid)
    sys.exit(6)
path = os.path.join(here, "nvidia-smi.state.json")
state = json.load(open(path)) if os.path.exists(path) else {}
state[uuid] = int(level)
with open(path + ".tmp", "w") as out:
    json.dump(state, out, sort_keys=True)
os.replace(path + ".tmp", path)
print("Set timeslice to %s for GPU %s" % (level, uuid))
"""


@dataclass(frozen=True)
class FakeDriver:
    root: Path  # the driver root (NVIDIA_DRIVER_ROOT)
    proc_root: Path  # stands in for /proc
    real_nodes: bool  # device nodes are character devices
    lib_dir: str = LIB_DIR  # where the libraries are, relative to the root

    def library(self, name: str) -> Path:
        return self.root / self.lib_dir / f"{name}.so.{DRIVER_VERSION}"

    @property
    def nvidia_smi_dir(self) -> Path:
        """The stand-in nvidia-smi's state directory (unless ``$FAKE_NVIDIA_SMI_DIR`` moves it)."""
        return self.root / "usr/bin"

    def time_slices(self) -> dict[str, int]:
        """GPU uuid -> the time slice the stand-in nvidia-smi was last told (none: never)."""
        return read_time_slices(self.nvidia_smi_dir)

    def nvidia_smi_calls(self) -> list[str]:
        """The argument lines nvidia-smi was run with, oldest first."""
        return read_nvidia_smi_calls(self.nvidia_smi_dir)


def read_time_slices(state_dir: Path) -> dict[str, int]:
    """What the stand-in nvidia-smi with state in ``state_dir`` set, per GPU uuid."""
    path = state_dir / NVIDIA_SMI_STATE
    if not path.exists():
        return {}
    return {str(k): int(v) for k, v in json.loads(path.read_text()).items()}


def read_nvidia_smi_calls(state_dir: Path) -> list[str]:
    """The argument lines the stand-in nvidia-smi with state in ``state_dir`` was run with."""
    path = state_dir / NVIDIA_SMI_LOG
    return path.read_text().splitlines() if path.exists() else []


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
    gpu_uuids: Iterable[str] = (),
) -> FakeDriver:
    """A driver install under ``base/driver-root``: libraries in ``lib_dir`` (the Debian
    multiarch directory, or ``usr/lib64`` as RHEL-family hosts have it), each holding
    ``library_bytes(name)`` (default: a line of text naming it; tests that load them give real
    ELF objects), tools, and with ``device_nodes`` a ``dev/`` with the control and GPU nodes
    (as a driver container's root has; a host install keeps them in the host's /dev). The
    stand-in nvidia-smi knows the GPUs of ``gpu_uuids`` (none given: any GPU UUID)."""
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
        (bindir / tool).write_text(
            NVIDIA_SMI if tool == "nvidia-smi" else f"#!/bin/sh\necho {tool}\n"
        )
        (bindir / tool).chmod(0o755)
    uuids = list(gpu_uuids)
    if uuids:
        (bindir / NVIDIA_SMI_GPUS).write_text("".join(f"{u}\n" for u in uuids))
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
