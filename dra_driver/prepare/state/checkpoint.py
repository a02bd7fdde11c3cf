"""Which claims this node has prepared: a snapshot plus a journal, shared by plugin instances.

Sits under the preparer (prepare/__init__.py): every prepare and unprepare records its progress
here before it answers the kubelet, so that a restarted plugin (or the second instance of a
rolling update) knows what is prepared. The records are checkpointrecords.py's; their bytes on
disk (``checkpoint.json``, the snapshot, and ``checkpoint.journal``, one line per commit) are
checkpointformat.py's; reading and writing the files (atomic snapshot, journal appends, the file
lock, cutting a torn tail, moving damaged files aside) is checkpointfiles.py's. This module owns
the in-memory claim table and what is written when:

- A commit appends one journal line (fdatasynced unless the change need not outlive a power
  loss). ``compact()`` folds the journal into a new snapshot once it passes
  ``COMPACT_AFTER_BYTES``; the plugin calls it from its periodic repair (off the prepare path)
  and on a clean stop.

Rules:

- A claim left in ``PrepareStarted`` is rolled back by the next reconcile.
- The node's boot ID is recorded: after a reboot nothing counts as prepared.
- Snapshots of the earlier snapshot-only format (version 1) are read, so an upgrade keeps the
  prepared claims; the next snapshot is written as version 2.
- Writers that arrive while a write is in flight are committed together by the next append
  (group commit), so concurrent claims share fdatasyncs.
- Two plugin instances share the files: every read-modify-write holds ``checkpoint.lock``
  (flock) and first reads what the other process appended (or its new snapshot).
- A last journal line without its newline is a write a kill interrupted: it is cut off.
- Damage (snapshot truncated, not JSON, wrong checksum, unknown future version; a journal line
  with a wrong checksum, or a gap in the sequence numbers) never stops the plugin: snapshot and
  journal are moved aside as ``<name>.corrupt-<ts>`` and reported; the caller rebuilds the
  state (the preparer: from the CDI specs on disk and the API). The files moved aside are kept
  to a bounded number and size, oldest removed first (setaside.py).

``ClaimLocks`` (checkpointlocks.py) serialises work on one claim across threads and processes.
The names other modules import from here are re-exported from those modules.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from dra_driver.errors import CheckpointCorrupt, CheckpointError
from dra_driver.fsutil import fsync_dir
from dra_driver.prepare.state.checkpointfiles import CheckpointFiles, read_state
from dra_driver.prepare.state.checkpointformat import (
    apply_entries,
    claim_member,
    decode,
    decode_snapshot,
    encode_journal_line,
    encode_snapshot,
    parse_journal,
    record_json,
)
from dra_driver.prepare.state.checkpointlocks import ClaimLocks
from dra_driver.prepare.state.checkpointrecords import (
    PREPARE_COMPLETED,
    PREPARE_STARTED,
    ClaimRecord,
    Claims,
    Phase,
    PreparedDevice,
)
from dra_driver.prepare.state.instances import Instances

__all__ = [
    "BOOT_ID_PATH",
    "PREPARE_COMPLETED",
    "PREPARE_STARTED",
    "Checkpoint",
    "ClaimLocks",
    "ClaimRecord",
    "Claims",
    "LoadReport",
    "Phase",
    "PreparedDevice",
    "decode",
    "read_boot_id",
    "read_state",
]

log = logging.getLogger(__name__)

COMPACT_AFTER_BYTES = 256 * 1024  # journal size at which compact() folds it into the snapshot
COMPACT_HARD_LIMIT_FACTOR = 8  # an append folds it itself past 8 x that (2 MiB)
BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")
T = TypeVar("T")


@dataclass(frozen=True)
class LoadReport:
    """What happened when the checkpoint was opened at start."""

    claims: int
    discarded_after_reboot: int = 0
    corrupt_moved_to: Path | None = None
    corrupt_reason: str = ""


@dataclass
class _Pending(Generic[T]):
    op: Callable[[Claims], T]
    durable: bool = True
    done: bool = False
    result: T | None = None
    error: BaseException | None = None


def read_boot_id(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError as exc:
        raise CheckpointError(f"cannot read the boot ID from {path}: {exc}") from exc


class Checkpoint:
    """The checkpoint (snapshot + journal) and its in-memory copy. Thread-safe; safe across
    processes.

    Changes go through ``transact(op)``: ``op`` gets the current claim table (fresh from disk if
    another process wrote it) and may change it; the change is on disk when ``transact``
    returns. An ``op`` that raises must not have changed the table; its error is re-raised to
    its caller only, other transactions of the same group commit are unaffected.
    """

    def __init__(
        self,
        path: Path,
        *,
        boot_id_path: Path = BOOT_ID_PATH,
        compact_after_bytes: int = COMPACT_AFTER_BYTES,
        instances: Instances | None = None,
    ) -> None:
        self._files = CheckpointFiles(path)
        # While this is the only plugin instance (instances.py) nobody else writes the files:
        # once memory has caught up with them (after each time it became solo), reads and
        # commits skip the file lock and the look for another process's writes.
        self._instances = instances
        self._caught_up_with = -1  # the instances' generation memory has caught up in
        self.boot_id = read_boot_id(boot_id_path)
        self.compact_after_bytes = compact_after_bytes
        self._claims = Claims()
        self._fragments: dict[str, tuple[ClaimRecord, str]] = {}
        self._seq = 0  # sequence number of the last change applied to memory
        self._force_reload = False
        self._cond = threading.Condition()
        self._pending: list[_Pending[Any]] = []
        self._writing = False
        self.on_corrupt: Callable[[Path, str], None] | None = None

    @property
    def path(self) -> Path:
        """The snapshot's path (``relocate`` may change it)."""
        return self._files.path

    @property
    def journal_path(self) -> Path:
        return self._files.journal_path

    # -- opening and closing ----------------------------------------------------------------

    def open(self) -> LoadReport:
        """Create the directory and read the files; never fails because they are damaged."""
        self._files.open()
        with self._files.lock():
            report = self._reload()
            fsync_dir(self.path.parent)  # the journal and lock files, if just created
            return report

    def close(self) -> None:
        """Fold the journal into the snapshot (a clean stop leaves one file), release files."""
        if self._files.is_open:
            try:
                self.compact(force=True)
            except (OSError, CheckpointError) as exc:
                log.warning(
                    "could not compact the checkpoint journal on stop; it is replayed at start",
                    extra={"path": str(self.journal_path), "error": str(exc)},
                )
        self._files.close()

    def compact(self, *, force: bool = False) -> bool:
        """Fold the journal into a new snapshot if it passed ``compact_after_bytes`` (any size
        with ``force``); return whether it did. Called off the prepare path (the plugin's
        periodic repair), so prepares do not pay for it; an append folds the journal itself
        only past ``COMPACT_HARD_LIMIT_FACTOR`` times that size."""
        with self._sole_writer(), self._files.lock():
            self._reload_if_replaced()
            end = self._files.journal_end
            if end and (force or end >= self.compact_after_bytes):
                self._compact_locked()
                return True
            return False

    def relocate(
        self, target: Path, *, alone: Callable[[Path], AbstractContextManager[bool]]
    ) -> bool:
        """Move snapshot and journal to ``target``'s names and use them (and its lock) from
        now on, if ``alone(journal)`` yields True while this process's own journal is closed:
        no other process has the files open (prepare/switchover.py: an earlier release's agent
        that ran beside us in a rolling update is gone). Under the file lock; journal first, so
        a crash between the renames is finished at the next start. True when moved."""
        with self._sole_writer(), self._files.lock():
            self._reload_if_replaced()
            return self._files.relocate(target, alone=alone)

    @contextmanager
    def _sole_writer(self) -> Iterator[None]:
        """Wait until no group commit is writing, and keep the next from starting meanwhile."""
        with self._cond:
            while self._writing:
                self._cond.wait()
            self._writing = True
        try:
            yield
        finally:
            with self._cond:
                self._writing = False
                self._cond.notify_all()

    def _reload(self) -> LoadReport:
        """Read snapshot and journal into memory (file lock held).

        Damaged -> both moved aside, empty table, ``on_corrupt`` told. From an earlier boot ->
        empty table. A torn last journal line (a writer killed mid-append, never acknowledged)
        is cut off.
        """
        self._force_reload = False
        self._files.open_journal()
        self._files.journal_end = 0
        snapshot = self._files.read_snapshot()
        journal = self._files.read_journal(0)
        if snapshot is None:
            if journal.strip():
                return self._corrupt(self.journal_path, "the journal has no snapshot to apply to")
            self._set_claims({}, seq=0)
            self._write_snapshot_locked()
            return LoadReport(claims=0)
        raw, identity = snapshot
        try:
            boot_id, seq, claims = decode_snapshot(raw)
        except CheckpointCorrupt as exc:
            return self._corrupt(self.path, str(exc))
        if boot_id != self.boot_id:
            try:
                entries, _, _ = parse_journal(journal, after_seq=seq)
                seq = apply_entries(claims, entries, seq)
            except CheckpointCorrupt:
                pass  # an earlier boot's journal: counted as far as it reads, then dropped
            log.info(
                "checkpoint is from an earlier boot; no claim counts as prepared",
                extra={"claims": len(claims), "checkpoint_boot_id": boot_id},
            )
            self._set_claims({}, seq=seq)
            self._compact_locked()
            return LoadReport(claims=0, discarded_after_reboot=len(claims))
        try:
            entries, end, torn = parse_journal(journal, after_seq=seq)
        except CheckpointCorrupt as exc:
            return self._corrupt(self.journal_path, str(exc))
        seq = apply_entries(claims, entries, seq)
        self._set_claims(claims, seq=seq)
        self._files.snapshot_seen = identity
        self._files.journal_end = end
        if torn:
            self._files.cut_torn_tail(end)
        return LoadReport(claims=len(claims))

    def _corrupt(self, damaged: Path, reason: str) -> LoadReport:
        moved = self._files.move_aside()
        moved_damaged = moved.get(damaged, damaged)
        log.error(
            "checkpoint is damaged; moved it aside and rebuilding the state",
            extra={"path": str(damaged), "moved_to": str(moved_damaged), "reason": reason},
        )
        self._files.open_journal()
        self._files.journal_end = 0
        self._set_claims({}, seq=0)
        self._write_snapshot_locked()
        if self.on_corrupt is not None:
            self.on_corrupt(moved_damaged, reason)
        return LoadReport(claims=0, corrupt_moved_to=moved_damaged, corrupt_reason=reason)

    def _set_claims(self, claims: Mapping[str, ClaimRecord], *, seq: int) -> None:
        with self._cond:
            self._claims = Claims(claims)
            self._seq = seq
            self._fragments = {
                uid: frag for uid, frag in self._fragments.items() if claims.get(uid) is frag[0]
            }

    # -- reading and changing -------------------------------------------------------------

    def get(self, uid: str) -> ClaimRecord | None:
        """The claim's record as of now (re-read from disk if another process changed it).

        Callers hold the claim's lock, so nobody changes this claim meanwhile; if neither file
        changed since this process last read or wrote them, memory is current and the answer
        needs no file lock (it saves a lock round trip on every prepare). While this is the
        only plugin instance and memory has caught up, not even that is looked at.
        """
        with self._op() as alone:
            if (alone and self._trusted()) or self._unchanged_on_disk():
                if alone:
                    self._caught_up()
                with self._cond:
                    return self._claims.get(uid)
        return self.transact(lambda claims: claims.get(uid))

    def snapshot(self) -> dict[str, ClaimRecord]:
        return self.transact(dict)

    def transact(self, op: Callable[[Claims], T], *, durable: bool = True) -> T:
        """Run ``op`` on the claim table; its change is on disk when this returns.

        ``durable=True`` (the default) also fdatasyncs the journal. ``durable=False`` only
        appends: other processes and a restarted plugin see the change, a power loss may lose
        it. That is enough for records that matter only within this boot (``PrepareStarted``):
        after a power loss the node reboots, and the boot ID check drops every claim anyway.
        """
        entry: _Pending[T] = _Pending(op, durable)
        with self._cond:
            self._pending.append(entry)
            while not entry.done:
                if self._writing:
                    self._cond.wait()
                    continue
                self._writing = True
                batch, self._pending = self._pending, []
                self._cond.release()
                try:
                    self._commit(batch)
                finally:
                    self._cond.acquire()
                    self._writing = False
                    self._cond.notify_all()
        if entry.error is not None:
            raise entry.error
        return entry.result  # type: ignore[return-value]

    def _commit(self, batch: list[_Pending[Any]]) -> None:
        try:
            with self._op() as alone, self._files_locked(alone):
                with self._cond:
                    claims = self._claims
                    claims.touched = set()
                    for entry in batch:
                        try:
                            entry.result = entry.op(claims)
                        except Exception as exc:  # noqa: BLE001 - handed back to its caller
                            entry.error = exc
                    touched = claims.touched
                if touched:
                    self._append_locked(touched, durable=any(e.durable for e in batch))
        except (OSError, CheckpointError) as exc:
            # memory may now be ahead of the disk: believe the disk next time
            self._force_reload = True
            error = (
                exc
                if isinstance(exc, CheckpointError)
                else CheckpointError(f"cannot write {self.journal_path}: {exc}")
            )
            for entry in batch:
                if entry.error is None:
                    entry.error = error
        finally:
            for entry in batch:
                entry.done = True

    def _op(self) -> AbstractContextManager[bool]:
        return self._instances.op() if self._instances is not None else nullcontext(False)

    def _trusted(self) -> bool:
        """Solo (the caller's op says so) and memory caught up with the files since."""
        assert self._instances is not None
        return not self._force_reload and self._caught_up_with == self._instances.generation

    def _caught_up(self) -> None:
        """Memory is current and, solo, stays so: no other process writes till we share."""
        assert self._instances is not None
        self._caught_up_with = self._instances.generation

    @contextmanager
    def _files_locked(self, alone: bool) -> Iterator[None]:
        """The file lock and what another process wrote since we last looked; neither when
        this is the only instance and memory has caught up (see __init__)."""
        if alone and self._trusted():
            yield
            return
        with self._files.lock():
            self._reload_if_replaced()
            if alone:
                self._caught_up()
            yield

    def _reload_if_replaced(self) -> None:
        """Catch up with what another process wrote since we last looked (file lock held)."""
        change = "replaced" if self._force_reload else self._files.change()
        if change == "replaced":
            self._reload()
        elif change == "appended":
            tail = self._files.read_journal(self._files.journal_end)
            try:
                entries, end, torn = parse_journal(tail, after_seq=self._seq, strict=True)
            except CheckpointCorrupt as exc:
                self._corrupt(self.journal_path, str(exc))
                return
            with self._cond:
                self._seq = apply_entries(self._claims, entries, self._seq)
                self._forget_fragments([u for u in self._fragments if u not in self._claims])
            self._files.journal_end += end
            if torn:
                self._files.cut_torn_tail(self._files.journal_end)

    def _unchanged_on_disk(self) -> bool:
        """Lock-free check that no other process wrote since we last looked. A write racing
        with it is no different from one right after a locked read; this process's own commit
        in flight is none (so a prepare's read does not wait for other claims' fsync)."""
        if self._force_reload:
            return False
        return self._files.change() == "unchanged"

    def _append_locked(self, touched: set[str], *, durable: bool) -> None:
        with self._cond:
            seq = self._seq + 1
            put = [
                claim_member(uid, self._fragment(uid))
                for uid in sorted(touched)
                if uid in self._claims
            ]
            removed = sorted(uid for uid in touched if uid not in self._claims)
            self._forget_fragments(removed)
        self._files.append(encode_journal_line(seq=seq, put=put, delete=removed), durable=durable)
        self._seq = seq
        if self._files.journal_end >= self.compact_after_bytes * COMPACT_HARD_LIMIT_FACTOR:
            self._compact_locked()  # compact() was not called in time: bound the journal

    def _compact_locked(self) -> None:
        """Write the whole table as a new snapshot, then empty the journal (file lock held).

        A crash between the two leaves journal lines the snapshot already contains; their
        sequence numbers say so and the next load skips them.
        """
        self._write_snapshot_locked()
        self._files.empty_journal()

    def _write_snapshot_locked(self) -> None:
        with self._cond:
            content = self._encode_snapshot()
        self._files.write_snapshot(content)

    def _fragment(self, uid: str) -> str:
        """The claim's canonical JSON, cached while its record is unchanged (lock held)."""
        record = self._claims[uid]
        cached = self._fragments.get(uid)
        if cached is None or cached[0] is not record:
            cached = (record, record_json(record))
            self._fragments[uid] = cached
        return cached[1]

    def _forget_fragments(self, uids: Iterable[str]) -> None:
        """Drop the cached JSON of removed claims (lock held): the cache holds only claims in
        the table, so a node that prepares and unprepares all day keeps no more than it has
        prepared now (compaction, which also prunes, may be far away)."""
        for uid in uids:
            self._fragments.pop(uid, None)

    def _encode_snapshot(self) -> bytes:
        parts = [claim_member(uid, self._fragment(uid)) for uid in sorted(self._claims)]
        for uid in [u for u in self._fragments if u not in self._claims]:
            del self._fragments[uid]
        return encode_snapshot(boot_id=self.boot_id, seq=self._seq, claims=parts)
