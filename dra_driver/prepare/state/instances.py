"""Whether this plugin instance is the only one using the node's prepare state (``solo``).

Place in the flow: the node state (nodestate.py) opens an :class:`Instances` before it touches
the checkpoint, the specs or the devices; the claim locks (checkpointlocks.py) and the
checkpoint (checkpoint.py) ask it, per operation, whether another instance can be at work
(:meth:`Instances.op`). Nearly always one agent runs per node: then a prepare takes no
cross-process claim lock, and the checkpoint neither takes its file lock nor looks for another
process's writes, about eight system calls per prepare and unprepare, each of which handed the
interpreter lock to another thread (docs/benchmarks.md "Fourth pass"). During a rolling update
the chart runs two instances side by side; both then take every lock, as before.

How, with open file description locks (``F_OFD_SETLK``) on two bytes of ``instances.lock`` in
the plugin data dir (an instance's locks go with its file, so two instances in one process, as
in tests, exclude each other as two processes do, and a killed instance's locks go with it):

- byte 0, *arrival*: every instance holds a read lock on it from its start.
- byte 1: every instance holds a read lock on it, except a solo one, which holds the write lock.

A starting instance takes byte 0, then waits for a read lock on byte 1, which it gets once no
instance is solo; only then does :meth:`Instances.open` return. An instance becomes solo by
turning its read lock on byte 1 into the write lock without waiting (refused while any other
instance holds byte 1) and then finding no other holder of byte 0 (one that arrived and waits).
The solo instance looks for an arrival every ``check_s``: then operations that start from
that moment take the locks, it waits for the operations already in flight, and turns its write
lock back into a read lock, which lets the newcomer in. An instance that shares looks every
``check_s`` whether it is alone again; each time it becomes solo ``generation`` grows, so that
the checkpoint catches up once with what the other instance wrote (:meth:`Checkpoint.get`).

Never solo while the checkpoint is shared with an earlier release's agent, which knows nothing
of this file (switchover.checkpoint_names): :meth:`Instances.allow_solo` is called once the
files are ours alone.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import struct
import threading
import time
from contextlib import AbstractContextManager
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_CHECK_S = 1.0  # how often a solo instance looks for an arrival (and a sharing one for
# being alone again): a newcomer waits for at most this before it starts
_WAIT_LOG_S = 10.0  # a newcomer that still waits says so this often

_ARRIVAL, _SOLO = 0, 1  # the two bytes
# struct flock (fcntl(2)): l_type, l_whence, l_start, l_len, l_pid (0 for OFD locks)
_FLOCK = struct.Struct("hhqqi4x")


class Instances:
    """This instance's place among the plugin instances sharing one plugin data dir."""

    def __init__(self, path: Path, *, check_s: float = DEFAULT_CHECK_S) -> None:
        self.path = path
        self.check_s = check_s
        self._fd = -1
        self._lock = threading.Lock()
        self._transition = threading.Lock()  # one _try_solo or _share at a time
        self._solo = False
        self._solo_ops = 0  # operations in flight that started while solo
        self._allowed = False
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None
        self.generation = 0  # times this instance became solo

    # -- lifecycle -------------------------------------------------------------------------

    def open(self) -> None:
        """Arrive, and wait until no instance is solo (at most about ``check_s`` while the
        solo one is alive). Shares until :meth:`allow_solo`."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            self._set(fcntl.F_RDLCK, _ARRIVAL)
        except OSError as exc:  # no open file description locks here: never solo
            log.warning(
                "cannot tell whether another plugin instance runs; taking every lock",
                extra={"path": str(self.path), "error": str(exc)},
            )
            os.close(self._fd)
            self._fd = -1
            return
        started = time.monotonic()
        said = started
        while not self._set(fcntl.F_RDLCK, _SOLO):
            if time.monotonic() - said >= _WAIT_LOG_S:
                said = time.monotonic()
                log.warning(
                    "waiting for the other plugin instance on this node to share its state",
                    extra={"path": str(self.path), "waited_s": round(said - started)},
                )
            time.sleep(min(0.02, self.check_s))
        self._watcher = threading.Thread(target=self._watch, name="instances", daemon=True)
        self._watcher.start()

    def allow_solo(self) -> None:
        """The state is ours alone to share with instances of this release: become solo now
        if no other instance is there, and whenever that is so again."""
        self._allowed = True
        try:
            self._try_solo()
        except OSError as exc:
            log.warning(
                "cannot tell whether another plugin instance runs; taking every lock",
                extra={"path": str(self.path), "error": str(exc)},
            )
            self._give_up()

    def close(self) -> None:
        """Leave (our locks go with the file). Safe to call twice or before open()."""
        self._stopping.set()
        if self._watcher is not None:
            self._watcher.join()
            self._watcher = None
        with self._lock:
            self._solo = False
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    @property
    def solo(self) -> bool:
        return self._solo

    # -- operations --------------------------------------------------------------------------

    def op(self) -> AbstractContextManager[bool]:
        """One operation on the shared state: ``with instances.op() as alone``, ``alone`` True
        when no other instance can be at work until it ends (the locks against other processes
        may be skipped). A class, not a generator: every prepare enters three."""
        return _Op(self)

    # -- the watcher -------------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._stopping.wait(self.check_s):
            try:
                if self._solo:
                    if self._arrived():
                        self._share()
                else:
                    self._try_solo()
            except Exception as exc:  # noqa: BLE001 - share rather than keep a newcomer out
                log.warning(
                    "cannot tell whether another plugin instance runs; taking every lock",
                    extra={"path": str(self.path), "error": str(exc)},
                )
                self._give_up()
                return

    def _give_up(self) -> None:
        """Never solo again, and out of the newcomers' way: our locks go with the file."""
        with self._transition:
            self._allowed = False
            with self._lock:
                self._solo = False
            self._drain()
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def _try_solo(self) -> None:
        with self._transition:
            self._try_solo_now()

    def _try_solo_now(self) -> None:
        if not self._allowed or self._solo or self._stopping.is_set() or self._fd < 0:
            return
        if not self._set(fcntl.F_WRLCK, _SOLO):
            return  # another instance shares
        if self._arrived():  # one waits for byte 1: let it in
            self._set(fcntl.F_RDLCK, _SOLO)
            return
        with self._lock:
            self.generation += 1
            self._solo = True
        log.info("the only plugin instance on this node: no locks against other instances")

    def _share(self) -> None:
        """Stop being solo: new operations take the locks; once those in flight are done,
        the newcomer gets byte 1."""
        with self._transition:
            self._share_now()

    def _share_now(self) -> None:
        with self._lock:
            if not self._solo:
                return
            self._solo = False
        self._drain()
        if self._fd >= 0:
            self._set(fcntl.F_RDLCK, _SOLO)
        log.info("another plugin instance arrived on this node: sharing the state with it")

    def _drain(self) -> None:
        """Wait for the operations that started while solo."""
        while True:
            with self._lock:
                if not self._solo_ops:
                    return
            time.sleep(0.001)

    def _arrived(self) -> bool:
        """Whether another instance holds byte 0 (our own lock never conflicts with us)."""
        query = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, _ARRIVAL, 1, 0)
        answer = fcntl.fcntl(self._fd, fcntl.F_OFD_GETLK, query)
        return bool(_FLOCK.unpack(answer)[0] != fcntl.F_UNLCK)

    def _set(self, kind: int, byte: int) -> bool:
        """Lock ``byte`` as ``kind`` (or convert our lock on it) without waiting; False when
        another instance's lock refuses it."""
        try:
            fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, _FLOCK.pack(kind, os.SEEK_SET, byte, 1, 0))
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                return False
            raise
        return True


class _Op:
    """What :meth:`Instances.op` returns: a solo operation is counted while it runs, so that
    the instance shares only once those in flight are done."""

    __slots__ = ("_alone", "_instances")

    def __init__(self, instances: Instances) -> None:
        self._instances = instances
        self._alone = False

    def __enter__(self) -> bool:
        instances = self._instances
        with instances._lock:
            alone = self._alone = instances._solo
            if alone:
                instances._solo_ops += 1
        return alone

    def __exit__(self, *exc: object) -> None:
        if self._alone:
            instances = self._instances
            with instances._lock:
                instances._solo_ops -= 1
