"""The checkpoint's files: snapshot, journal and lock, and what this process last saw of them.

Place in the flow: checkpoint.py's :class:`~dra_driver.prepare.state.checkpoint.Checkpoint`
decides what to write and when (its claim table, group commit, reload); it reads and writes
through :class:`CheckpointFiles`. The bytes are checkpointformat.py's. Three files in the plugin
data dir, named after the snapshot's path: ``checkpoint.json`` (the snapshot),
``checkpoint.journal`` (one line per commit) and ``checkpoint.lock``.

- The snapshot is written atomically (temp file, fsync, rename, fsync of the directory); an
  append is one journal line and, when durable, one fdatasync of it. The append costs one small
  fdatasync where rewriting the snapshot costs a new file, two fsyncs and a rename: that is most
  of a prepare's disk time, and why there is a journal at all.
- ``checkpoint.lock`` (flock) is held for every read-modify-write: two plugin instances share
  the files. Whether another process wrote since this one last looked is told by the
  snapshot's inode, modification time and size and the journal's inode and size
  (:meth:`CheckpointFiles.change`), which needs no lock.
- A last journal line without its newline is a write a kill interrupted (appends happen under
  the lock, so its writer is dead and never answered the kubelet): it is cut off.
- Damaged files are moved aside as ``<name>.corrupt-<ts>``, snapshot first, kept to a bounded
  number and size (setaside.py).

Not thread-safe on its own: the Checkpoint calls it with one writer at a time and the file lock
held, except :meth:`CheckpointFiles.change`.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Literal

from dra_driver.errors import CheckpointError
from dra_driver.fsutil import fsync_dir, write_all
from dra_driver.prepare import setaside
from dra_driver.prepare.state.checkpointformat import apply_entries, decode_snapshot, parse_journal
from dra_driver.prepare.state.checkpointrecords import ClaimRecord

log = logging.getLogger(__name__)

Identity = tuple[int, int, int]
"""A snapshot file as seen: inode, modification time (ns), size."""

Change = Literal["unchanged", "appended", "replaced"]
"""What the files show since this process last read or wrote them: nothing new, lines appended
to the journal it read, or a file it has not read (a new snapshot or journal, a journal cut
short)."""


def journal_path(path: Path) -> Path:
    """The journal beside the snapshot at ``path``."""
    return path.with_name(path.stem + ".journal")


def lock_path(path: Path) -> Path:
    """The lock file beside the snapshot at ``path``."""
    return path.with_name(path.stem + ".lock")


class CheckpointFiles:
    """The snapshot at ``path``, its journal and its lock file, once :meth:`open`.

    ``snapshot_seen`` and ``journal_end`` say how far this process has read (and applied) the
    files; the writes here move them on, the reader sets ``journal_end`` once it applied what it
    read.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.journal_path = journal_path(path)
        self.lock_path = lock_path(path)
        self.snapshot_seen: Identity | None = None
        self.journal_end = 0  # bytes of the journal read and applied
        # the journal's size once the line being appended now is written (None: no append in
        # flight); lets change() tell this process's own append from another's
        self.appending_end: int | None = None
        self._journal_ino = 0
        self._lock_fd = -1
        self._journal_fd = -1

    def open(self) -> None:
        """Create the directory and the lock file; the journal is opened by :meth:`open_journal`
        with the lock held."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)

    @property
    def is_open(self) -> bool:
        """Whether both the lock file and the journal are open."""
        return self._lock_fd >= 0 and self._journal_fd >= 0

    def close(self) -> None:
        """Close the journal and the lock file (which releases the lock); idempotent."""
        for attr in ("_journal_fd", "_lock_fd"):
            fd = getattr(self, attr)
            if fd >= 0:
                os.close(fd)
                setattr(self, attr, -1)

    @contextmanager
    def lock(self) -> Iterator[None]:
        """Hold ``checkpoint.lock`` (flock). What is released at the end is the lock file in use
        then: :meth:`relocate` may have moved to another one, whose lock it took."""
        if self._lock_fd < 0:
            raise CheckpointError("checkpoint is not open")
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    # -- reading ------------------------------------------------------------------------------

    def change(self) -> Change:
        """What another process wrote since this one last looked; needs no lock (a write racing
        with it is no different from one right after a locked read). This process's own append
        in flight is no change: its line is in memory already (another process cannot append
        meanwhile: the append holds the file lock)."""
        try:
            st = os.stat(self.path)
            snapshot: Identity | None = (st.st_ino, st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            snapshot = None
        try:
            jst = os.stat(self.journal_path)
            journal_ino, journal_size = jst.st_ino, jst.st_size
        except FileNotFoundError:
            journal_ino, journal_size = 0, 0
        if (
            snapshot != self.snapshot_seen
            or journal_ino != self._journal_ino
            or journal_size < self.journal_end
        ):
            return "replaced"
        if journal_size in (self.journal_end, self.appending_end):
            return "unchanged"  # nothing, or only the line this process is appending
        return "appended"

    def open_journal(self) -> None:
        """(Re)open the journal file (created empty if missing); file lock held."""
        if self._journal_fd >= 0:
            os.close(self._journal_fd)
        self._journal_fd = os.open(
            self.journal_path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600
        )
        self._journal_ino = os.fstat(self._journal_fd).st_ino

    def read_snapshot(self) -> tuple[bytes, Identity] | None:
        """The snapshot's bytes and identity; None when there is none. The caller sets
        ``snapshot_seen`` to the identity once it has applied the bytes."""
        try:
            raw = self.path.read_bytes()
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise CheckpointError(f"cannot read {self.path}: {exc}") from exc
        return raw, (st.st_ino, st.st_mtime_ns, st.st_size)

    def read_journal(self, offset: int) -> bytes:
        """The journal's bytes from ``offset`` to its end (the open journal file's)."""
        size = os.fstat(self._journal_fd).st_size
        chunks = []
        while offset < size:
            chunk = os.pread(self._journal_fd, size - offset, offset)
            if not chunk:
                break
            chunks.append(chunk)
            offset += len(chunk)
        return b"".join(chunks)

    def cut_torn_tail(self, end: int) -> None:
        """Cut the journal at ``end``, the end of its last whole line; file lock held."""
        # Appends happen under the file lock, which we hold: the writer of a line without its
        # newline is dead, and the kubelet never heard of that change.
        log.warning(
            "cut off a torn last line of the checkpoint journal (a writer was killed mid-write)",
            extra={"path": str(self.journal_path), "kept_bytes": end},
        )
        os.ftruncate(self._journal_fd, end)

    # -- writing ------------------------------------------------------------------------------

    def append(self, line: bytes, *, durable: bool) -> None:
        """Append one journal line; fdatasync it when ``durable``. File lock held."""
        self.appending_end = self.journal_end + len(line)
        try:
            write_all(self._journal_fd, line)
            if durable:
                os.fdatasync(self._journal_fd)
            self.journal_end += len(line)
        finally:
            self.appending_end = None

    def empty_journal(self) -> None:
        """Cut the journal to nothing, durably (after a snapshot that holds it). File lock
        held."""
        os.ftruncate(self._journal_fd, 0)
        os.fsync(self._journal_fd)
        self.journal_end = 0

    def write_snapshot(self, content: bytes) -> None:
        """Replace the snapshot atomically: temp file, fsync, rename, fsync of the directory.
        File lock held."""
        temp = self.path.with_name(f".{self.path.name}.tmp")
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            write_all(fd, content)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(temp, self.path)
        fsync_dir(self.path.parent)
        st = os.stat(self.path)
        self.snapshot_seen = (st.st_ino, st.st_mtime_ns, st.st_size)

    def move_aside(self) -> dict[Path, Path]:
        """Rename snapshot, then journal, to ``<name>.corrupt-<ts>``; return old -> new. The
        journal is not reopened: the caller does that. File lock held."""
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        n = setaside.next_number((self.path, self.journal_path), kind="corrupt", stamp=stamp)
        suffix = f".corrupt-{stamp}{f'-{n}' if n else ''}"
        moved = {}
        # snapshot first: a crash in between leaves a journal without a snapshot, which is
        # itself reported as damage, never a good snapshot that silently lost its journal
        for p in (self.path, self.journal_path):
            if p.exists():
                target = p.with_name(p.name + suffix)
                os.rename(p, target)
                moved[p] = target
        fsync_dir(self.path.parent)
        setaside.prune(
            self.path.parent, names=(self.path.name, self.journal_path.name), kind="corrupt"
        )
        return moved

    def relocate(
        self, target: Path, *, alone: Callable[[Path], AbstractContextManager[bool]]
    ) -> bool:
        """Move snapshot and journal to ``target``'s names and use them (and its lock file) from
        now on, if ``alone(journal)`` yields True while this process's own journal is closed.
        File lock held (:meth:`lock`, which then releases the new names' lock). Journal first,
        so a crash between the renames is finished at the next start. True when moved."""
        os.close(self._journal_fd)
        self._journal_fd = -1
        lock_fd = -1
        try:
            with alone(self.journal_path) as ok:
                if ok:
                    new_lock = lock_path(target)
                    lock_fd = os.open(new_lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                    fcntl.flock(lock_fd, fcntl.LOCK_EX)
                    journal = journal_path(target)
                    os.rename(self.journal_path, journal)
                    os.rename(self.path, target)
                    fsync_dir(target.parent)
                    self.path, self.journal_path, self.lock_path = target, journal, new_lock
        except BaseException:
            if lock_fd >= 0 and self.path != target:
                os.close(lock_fd)
            raise
        finally:
            self.open_journal()  # at whichever names are in use now
        if lock_fd < 0:
            return False
        os.close(self._lock_fd)  # releases the old names' lock
        self._lock_fd = lock_fd
        return True


def read_state(path: Path) -> tuple[str, dict[str, ClaimRecord]]:
    """Boot ID and claims recorded by the snapshot at ``path`` and its journal (read-only).

    For tools and tests; a torn last journal line is ignored as the plugin would.
    """
    boot_id, seq, claims = decode_snapshot(path.read_bytes())
    try:
        journal = journal_path(path).read_bytes()
    except FileNotFoundError:
        journal = b""
    entries, _, _ = parse_journal(journal, after_seq=seq)
    apply_entries(claims, entries, seq)
    return boot_id, claims
