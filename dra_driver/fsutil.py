"""File-writing primitives shared by the CDI spec directory, the checkpoint, the CDI hook's
installer and the simulated node's state (pure OS calls)."""

from __future__ import annotations

import ctypes
import os
import secrets
import struct
from pathlib import Path

# statfs(2) f_type of the file systems that keep files in memory only: fsync has nothing to do
TMPFS_MAGIC = 0x01021994
RAMFS_MAGIC = 0x858458F6


def write_all(fd: int, data: bytes) -> None:
    """Write every byte of ``data`` to ``fd`` (``os.write`` may write fewer)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` (creations, renames, removals) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_file(path: Path, data: bytes, *, mode: int = 0o644, durable: bool = True) -> None:
    """Make ``path`` hold ``data``, atomically and durably: a temp file beside it (written,
    given ``mode``, fsync'd) renamed over it, then the directory fsync'd. A reader sees the old
    content or the new, never a part; on failure the temp file is removed and ``path`` is left
    as it was. Creates the directory if needed. ``durable=False`` leaves out both syncs: still
    atomic, and a crash of the process cannot lose it, only a power loss can."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        try:
            write_all(fd, data)
            os.fchmod(fd, mode)  # the umask may have taken bits away
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


def in_memory_fs(path: Path) -> bool:
    """Whether ``path`` is on a tmpfs or ramfs (like /run, where /var/run/cdi is on a node), on
    which fsync returns at once: nothing is written anywhere. False when it cannot be told
    (statfs failed): callers then treat the path as on a disk. os.statvfs has no f_type, so
    statfs(2) is called through ctypes; f_type is the first field, a C long, on Linux."""
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.statfs(os.fsencode(path), buf) != 0:
            return False
    except (OSError, AttributeError):
        return False
    (f_type,) = struct.unpack_from("l", buf)
    return f_type & 0xFFFFFFFF in (TMPFS_MAGIC, RAMFS_MAGIC)
