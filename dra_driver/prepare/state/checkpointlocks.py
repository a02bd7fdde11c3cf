"""Per-claim locks that hold across threads and processes (``claims.lock`` in the plugin data dir).

Place in the flow: the preparer holds a claim's lock for the whole of its prepare or unprepare
(and reconcile tries it), so the same claim is never prepared and unprepared at once, even by
the two plugin instances of a rolling update. The checkpoint's own file lock (checkpointfiles.py)
is separate: it is held only for one read-modify-write of the checkpoint files.
"""

from __future__ import annotations

import fcntl
import os
import threading
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_LOCK_STRIPES = 4096


class ClaimLocks:
    """Mutual exclusion per claim UID, across threads of this process and across processes.

    A UID maps to one of 4096 stripes: a thread lock (threads of one process share POSIX
    record locks, so those alone would not exclude each other) plus a one-byte ``lockf`` range
    in ``claims.lock``. Two unrelated claims rarely share a stripe; when they do they merely
    wait for each other. Lock files never pile up, unlike one file per claim.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._threads = [threading.Lock() for _ in range(_LOCK_STRIPES)]
        self._fd = -1

    def open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    @staticmethod
    def _stripe(uid: str) -> int:
        return zlib.crc32(uid.encode()) % _LOCK_STRIPES

    @contextmanager
    def hold(self, uid: str) -> Iterator[None]:
        """Wait for and hold the claim's lock."""
        stripe = self._stripe(uid)
        with self._threads[stripe]:
            fcntl.lockf(self._fd, fcntl.LOCK_EX, 1, stripe)
            try:
                yield
            finally:
                fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, stripe)

    @contextmanager
    def try_hold(self, uid: str) -> Iterator[bool]:
        """Hold the claim's lock if nobody does; yields False (and holds nothing) otherwise."""
        stripe = self._stripe(uid)
        thread_lock = self._threads[stripe]
        if not thread_lock.acquire(blocking=False):
            yield False
            return
        try:
            try:
                fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, stripe)
            except OSError:
                yield False
                return
            try:
                yield True
            finally:
                fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, stripe)
        finally:
            thread_lock.release()
