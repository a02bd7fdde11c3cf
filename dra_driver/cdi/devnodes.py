"""Device nodes a claim's CDI spec names, made where they are missing, as ``nvidia-modprobe``
makes them.

Place in the flow: prepare (prepare/preparer.py), after a claim's steps and before its spec is
written, hands the spec's device nodes to driverfiles.py's ``DriverFiles.ensure_claim_nodes``,
which has them made here. A node that cannot be made
fails that claim with an error naming the node: never a spec without it (a container runtime
given such a spec starts the container without the node, or refuses it at CreateContainer).

Why: the kernel module registers its character devices, but the files in ``/dev`` are made by
user space (``nvidia-modprobe``, run by the driver's udev rule, by libcuda or nvidia-smi). On a
freshly booted node where nothing ran yet, ``/dev/nvidia-uvm`` and friends do not exist, and
NVIDIA's DRA driver wrote specs without them (kubernetes-sigs/dra-driver-nvidia-gpu issue 1380;
PR 1458 checks the spec's nodes before it is written).

The rules, from NVIDIA/nvidia-modprobe ``modprobe-utils/nvidia-modprobe-utils.c``:

- ``/dev/nvidia<N>``, ``/dev/nvidiactl`` (minor 255), ``/dev/nvidia-modeset`` (254): major 195;
  owner, group and mode from ``/proc/driver/nvidia/params`` (``DeviceFileUID``,
  ``DeviceFileGID``, ``DeviceFileMode``), none made when it says ``ModifyDeviceFiles: 0``;
- ``/dev/nvidia-uvm`` (minor 0), ``/dev/nvidia-uvm-tools`` (1): the major of ``nvidia-uvm`` in
  the ``Character devices`` of ``/proc/devices``, root's, mode 0666;
- ``/dev/nvidia-caps/nvidia-cap<N>``: the major of ``nvidia-caps``, minor N; owner, mode and
  ``DeviceFileModify`` from the capability's own file under ``/proc/driver/nvidia/capabilities``
  (found through the kernel's table ``/proc/driver/nvidia-caps/mig-minors``), whose
  ``DeviceFileMinor`` must be N; the directory is made with mode 0755.

Defaults where a file names no value: root, mode 0666 (``NV_DEVICE_FILE_MODE``). A node that
exists is left as it is (nvidia-modprobe would also replace one of the wrong type or number and
reset its mode: the agent changes nothing an administrator or the driver made). Nodes are made
only under the dev root the spec names (the host's ``/dev``, or the driver root's ``dev/`` with
the GPU operator), where this process sees it.

:func:`node_facts` is the pure half (the text of the /proc files -> what to make);
:func:`ensure_device_nodes` reads those files and makes the nodes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from dra_driver.errors import CdiError

log = logging.getLogger("dra_driver.cdi")

NVIDIA_MAJOR = 195  # NV_MAJOR_DEVICE_NUMBER: fixed, unlike the majors of uvm and caps
CONTROL_MINOR = 255
MODESET_MINOR = 254
UVM_MINOR = 0
UVM_TOOLS_MINOR = 1
DEFAULT_MODE = 0o666  # NV_DEVICE_FILE_MODE
CAPS_DIR_MODE = 0o755
# The names the nvidia module registers major 195 under (older drivers: nvidia-frontend).
NVIDIA_CHARDEV_NAMES = ("nvidia-frontend", "nvidia")
UVM_CHARDEV = "nvidia-uvm"
CAPS_CHARDEV = "nvidia-caps"

PROC_DEVICES = "devices"
NVIDIA_PARAMS = "driver/nvidia/params"
MIG_MINORS = "driver/nvidia-caps/mig-minors"
CAPABILITIES = "driver/nvidia/capabilities"

_GPU_NODE = re.compile(r"/dev/nvidia(\d+)")
_CAP_NODE = re.compile(r"/dev/nvidia-caps/nvidia-cap(\d+)")
# mig-minors names -> capability files: "gpu0/gi1/ci0/access" -> "gpu0/mig/gi1/ci0/access",
# "config" -> "mig/config" (nv-caps.c keeps both tables in one numbering).
_TABLE_GPU_NAME = re.compile(r"gpu(\d+)/(gi\d+(?:/ci\d+)?/access)")


@dataclass(frozen=True)
class NodeFacts:
    """One device node to make: its path as the spec names it, device number and owner."""

    path: str  # e.g. /dev/nvidia-uvm
    major: int
    minor: int
    mode: int  # permission bits
    uid: int = 0
    gid: int = 0


@dataclass(frozen=True)
class ProcFacts:
    """The text of the /proc files the rules read ("" for one that does not exist)."""

    devices: str
    nvidia_params: str = ""
    mig_minors: str = ""
    # capability file (relative to /proc/driver/nvidia/capabilities) -> its text, for those
    # read; a file that does not exist is absent
    capabilities: Mapping[str, str] = field(default_factory=dict)


def node_facts(path: str, proc: ProcFacts) -> NodeFacts:
    """What to make at ``path`` (a node a spec names, e.g. ``/dev/nvidia-uvm``), by the kernel's
    facts in ``proc``. Pure. Raises CdiError naming the node and why it cannot be made (module
    not loaded, capability unknown, the driver forbids it)."""
    majors = char_majors(proc.devices)
    if path in ("/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"):
        major = majors.get(UVM_CHARDEV)
        if major is None:
            raise _cannot(
                path, f"no {UVM_CHARDEV!r} in /proc/devices: the nvidia-uvm module is not loaded"
            )
        minor = UVM_MINOR if path == "/dev/nvidia-uvm" else UVM_TOOLS_MINOR
        return NodeFacts(path=path, major=major, minor=minor, mode=DEFAULT_MODE)
    gpu = _GPU_NODE.fullmatch(path)
    if gpu is not None or path in ("/dev/nvidiactl", "/dev/nvidia-modeset"):
        if not any(majors.get(name) == NVIDIA_MAJOR for name in NVIDIA_CHARDEV_NAMES):
            raise _cannot(
                path, f"no major {NVIDIA_MAJOR} in /proc/devices: the nvidia module is not loaded"
            )
        if gpu is not None:
            minor = int(gpu[1])
        else:
            minor = CONTROL_MINOR if path == "/dev/nvidiactl" else MODESET_MINOR
        return _with_parameters(
            path, NVIDIA_MAJOR, minor, parameters(proc.nvidia_params), "/proc/driver/nvidia/params"
        )
    cap = _CAP_NODE.fullmatch(path)
    if cap is None:
        raise _cannot(path, "not an NVIDIA device node the agent knows how to make")
    minor = int(cap[1])
    major = majors.get(CAPS_CHARDEV)
    if major is None:
        raise _cannot(path, f"no {CAPS_CHARDEV!r} in /proc/devices")
    name = capability_file(minor, proc.mig_minors)
    if name is None:
        raise _cannot(
            path, f"minor {minor} is not in the driver's capability table (/proc/{MIG_MINORS})"
        )
    text = proc.capabilities.get(name)
    where = f"/proc/{CAPABILITIES}/{name}"
    if text is None:
        raise _cannot(path, f"{where} does not exist: the driver has no such MIG capability now")
    found = parameters(text)
    if found.get("DeviceFileMinor") != minor:
        raise _cannot(path, f"{where} says DeviceFileMinor {found.get('DeviceFileMinor')}")
    return _with_parameters(path, major, minor, found, where)


def _with_parameters(
    path: str, major: int, minor: int, found: Mapping[str, int], where: str
) -> NodeFacts:
    modify = found.get("ModifyDeviceFiles", found.get("DeviceFileModify", 1))
    if modify != 1:
        raise _cannot(path, f"the driver does not allow it to be made ({where}: modify {modify})")
    return NodeFacts(
        path=path,
        major=major,
        minor=minor,
        mode=found.get("DeviceFileMode", DEFAULT_MODE) & 0o777,
        uid=found.get("DeviceFileUID", 0),
        gid=found.get("DeviceFileGID", 0),
    )


class NodeUnavailable(CdiError):
    """A device node cannot be made (``why`` says why)."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(f"cannot create device node {path}: {why}")
        self.path = path
        self.why = why


def _cannot(path: str, why: str) -> NodeUnavailable:
    return NodeUnavailable(path, why)


def char_majors(devices: str) -> dict[str, int]:
    """Name -> major of the ``Character devices:`` section of /proc/devices (block devices,
    which follow it, have majors of their own)."""
    majors: dict[str, int] = {}
    in_chars = False
    for line in devices.splitlines():
        if line.strip() == "Character devices:":
            in_chars = True
            continue
        if in_chars:
            parts = line.split()
            if not parts:
                break  # the blank line ending the section
            if len(parts) == 2 and parts[0].isdigit():
                majors.setdefault(parts[1], int(parts[0]))
    return majors


def parameters(text: str) -> dict[str, int]:
    """``Name: <integer>`` lines of a driver /proc file (params, a capability file); lines with
    other values (``RegistryDwords: ""``) are skipped."""
    found: dict[str, int] = {}
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        value = value.strip()
        if sep and value.isdigit():
            found[name.strip()] = int(value)
    return found


def capability_file(minor: int, mig_minors: str) -> str | None:
    """The capability file (relative to /proc/driver/nvidia/capabilities) of ``minor`` in the
    kernel's table (``gpu0/gi1/access 12`` -> ``gpu0/mig/gi1/access``); None when the table has
    no such minor."""
    for line in mig_minors.splitlines():
        parts = line.split()
        if len(parts) != 2 or not parts[1].isdigit() or int(parts[1]) != minor:
            continue
        gpu = _TABLE_GPU_NAME.fullmatch(parts[0])
        if gpu is not None:
            return f"gpu{gpu[1]}/mig/{gpu[2]}"
        if parts[0] in ("config", "monitor"):
            return f"mig/{parts[0]}"
        return None
    return None


def module_loaded(modules: str, name: str) -> bool:
    """Whether /proc/modules (its text) lists module ``name`` (``-`` and ``_`` alike)."""
    wanted = name.replace("-", "_")
    return any(line.split(" ", 1)[0].replace("-", "_") == wanted for line in modules.splitlines())


# ---------------------------------------------------------------------------------------------
# Making the nodes


def ensure_device_nodes(
    paths: Iterable[str], *, dev_root: Path, proc_root: Path
) -> tuple[NodeFacts, ...]:
    """Make each node of ``paths`` (``/dev/...``) that does not exist under ``dev_root`` (this
    process's view of the dev root a spec names), as nvidia-modprobe would; returns what was
    made. Idempotent, and safe from many threads and processes: a node another made first
    counts as made. The /proc files are read only when a node is missing. Nothing is made
    outside ``dev_root``/dev (a link leading elsewhere is refused). Raises CdiError naming every
    node that cannot be made; the others are made."""
    # the fast path (every prepare): one stat per node, on strings (a Path costs more)
    prefix = str(dev_root).rstrip("/")
    missing = list(dict.fromkeys(p for p in paths if not _exists(prefix + p)))
    if not missing:
        return ()
    proc = read_proc_facts(proc_root, missing)
    made: list[NodeFacts] = []
    errors: list[str] = []
    for path in missing:
        try:
            facts = node_facts(path, proc)
            if _make(dev_root, facts):
                made.append(facts)
        except NodeUnavailable as exc:
            errors.append(f"cannot create device node {_where(dev_root, path)}: {exc.why}")
    if errors:
        raise CdiError("; ".join(errors))
    return tuple(made)


def read_proc_facts(proc_root: Path, paths: Iterable[str]) -> ProcFacts:
    """The /proc files the rules need for ``paths``: /proc/devices, the nvidia module's params,
    the capability table and the capability files of the ``nvidia-cap<N>`` nodes among them."""
    mig_minors = _read(proc_root / MIG_MINORS)
    capabilities: dict[str, str] = {}
    for path in paths:
        cap = _CAP_NODE.fullmatch(path)
        name = capability_file(int(cap[1]), mig_minors) if cap is not None else None
        if name is not None:
            text = _read_if_there(proc_root / CAPABILITIES / name)
            if text is not None:
                capabilities[name] = text
    return ProcFacts(
        devices=_read(proc_root / PROC_DEVICES),
        nvidia_params=_read(proc_root / NVIDIA_PARAMS),
        mig_minors=mig_minors,
        capabilities=capabilities,
    )


def _read(path: Path) -> str:
    """``path``'s text; "" when it does not exist (a module not loaded has no file)."""
    text = _read_if_there(path)
    return "" if text is None else text


def _read_if_there(path: Path) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CdiError(f"cannot read {path}: {exc}") from exc


def present(paths: Iterable[str], *, dev_root: Path) -> list[str]:
    """The nodes of ``paths`` (``/dev/...``) that exist under ``dev_root``: one stat each,
    nothing made (a caller checks ahead of the prepares that would otherwise ask)."""
    prefix = str(dev_root).rstrip("/")
    return [p for p in paths if _exists(prefix + p)]


def _here(dev_root: Path, path: str) -> Path:
    return dev_root / path.lstrip("/")


def _exists(path: str) -> bool:
    try:
        os.stat(path)
    except FileNotFoundError:
        return False
    except OSError:
        return True  # there, but not ours to look at: the runtime will say
    return True


def _where(dev_root: Path, path: str) -> str:
    """``path`` as the spec names it, and where this process makes it when elsewhere."""
    here = _here(dev_root, path)
    return path if here == Path(path) else f"{path} (at {here})"


def _make(dev_root: Path, facts: NodeFacts) -> bool:
    """mknod ``facts`` under ``dev_root``, then its owner and mode (umask and a prior file's
    mode do not count); False when another made it first. Raises NodeUnavailable."""
    here = _here(dev_root, facts.path)
    dev_dir = Path(os.path.realpath(dev_root / "dev"))
    try:
        if here.parent.name == "nvidia-caps" and here.parent.parent == dev_root / "dev":
            with contextlib.suppress(FileExistsError):
                here.parent.mkdir(mode=CAPS_DIR_MODE)
        parent = Path(os.path.realpath(here.parent))
        if parent != dev_dir and dev_dir not in parent.parents:
            raise NodeUnavailable(facts.path, f"{parent} is outside {dev_dir}")
        try:
            os.mknod(here, stat.S_IFCHR | facts.mode, os.makedev(facts.major, facts.minor))
        except FileExistsError:
            return False
        try:
            os.chown(here, facts.uid, facts.gid)
            os.chmod(here, facts.mode)
        except OSError:
            here.unlink(missing_ok=True)  # as nvidia-modprobe: no node with the wrong access
            raise
    except OSError as exc:
        raise NodeUnavailable(facts.path, exc.strerror or str(exc)) from exc
    log.info(
        "created a missing device node",
        extra={"path": str(here), "major": facts.major, "minor": facts.minor,
               "mode": f"{facts.mode:04o}"},
    )  # fmt: skip
    return True
