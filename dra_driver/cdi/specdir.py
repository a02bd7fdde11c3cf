"""The CDI spec directory: our claim specs written atomically, removed, listed; spares kept.

Last step of the flow: prepare hands spec.py's bytes to :class:`CdiSpecDir`, which puts them at
``<cdi root>/<vendor>-claim_<claimUID>.json`` (a node's /etc/cdi or /run/cdi) for the container
runtime to read; unprepare and reconcile remove them. Only files named like our claim specs (and
their temp files and spares) are ever written or removed in the directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import re
import secrets
import threading
from dataclasses import dataclass
from pathlib import Path

from dra_driver.cdi.spec import CDI_CLASS, CLAIM_UID, CLAIM_UID_PATTERN
from dra_driver.errors import CdiError
from dra_driver.fsutil import OS_CALLS, FileCalls, fsync_dir, held_calls, in_memory_fs


class PendingSpec:
    """A spec written to its temp file but not yet synced and renamed (see CdiSpecDir.begin)."""

    __slots__ = ("_calls", "_done", "_fd", "_final", "_in_memory", "_temp")

    def __init__(
        self,
        *,
        fd: int,
        temp: str | Path,
        final: str | Path,
        in_memory: bool = False,
        calls: FileCalls = OS_CALLS,
    ) -> None:
        self._final = final  # a string on the prepare path (a Path costs a parse there)
        self._fd = fd
        self._temp = temp
        self._done = False
        self._in_memory = in_memory
        self._calls = calls

    @property
    def final(self) -> Path:
        """Where the spec goes."""
        return Path(self._final)

    def sync(self) -> None:
        """fsync the temp file (blocking; may run in another thread than the rest). Nothing on
        a tmpfs (a node's /run/cdi), whose files live in memory: its fsync has nothing to
        write and returns at once, and a power loss takes the directory with it anyway; the
        call only handed the interpreter lock to another thread and back."""
        if self._in_memory:
            return
        try:
            os.fsync(self._fd)
        except OSError as exc:
            raise CdiError(f"cannot write CDI spec {self._final}: {exc}") from exc

    def commit(self) -> None:
        """Rename the synced temp file over the spec: readers see the new spec from now on."""
        # Renamed before closing: a recycled spare stays locked (ours) until it is the spec.
        try:
            self._calls.rename(self._temp, self._final)
        except OSError as exc:
            raise CdiError(f"cannot write CDI spec {self._final}: {exc}") from exc
        self._done = True
        # synced and renamed: the spec is in place (no contextlib.suppress: it is a class of
        # Python calls, on every prepare)
        try:  # noqa: SIM105
            self._calls.close(self._fd)
        except OSError:
            pass
        self._fd = -1

    def abort(self) -> None:
        """Drop the temp file unless committed. Idempotent; never raises."""
        # Unlinked before closing, for the same reason as in commit.
        if not self._done:
            self._done = True
            with contextlib.suppress(OSError):
                self._calls.unlink(self._temp)
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                self._calls.close(self._fd)
            self._fd = -1


@dataclass
class _Spare:
    """A removed spec kept for the next write: renamed to a hidden name, open, and locked."""

    path: Path
    fd: int  # O_RDWR; holds an exclusive flock for as long as the file is a spare of ours
    size: int


def _open_locked(path: str | Path) -> int | None:
    """``path`` opened read-write with the exclusive flock that marks a spare as its holder's;
    None (nothing left open) when another open file holds that lock."""
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


class CdiSpecDir:
    """Our claim specs in the CDI directory: atomic writes, removal, listing.

    Spec file: ``<vendor>-claim_<claimUID>.json``. A write goes to a hidden temp file in the same
    directory (``.<spec name>.<hex>.tmp``: runtimes only read ``*.json``/``*.yaml``), is
    fsync'd (except on a tmpfs, where there is no disk to sync to) and renamed over the final
    name, so a reader sees the old spec or the new one, never a mix or a partial file, even
    after a power loss. The directory is not fsync'd: after a power
    loss the boot ID drops every prepared claim and reconcile removes the specs and temp files
    left behind, so whether a rename survived does not matter. Files not named like our specs
    are never touched.

    Spares: creating a file and deleting one are the costliest steps of a spec's life on a
    journaling file system (an inode allocated and freed, ~0.2 ms of kernel time each on a small
    VM). So a removed spec is renamed to a hidden spare (``.<vendor>-claim_spare.<random>.tmp``),
    kept open with an exclusive ``flock``, and the next write overwrites it in place instead of
    creating a temp file; up to ``max_spares`` are kept. The lock says whose a spare is: a second
    plugin instance (rolling update) never touches a locked spare, and a spare whose owner died
    (its lock went with it) is adopted or deleted by :meth:`collect_spares`. :meth:`close`
    deletes this instance's spares.

    No spares on a tmpfs (a node's /run/cdi; found by ensure()): there a file is created and
    deleted in memory, and a spare's extra steps (open, lock, rename) cost more than they save
    (a write 81 vs 42 us, a removal 31 vs 13 us, measured on /dev/shm here); spares an earlier
    instance left there are deleted, not adopted.
    """

    def __init__(self, root: Path, *, vendor: str, max_spares: int = 16) -> None:
        self.root = root
        self._root = str(root)
        self.vendor = vendor
        self.max_spares = max_spares
        self._prefix = f"{vendor}-{CDI_CLASS}_"
        self._spec_name = re.compile(rf"^{re.escape(self._prefix)}({CLAIM_UID_PATTERN})\.json$")
        self._temp_name = re.compile(
            rf"^\.{re.escape(self._prefix)}({CLAIM_UID_PATTERN})\.json\.[0-9a-f]+\.tmp$"
        )
        self._spare_name = re.compile(rf"^\.{re.escape(self._prefix)}spare\.[0-9a-f]+\.tmp$")
        self._spares: list[_Spare] = []
        self._spares_lock = threading.Lock()
        # Temp file names: random per instance, then numbered (a random name per spec cost a
        # getrandom call, and with it a handoff of the interpreter lock, on every prepare).
        # O_EXCL still refuses a name that is taken.
        self._temp_prefix = secrets.token_hex(4)
        self._temp_numbers = itertools.count()
        # The directory is on a tmpfs (a node's /run/cdi): a spec's fsync returns at once, so
        # handing it to another thread would cost more than it overlaps; and no call of a
        # write or a removal waits for a device, so they keep the interpreter lock
        # (fsutil.held_calls). Set by ensure().
        self.in_memory = False
        self._calls = OS_CALLS

    @property
    def _spare_room(self) -> int:
        return 0 if self.in_memory else self.max_spares

    def ensure(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.in_memory = in_memory_fs(self.root)
        self._calls = held_calls() if self.in_memory else OS_CALLS

    def path_for(self, claim_uid: str) -> Path:
        return self.root / f"{self._stem(claim_uid)}.json"

    def _stem(self, claim_uid: str) -> str:
        """The claim's spec file name without its suffix."""
        if not CLAIM_UID.match(claim_uid):
            # the UID is part of a file name: refuse anything that could climb out of the dir
            raise CdiError(f"claim UID {claim_uid!r} is not a lowercase UUID")
        return f"{self._prefix}{claim_uid}"

    def foreign_path(self, claim_uid: str) -> Path:
        """Where NVIDIA's driver keeps the claim's spec (``.yaml``, docs/migration.md): a claim
        adopted from it keeps that spec until its unprepare (:meth:`remove`)."""
        return self.path_for(claim_uid).with_suffix(".yaml")

    def has_spec(self, claim_uid: str) -> bool:
        """Whether the claim has a spec: ours, or the one NVIDIA's driver wrote (adopted)."""
        return self.path_for(claim_uid).exists() or self.foreign_path(claim_uid).exists()

    def is_foreign(self, claim_uid: str) -> bool:
        """Whether the claim's spec is NVIDIA's (an adopted claim): never rewritten as ours."""
        return self.foreign_path(claim_uid).exists()

    def write(self, claim_uid: str, content: bytes) -> Path:
        """Atomically replace the spec of ``claim_uid`` with ``content``."""
        pending = self.begin(claim_uid, content)
        try:
            pending.sync()
            pending.commit()
            return pending.final
        finally:
            pending.abort()

    def begin(self, claim_uid: str, content: bytes) -> PendingSpec:
        """Write ``content`` to a temp file; the caller then calls ``sync()`` (from any thread)
        and ``commit()``, or ``abort()``. Splitting the write lets the slow part (the fsync)
        overlap other work without the rest of the write leaving the caller's thread."""
        # strings, not Paths: this runs on every prepare (as remove on every unprepare)
        name = f"{self._stem(claim_uid)}.json"
        final = f"{self._root}/{name}"
        with self._spares_lock:
            spare = self._spares.pop() if self._spares else None
        temp: str | Path
        if spare is not None:
            fd, temp = spare.fd, spare.path  # opened at offset 0 when it became a spare
        else:
            temp = f"{self._root}/.{name}.{self._temp_prefix}{next(self._temp_numbers):x}.tmp"
            try:
                fd = self._calls.create(temp)
            except OSError as exc:
                raise CdiError(f"cannot write CDI spec {final}: {exc}") from exc
        pending = PendingSpec(
            fd=fd, temp=temp, final=final, in_memory=self.in_memory, calls=self._calls
        )
        try:
            self._calls.write_all(fd, content)
            if spare is not None and spare.size > len(content):
                os.ftruncate(fd, len(content))
        except OSError as exc:
            pending.abort()
            raise CdiError(f"cannot write CDI spec {final}: {exc}") from exc
        return pending

    def read(self, claim_uid: str) -> bytes | None:
        """The spec's bytes, or None when the claim has no spec."""
        try:
            return self.path_for(claim_uid).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise CdiError(f"cannot read CDI spec of claim {claim_uid}: {exc}") from exc

    def remove(self, claim_uid: str, *, sync_dir: bool = True) -> bool:
        """Delete the spec of ``claim_uid`` (keep it as a spare while there is room), or, when
        it has none of ours, the ``.yaml`` one NVIDIA's driver wrote for an adopted claim; False
        when there was neither (not an error). A claim has one spec or the other, never both:
        an adopted claim's spec is never rewritten as ours (repair.py), and a claim rolled back
        loses both before it is prepared again. So an unprepare of one of our claims costs one
        system call, not a second one for a ``.yaml`` that is not there."""
        # strings, not Paths: this runs on every unprepare, where Path's parsing showed up
        base = f"{self._root}/{self._stem(claim_uid)}"
        try:
            try:
                if not self._keep_as_spare(f"{base}.json"):
                    self._calls.unlink(f"{base}.json")
            except FileNotFoundError:
                try:
                    self._calls.unlink(f"{base}.yaml")
                except FileNotFoundError:
                    return False
        except OSError as exc:
            raise CdiError(f"cannot remove CDI spec of claim {claim_uid}: {exc}") from exc
        if sync_dir:
            self.sync()
        return True

    def _keep_as_spare(self, spec: str) -> bool:
        """Rename ``spec`` to a new spare of ours; False (nothing done) when the pool is full.
        FileNotFoundError when there is no such spec."""
        with self._spares_lock:
            if len(self._spares) >= self._spare_room:
                return False
        try:
            # Locked before it gets a spare's name, so no other instance ever sees it unlocked.
            fd = _open_locked(spec)
        except FileNotFoundError:
            raise
        except OSError:
            return False  # not a plain file we can reuse (a symlink, say): just delete it
        if fd is None:
            return False  # locked by someone: not a file of the kind we keep
        try:
            size = os.fstat(fd).st_size
            spare = self.root / f".{self._prefix}spare.{secrets.token_hex(4)}.tmp"
            os.rename(spec, spare)
        except BaseException:
            os.close(fd)
            raise
        with self._spares_lock:
            self._spares.append(_Spare(path=spare, fd=fd, size=size))
        return True

    @property
    def spare_count(self) -> int:
        with self._spares_lock:
            return len(self._spares)

    def collect_spares(self) -> tuple[int, int]:
        """Adopt the spares of instances that are gone (no lock on them) while there is room,
        delete the rest of them; spares another live instance holds are left alone. Returns
        (adopted, deleted)."""
        with self._spares_lock:
            ours = {s.path.name for s in self._spares}
        try:
            names = [n for n in os.listdir(self.root) if self._spare_name.match(n)]
        except FileNotFoundError:
            return 0, 0
        adopted = deleted = 0
        for name in names:
            if name in ours:
                continue
            path = self.root / name
            try:
                fd = _open_locked(path)
            except OSError:
                continue  # gone meanwhile, or not a plain file of ours
            if fd is None:
                continue  # a live instance's spare
            with self._spares_lock:
                room = len(self._spares) < self._spare_room
                if room:
                    self._spares.append(_Spare(path=path, fd=fd, size=os.fstat(fd).st_size))
            if room:
                adopted += 1
                continue
            with contextlib.suppress(FileNotFoundError):
                path.unlink()  # still locked by us: nobody can adopt it in between
            os.close(fd)
            deleted += 1
        return adopted, deleted

    def close(self) -> None:
        """Delete this instance's spares (a stopping plugin leaves only specs behind)."""
        with self._spares_lock:
            spares, self._spares = self._spares, []
        for spare in spares:
            with contextlib.suppress(OSError):
                spare.path.unlink()
            with contextlib.suppress(OSError):
                os.close(spare.fd)

    def claim_uids(self) -> set[str]:
        """UIDs of every claim that has a spec of ours in the directory."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return set()
        return {m[1] for n in names if (m := self._spec_name.match(n))}

    def temp_files(self) -> list[tuple[str, Path]]:
        """``(claim UID, path)`` of every temp file of ours: writes in flight or crash leftovers.

        Writes happen only under the claim's lock, so a caller holding that lock knows the file
        is a leftover and may delete it with :meth:`remove_temp_file`.
        """
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        return [(m[1], self.root / n) for n in names if (m := self._temp_name.match(n))]

    def remove_temp_file(self, path: Path) -> bool:
        """Delete one temp file found by :meth:`temp_files`; False when it was already gone."""
        if not self._temp_name.match(path.name) or path.parent != self.root:
            raise CdiError(f"{path} is not a temp file of ours")
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise CdiError(f"cannot remove temp file {path}: {exc}") from exc
        return True

    def sync(self) -> None:
        fsync_dir(self.root)
