"""Where a driver root's files are: paths and links followed as if the root were ``/``, its
library directories, and its programs (the real one where the root's PATH has a wrapper script).

The path side of the CDI end of the flow: driverfiles.py scans a root with these at the agent's
start, and sharing/ finds the programs it runs (``nvidia-smi``, ``nvidia-cuda-mps-control``)
with :func:`find_driver_tool`. Reads the file system only (links, directory listings, a file's
first bytes).
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

_BIN_DIRS = ("usr/bin", "usr/sbin", "bin", "sbin", "usr/local/bin")
_LIB_DIRS_BY_ARCH = {
    "x86_64": ("usr/lib/x86_64-linux-gnu", "lib/x86_64-linux-gnu", "usr/lib64", "lib64"),
    "aarch64": ("usr/lib/aarch64-linux-gnu", "lib/aarch64-linux-gnu", "usr/lib64", "lib64"),
}
_COMMON_LIB_DIRS = ("usr/lib", "lib")
MAX_SYMLINK_HOPS = 16


def find_driver_tool(driver_root: Path, name: str) -> Path | None:
    """Where this process finds the driver's program ``name`` (``nvidia-smi``) under
    ``driver_root`` (its own view: ``CONTAINER_DRIVER_ROOT``), links followed inside the root;
    None when the install has none. Where the one on the root's PATH is a script wrapping the
    driver's (as ``/usr/bin/nvidia-smi`` on a node whose driver lives in ``/usr/local/nvidia``),
    the program beside the driver's libraries (``<lib dir>/../bin/<name>``) is preferred."""
    nvml_library = find_driver_library(driver_root, "libnvidia-ml.so.1")
    return find_tool(driver_root, name, [] if nvml_library is None else [nvml_library.parent])


def file_kind(path: Path) -> str:
    """What the file at ``path`` (links followed) is by its first bytes: ``"ELF"``, ``"script"``
    (``#!``), ``"file"`` (anything else), or ``"missing"``."""
    try:
        with path.open("rb") as f:
            head = f.read(4)
    except OSError:
        return "missing"
    if head == b"\x7fELF":
        return "ELF"
    return "script" if head.startswith(b"#!") else "file"


def find_tool(driver_root: Path, name: str, homes: list[Path]) -> Path | None:
    """``name`` on the root's PATH directories, or, when that is a script (a wrapper), the ELF
    program of that name in a ``bin`` directory beside ``homes`` (the driver's library
    directories), which a container without a shell can run."""
    found = None
    for rel in _BIN_DIRS:
        tool = resolve_in_root(driver_root, driver_root / rel / name)
        if tool is not None and tool.is_file():
            found = tool
            break
    if found is not None and file_kind(found) != "script":
        return found
    for home in homes:
        beside = resolve_in_root(driver_root, home.parent / "bin" / name)
        if beside is not None and beside.is_file() and file_kind(beside) == "ELF":
            return beside
    return found


def find_driver_library(driver_root: Path, soname: str) -> Path | None:
    """The file ``soname`` (``libnvidia-ml.so.1``) names in the first library directory under
    ``driver_root`` that has it, links followed inside the root; None when none has it."""
    for directory in library_dirs(driver_root):
        real = resolve_in_root(driver_root, directory / soname)
        if real is not None and real.is_file():
            return real
    return None


def library_dirs(driver_root: Path) -> list[Path]:
    rels = _LIB_DIRS_BY_ARCH.get(platform.machine(), ()) + _COMMON_LIB_DIRS
    seen: set[Path] = set()
    dirs: list[Path] = []
    for rel in rels:
        directory = driver_root / rel
        real = resolve_in_root(driver_root, directory)
        # merged-/usr systems make /lib a link to /usr/lib: scan each directory once
        if real is None or not real.is_dir() or real in seen:
            continue
        seen.add(real)
        dirs.append(directory)
    return dirs


def resolve_in_root(driver_root: Path, path: Path) -> Path | None:
    """Follow symlinks of ``path`` as if ``driver_root`` were ``/``; None if it leaves the root.

    Absolute link targets in a driver container's tree are relative to that tree, not to our
    root, so ``Path.resolve`` would look in the wrong place.
    """
    current = path
    for _ in range(MAX_SYMLINK_HOPS):
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
            if hops > MAX_SYMLINK_HOPS:
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


__all__ = [
    "MAX_SYMLINK_HOPS",
    "file_kind",
    "find_driver_library",
    "find_driver_tool",
    "find_tool",
    "library_dirs",
    "resolve_in_root",
]
