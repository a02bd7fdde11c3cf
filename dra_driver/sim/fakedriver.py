"""A fake NVIDIA driver installation, part of the simulated backend (the demo, tests, benchmarks,
and users trying ``--simulate`` without a GPU): files laid out as a real driver install lays them
out (versioned libraries, soname symlinks, tools), device nodes, and the
kernel's MIG capability table, all under one temporary directory.

Its ``usr/bin/nvidia-smi`` is a stand-in (``NVIDIA_SMI``, a Python script) for the commands the
agent runs, ``nvidia-smi compute-policy -i <uuid> --set-timeslice <0..3>`` (timeslice.py) and
``nvidia-smi -i <uuid> -c <compute mode>`` (mpsdaemon.py). It keeps each GPU's time slice in
``nvidia-smi.state.json``, its compute mode in ``nvidia-smi.compute-mode.json``, and appends
every command line it was given to ``nvidia-smi.log``, both in its state directory: next to it, or
``$FAKE_NVIDIA_SMI_DIR`` (a driver root mounted read-only). There ``nvidia-smi.gpus`` (one UUID
per line, written from ``gpu_uuids``) lists the GPUs it knows (without it: any ``GPU-<uuid>``);
a file ``nvidia-smi.fail`` makes it fail with that file's text, ``nvidia-smi.hang`` makes it
hang (writing its PID to ``nvidia-smi.hanging``): for tests of the error and timeout paths.
``usr/bin/nvidia-cuda-mps-control`` is a stand-in MPS control daemon and client (``MPS_CONTROL``
says what it knows and records).

Device nodes are real character devices when we are root (major/minor of /dev/null, so a real
CDI consumer accepts them and nothing can reach a GPU through them), regular files otherwise.
Beside the GPU and control nodes, ``dev/nvidia-caps/`` holds the capability node of every GPU
instance and of its compute instance 0 (the only compute instance simulated GPUs make) of each
GPU minor, as nvidia-modprobe leaves them (hard links of one node: cheap to make by the
thousand). Its ``proc/`` holds what the agent reads of the kernel: ``devices`` (the majors of
``nvidia-frontend``, ``nvidia-uvm`` and ``nvidia-caps``), ``driver/nvidia/params`` and the MIG
capability table ``driver/nvidia-caps/mig-minors``; :func:`write_capability` adds a MIG
capability's own file, as the driver does when the instance is made (prepare reads it only to
make a missing capability node: cdi/devnodes.py).
"""

from __future__ import annotations

import json
import os
import platform
import stat
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from dra_driver.gpus import nvml
from dra_driver.gpus.info import Inventory
from dra_driver.sim.nvml import simulated_nvml
from dra_driver.sim.profiles import DRIVER_VERSION

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
TOOLS = ("nvidia-smi", "nvidia-debugdump", "nvidia-persistenced", "nvidia-cuda-mps-control")
OLD_VERSION = "535.54.03"
NVIDIA_SMI_STATE = "nvidia-smi.state.json"
NVIDIA_SMI_LOG = "nvidia-smi.log"
NVIDIA_SMI_GPUS = "nvidia-smi.gpus"
NVIDIA_SMI_FAIL = "nvidia-smi.fail"
NVIDIA_SMI_HANG = "nvidia-smi.hang"
NVIDIA_SMI_HANGING = "nvidia-smi.hanging"  # the PIDs of hanging runs, one a line
NVIDIA_SMI_COMPUTE_MODES = "nvidia-smi.compute-mode.json"
MPS_CONTROL_LOG = "nvidia-cuda-mps-control.log"
MPS_CONTROL_HANG = "nvidia-cuda-mps-control.hang"
MPS_CONTROL_FAIL = "nvidia-cuda-mps-control.fail"
# The majors a fake /proc/devices gives the driver's character devices (195 is fixed; the others
# the kernel hands out, in this range on real nodes).
UVM_MAJOR = 508
CAPS_MAJOR = 511
PROC_DEVICES = f"""Character devices:
  1 mem
  4 /dev/vc/0
  5 /dev/tty
 10 misc
195 nvidia-frontend
{CAPS_MAJOR - 1} nvidia-nvswitch
{UVM_MAJOR} nvidia-uvm
{CAPS_MAJOR} nvidia-caps

Block devices:
  7 loop
259 blkext
"""
# /proc/driver/nvidia/params as a driver with the default device file settings has it
NVIDIA_PARAMS = """ResmanDebugLevel: 4294967295
RmLogonRC: 1
ModifyDeviceFiles: 1
DeviceFileUID: 0
DeviceFileGID: 0
DeviceFileMode: 438
RegistryDwords: ""
"""
MIG_ACCESS_MODE = 0o444  # the mode a MIG capability's file gives its node

# The stand-in nvidia-smi; exit statuses as the real one documents them (2: an invalid argument,
# 6: no such GPU).
NVIDIA_SMI = r"""#!/usr/bin/env python3
import fcntl, json, os, re, sys, time
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
def known(uuid):
    known_file = os.path.join(here, "nvidia-smi.gpus")
    if os.path.exists(known_file):
        found = uuid in open(known_file).read().split()
    else:
        found = re.match(r"^GPU-[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}$", uuid) is not None
    if not found:
        sys.stderr.write("No devices were found matching %s\n" % uuid)
        sys.exit(6)
def save(name, uuid, value):
    # runs for different GPUs may overlap: one at a time changes the state file
    path = os.path.join(here, name)
    with open(os.path.join(here, "nvidia-smi.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        state = json.load(open(path)) if os.path.exists(path) else {}
        state[uuid] = value
        with open(path + ".tmp", "w") as out:
            json.dump(state, out, sort_keys=True)
        os.replace(path + ".tmp", path)
MODES = {"0": "DEFAULT", "DEFAULT": "DEFAULT", "2": "PROHIBITED", "PROHIBITED": "PROHIBITED",
         "3": "EXCLUSIVE_PROCESS", "EXCLUSIVE_PROCESS": "EXCLUSIVE_PROCESS"}
if len(args) == 4 and args[0] == "-i" and args[2] == "-c":
    uuid, mode = args[1], args[3]
    if mode not in MODES:
        usage("Invalid value for -c: %s (valid: DEFAULT, PROHIBITED, EXCLUSIVE_PROCESS)." % mode)
    known(uuid)
    save("nvidia-smi.compute-mode.json", uuid, MODES[mode])
    print("Set compute mode to %s for GPU %s." % (MODES[mode], uuid))
    sys.exit(0)
if len(args) != 5 or args[0] != "compute-policy" or args[1] != "-i" or args[3] != "--set-timeslice":
    usage("Invalid combination of input arguments (this stand-in knows only "
          "'compute-policy -i <uuid> --set-timeslice <0..3>' and '-i <uuid> -c <mode>').")
uuid, level = args[2], args[4]
if level not in ("0", "1", "2", "3"):
    usage("Invalid value for --set-timeslice: %s (valid: 0, 1, 2, 3)." % level)
known(uuid)
save("nvidia-smi.state.json", uuid, int(level))
print("Set timeslice to %s for GPU %s" % (level, uuid))
"""

# The stand-in nvidia-cuda-mps-control. With -f (foreground) or -d (background), either followed
# by -M (multi-user mode, recorded in its start line), it is a control
# daemon listening on a Unix socket "control" in $CUDA_MPS_PIPE_DIRECTORY, logging to
# control.log in $CUDA_MPS_LOG_DIRECTORY; without arguments it is the client: each line of its
# standard input is one command sent to that daemon, each answer printed. The daemon knows
# get_server_list (no servers: it starts none), set/get_default_active_thread_percentage,
# set/get_default_device_pinned_mem_limit <dev> <value> (dev: a UUID of CUDA_VISIBLE_DEVICES or
# an index into it; value: <n>M or <n>G) and quit. Every command it is told, and its start and
# exit, are appended to nvidia-cuda-mps-control.log in the state directory (as nvidia-smi's) as
# "<pipe directory> <line>". A file nvidia-cuda-mps-control.hang there makes a daemon start but
# never listen; nvidia-cuda-mps-control.fail makes it log that file's text and exit 1.
MPS_CONTROL = r"""#!/usr/bin/env python3
import os, re, signal, socket, sys, time
here = os.environ.get("FAKE_NVIDIA_SMI_DIR") or os.path.dirname(os.path.abspath(__file__))
pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
logdir = os.environ.get("CUDA_MPS_LOG_DIRECTORY", "/var/log/nvidia-mps")
path = os.path.join(pipe, "control")
def record(line):
    with open(os.path.join(here, "nvidia-cuda-mps-control.log"), "a") as out:
        out.write("%s %s\n" % (pipe, line))
def log(line):
    with open(os.path.join(logdir, "control.log"), "a") as out:
        out.write("[%s Control %d] %s\n" % (time.strftime("%Y-%m-%d %H:%M:%S"), os.getpid(), line))
def client():
    bad = False
    for line in sys.stdin.read().splitlines():
        if not line.strip():
            continue
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(path)
        except OSError:
            sys.stderr.write("Cannot find MPS control daemon process\n")
            sys.exit(1)
        conn.sendall(line.strip().encode() + b"\n")
        reply = b""
        while True:
            chunk = conn.recv(4096)
            if not chunk:
                break
            reply += chunk
        conn.close()
        text = reply.decode()
        if text:
            sys.stdout.write(text if text.endswith("\n") else text + "\n")
        bad = bad or text.startswith(("Invalid", "Unrecognized"))
    sys.exit(1 if bad else 0)
def serve(multi_user=False):
    devices = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
    record("start " + ("-M " if multi_user else "") + ",".join(devices))
    log("Starting control daemon using socket %s" % path)
    fail = os.path.join(here, "nvidia-cuda-mps-control.fail")
    if os.path.exists(fail):
        log(open(fail).read().strip())
        record("exit 1")
        sys.exit(1)
    if os.path.exists(os.path.join(here, "nvidia-cuda-mps-control.hang")):
        while True:
            time.sleep(3600)
    if os.path.exists(path):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
            log("An instance of this daemon is already running")
            sys.exit(1)
        except OSError:
            os.unlink(path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(16)
    def stop(*_):
        if os.path.exists(path):
            os.unlink(path)
        record("exit 0")
        os._exit(0)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    percentage, limits = "100.0", {}
    def device(dev):
        if dev in devices:
            return dev
        if dev.isdigit() and int(dev) < len(devices):
            return devices[int(dev)]
        return None
    while True:
        conn, _ = server.accept()
        data = b""
        while not data.endswith(b"\n"):
            chunk = conn.recv(4096)
            if not chunk:
                break
            data += chunk
        line = data.decode().strip()
        record(line)
        log("Cmd:" + line)
        words, reply = line.split(), ""
        if words == ["get_server_list"]:
            reply = ""
        elif len(words) == 2 and words[0] == "set_default_active_thread_percentage":
            try:
                value = float(words[1])
            except ValueError:
                value = -1.0
            if not 0 < value <= 100:
                reply = "Invalid percentage %s" % words[1]
            else:
                percentage = "%.1f" % value
                reply = percentage
        elif words == ["get_default_active_thread_percentage"]:
            reply = percentage
        elif len(words) == 3 and words[0] == "set_default_device_pinned_mem_limit":
            dev = device(words[1])
            if dev is None:
                reply = "Invalid device %s" % words[1]
            elif not re.match(r"^[0-9]+[MG]$", words[2]):
                reply = "Invalid value %s" % words[2]
            else:
                limits[dev] = words[2]
        elif len(words) == 2 and words[0] == "get_default_device_pinned_mem_limit":
            dev = device(words[1])
            reply = "Invalid device %s" % words[1] if dev is None else limits.get(dev, "0M")
        elif words == ["quit"]:
            conn.close()
            stop()
        else:
            reply = "Unrecognized command %s" % line
        conn.sendall(reply.encode())
        conn.close()
args = sys.argv[1:]
multi = args[1:] == ["-M"]
if not args:
    client()
elif args in (["-f"], ["-f", "-M"]):
    serve(multi)
elif args in (["-d"], ["-d", "-M"]):
    if os.fork() == 0:
        os.setsid()
        serve(multi)
    sys.exit(0)
else:
    sys.stderr.write("Unknown option %s (this stand-in knows -f, -d, either with -M, "
                     "and none)\n" % " ".join(args))
    sys.exit(1)
"""


# The stand-ins run with this interpreter, without site packages (-S: they need only the standard
# library): started through a shim on PATH (pyenv's is a shell script) each run would cost ~0.1 s.
_ENV_PYTHON = "#!/usr/bin/env python3\n"
_SHEBANG = f"#!{os.path.realpath(sys.executable)} -S\n"


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

    def compute_modes(self) -> dict[str, str]:
        """GPU uuid -> the compute mode the stand-in nvidia-smi was last told (none: never)."""
        return read_compute_modes(self.nvidia_smi_dir)

    def mps_control_calls(self) -> list[str]:
        """What stand-in MPS control daemons were told, oldest first: ``<pipe dir> <line>``."""
        return read_mps_control_calls(self.nvidia_smi_dir)


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


def read_compute_modes(state_dir: Path) -> dict[str, str]:
    """The compute mode the stand-in nvidia-smi with state in ``state_dir`` set, per GPU uuid."""
    path = state_dir / NVIDIA_SMI_COMPUTE_MODES
    if not path.exists():
        return {}
    return {str(k): str(v) for k, v in json.loads(path.read_text()).items()}


def read_mps_control_calls(state_dir: Path) -> list[str]:
    """The lines stand-in MPS control daemons with state in ``state_dir`` recorded."""
    path = state_dir / MPS_CONTROL_LOG
    return path.read_text().splitlines() if path.exists() else []


def make_node(path: Path) -> bool:
    """A stand-in device node: char device 1:3 as root, else a regular file. True if char. A
    node already there is left as it is."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if os.path.lexists(path):
        return stat.S_ISCHR(os.lstat(path).st_mode)
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
        scripts = {"nvidia-smi": NVIDIA_SMI, "nvidia-cuda-mps-control": MPS_CONTROL}
        script = scripts.get(tool, f"#!/bin/sh\necho {tool}\n")
        (bindir / tool).write_text(script.replace(_ENV_PYTHON, _SHEBANG, 1))
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
    table = mig_capability_table(max(8, gpu_minors.stop))
    lines = [f"{name} {minor}" for name, minor in table.items()]
    (caps / "mig-minors").write_text("\n".join(lines) + "\n")
    (proc_root / "devices").write_text(PROC_DEVICES)
    (proc_root / "driver/nvidia/params").parent.mkdir(parents=True)
    (proc_root / "driver/nvidia/params").write_text(NVIDIA_PARAMS)
    return FakeDriver(root=root, proc_root=proc_root, real_nodes=real_nodes, lib_dir=lib_dir)


def mig_capability_table(gpus: int = 8) -> dict[str, int]:
    """The kernel's MIG capability table (mig-minors) of ``gpus`` GPUs: name -> minor, numbered
    as nv-caps.c numbers it (cdi/driverfiles.py)."""
    table = {"config": 1, "monitor": 2}
    minor = 3
    for gpu in range(gpus):
        for gi in range(15):
            table[f"gpu{gpu}/gi{gi}/access"] = minor
            minor += 1
            for ci in range(8):
                table[f"gpu{gpu}/gi{gi}/ci{ci}/access"] = minor
                minor += 1
    return table


def write_capability(
    proc_root: Path, name: str, *, mode: int = MIG_ACCESS_MODE, minor: int | None = None
) -> Path:
    """The driver's file of MIG capability ``name`` (``gpu0/gi1/access``, as the table names
    it) under ``proc_root``, as the driver writes it when the instance exists; its path.
    ``minor``: the capability's minor in a table renumbered since (a driver reload)."""
    gpu, _, rest = name.partition("/")
    path = proc_root / "driver/nvidia/capabilities" / gpu / "mig" / rest
    path.parent.mkdir(parents=True, exist_ok=True)
    if minor is None:
        minor = mig_capability_table()[name]
    path.write_text(f"DeviceFileMinor: {minor}\nDeviceFileMode: {mode}\nDeviceFileModify: 1\n")
    return path


def make_device_nodes(dev: Path, *, gpu_minors: range = range(8)) -> None:
    """The control nodes, one node per GPU minor and the MIG capability nodes simulated GPUs can
    name (every GPU instance and its compute instance 0) under ``dev``."""
    for name in ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"):
        make_node(dev / name)
    for minor in gpu_minors:
        make_node(dev / f"nvidia{minor}")
    table = mig_capability_table(max(8, gpu_minors.stop))
    minors = [
        table[f"gpu{gpu}/gi{gi}/{ci}access"]
        for gpu in gpu_minors
        for gi in range(15)
        for ci in ("", "ci0/")
    ]
    if minors:
        first = dev / "nvidia-caps" / f"nvidia-cap{minors[0]}"
        make_node(first)
        for minor in minors[1:]:
            os.link(first, first.with_name(f"nvidia-cap{minor}"))


def simulated_inventory(spec: str, *, node_name: str) -> Inventory:
    """Discovery run against simulated GPUs (the real pynvml call sequence)."""
    with simulated_nvml(spec, node_name=node_name) as node:
        return nvml.discover(driver_root=Path("/nonexistent"), sysfs_root=node.sysfs_root)
