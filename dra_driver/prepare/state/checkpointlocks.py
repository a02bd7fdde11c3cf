"""Per-claim locks that hold across threads and processes (``claims.lock`` in the plugin data dir).

Place in the flow: the preparer holds a claim's lock for the whole of its prepare or unprepare
(and reconcile tries it), so the same claim is never prepared and unprepared at once, even by
the two plugin instances of a rolling update. The checkpoint's own file lock (checkpointfiles.py)
is separate: it is held only for one read-modify-write of the checkpoint files. While this is
the only plugin instance (instances.py: no other can start work until it says so), only the
thread lock is taken.
"""

from __future__ import annotations

import fcntl
import os
import threading
import zlib
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path

from dra_driver.prepare.state.instances import Instances

_LOCK_STRIPES = 4096


class ClaimLocks:
    """Mutual exclusion per claim UID, across threads of this process and across processes.

    A UID maps to one of 4096 stripes: a thread lock (threads of one process share POSIX
    record locks, so those alone would not exclude each other) plus a one-byte ``lockf`` range
    in ``claims.lock``. Two unrelated claims rarely share a stripe; when they do they merely
    wait for each other. Lock files never pile up, unlike one file per claim. A stripe's thread
    lock exists only while a thread holds or waits for it (4,096 standing locks were 384 KiB
    of the agent's memory, for the few claims ever in flight at once).
    """

    def __init__(self, path: Path, *, instances: Instances | None = None) -> None:
        self.path = path
        # while this is the only plugin instance (instances.py), no process can want a
        # claim's lock but ours: the thread lock alone excludes, the lockf pair is skipped
        self._instances = instances
        # stripe -> its thread lock and how many threads hold or wait for it
        self._threads: dict[int, _StripeLock] = {}
        self._guard = threading.Lock()
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

    def hold(self, uid: str) -> AbstractContextManager[None]:
        """``with locks.hold(uid):`` waits for and holds the claim's lock. (A class, not a
        generator: every prepare and unprepare takes one.)"""
        return _Hold(self, uid)

    @contextmanager
    def try_hold(self, uid: str, *, holding: str | None = None) -> Iterator[bool]:
        """Hold the claim's lock if nobody does; yields False (and holds nothing) otherwise.

        ``holding``: a claim whose lock the caller holds already. A ``uid`` on its stripe is
        held by the caller too: yields True and takes nothing (taking the stripe's thread lock
        again would find it busy, by ourselves; unlocking its byte in the file would let go of
        the caller's hold)."""
        stripe = self._stripe(uid)
        if holding is not None and self._stripe(holding) == stripe:
            yield True
            return
        entry = self._use(stripe)
        try:
            if not entry.lock.acquire(blocking=False):
                yield False
                return
            try:
                with self._op() as alone:
                    if alone:
                        yield True
                        return
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
                entry.lock.release()
        finally:
            self._done_with(stripe, entry)

    def _op(self) -> AbstractContextManager[bool]:
        return self._instances.op() if self._instances is not None else nullcontext(False)

    def _use(self, stripe: int) -> _StripeLock:
        """The stripe's thread lock (not acquired), made for the first thread that asks; hand
        it back with :meth:`_done_with`."""
        with self._guard:
            entry = self._threads.get(stripe)
            if entry is None:
                entry = self._threads[stripe] = _StripeLock(threading.Lock())
            entry.users += 1
        return entry

    def _done_with(self, stripe: int, entry: _StripeLock) -> None:
        """Dropped after the last thread that held or waited for it is done with it."""
        with self._guard:
            entry.users -= 1
            if not entry.users:
                del self._threads[stripe]


class _StripeLock:
    __slots__ = ("lock", "users")

    def __init__(self, lock: threading.Lock) -> None:
        self.lock = lock
        self.users = 0


class _Hold:
    """One hold of a claim's lock (:meth:`ClaimLocks.hold`): the stripe's thread lock, then,
    unless this instance is solo, its byte in the lock file; let go in the reverse order."""

    __slots__ = ("_entry", "_locked", "_locks", "_op", "_stripe", "_uid")

    def __init__(self, locks: ClaimLocks, uid: str) -> None:
        self._locks = locks
        self._uid = uid

    def __enter__(self) -> None:
        locks = self._locks
        stripe = self._stripe = locks._stripe(self._uid)
        entry = self._entry = locks._use(stripe)
        try:
            entry.lock.acquire()
            try:
                op = self._op = locks._op()
                alone = op.__enter__()
                try:
                    if not alone:
                        fcntl.lockf(locks._fd, fcntl.LOCK_EX, 1, stripe)
                except BaseException:
                    op.__exit__(None, None, None)
                    raise
            except BaseException:
                entry.lock.release()
                raise
        except BaseException:
            locks._done_with(stripe, entry)
            raise
        self._locked = not alone

    def __exit__(self, *exc: object) -> None:
        try:
            try:
                try:
                    if self._locked:
                        fcntl.lockf(self._locks._fd, fcntl.LOCK_UN, 1, self._stripe)
                finally:
                    self._op.__exit__(None, None, None)
            finally:
                self._entry.lock.release()
        finally:
            self._locks._done_with(self._stripe, self._entry)
