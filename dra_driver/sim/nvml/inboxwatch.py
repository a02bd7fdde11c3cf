"""Waiting for the simulated node's inbox file to change, without polling it: Linux inotify.

A real ``nvmlEventSetWait_v2`` waits in the C library and costs the agent nothing while no event
comes. The simulated one must also notice the faults other processes append to the inbox file
(health.py), and it used to look at the file every 20 ms while it waited: 50 wakes a second of
the health monitor's thread, measured at 0.85% of a CPU on an idle agent and taken from the
prepares under load (docs/benchmarks.md, "Ninth pass"). An :class:`InboxWatch` blocks in
``select`` on an inotify descriptor (the inbox changed or appeared) and an eventfd (this process
injected a fault: :meth:`InboxWatch.wake`), so a wait costs nothing until one of them happens.

Three libc calls through ctypes rather than a package: the standard library has no inotify, and
the simulated node is the only user. :func:`open_inbox_watch` answers None where inotify is not
there (another OS, no descriptors left, the inbox's directory missing); the caller then polls as
before.
"""

from __future__ import annotations

import ctypes
import os
import select
from pathlib import Path

# <sys/inotify.h>
IN_MODIFY = 0x00000002  # the file was written (an append) or truncated
IN_ATTRIB = 0x00000004
IN_MOVED_TO = 0x00000080  # a file was renamed into the directory
IN_CREATE = 0x00000100  # a file was created in the directory
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC

_FILE_EVENTS = IN_MODIFY | IN_ATTRIB
_DIRECTORY_EVENTS = IN_CREATE | IN_MOVED_TO  # not IN_MODIFY: the checkpoint's appends live here


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        init, add = libc.inotify_init1, libc.inotify_add_watch
    except (OSError, AttributeError):
        return None
    init.argtypes, init.restype = [ctypes.c_int], ctypes.c_int
    add.argtypes, add.restype = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32], ctypes.c_int
    return libc


_LIBC = _libc()


class InboxWatch:
    """One waiter's watch on the inbox file ``path``: :meth:`wait` returns when the file was
    written, created or replaced, when :meth:`wake` was called, or after the timeout. Owns two
    descriptors until :meth:`close`."""

    def __init__(self, path: Path, inotify_fd: int) -> None:
        self._path = os.fsencode(path)
        self._inotify = inotify_fd
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._watch_file()

    def _watch_file(self) -> None:
        """Watch the file itself (again: a new file after a replacement is a new inode). ENOENT
        (not there yet) is fine: the directory's watch tells when it appears."""
        assert _LIBC is not None
        _LIBC.inotify_add_watch(self._inotify, self._path, _FILE_EVENTS)

    def wait(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` for a change of the inbox or a :meth:`wake`; True when one
        came (the caller reads the inbox then, however recently it last did)."""
        ready, _, _ = select.select([self._inotify, self._wake], [], [], max(0.0, timeout_s))
        if not ready:
            return False
        if self._inotify in ready:
            _drain(self._inotify)
            self._watch_file()
        if self._wake in ready:
            _drain(self._wake)
        return True

    def wake(self) -> None:
        """Make a blocked (or the next) :meth:`wait` return: this process injected a fault."""
        os.eventfd_write(self._wake, 1)

    def close(self) -> None:
        for fd in (self._inotify, self._wake):
            os.close(fd)


def _drain(fd: int) -> None:
    """Read what is queued on a non-blocking descriptor (the events themselves do not matter:
    any change means "read the inbox")."""
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def open_inbox_watch(path: Path) -> InboxWatch | None:
    """A watch on the inbox ``path`` (its directory must exist), or None where inotify cannot
    be had (the caller polls the file instead)."""
    if _LIBC is None:
        return None
    fd = _LIBC.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
    if fd < 0:
        return None
    if _LIBC.inotify_add_watch(fd, os.fsencode(path.parent), _DIRECTORY_EVENTS) < 0:
        os.close(fd)
        return None
    try:
        return InboxWatch(path, fd)
    except OSError:
        os.close(fd)
        return None
