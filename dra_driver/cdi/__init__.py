"""CDI specs for prepared claims: what a container gets, and how the spec reaches the disk.

Sits at the end of the node flow: prepare.py decides which devices a claim gets, this module turns
them into one transient CDI spec per claim (``<cdi root>/<vendor>-claim_<claimUID>.json``, kind
``<vendor>/claim``, device names ``<claimUID>-<device name>``; nvidia-compat.md "Names", spec F)
and writes it atomically. The container runtime (containerd, CRI-O, podman) reads it when the
kubelet passes our CDI IDs at CreateContainer.

The content makes a CUDA container work without the NVIDIA container runtime: the GPU's device
nodes (and for MIG the capability nodes of its GPU and compute instance), the control nodes, the
driver's user-space libraries and tools mounted read-only (also under the sonames the CUDA runtime
loads), and ``NVIDIA_VISIBLE_DEVICES=void`` so that an NVIDIA runtime, if installed, does not
inject devices a second time. What exists under the driver root is found once at start
(``find_driver_files``); building a spec afterwards does no I/O.

Only files named like our claim specs are ever written or removed in the CDI directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import platform
import re
import secrets
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dra_driver.errors import CdiError
from dra_driver.fsutil import fsync_dir, in_memory_fs, write_all

CDI_CLASS = "claim"

# The driver's files grouped the way the NVIDIA container runtime groups them, by the driver
# capability that needs them (NVIDIA_DRIVER_CAPABILITIES): a claim gets the groups its config asks
# for (deviceconfig.driver_capabilities; compute and utility by default).
LIBRARIES_BY_CAPABILITY: dict[str, tuple[str, ...]] = {
    "utility": ("libnvidia-ml", "libnvidia-cfg"),
    "compute": (
        "libcuda",
        "libcudadebugger",
        "libnvidia-allocator",
        "libnvidia-gpucomp",
        "libnvidia-nscq",
        "libnvidia-nvvm",
        "libnvidia-opencl",
        "libnvidia-pkcs11",
        "libnvidia-pkcs11-openssl3",
        "libnvidia-ptxjitcompiler",
    ),
    "video": ("libnvcuvid", "libnvidia-encode", "libnvidia-opticalflow", "libvdpau_nvidia"),
    "graphics": (
        "libEGL_nvidia",
        "libGLESv1_CM_nvidia",
        "libGLESv2_nvidia",
        "libGLX_nvidia",
        "libnvidia-cbl",
        "libnvidia-egl-gbm",
        "libnvidia-egl-wayland",
        "libnvidia-eglcore",
        "libnvidia-fbc",
        "libnvidia-glcore",
        "libnvidia-glsi",
        "libnvidia-glvkspirv",
        "libnvidia-rtcore",
        "libnvidia-tls",
        "libnvidia-vulkan-producer",
        "libnvoptix",
    ),
    "display": (),
}
BINARIES_BY_CAPABILITY: dict[str, tuple[str, ...]] = {
    "utility": ("nvidia-debugdump", "nvidia-persistenced", "nvidia-smi"),
    "compute": ("nvidia-cuda-mps-control", "nvidia-cuda-mps-server"),
}
# Other files, mounted at their path relative to the driver root: ICD and vendor files that
# tell the Vulkan/EGL/GLX loaders to use NVIDIA's libraries, the X driver modules.
FILES_BY_CAPABILITY: dict[str, tuple[str, ...]] = {
    "graphics": (
        "etc/vulkan/icd.d/nvidia_icd.json",
        "usr/share/vulkan/icd.d/nvidia_icd.json",
        "etc/vulkan/implicit_layer.d/nvidia_layers.json",
        "usr/share/vulkan/implicit_layer.d/nvidia_layers.json",
        "usr/share/glvnd/egl_vendor.d/10_nvidia.json",
        "usr/share/egl/egl_external_platform.d/10_nvidia_wayland.json",
        "usr/share/egl/egl_external_platform.d/15_nvidia_gbm.json",
        "usr/share/nvidia/nvoptix.bin",
    ),
    "display": (
        "usr/lib/xorg/modules/drivers/nvidia_drv.so",
        "usr/lib/xorg/modules/extensions/libglxserver_nvidia.so",
    ),
}
# Device nodes beyond the GPU's own and the control nodes every claim gets (when they exist).
DEVICE_NODES_BY_CAPABILITY: dict[str, tuple[str, ...]] = {
    "graphics": ("/dev/nvidia-modeset",),
    "display": ("/dev/nvidia-modeset",),
}
# What every claim gets whatever its capabilities, when the node has it: the sockets of the
# persistence daemon and the fabric manager (NVML asks them), and the GSP firmware of the
# running driver (mounted by NVIDIA's generator too).
_BASE_SOCKETS = ("run/nvidia-persistenced/socket", "run/nvidia-fabricmanager/socket")
_FIRMWARE_DIR = "lib/firmware/nvidia"
BASE = "base"
# The NVIDIA container runtime's NVIDIA_DRIVER_CAPABILITIES names (deviceconfig validates a
# claim's driverCapabilities against them), and what a claim gets without any.
DRIVER_CAPABILITIES = ("compute", "utility", "video", "graphics", "display")
DEFAULT_CAPABILITIES = frozenset({"compute", "utility"})

# Where a container finds the libraries, whatever the host's layout (/usr/lib/x86_64-linux-gnu,
# /usr/lib64, a driver container's root): one directory, the one NVIDIA's CUDA images already
# put in their loader configuration, so they load the driver even without the hook.
CONTAINER_LIB_DIR = "/usr/local/nvidia/lib64"
# The soname each library is loaded by, for installs that lack the ldconfig symlink.
_SONAMES = {
    "libcuda": "libcuda.so.1",
    "libcudadebugger": "libcudadebugger.so.1",
    "libnvidia-allocator": "libnvidia-allocator.so.1",
    "libnvidia-cfg": "libnvidia-cfg.so.1",
    "libnvidia-ml": "libnvidia-ml.so.1",
    "libnvidia-nvvm": "libnvidia-nvvm.so.4",
    "libnvidia-opencl": "libnvidia-opencl.so.1",
    "libnvidia-ptxjitcompiler": "libnvidia-ptxjitcompiler.so.1",
    "libnvcuvid": "libnvcuvid.so.1",
    "libnvidia-encode": "libnvidia-encode.so.1",
    "libnvidia-opticalflow": "libnvidia-opticalflow.so.1",
    "libvdpau_nvidia": "libvdpau_nvidia.so.1",
    "libEGL_nvidia": "libEGL_nvidia.so.0",
    "libGLESv1_CM_nvidia": "libGLESv1_CM_nvidia.so.1",
    "libGLESv2_nvidia": "libGLESv2_nvidia.so.2",
    "libGLX_nvidia": "libGLX_nvidia.so.0",
    "libnvidia-fbc": "libnvidia-fbc.so.1",
    "libnvoptix": "libnvoptix.so.1",
}
# Development names that programs dlopen or link against (the chain libcuda.so -> libcuda.so.1
# -> libcuda.so.<version> must resolve in the container).
_DEV_LINKS = {"libcuda": "libcuda.so", "libnvidia-opticalflow": "libnvidia-opticalflow.so"}
CONTROL_DEVICE_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
MOUNT_OPTIONS = ("ro", "nosuid", "nodev", "bind")
# Read-write bind mounts a device of a claim gives its container (an MPS daemon's directories).
RW_MOUNT_OPTIONS = ("rw", "nosuid", "nodev", "rbind")
NO_SECOND_INJECTION_ENV = "NVIDIA_VISIBLE_DEVICES=void"
HOOK_STAGE = "createContainer"

_BIN_DIRS = ("usr/bin", "usr/sbin", "bin", "sbin", "usr/local/bin")
_LIB_DIRS_BY_ARCH = {
    "x86_64": ("usr/lib/x86_64-linux-gnu", "lib/x86_64-linux-gnu", "usr/lib64", "lib64"),
    "aarch64": ("usr/lib/aarch64-linux-gnu", "lib/aarch64-linux-gnu", "usr/lib64", "lib64"),
}
_COMMON_LIB_DIRS = ("usr/lib", "lib")
_MAX_SYMLINK_HOPS = 16

# /proc/driver/nvidia-caps/mig-minors lists "gpu<minor>/gi<id>/access <N>" and
# "gpu<minor>/gi<id>/ci<id>/access <N>"; /dev/nvidia-caps/nvidia-cap<N> is the node to grant.
_MIG_MINOR_LINE = re.compile(r"^(gpu\d+/gi\d+(?:/ci\d+)?/access) (\d+)$")
# The kernel module numbers its capability table in a fixed order (nv-caps.c): one nvlink entry,
# mig config and monitor, then per GPU 15 GPU instances, each followed by its 8 compute instances.
_CAPS_BEFORE_GPU_TABLE = 3
_CIS_PER_GI = 8
_GIS_PER_GPU = 15
_CAPS_PER_GI = 1 + _CIS_PER_GI
_CAPS_PER_GPU = _GIS_PER_GPU * _CAPS_PER_GI

_UUID_PATTERN = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
_UUID = re.compile(rf"^{_UUID_PATTERN}$")


@dataclass(frozen=True)
class DeviceNode:
    """A device node the container gets at ``path``; the runtime stats ``host_path`` for it."""

    path: str
    host_path: str


@dataclass(frozen=True)
class Mount:
    """A read-only bind mount of a host file into the container."""

    host_path: str
    container_path: str


@dataclass(frozen=True)
class Link:
    """A symbolic link the hook creates in the container: ``link`` -> ``target``."""

    target: str  # relative to the link's directory, e.g. libcuda.so.570.124.06
    link: str  # absolute container path, e.g. /usr/local/nvidia/lib64/libcuda.so.1


@dataclass(frozen=True)
class DriverFiles:
    """What the driver installation offers to containers, grouped by driver capability.

    Every path a container edit names on the host is a host path (``NVIDIA_DRIVER_ROOT``), even
    though the files were found under the agent's own view of that root
    (``CONTAINER_DRIVER_ROOT``). ``hook_path`` is the host path of the CDI hook
    (gpu-dra-cdi-hook or NVIDIA's nvidia-cdi-hook), None when specs carry no hook.
    """

    dev_root: Path  # where /dev/nvidia* live on the host: "/" or the driver root
    mounts_by_capability: Mapping[str, tuple[Mount, ...]] = field(default_factory=dict)
    links_by_capability: Mapping[str, tuple[Link, ...]] = field(default_factory=dict)
    nodes_by_capability: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    mig_cap_minors: Mapping[str, int] = field(default_factory=dict)  # "gpu0/gi1/access" -> minor
    hook_path: str | None = None

    @property
    def mounts(self) -> tuple[Mount, ...]:
        """Every mount of every capability, sorted by container path."""
        every = {m.container_path: m for ms in self.mounts_by_capability.values() for m in ms}
        return tuple(sorted(every.values(), key=lambda m: m.container_path))

    def edits(self, capabilities: frozenset[str]) -> dict[str, Any]:
        """The container edits a claim with ``capabilities`` shares with every such claim."""
        groups = [BASE, *sorted(capabilities)]
        nodes = list(CONTROL_DEVICE_NODES)
        mounts: dict[str, Mount] = {}
        links: dict[str, Link] = {}
        for group in groups:
            nodes.extend(n for n in self.nodes_by_capability.get(group, ()) if n not in nodes)
            for m in self.mounts_by_capability.get(group, ()):
                mounts.setdefault(m.container_path, m)
            for link in self.links_by_capability.get(group, ()):
                links.setdefault(link.link, link)
        edits: dict[str, Any] = {
            "env": [NO_SECOND_INJECTION_ENV],
            "deviceNodes": [_node_json(self.node(p)) for p in nodes],
        }
        if self.hook_path is None:
            # No hook to create links: each link name is a mount of the file it names.
            by_name = {m.container_path.rsplit("/", 1)[1]: m for m in mounts.values()}
            for link in links.values():
                source = _link_source(link, links, by_name)
                if source is not None and link.link not in mounts:
                    mounts[link.link] = Mount(source.host_path, link.link)
        if mounts:
            edits["mounts"] = [
                {"hostPath": m.host_path, "containerPath": m.container_path,
                 "options": list(MOUNT_OPTIONS)}
                for m in sorted(mounts.values(), key=lambda m: m.container_path)
            ]  # fmt: skip
        if self.hook_path is not None and any(
            m.container_path.startswith(CONTAINER_LIB_DIR + "/") for m in mounts.values()
        ):
            name = self.hook_path.rsplit("/", 1)[-1]
            hooks = []
            if links:
                args = [name, "create-symlinks"]
                for link in sorted(links.values(), key=lambda x: x.link):
                    args += ["--link", f"{link.target}::{link.link}"]
                hooks.append({"hookName": HOOK_STAGE, "path": self.hook_path, "args": args})
            hooks.append(
                {
                    "hookName": HOOK_STAGE,
                    "path": self.hook_path,
                    "args": [name, "update-ldcache", "--folder", CONTAINER_LIB_DIR],
                }
            )
            edits["hooks"] = hooks
        return edits

    def node(self, path: str) -> DeviceNode:
        """The device node at container ``path``, addressed on the host under the dev root."""
        return DeviceNode(path=path, host_path=str(self.dev_root / path.lstrip("/")))

    def mig_cap_minor(self, name: str) -> int:
        """Minor of ``/dev/nvidia-caps/nvidia-cap<N>`` for a capability like ``gpu0/gi1/access``."""
        known = self.mig_cap_minors.get(name)
        if known is not None:
            return known
        m = re.fullmatch(r"gpu(\d+)/gi(\d+)(?:/ci(\d+))?/access", name)
        if m is None:
            raise CdiError(f"{name!r} is not a MIG capability name")
        gpu, gi = int(m[1]), int(m[2])
        minor = _CAPS_BEFORE_GPU_TABLE + gpu * _CAPS_PER_GPU + gi * _CAPS_PER_GI
        if m[3] is not None:
            minor += 1 + int(m[3])
        return minor


def _link_source(link: Link, links: Mapping[str, Link], files: Mapping[str, Mount]) -> Mount | None:
    """The mounted file a link leads to, following links to links (libcuda.so -> .so.1 -> ...)."""
    target = link.target
    for _ in range(_MAX_SYMLINK_HOPS):
        if target in files:
            return files[target]
        nxt = links.get(f"{CONTAINER_LIB_DIR}/{target}")
        if nxt is None:
            return None
        target = nxt.target
    return None


@dataclass(frozen=True)
class ClaimDevice:
    """One device of a claim as the container sees it."""

    name: str  # the DRA device name, e.g. gpu-0
    nodes: tuple[DeviceNode, ...]
    env: tuple[str, ...] = ()
    # (host path, container path) of read-write bind mounts (an MPS daemon's pipe and shm)
    mounts: tuple[tuple[str, str], ...] = ()


def gpu_nodes(files: DriverFiles, *, minor: int) -> tuple[DeviceNode, ...]:
    """Device nodes of a full GPU."""
    return (files.node(f"/dev/nvidia{minor}"),)


def mig_nodes(
    files: DriverFiles, *, parent_minor: int, gpu_instance_id: int, compute_instance_id: int
) -> tuple[DeviceNode, ...]:
    """Device nodes of a MIG device: the parent GPU plus its GI and CI capability nodes."""
    gi = files.mig_cap_minor(f"gpu{parent_minor}/gi{gpu_instance_id}/access")
    ci = files.mig_cap_minor(
        f"gpu{parent_minor}/gi{gpu_instance_id}/ci{compute_instance_id}/access"
    )
    return (
        files.node(f"/dev/nvidia{parent_minor}"),
        files.node(f"/dev/nvidia-caps/nvidia-cap{gi}"),
        files.node(f"/dev/nvidia-caps/nvidia-cap{ci}"),
    )


def cdi_device_name(*, claim_uid: str, device_name: str) -> str:
    return f"{claim_uid}-{device_name}"


def cdi_device_id(*, vendor: str, claim_uid: str, device_name: str) -> str:
    """Fully qualified CDI name given to the runtime: ``<vendor>/claim=<uid>-<device>``."""
    return f"{vendor}/{CDI_CLASS}={cdi_device_name(claim_uid=claim_uid, device_name=device_name)}"


class ClaimSpecEncoder:
    """Claim specs for one vendor and driver install.

    Deterministic: the same input gives the same bytes. The edits every claim shares (control
    device nodes, driver mounts: most of a spec's bytes) are built and JSON-encoded once;
    :meth:`encode` splices them in, giving exactly the compact JSON of :meth:`spec` in its own
    key order. A prepare waits for these bytes before its spec's fsync can start, so the bytes
    of a set of devices are also kept as a template cut where the claim UID goes: the spec of a
    claim whose devices were seen before is one join (the UID's first character is part of the
    key, since it decides the cdiVersion). A template holds only its devices' bytes; the shared
    edits are appended from the one copy (kept in every template, they were most of the
    agent's memory growth under load).
    """

    max_templates = 256

    def __init__(self, *, vendor: str, files: DriverFiles) -> None:
        self.kind = f"{vendor}/{CDI_CLASS}"
        self._files = files
        # capabilities -> (the shared edits, their JSON, the spec's closing bytes with them)
        self._common: dict[frozenset[str], tuple[dict[str, Any], str, bytes]] = {}
        self._templates: dict[
            tuple[tuple[ClaimDevice, ...], bool, frozenset[str]], list[bytes]
        ] = {}
        self._templates_lock = threading.Lock()

    def _common_edits(self, capabilities: frozenset[str]) -> tuple[dict[str, Any], str, bytes]:
        common = self._common.get(capabilities)
        if common is None:
            edits = self._files.edits(capabilities)
            edits_json = json.dumps(edits, separators=(",", ":"))
            common = (edits, edits_json, f',"containerEdits":{edits_json}}}\n'.encode())
            self._common[capabilities] = common  # a few sets at most: no eviction
        return common

    def spec(
        self,
        claim_uid: str,
        devices: Sequence[ClaimDevice],
        capabilities: frozenset[str] = DEFAULT_CAPABILITIES,
    ) -> dict[str, Any]:
        """The spec as a mapping (its ``containerEdits`` is shared: do not change it)."""
        if not devices:
            raise CdiError(f"claim {claim_uid}: a CDI spec needs at least one device")
        spec_devices = []
        for dev in devices:
            edits: dict[str, Any] = {}
            if dev.env:
                edits["env"] = list(dev.env)
            edits["deviceNodes"] = [_node_json(n) for n in dev.nodes]
            if dev.mounts:
                edits["mounts"] = [
                    {"hostPath": host, "containerPath": path, "options": list(RW_MOUNT_OPTIONS)}
                    for host, path in dev.mounts
                ]
            spec_devices.append(
                {
                    "name": cdi_device_name(claim_uid=claim_uid, device_name=dev.name),
                    "containerEdits": edits,
                }
            )
        spec: dict[str, Any] = {
            "cdiVersion": "",
            "kind": self.kind,
            "devices": spec_devices,
            "containerEdits": self._common_edits(capabilities)[0],
        }
        spec["cdiVersion"] = minimum_version(spec)
        return spec

    def encode(
        self,
        claim_uid: str,
        devices: Sequence[ClaimDevice],
        capabilities: frozenset[str] = DEFAULT_CAPABILITIES,
    ) -> bytes:
        """The spec's bytes on disk: compact JSON of :meth:`spec`, newline-terminated."""
        if not _UUID.match(claim_uid):  # JSON might escape it: no template
            return self._encode(claim_uid, devices, capabilities)
        key = (tuple(devices), claim_uid[0].isdigit(), capabilities)
        parts = self._templates.get(key)
        if parts is None:
            # A UID of the same first-character class whose JSON form ("\u0000") no path,
            # name or UUID contains: the encoding cut at it is the template. Only the devices'
            # part is kept per template; the shared edits (most of the bytes) are kept once.
            marker = "0\x00" if key[1] else "a\x00"
            parts = self._head(marker, devices, capabilities).split(
                json.dumps(marker)[1:-1].encode()
            )
            with self._templates_lock:
                if len(self._templates) >= self.max_templates:
                    del self._templates[next(iter(self._templates))]  # the oldest
                self._templates[key] = parts
        return claim_uid.encode().join(parts) + self._common_edits(capabilities)[2]

    def _encode(
        self, claim_uid: str, devices: Sequence[ClaimDevice], capabilities: frozenset[str]
    ) -> bytes:
        return self._head(claim_uid, devices, capabilities) + self._common_edits(capabilities)[2]

    def _head(
        self, claim_uid: str, devices: Sequence[ClaimDevice], capabilities: frozenset[str]
    ) -> bytes:
        """The spec's bytes up to its shared ``containerEdits`` (no closing brace)."""
        spec = self.spec(claim_uid, devices, capabilities)
        head = json.dumps(
            {"cdiVersion": spec["cdiVersion"], "kind": spec["kind"], "devices": spec["devices"]},
            separators=(",", ":"),
        )
        return head[:-1].encode()


def minimum_version(spec: Mapping[str, Any]) -> str:
    """The lowest cdiVersion that allows every field ``spec`` uses (spec F.1).

    Older runtimes only know older versions (podman 4.3 accepts <= 0.5.0), so a spec must not
    claim a newer version than it needs.
    """
    if "annotations" in spec or "." in str(spec.get("kind", "")).split("/")[-1]:
        return "0.6.0"
    version = "0.3.0"
    edit_sets = [spec.get("containerEdits") or {}]
    for dev in spec.get("devices", ()):
        if "annotations" in dev:
            return "0.6.0"
        if str(dev.get("name", "")).startswith(tuple("0123456789")):
            version = "0.5.0"
        edit_sets.append(dev.get("containerEdits") or {})
    for edits in edit_sets:
        if "additionalGids" in edits or "intelRdt" in edits:
            return "0.7.0"
        if any("hostPath" in n for n in edits.get("deviceNodes", ())):
            version = "0.5.0"
        if version < "0.4.0" and any("type" in m for m in edits.get("mounts", ())):
            version = "0.4.0"
    return version


def _node_json(node: DeviceNode) -> dict[str, str]:
    if node.host_path == node.path:
        return {"path": node.path}
    return {"path": node.path, "hostPath": node.host_path}


# ---------------------------------------------------------------------------------------------
# Finding the driver's files


def find_driver_files(
    *,
    driver_root: Path,
    driver_version: str | None,
    host_driver_root: Path | None = None,
    proc_root: Path = Path("/proc"),
) -> DriverFiles:
    """Scan the driver install once for what containers need, by driver capability.

    ``driver_root`` is where this process sees the install (``CONTAINER_DRIVER_ROOT``: the chart
    mounts the host's driver root at ``/driver-root``); ``host_driver_root`` is the same tree as
    the host and so the container runtime sees it (``NVIDIA_DRIVER_ROOT``; default: the same).
    Files are found under the first and named in specs under the second, by swapping the prefix.
    Device nodes live under the host driver root when the install holds ``dev/nvidiactl``
    (the GPU operator's driver container), else under the host's ``/dev``.

    ``driver_version`` (e.g. ``570.124.06``) selects the libraries of the running driver when
    several versions are installed side by side; None takes every version found. Missing files
    are not an error: a spec without them still gives the container its device nodes.
    """
    host_root = host_driver_root or driver_root

    def host(path: Path) -> str:
        return str(host_root / path.relative_to(driver_root))

    mounts: dict[str, dict[str, Mount]] = {}
    links: dict[str, dict[str, Link]] = {}
    for directory in _library_dirs(driver_root):
        for capability, libs in LIBRARIES_BY_CAPABILITY.items():
            for lib in libs:
                found = _library_files(driver_root, directory, lib, driver_version)
                if found is None:
                    continue
                real, lib_links = found
                group = mounts.setdefault(capability, {})
                container_path = f"{CONTAINER_LIB_DIR}/{real.name}"
                if container_path in group:
                    continue  # the same library in a second directory (lib and lib64)
                group[container_path] = Mount(host(real), container_path)
                for link in lib_links:
                    links.setdefault(capability, {}).setdefault(link.link, link)
    for capability, names in BINARIES_BY_CAPABILITY.items():
        for name in names:
            for rel in _BIN_DIRS:
                tool = _resolve_in_root(driver_root, driver_root / rel / name)
                if tool is not None and tool.is_file():
                    container_path = f"/usr/bin/{name}"
                    mounts.setdefault(capability, {})[container_path] = Mount(
                        host(tool), container_path
                    )
                    break
    for capability, rels in FILES_BY_CAPABILITY.items():
        for rel in rels:
            for real, container_path in _matching_files(driver_root, rel, driver_version):
                mounts.setdefault(capability, {}).setdefault(
                    container_path, Mount(host(real), container_path)
                )
    for rel in _BASE_SOCKETS:
        sock = _resolve_in_root(driver_root, driver_root / rel)
        if sock is not None and sock.is_socket():
            mounts.setdefault(BASE, {})["/" + rel] = Mount(host(sock), "/" + rel)
    if driver_version:
        firmware = _resolve_in_root(driver_root, driver_root / _FIRMWARE_DIR / driver_version)
        if firmware is not None and firmware.is_dir():
            for name in sorted(os.listdir(firmware)):
                if name.startswith("gsp") and name.endswith(".bin"):
                    container_path = f"/{_FIRMWARE_DIR}/{driver_version}/{name}"
                    mounts.setdefault(BASE, {})[container_path] = Mount(
                        host(firmware / name), container_path
                    )
    dev_root = Path("/")
    if host_root != Path("/") and _is_node(driver_root / "dev/nvidiactl"):
        dev_root = host_root
    dev_seen_at = driver_root if dev_root == host_root else Path("/")
    nodes = {
        capability: tuple(n for n in names if _is_node(dev_seen_at / n.lstrip("/")))
        for capability, names in DEVICE_NODES_BY_CAPABILITY.items()
    }
    return DriverFiles(
        dev_root=dev_root,
        mounts_by_capability={
            c: tuple(sorted(ms.values(), key=lambda m: m.container_path))
            for c, ms in mounts.items()
        },
        links_by_capability={
            c: tuple(sorted(ls.values(), key=lambda x: x.link)) for c, ls in links.items()
        },
        nodes_by_capability={c: n for c, n in nodes.items() if n},
        mig_cap_minors=read_mig_cap_minors(proc_root / "driver/nvidia-caps/mig-minors"),
    )


def _is_node(path: Path) -> bool:
    """A device node (or, for unprivileged tests, any file) at ``path``."""
    try:
        return path.exists()
    except OSError:
        return False


def read_mig_cap_minors(path: Path) -> dict[str, int]:
    """Parse the kernel's MIG capability table; empty when the file does not exist."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise CdiError(f"cannot read {path}: {exc}") from exc
    minors: dict[str, int] = {}
    for line in text.splitlines():
        m = _MIG_MINOR_LINE.match(line.strip())
        if m:
            minors[m[1]] = int(m[2])
    return minors


def find_driver_tool(driver_root: Path, name: str) -> Path | None:
    """Where this process finds the driver's program ``name`` (``nvidia-smi``) under
    ``driver_root`` (its own view: ``CONTAINER_DRIVER_ROOT``), links followed inside the root;
    None when the install has none."""
    for rel in _BIN_DIRS:
        tool = _resolve_in_root(driver_root, driver_root / rel / name)
        if tool is not None and tool.is_file():
            return tool
    return None


def find_driver_library(driver_root: Path, soname: str) -> Path | None:
    """The file ``soname`` (``libnvidia-ml.so.1``) names in the first library directory under
    ``driver_root`` that has it, links followed inside the root; None when none has it."""
    for directory in _library_dirs(driver_root):
        real = _resolve_in_root(driver_root, directory / soname)
        if real is not None and real.is_file():
            return real
    return None


def _library_dirs(driver_root: Path) -> list[Path]:
    rels = _LIB_DIRS_BY_ARCH.get(platform.machine(), ()) + _COMMON_LIB_DIRS
    seen: set[Path] = set()
    dirs: list[Path] = []
    for rel in rels:
        directory = driver_root / rel
        real = _resolve_in_root(driver_root, directory)
        # merged-/usr systems make /lib a link to /usr/lib: scan each directory once
        if real is None or not real.is_dir() or real in seen:
            continue
        seen.add(real)
        dirs.append(directory)
    return dirs


def _library_files(
    driver_root: Path, directory: Path, lib: str, driver_version: str | None
) -> tuple[Path, list[Link]] | None:
    """The real file of ``lib`` in ``directory`` (of the running driver version) and the links
    a container needs to it: the install's own links (``libcuda.so.1``, ``libcuda.so``), the
    soname where the install lacks it, and the development name of ``_DEV_LINKS``."""
    pattern = re.compile(rf"^{re.escape(lib)}\.so(\.[0-9][0-9.]*)?$")
    by_real: dict[Path, list[str]] = {}
    for name in sorted(os.listdir(directory)):
        if not pattern.match(name):
            continue
        resolved = _resolve_in_root(driver_root, directory / name)
        if resolved is None or not resolved.is_file():
            continue
        version = resolved.name.removeprefix(f"{lib}.so.")
        if driver_version is not None and version != driver_version:
            continue
        by_real.setdefault(resolved, []).append(name)
    soname = _SONAMES.get(lib)
    if len(by_real) > 1:
        # Several versions and the running one unknown: the one the soname leads to, or none
        # (never a mix of two drivers' libraries).
        by_real = {r: n for r, n in by_real.items() if soname in n}
    if len(by_real) != 1:
        return None
    ((real, names),) = by_real.items()
    links = {n: Link(real.name, f"{CONTAINER_LIB_DIR}/{n}") for n in names if n != real.name}
    if soname is not None and soname != real.name:
        links.setdefault(soname, Link(real.name, f"{CONTAINER_LIB_DIR}/{soname}"))
    dev = _DEV_LINKS.get(lib)
    if dev is not None:
        links[dev] = Link(soname or real.name, f"{CONTAINER_LIB_DIR}/{dev}")
    return real, sorted(links.values(), key=lambda x: x.link)


def _matching_files(
    driver_root: Path, rel: str, driver_version: str | None
) -> list[tuple[Path, str]]:
    """``rel`` under the driver root, or for a ``.so`` name its versioned file
    (``libglxserver_nvidia.so.<version>``): (real path, container path) pairs."""
    for name in (rel, f"{rel}.{driver_version}" if rel.endswith(".so") else None):
        if name is None or (name != rel and driver_version is None):
            continue
        real = _resolve_in_root(driver_root, driver_root / name)
        if real is not None and real.is_file():
            return [(real, "/" + name)]
    return []


def _resolve_in_root(driver_root: Path, path: Path) -> Path | None:
    """Follow symlinks of ``path`` as if ``driver_root`` were ``/``; None if it leaves the root.

    Absolute link targets in a driver container's tree are relative to that tree, not to our
    root, so ``Path.resolve`` would look in the wrong place.
    """
    current = path
    for _ in range(_MAX_SYMLINK_HOPS):
        parent = _resolve_dir_in_root(driver_root, current.parent)
        if parent is None:
            return None
        current = parent / current.name
        if not current.is_symlink():
            return current if current.exists() else None
        target = os.readlink(current)
        if target.startswith("/"):
            current = driver_root / target.lstrip("/")
        else:
            current = current.parent / target
    return None


def _resolve_dir_in_root(driver_root: Path, directory: Path) -> Path | None:
    try:
        rel = directory.relative_to(driver_root)
    except ValueError:
        normal = Path(os.path.normpath(directory))
        try:
            rel = normal.relative_to(driver_root)
        except ValueError:
            return None
    current = driver_root
    for part in rel.parts:
        if part == "..":
            if current == driver_root:
                return None
            current = current.parent
            continue
        current = current / part
        hops = 0
        while current.is_symlink():
            hops += 1
            if hops > _MAX_SYMLINK_HOPS:
                return None
            target = os.readlink(current)
            current = (
                driver_root / target.lstrip("/")
                if target.startswith("/")
                else Path(os.path.normpath(current.parent / target))
            )
            try:
                current.relative_to(driver_root)
            except ValueError:
                return None
    return current


# ---------------------------------------------------------------------------------------------
# The spec directory


class PendingSpec:
    """A spec written to its temp file but not yet synced and renamed (see CdiSpecDir.begin)."""

    def __init__(self, *, fd: int, temp: Path, final: Path) -> None:
        self.final = final
        self._fd = fd
        self._temp = temp
        self._done = False

    def sync(self) -> None:
        """fsync the temp file (blocking; may run in another thread than the rest)."""
        try:
            os.fsync(self._fd)
        except OSError as exc:
            raise CdiError(f"cannot write CDI spec {self.final}: {exc}") from exc

    def commit(self) -> Path:
        """Rename the synced temp file over the spec: readers see the new spec from now on."""
        # Renamed before closing: a recycled spare stays locked (ours) until it is the spec.
        try:
            os.rename(self._temp, self.final)
        except OSError as exc:
            raise CdiError(f"cannot write CDI spec {self.final}: {exc}") from exc
        self._done = True
        with contextlib.suppress(OSError):  # synced and renamed: the spec is in place
            os.close(self._fd)
        self._fd = -1
        return self.final

    def abort(self) -> None:
        """Drop the temp file unless committed. Idempotent; never raises."""
        # Unlinked before closing, for the same reason as in commit.
        if not self._done:
            self._done = True
            with contextlib.suppress(OSError):
                self._temp.unlink(missing_ok=True)
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1


@dataclass
class _Spare:
    """A removed spec kept for the next write: renamed to a hidden name, open, and locked."""

    path: Path
    fd: int  # O_RDWR; holds an exclusive flock for as long as the file is a spare of ours
    size: int


def _open_locked(path: Path) -> int | None:
    """``path`` opened read-write with the exclusive flock that marks a spare as its holder's;
    None (nothing left open) when another open file holds that lock."""
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


class CdiSpecDir:
    """Our claim specs in the CDI directory: atomic writes, removal, listing.

    Spec file: ``<vendor>-claim_<claimUID>.json``. A write goes to a hidden temp file in the same
    directory (``.<spec name>.<random>.tmp``: runtimes only read ``*.json``/``*.yaml``), is
    fsync'd and renamed over the final name, so a reader sees the old spec or the new one, never
    a mix or a partial file, even after a power loss. The directory is not fsync'd: after a power
    loss the boot ID drops every prepared claim and reconcile removes the specs and temp files
    left behind, so whether a rename survived does not matter. Files not named like our specs
    are never touched.

    Spares: creating a file and deleting one are the costliest steps of a spec's life on a
    journaling file system (an inode allocated and freed, ~0.2 ms of kernel time each on a small
    VM). So a removed spec is renamed to a hidden spare (``.<vendor>-claim_spare.<random>.tmp``),
    kept open with an exclusive ``flock``, and the next write overwrites it in place instead of
    creating a temp file; up to ``max_spares`` are kept. The lock says whose a spare is: a second
    plugin instance (rolling update) never touches a locked spare, and a spare whose owner died
    (its lock went with it) is adopted or deleted by :meth:`collect_spares`. :meth:`close`
    deletes this instance's spares.

    No spares on a tmpfs (a node's /run/cdi; found by ensure()): there a file is created and
    deleted in memory, and a spare's extra steps (open, lock, rename) cost more than they save
    (a write 81 vs 42 us, a removal 31 vs 13 us, measured on /dev/shm here); spares an earlier
    instance left there are deleted, not adopted.
    """

    def __init__(self, root: Path, *, vendor: str, max_spares: int = 16) -> None:
        self.root = root
        self.vendor = vendor
        self.max_spares = max_spares
        self._prefix = f"{vendor}-{CDI_CLASS}_"
        self._spec_name = re.compile(rf"^{re.escape(self._prefix)}({_UUID_PATTERN})\.json$")
        self._temp_name = re.compile(
            rf"^\.{re.escape(self._prefix)}({_UUID_PATTERN})\.json\.[0-9a-f]+\.tmp$"
        )
        self._spare_name = re.compile(rf"^\.{re.escape(self._prefix)}spare\.[0-9a-f]+\.tmp$")
        self._spares: list[_Spare] = []
        self._spares_lock = threading.Lock()
        # The directory is on a tmpfs (a node's /run/cdi): a spec's fsync returns at once, so
        # handing it to another thread would cost more than it overlaps. Set by ensure().
        self.in_memory = False

    @property
    def _spare_room(self) -> int:
        return 0 if self.in_memory else self.max_spares

    def ensure(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.in_memory = in_memory_fs(self.root)

    def path_for(self, claim_uid: str) -> Path:
        if not _UUID.match(claim_uid):
            # the UID is part of a file name: refuse anything that could climb out of the dir
            raise CdiError(f"claim UID {claim_uid!r} is not a lowercase UUID")
        return self.root / f"{self._prefix}{claim_uid}.json"

    def write(self, claim_uid: str, content: bytes) -> Path:
        """Atomically replace the spec of ``claim_uid`` with ``content``."""
        pending = self.begin(claim_uid, content)
        try:
            pending.sync()
            return pending.commit()
        finally:
            pending.abort()

    def begin(self, claim_uid: str, content: bytes) -> PendingSpec:
        """Write ``content`` to a temp file; the caller then calls ``sync()`` (from any thread)
        and ``commit()``, or ``abort()``. Splitting the write lets the slow part (the fsync)
        overlap other work without the rest of the write leaving the caller's thread."""
        final = self.path_for(claim_uid)
        with self._spares_lock:
            spare = self._spares.pop() if self._spares else None
        if spare is not None:
            fd, temp = spare.fd, spare.path  # opened at offset 0 when it became a spare
        else:
            temp = self.root / f".{final.name}.{secrets.token_hex(4)}.tmp"
            try:
                fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            except OSError as exc:
                raise CdiError(f"cannot write CDI spec {final}: {exc}") from exc
        pending = PendingSpec(fd=fd, temp=temp, final=final)
        try:
            write_all(fd, content)
            if spare is not None and spare.size > len(content):
                os.ftruncate(fd, len(content))
        except OSError as exc:
            pending.abort()
            raise CdiError(f"cannot write CDI spec {final}: {exc}") from exc
        return pending

    def read(self, claim_uid: str) -> bytes | None:
        """The spec's bytes, or None when the claim has no spec."""
        try:
            return self.path_for(claim_uid).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise CdiError(f"cannot read CDI spec of claim {claim_uid}: {exc}") from exc

    def remove(self, claim_uid: str, *, sync_dir: bool = True) -> bool:
        """Delete the spec of ``claim_uid`` (keep it as a spare while there is room); False when
        there was none (not an error)."""
        path = self.path_for(claim_uid)
        try:
            if not self._keep_as_spare(path):
                path.unlink()
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise CdiError(f"cannot remove CDI spec of claim {claim_uid}: {exc}") from exc
        if sync_dir:
            self.sync()
        return True

    def _keep_as_spare(self, spec: Path) -> bool:
        """Rename ``spec`` to a new spare of ours; False (nothing done) when the pool is full.
        FileNotFoundError when there is no such spec."""
        with self._spares_lock:
            if len(self._spares) >= self._spare_room:
                return False
        try:
            # Locked before it gets a spare's name, so no other instance ever sees it unlocked.
            fd = _open_locked(spec)
        except FileNotFoundError:
            raise
        except OSError:
            return False  # not a plain file we can reuse (a symlink, say): just delete it
        if fd is None:
            return False  # locked by someone: not a file of the kind we keep
        try:
            size = os.fstat(fd).st_size
            spare = self.root / f".{self._prefix}spare.{secrets.token_hex(4)}.tmp"
            os.rename(spec, spare)
        except BaseException:
            os.close(fd)
            raise
        with self._spares_lock:
            self._spares.append(_Spare(path=spare, fd=fd, size=size))
        return True

    @property
    def spare_count(self) -> int:
        with self._spares_lock:
            return len(self._spares)

    def collect_spares(self) -> tuple[int, int]:
        """Adopt the spares of instances that are gone (no lock on them) while there is room,
        delete the rest of them; spares another live instance holds are left alone. Returns
        (adopted, deleted)."""
        with self._spares_lock:
            ours = {s.path.name for s in self._spares}
        try:
            names = [n for n in os.listdir(self.root) if self._spare_name.match(n)]
        except FileNotFoundError:
            return 0, 0
        adopted = deleted = 0
        for name in names:
            if name in ours:
                continue
            path = self.root / name
            try:
                fd = _open_locked(path)
            except OSError:
                continue  # gone meanwhile, or not a plain file of ours
            if fd is None:
                continue  # a live instance's spare
            with self._spares_lock:
                room = len(self._spares) < self._spare_room
                if room:
                    self._spares.append(_Spare(path=path, fd=fd, size=os.fstat(fd).st_size))
            if room:
                adopted += 1
                continue
            with contextlib.suppress(FileNotFoundError):
                path.unlink()  # still locked by us: nobody can adopt it in between
            os.close(fd)
            deleted += 1
        return adopted, deleted

    def close(self) -> None:
        """Delete this instance's spares (a stopping plugin leaves only specs behind)."""
        with self._spares_lock:
            spares, self._spares = self._spares, []
        for spare in spares:
            with contextlib.suppress(OSError):
                spare.path.unlink()
            with contextlib.suppress(OSError):
                os.close(spare.fd)

    def claim_uids(self) -> set[str]:
        """UIDs of every claim that has a spec of ours in the directory."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return set()
        return {m[1] for n in names if (m := self._spec_name.match(n))}

    def temp_files(self) -> list[tuple[str, Path]]:
        """``(claim UID, path)`` of every temp file of ours: writes in flight or crash leftovers.

        Writes happen only under the claim's lock, so a caller holding that lock knows the file
        is a leftover and may delete it with :meth:`remove_temp_file`.
        """
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        return [(m[1], self.root / n) for n in names if (m := self._temp_name.match(n))]

    def remove_temp_file(self, path: Path) -> bool:
        """Delete one temp file found by :meth:`temp_files`; False when it was already gone."""
        if not self._temp_name.match(path.name) or path.parent != self.root:
            raise CdiError(f"{path} is not a temp file of ours")
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise CdiError(f"cannot remove temp file {path}: {exc}") from exc
        return True

    def sync(self) -> None:
        fsync_dir(self.root)


def device_names_in_spec(content: bytes, *, claim_uid: str) -> list[str]:
    """DRA device names a spec of ours was written for (used to rebuild lost state)."""
    try:
        spec = json.loads(content)
        names = [str(d["name"]) for d in spec["devices"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise CdiError(f"CDI spec of claim {claim_uid} is not readable: {exc}") from exc
    prefix = f"{claim_uid}-"
    return sorted(n.removeprefix(prefix) for n in names if n.startswith(prefix))
