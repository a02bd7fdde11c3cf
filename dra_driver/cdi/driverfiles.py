"""What of the NVIDIA driver install a container needs, found once at start. Pure after the scan.

First step of the CDI side of the flow: the plugin calls :func:`find_driver_files` once at start
(``CONTAINER_DRIVER_ROOT``, named in specs as ``NVIDIA_DRIVER_ROOT``); the resulting
:class:`DriverFiles` says which device nodes, libraries, tools and other files each driver
capability (NVIDIA_DRIVER_CAPABILITIES) gives a container, and :meth:`DriverFiles.edits` turns
them into the container edits every claim with those capabilities shares. spec.py builds a
claim's spec from them; building a spec afterwards does no I/O.

The edits make a CUDA container work without the NVIDIA container runtime: the control nodes,
the driver's user-space libraries and tools mounted read-only (also under the sonames the CUDA
runtime loads, by the CDI hook or as extra mounts), and ``NVIDIA_VISIBLE_DEVICES=void`` so that
an NVIDIA runtime, if installed, does not inject devices a second time. Missing files are not an
error.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from dra_driver.cdi import devnodes
from dra_driver.cdi.driverpaths import (
    MAX_SYMLINK_HOPS,
    find_tool,
    library_dirs,
    resolve_in_root,
)
from dra_driver.errors import CdiError

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
MODESET_NODE = "/dev/nvidia-modeset"
DEVICE_NODES_BY_CAPABILITY: dict[str, tuple[str, ...]] = {
    "graphics": (MODESET_NODE,),
    "display": (MODESET_NODE,),
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
NO_SECOND_INJECTION_ENV = "NVIDIA_VISIBLE_DEVICES=void"
HOOK_STAGE = "createContainer"

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
    # The dev root where this process sees it, where missing nodes are made (devnodes.py);
    # None: files not scanned from a driver root, nothing is made.
    dev_root_here: Path | None = None
    proc_root: Path = Path("/proc")  # the kernel's facts for making nodes (devnodes.py)
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

    def renumbered_from(self, other: DriverFiles) -> bool:
        """Whether these files are ``other`` but for the numbers a driver reload may change
        (the MIG capability minors, read again): the edits every spec shares are the same."""
        return replace(self, mig_cap_minors=other.mig_cap_minors) == other

    def edits(self, capabilities: frozenset[str]) -> dict[str, Any]:
        """The container edits a claim with ``capabilities`` shares with every such claim."""
        groups = [BASE, *sorted(capabilities)]
        nodes = self.node_paths(capabilities)
        mounts: dict[str, Mount] = {}
        links: dict[str, Link] = {}
        for group in groups:
            for m in self.mounts_by_capability.get(group, ()):
                mounts.setdefault(m.container_path, m)
            for link in self.links_by_capability.get(group, ()):
                links.setdefault(link.link, link)
        edits: dict[str, Any] = {
            "env": [NO_SECOND_INJECTION_ENV],
            "deviceNodes": [device_node_json(self.node(p)) for p in nodes],
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

    def ensure_claim_nodes(
        self, paths: Iterable[str], capabilities: frozenset[str], *, shared: bool = True
    ) -> None:
        """Make every device node missing that a claim's spec will name (devnodes.py): its
        devices' own ``paths`` and, with ``shared``, those the ``capabilities`` give every claim
        (the caller may check those once for many claims). Nothing when these files came
        without the dev root's place here (``dev_root_here`` None: not scanned from a driver
        root). Raises CdiError naming each node that cannot be made."""
        if self.dev_root_here is None:
            return
        wanted = list(paths)
        if shared:
            wanted += self.node_paths(capabilities)
        devnodes.ensure_device_nodes(wanted, dev_root=self.dev_root_here, proc_root=self.proc_root)

    def present_nodes(self, paths: Iterable[str]) -> list[str]:
        """Those of ``paths`` (container paths) whose node exists now; none when these files
        came without the dev root's place here (nothing is made for them either)."""
        if self.dev_root_here is None:
            return []
        return devnodes.present(paths, dev_root=self.dev_root_here)

    def node_paths(self, capabilities: frozenset[str]) -> list[str]:
        """The device nodes every claim with ``capabilities`` gets (container paths)."""
        nodes = list(CONTROL_DEVICE_NODES)
        for group in [BASE, *sorted(capabilities)]:
            nodes.extend(n for n in self.nodes_by_capability.get(group, ()) if n not in nodes)
        return nodes

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
    for _ in range(MAX_SYMLINK_HOPS):
        if target in files:
            return files[target]
        nxt = links.get(f"{CONTAINER_LIB_DIR}/{target}")
        if nxt is None:
            return None
        target = nxt.target
    return None


def device_node_json(node: DeviceNode) -> dict[str, str]:
    """A device node as CDI JSON (``hostPath`` only where it differs from ``path``)."""
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
    homes: list[Path] = []  # where the driver's libraries really are (links followed)
    for directory in library_dirs(driver_root):
        for capability, libs in LIBRARIES_BY_CAPABILITY.items():
            for lib in libs:
                found = _library_files(driver_root, directory, lib, driver_version)
                if found is None:
                    continue
                real, lib_links = found
                if real.parent not in homes:
                    homes.append(real.parent)
                group = mounts.setdefault(capability, {})
                container_path = f"{CONTAINER_LIB_DIR}/{real.name}"
                if container_path in group:
                    continue  # the same library in a second directory (lib and lib64)
                group[container_path] = Mount(host(real), container_path)
                for link in lib_links:
                    links.setdefault(capability, {}).setdefault(link.link, link)
    for capability, names in BINARIES_BY_CAPABILITY.items():
        for name in names:
            tool = find_tool(driver_root, name, homes)
            if tool is not None:
                container_path = f"/usr/bin/{name}"
                mounts.setdefault(capability, {})[container_path] = Mount(
                    host(tool), container_path
                )
    for capability, rels in FILES_BY_CAPABILITY.items():
        for rel in rels:
            for real, container_path in _matching_files(driver_root, rel, driver_version):
                mounts.setdefault(capability, {}).setdefault(
                    container_path, Mount(host(real), container_path)
                )
    for rel in _BASE_SOCKETS:
        sock = resolve_in_root(driver_root, driver_root / rel)
        if sock is not None and sock.is_socket():
            mounts.setdefault(BASE, {})["/" + rel] = Mount(host(sock), "/" + rel)
    if driver_version:
        firmware = resolve_in_root(driver_root, driver_root / _FIRMWARE_DIR / driver_version)
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
    # /dev/nvidia-modeset also when its module is loaded: prepare makes the node (devnodes.py)
    modeset = devnodes.module_loaded(_read_or_empty(proc_root / "modules"), "nvidia_modeset")
    nodes = {
        capability: tuple(
            n
            for n in names
            if _is_node(dev_seen_at / n.lstrip("/")) or (modeset and n == MODESET_NODE)
        )
        for capability, names in DEVICE_NODES_BY_CAPABILITY.items()
    }
    return DriverFiles(
        dev_root=dev_root,
        dev_root_here=dev_seen_at,
        proc_root=proc_root,
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


def _read_or_empty(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


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
        resolved = resolve_in_root(driver_root, directory / name)
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
        real = resolve_in_root(driver_root, driver_root / name)
        if real is not None and real.is_file():
            return [(real, "/" + name)]
    return []
