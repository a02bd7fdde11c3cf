"""The driver-files part of the check: the roots a driver is installed under, the agent's scan of
each, and the CDI spec it would write for one GPU with each set of driver capabilities.

Place in the flow: the CDI end (cdi/driverfiles.py scans, cdi/spec.py encodes) run exactly as
the kubelet plugin runs them at start, on this machine's real install, and what each host path
is (a driver whose ``nvidia-smi`` on the PATH is a wrapper script shows it here). Read-only: it
only lists, stats and reads the first bytes of files. Every host path a spec names (mounts,
device nodes, the hook) must exist; one that does not is a spec a runtime would refuse.
"""

from __future__ import annotations

import dataclasses
import os
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from dra_driver import cdi
from dra_driver.cdi import hook as cdihook
from dra_driver.gpus import nvml

CANDIDATE_ROOTS = (Path("/"), Path("/usr/local/nvidia"), Path("/run/nvidia/driver"))
"""Where a driver may be installed: the host, the device plugin's mount, the GPU operator's."""

CLAIM_UID = "00000000-0000-4000-8000-00000000c4ec"  # a fixed, valid claim UID for the specs
VENDOR = "k8s.gpu.nvidia.com"
CAPABILITY_SETS: tuple[frozenset[str], ...] = (
    cdi.DEFAULT_CAPABILITIES,
    *(cdi.DEFAULT_CAPABILITIES | {extra} for extra in ("video", "graphics", "display")),
    frozenset(cdi.DRIVER_CAPABILITIES),
)
"""Every capability set the check writes a spec for: the default, each extra, and all."""


def driver_roots(extra: Iterable[Path] = ()) -> list[Path]:
    """The roots (given first, then :data:`CANDIDATE_ROOTS`) that hold ``libnvidia-ml.so.1``."""
    found: list[Path] = []
    for root in (*extra, *CANDIDATE_ROOTS):
        if root not in found and any(p.exists() for p in nvml.library_candidates(root)):
            found.append(root)
    return found


def scan(root: Path, *, driver_version: str | None, proc_root: Path) -> cdi.DriverFiles:
    """The agent's scan of ``root``, naming the packaged CDI hook (when built) as the agent
    would name its installed copy."""
    files = cdi.find_driver_files(
        driver_root=root, driver_version=driver_version, proc_root=proc_root
    )
    hook = cdihook.PACKAGED_BINARY
    return dataclasses.replace(files, hook_path=str(hook) if hook.is_file() else None)


def gpu_spec(files: cdi.DriverFiles, *, minor: int, capabilities: frozenset[str]) -> dict[str, Any]:
    """The spec the agent would write for a claim of ``gpu-<minor>`` with ``capabilities``."""
    encoder = cdi.ClaimSpecEncoder(vendor=VENDOR, files=files)
    device = cdi.ClaimDevice(name=f"gpu-{minor}", nodes=cdi.gpu_nodes(files, minor=minor))
    return encoder.spec(CLAIM_UID, [device], capabilities)


def library_view(files: cdi.DriverFiles, directory: Path) -> Path:
    """``directory`` (created) made to hold what a container's library directory holds from
    the spec: a link to each driver library found and the links the hook makes, so a process on
    the host loads the driver from the driver root alone (``LD_LIBRARY_PATH``), nothing else
    of the root's library directories."""
    directory.mkdir(parents=True)
    for mount in files.mounts:
        container = Path(mount.container_path)
        if str(container.parent) == cdi.CONTAINER_LIB_DIR:
            (directory / container.name).symlink_to(mount.host_path)
    for links in files.links_by_capability.values():
        for link in links:
            target = directory / Path(link.link).name
            if not target.is_symlink():
                target.symlink_to(link.target)
    return directory


def host_paths(spec: Mapping[str, Any]) -> list[str]:
    """Every host path ``spec`` names: mounts, device nodes and hooks, of the spec and its
    devices, in order, without repeats."""
    edits = [spec.get("containerEdits", {})]
    edits += [d.get("containerEdits", {}) for d in spec.get("devices", [])]
    paths: list[str] = []
    for edit in edits:
        paths += [m["hostPath"] for m in edit.get("mounts", [])]
        paths += [n.get("hostPath", n["path"]) for n in edit.get("deviceNodes", [])]
        paths += [h["path"] for h in edit.get("hooks", [])]
    return list(dict.fromkeys(paths))


def describe(path: Path) -> str:
    """What the host path is: ``link -> <target> (<what that is>)``, ``character device``,
    ``directory``, ``socket``, ``ELF``, ``script (#!<interpreter>)``, ``file`` or ``missing``."""
    if path.is_symlink():
        return f"link -> {os.readlink(path)} ({describe(path.resolve())})"
    try:
        mode = path.stat().st_mode
    except OSError:
        return "missing"
    if stat.S_ISCHR(mode):
        return "character device"
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISSOCK(mode):
        return "socket"
    kind = cdi.file_kind(path)
    if kind == "script":
        with path.open("rb") as f:
            first = f.readline(200).decode(errors="replace").strip()
        return f"script ({first})"
    return kind


def scripts_mounted(spec: Mapping[str, Any]) -> dict[str, str]:
    """The programs ``spec`` mounts (under ``/usr/bin``) whose host file is a script, container
    path -> host path: a container runs one only with its interpreter (a minimal image has no
    ``/bin/sh``)."""
    edits = [spec.get("containerEdits", {})]
    edits += [d.get("containerEdits", {}) for d in spec.get("devices", [])]
    return {
        m["containerPath"]: m["hostPath"]
        for edit in edits
        for m in edit.get("mounts", [])
        if m["containerPath"].startswith("/usr/bin/")
        and cdi.file_kind(Path(m["hostPath"])) == "script"
    }


def driver_files_section(
    roots: Iterable[Path], *, driver_version: str | None, minor: int, proc_root: Path
) -> dict[str, Any]:
    """Per driver root: what the scan found by capability; what each host path the specs
    name is (:func:`describe`: ELF, script, link, ...) and which mounted programs are scripts;
    and per capability set the spec for ``gpu-<minor>`` with the host paths it names that do
    not exist."""
    section: dict[str, Any] = {}
    for root in roots:
        files = scan(root, driver_version=driver_version, proc_root=proc_root)
        specs = {}
        kinds: dict[str, str] = {}
        for capabilities in CAPABILITY_SETS:
            spec = gpu_spec(files, minor=minor, capabilities=capabilities)
            paths = host_paths(spec)
            missing = [p for p in paths if not Path(p).exists()]
            specs[",".join(sorted(capabilities))] = {"spec": spec, "missing_host_paths": missing}
            kinds.update((p, describe(Path(p))) for p in paths if p not in kinds)
        everything = gpu_spec(files, minor=minor, capabilities=CAPABILITY_SETS[-1])
        section[str(root)] = {
            "dev_root": str(files.dev_root),
            "hook": files.hook_path,
            "mounts": {
                c: [m.host_path for m in ms] for c, ms in files.mounts_by_capability.items()
            },
            "links": {
                c: [f"{link.link} -> {link.target}" for link in ls]
                for c, ls in files.links_by_capability.items()
            },
            "device_nodes": dict(files.nodes_by_capability),
            "mig_cap_minors": len(files.mig_cap_minors),
            "host_paths": kinds,
            "scripts": sorted(scripts_mounted(everything).values()),
            "specs": specs,
        }
    return section


__all__ = [
    "CANDIDATE_ROOTS",
    "CAPABILITY_SETS",
    "describe",
    "driver_files_section",
    "driver_roots",
    "gpu_spec",
    "host_paths",
    "library_view",
    "scan",
    "scripts_mounted",
]
