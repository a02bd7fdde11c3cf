"""File-writing primitives shared by the CDI spec directory, the checkpoint, the CDI hook's
installer and the simulated node's state (pure OS calls)."""

from __future__ import annotations

import os
import secrets
from pathlib import Path


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
