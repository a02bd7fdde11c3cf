"""Which claims this node has prepared: a versioned, checksummed file shared by plugin instances.

Sits under prepare.py: every prepare and unprepare records its progress here before it answers
the kubelet, so that a restarted plugin (or the second instance of a rolling update) knows what is
prepared. File: ``<plugin data dir>/checkpoint.json``::

    {"version": 1, "checksum": "<sha256 of data>", "data": {"bootId": ..., "claims": {uid: ...}}}

- Two phases per claim (nvidia-compat.md "Checkpoint"): ``PrepareStarted`` is recorded before
  anything is changed on the node, ``PrepareCompleted`` once the CDI spec is on disk. A claim
  left in ``PrepareStarted`` is rolled back by the next reconcile.
- The node's boot ID is recorded: after a reboot nothing counts as prepared.
- Writes are atomic (temp file, fsync, rename, fsync of the directory). Writers that arrive while
  a write is in flight are committed together by the next write (group commit), so concurrent
  claims share fsyncs.
- Two plugin instances share the file: every read-modify-write holds ``checkpoint.lock``
  (flock) and re-reads the file when another process replaced it since we last saw it.
- A damaged file (truncated, not JSON, wrong checksum, unknown future version) never stops the
  plugin: it is moved aside as ``checkpoint.json.corrupt-<ts>`` and reported; the caller
  rebuilds the state (prepare.py: from the CDI specs on disk and the API).

``ClaimLocks`` serialises work on one claim across threads and processes (byte-range locks on
``claims.lock``), so the same claim is never prepared and unprepared at once.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

from dra_driver.errors import CheckpointCorrupt, CheckpointError

log = logging.getLogger(__name__)

VERSION = 1
BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")
Phase = Literal["PrepareStarted", "PrepareCompleted"]
PREPARE_STARTED: Phase = "PrepareStarted"
PREPARE_COMPLETED: Phase = "PrepareCompleted"
_LOCK_STRIPES = 4096
T = TypeVar("T")


@dataclass(frozen=True)
class PreparedDevice:
    """One device of a prepared claim, as answered to the kubelet."""

    request_names: tuple[str, ...]
    pool: str
    device: str
    cdi_device_ids: tuple[str, ...]
    share_id: str | None = None
    admin_access: bool = False
    config: Mapping[str, Any] = field(default_factory=dict)  # effective opaque config


@dataclass(frozen=True)
class ClaimRecord:
    """A claim in the checkpoint. ``namespace``/``name`` are empty for a claim rebuilt from its
    CDI spec after the checkpoint was lost; the next prepare of it fetches them again."""

    uid: str
    namespace: str
    name: str
    phase: Phase
    devices: tuple[PreparedDevice, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "namespace": self.namespace,
            "name": self.name,
            "phase": self.phase,
            "devices": [
                {
                    "requestNames": list(d.request_names),
                    "pool": d.pool,
                    "device": d.device,
                    "cdiDeviceIds": list(d.cdi_device_ids),
                    **({"shareId": d.share_id} if d.share_id is not None else {}),
                    **({"adminAccess": True} if d.admin_access else {}),
                    "config": dict(d.config),
                }
                for d in self.devices
            ],
        }

    @staticmethod
    def from_json(uid: str, obj: Mapping[str, Any]) -> ClaimRecord:
        phase = obj["phase"]
        if phase not in (PREPARE_STARTED, PREPARE_COMPLETED):
            raise ValueError(f"unknown phase {phase!r}")
        return ClaimRecord(
            uid=uid,
            namespace=str(obj["namespace"]),
            name=str(obj["name"]),
            phase=phase,
            devices=tuple(
                PreparedDevice(
                    request_names=tuple(str(r) for r in d["requestNames"]),
                    pool=str(d["pool"]),
                    device=str(d["device"]),
                    cdi_device_ids=tuple(str(c) for c in d["cdiDeviceIds"]),
                    share_id=None if d.get("shareId") is None else str(d["shareId"]),
                    admin_access=bool(d.get("adminAccess", False)),
                    config=dict(d.get("config") or {}),
                )
                for d in obj["devices"]
            ),
        )


@dataclass(frozen=True)
class LoadReport:
    """What happened when the checkpoint was opened at start."""

    claims: int
    discarded_after_reboot: int = 0
    corrupt_moved_to: Path | None = None
    corrupt_reason: str = ""


class Claims(dict[str, ClaimRecord]):
    """The claim table handed to a transaction; remembers whether it was changed."""

    changed = False

    def __setitem__(self, key: str, value: ClaimRecord) -> None:
        self.changed = True
        super().__setitem__(key, value)

    def __delitem__(self, key: str) -> None:
        self.changed = True
        super().__delitem__(key)

    def discard(self, key: str) -> ClaimRecord | None:
        if key in self:
            record = self[key]
            del self[key]
            return record
        return None


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
    """The checkpoint file and its in-memory copy. Thread-safe; safe across processes.

    Changes go through ``transact(op)``: ``op`` gets the current claim table (fresh from disk if
    another process wrote it) and may change it; the change is durable when ``transact``
    returns. An ``op`` that raises must not have changed the table; its error is re-raised to
    its caller only, other transactions of the same group commit are unaffected.
    """

    def __init__(self, path: Path, *, boot_id_path: Path = BOOT_ID_PATH) -> None:
        self.path = path
        self.boot_id = read_boot_id(boot_id_path)
        self._lock_path = path.with_name(path.stem + ".lock")
        self._claims = Claims()
        self._fragments: dict[str, tuple[ClaimRecord, str]] = {}
        self._seen: tuple[int, int, int] | None = None  # (inode, mtime_ns, size) last read/written
        self._force_reload = False
        self._cond = threading.Condition()
        self._pending: list[_Pending[Any]] = []
        self._writing = False
        self._lock_fd = -1
        self.on_corrupt: Callable[[Path, str], None] | None = None

    # -- opening ---------------------------------------------------------------------------

    def open(self) -> LoadReport:
        """Create the directory and read the file; never fails because the file is damaged."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        with self._file_lock():
            return self._reload()

    def close(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def _reload(self) -> LoadReport:
        """Read the file into memory (file lock held). Damaged -> moved aside, empty table."""
        self._force_reload = False
        try:
            raw = self.path.read_bytes()
            st = os.stat(self.path)
        except FileNotFoundError:
            self._set_claims({}, seen=None)
            return LoadReport(claims=0)
        except OSError as exc:
            raise CheckpointError(f"cannot read {self.path}: {exc}") from exc
        try:
            boot_id, claims = decode(raw)
        except CheckpointCorrupt as exc:
            moved = self._move_aside()
            log.error(
                "checkpoint is damaged; moved it aside and rebuilding the state",
                extra={"path": str(self.path), "moved_to": str(moved), "reason": str(exc)},
            )
            self._set_claims({}, seen=None)
            if self.on_corrupt is not None:
                self.on_corrupt(moved, str(exc))
            return LoadReport(claims=0, corrupt_moved_to=moved, corrupt_reason=str(exc))
        if boot_id != self.boot_id:
            log.info(
                "checkpoint is from an earlier boot; no claim counts as prepared",
                extra={"claims": len(claims), "checkpoint_boot_id": boot_id},
            )
            self._set_claims({}, seen=(st.st_ino, st.st_mtime_ns, st.st_size))
            self._write_locked()
            return LoadReport(claims=0, discarded_after_reboot=len(claims))
        self._set_claims(claims, seen=(st.st_ino, st.st_mtime_ns, st.st_size))
        return LoadReport(claims=len(claims))

    def _move_aside(self) -> Path:
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        n = 1
        while target.exists():
            target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}-{n}")
            n += 1
        os.rename(self.path, target)
        _fsync_dir(self.path.parent)
        return target

    def _set_claims(
        self, claims: Mapping[str, ClaimRecord], *, seen: tuple[int, int, int] | None
    ) -> None:
        with self._cond:
            self._claims = Claims(claims)
            self._seen = seen
            self._fragments = {
                uid: frag for uid, frag in self._fragments.items() if claims.get(uid) is frag[0]
            }

    # -- reading and changing -------------------------------------------------------------

    def get(self, uid: str) -> ClaimRecord | None:
        """The claim's record as of now (re-read from disk if another process changed it)."""
        return self.transact(lambda claims: claims.get(uid))

    def snapshot(self) -> dict[str, ClaimRecord]:
        return self.transact(dict)

    def transact(self, op: Callable[[Claims], T], *, durable: bool = True) -> T:
        """Run ``op`` on the claim table; its change is on disk when this returns.

        ``durable=True`` (the default) also fsyncs the file and the directory. ``durable=False``
        only replaces the file atomically: other processes and a restarted plugin see the change,
        a power loss may lose it. That is enough for records that matter only within this boot
        (``PrepareStarted``): after a power loss the node reboots, and the boot ID check drops
        every claim anyway.
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
            with self._file_lock():
                self._reload_if_replaced()
                with self._cond:
                    claims = self._claims
                    claims.changed = False
                    for entry in batch:
                        try:
                            entry.result = entry.op(claims)
                        except Exception as exc:  # noqa: BLE001 - handed back to its caller
                            entry.error = exc
                    changed = claims.changed
                if changed:
                    self._write_locked(durable=any(e.durable for e in batch))
        except (OSError, CheckpointError) as exc:
            # memory may now be ahead of the disk: believe the disk next time
            self._force_reload = True
            error = (
                exc
                if isinstance(exc, CheckpointError)
                else CheckpointError(f"cannot write {self.path}: {exc}")
            )
            for entry in batch:
                if entry.error is None:
                    entry.error = error
        finally:
            for entry in batch:
                entry.done = True

    def _reload_if_replaced(self) -> None:
        try:
            st = os.stat(self.path)
            now: tuple[int, int, int] | None = (st.st_ino, st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            now = None
        if self._force_reload or now != self._seen:
            self._reload()

    def _write_locked(self, *, durable: bool = True) -> None:
        with self._cond:
            content = self._encode()
        temp = self.path.with_name(f".{self.path.name}.tmp")
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, content)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(temp, self.path)
        if durable:
            _fsync_dir(self.path.parent)
        st = os.stat(self.path)
        self._seen = (st.st_ino, st.st_mtime_ns, st.st_size)

    def _encode(self) -> bytes:
        # Each claim's JSON is cached while its record is unchanged, so a write costs one join
        # plus a checksum, not a re-serialisation of every claim.
        parts = []
        fragments = self._fragments
        for uid in sorted(self._claims):
            record = self._claims[uid]
            cached = fragments.get(uid)
            if cached is None or cached[0] is not record:
                cached = (record, _canonical(record.to_json()))
                fragments[uid] = cached
            parts.append(f"{json.dumps(uid)}:{cached[1]}")
        for uid in [u for u in fragments if u not in self._claims]:
            del fragments[uid]
        data = f'{{"bootId":{json.dumps(self.boot_id)},"claims":{{{",".join(parts)}}}}}'
        checksum = hashlib.sha256(data.encode()).hexdigest()
        return f'{{"version":{VERSION},"checksum":"{checksum}","data":{data}}}\n'.encode()

    @contextmanager
    def _file_lock(self) -> Iterator[None]:
        if self._lock_fd < 0:
            raise CheckpointError("checkpoint is not open")
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)


def decode(raw: bytes) -> tuple[str, dict[str, ClaimRecord]]:
    """Parse and verify a checkpoint file; CheckpointCorrupt says why it cannot be used."""
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointCorrupt(f"not valid JSON ({exc})") from exc
    if not isinstance(obj, dict):
        raise CheckpointCorrupt("not a JSON object")
    version = obj.get("version")
    if not isinstance(version, int) or version != VERSION:
        raise CheckpointCorrupt(
            f"version {version!r} is not supported (this plugin reads {VERSION})"
        )
    data = obj.get("data")
    checksum = obj.get("checksum")
    if not isinstance(data, dict) or not isinstance(checksum, str):
        raise CheckpointCorrupt("missing data or checksum")
    if hashlib.sha256(_canonical(data).encode()).hexdigest() != checksum:
        raise CheckpointCorrupt("checksum does not match the content")
    try:
        boot_id = str(data["bootId"])
        claims = {
            str(uid): ClaimRecord.from_json(str(uid), rec) for uid, rec in data["claims"].items()
        }
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointCorrupt(f"malformed content ({exc!r})") from exc
    return boot_id, claims


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
