"""File-writing primitives shared by the CDI spec directory, the checkpoint, the CDI hook's
installer and the simulated node's state (pure OS calls).

:class:`FileCalls` (``OS_CALLS``) and :func:`held_calls`: the calls of a CDI spec's life
(create, write, rename, close, unlink) made the standard way, or through libc with the
interpreter lock held, for a directory in memory (a node's /run/cdi). Measured reason
(docs/benchmarks.md, "Fifth pass"): each ``os`` call lets the interpreter lock go, and with
prepares in flight on other threads every release wakes one of them and costs the caller a
wait to get it back; on a tmpfs, where none of these calls waits for a device (each is 2-13 us
of kernel time here), holding the lock through them took a prepare's temp file write from 105
to 59 us and its rename from 75 to 35 us of its thread's CPU at concurrency 16 (same run).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import secrets
import struct
from pathlib import Path

# statfs(2) f_type of the file systems that keep files in memory only: fsync has nothing to do
TMPFS_MAGIC = 0x01021994
RAMFS_MAGIC = 0x858458F6


class FileCalls:
    """The file system calls of a spec's life through the ``os`` module, whose every call lets
    the interpreter lock go (right where a call may wait for a disk). Errors are ``os``'s:
    OSError of the matching subclass (FileNotFoundError, FileExistsError, ...)."""

    def create(self, path: str, mode: int = 0o644) -> int:
        """Open a new file for writing (FileExistsError when ``path`` exists)."""
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)

    def write_all(self, fd: int, data: bytes) -> None:
        write_all(fd, data)

    def rename(self, src: str | Path, dst: str | Path) -> None:
        os.rename(src, dst)

    def close(self, fd: int) -> None:
        os.close(fd)

    def unlink(self, path: str | Path) -> None:
        os.unlink(path)


class _HeldFileCalls(FileCalls):
    """The same calls through libc loaded with ``ctypes.PyDLL``, which keeps the interpreter
    lock through the call: only for a file system in memory, where none of them can wait for
    a device. Interrupted calls are retried, as ``os`` does (PEP 475); errors are the
    ``os`` ones, naming the path."""

    def __init__(self) -> None:
        libc = ctypes.PyDLL(None, use_errno=True)
        self._open = libc.open
        self._open.argtypes = (ctypes.c_char_p, ctypes.c_int, ctypes.c_uint)
        self._open.restype = ctypes.c_int
        self._write = libc.write
        self._write.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t)
        self._write.restype = ctypes.c_ssize_t
        self._rename = libc.rename
        self._rename.argtypes = (ctypes.c_char_p, ctypes.c_char_p)
        self._rename.restype = ctypes.c_int
        self._close = libc.close
        self._close.argtypes = (ctypes.c_int,)
        self._close.restype = ctypes.c_int
        self._unlink = libc.unlink
        self._unlink.argtypes = (ctypes.c_char_p,)
        self._unlink.restype = ctypes.c_int

    @staticmethod
    def _error(path: str | Path | None = None, dst: str | Path | None = None) -> OSError:
        """The error ``os`` raises: of errno's subclass, naming the paths as strings."""
        code = ctypes.get_errno()
        return OSError(
            code,
            os.strerror(code),
            None if path is None else os.fspath(path),
            None,
            None if dst is None else os.fspath(dst),
        )

    def create(self, path: str, mode: int = 0o644) -> int:
        encoded = os.fsencode(path)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        while (fd := self._open(encoded, flags, mode)) < 0:
            if ctypes.get_errno() != errno.EINTR:
                raise self._error(path)
        return int(fd)

    def write_all(self, fd: int, data: bytes) -> None:
        while data:
            written = self._write(fd, data, len(data))
            if written < 0:
                if ctypes.get_errno() == errno.EINTR:
                    continue
                raise self._error()
            data = data[written:]

    def rename(self, src: str | Path, dst: str | Path) -> None:
        while self._rename(os.fsencode(src), os.fsencode(dst)) != 0:
            if ctypes.get_errno() != errno.EINTR:
                raise self._error(src, dst)

    def close(self, fd: int) -> None:
        # Linux frees the descriptor even when close(2) is interrupted: never retried
        if self._close(fd) != 0:
            raise self._error()

    def unlink(self, path: str | Path) -> None:
        while self._unlink(os.fsencode(path)) != 0:
            if ctypes.get_errno() != errno.EINTR:
                raise self._error(path)


OS_CALLS = FileCalls()
"""The calls for a directory on a disk (or one whose kind is not known)."""


@functools.cache
def held_calls() -> FileCalls:
    """The calls for a directory in memory: with the interpreter lock held (libc through
    ctypes; one handle for the process), or the ``os`` ones where libc cannot be loaded so."""
    try:
        return _HeldFileCalls()
    except (OSError, AttributeError):
        return OS_CALLS


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
