"""Switching a running node in place: the state file NVIDIA's plugin and our earlier releases
both called ``checkpoint.json``, sorted out at start, before the plugin serves (and, after a
rolling update from an earlier release, once its agent is gone).

Flow position: nodestate.py (PrepareState.open) -> :func:`checkpoint_names` and :func:`stale_state`
before the checkpoint is opened, :func:`adopt_nvidia_checkpoint` right after it (before the
first reconcile); mig/dynamic.py reads :func:`recorded_names` before that ->
checkpoint.py + cdi/. Format of NVIDIA's file, spec names and MPS Deployments:
shared/spec/nvidia-compat.md "Switching in place"; the operator's side: docs/migration.md.

- Our own state lives in ``gpu-dra-checkpoint.json`` (+ ``.journal``, ``.lock``), so NVIDIA's
  plugin never reads it. A ``checkpoint.json`` in our format (an earlier release) is moved to
  the new names by two renames, journal first: a crash between them leaves a state the next
  start finishes (the snapshot is still ours at the old name). The bytes are unchanged. Not
  while that release's agent still runs beside us (a rolling update): it holds its journal open
  for its whole life, which a write lease detects (:func:`sole_user`); until it is gone we open
  the checkpoint at the old names and share it under ``checkpoint.lock``, and
  ``Checkpoint.relocate`` moves it on a later repair pass (or at our stop).
- Our own state older than NVIDIA's ``checkpoint.json`` is stale (NVIDIA's plugin ran after
  ours): :func:`stale_state` sets it aside before the checkpoint is opened; the adoption then
  removes its claims' specs unless NVIDIA's checkpoint holds the claim (docs/migration.md).
- A ``checkpoint.json`` in NVIDIA's format (``v2``, else ``v1``) of this boot is imported: every
  claim becomes a record of ours (``PrepareStarted`` ones too, which the first reconcile rolls
  back as ours), written and fdatasync'd in one transaction; only then is NVIDIA's file renamed
  aside (``checkpoint.json.nvidia-adopted-<ts>``), never deleted. A kill -9 before the rename
  imports again at the next start: claims already recorded are skipped, so it happens exactly
  once. An adopted claim keeps its ``.yaml`` spec (cdi.CdiSpecDir.foreign_path) until its
  unprepare removes it; what NVIDIA's driver set up for it beside the spec (an MPS Deployment)
  is named in its recorded config by the step that undoes it (prepare.Step.adopted: the MPS
  step of sharing/), which does so at its unprepare.
- Bad input never fails the start: an unreadable file is renamed aside
  (``.unreadable-<ts>``); a claim whose device this node lacks, whose config or allocation we
  cannot read, or whose completed spec is missing is left out and reported.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import signal
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from dra_driver import cdi
from dra_driver.errors import CdiError, CheckpointError, PrepareError
from dra_driver.fsutil import fsync_dir
from dra_driver.prepare.plan import ClaimRef, get, plan_claim
from dra_driver.prepare.state.checkpoint import (
    PREPARE_COMPLETED,
    PREPARE_STARTED,
    Checkpoint,
    ClaimRecord,
    Claims,
    PreparedDevice,
    read_state,
)
from dra_driver.prepare.step import Step
from dra_driver.prepare.targets import DeviceTarget

log = logging.getLogger("dra_driver.prepare")

LEGACY_NAME = "checkpoint.json"  # NVIDIA's state file, and ours before gpu-dra-checkpoint.json
STATE_NAME = "gpu-dra-checkpoint.json"

FileKind = Literal["absent", "ours", "nvidia", "unreadable"]


def classify(path: Path) -> tuple[FileKind, Any]:
    """What ``path`` holds: nothing, our snapshot, NVIDIA's checkpoint (with its parsed JSON),
    or something unreadable (the reason)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return "absent", None
    except OSError as exc:
        return "unreadable", str(exc)
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        return "unreadable", f"not valid JSON ({exc})"
    if isinstance(obj, dict) and "version" in obj and "data" in obj:
        return "ours", obj
    if isinstance(obj, dict) and (
        isinstance(obj.get("v2"), dict) or isinstance(obj.get("v1"), dict)
    ):
        return "nvidia", obj
    return "unreadable", "neither NVIDIA's checkpoint format (v1, v2) nor ours"


def _journal(path: Path) -> Path:
    return path.with_name(path.stem + ".journal")


def _lock(path: Path) -> Path:
    return path.with_name(path.stem + ".lock")


@contextmanager
def sole_user(path: Path) -> Iterator[bool]:
    """Whether no open file of ``path`` exists, this process's included: the kernel grants a
    write lease (fcntl(2) ``F_SETLEASE``) only then, whatever PID namespace the other opener is
    in. The lease is held for the block, so another process's ``open()`` of ``path`` waits (the
    lease break) until the block ends. A missing file has no user. Where no lease can be taken
    (a file system without them) the answer is False: keep sharing the old names."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        yield True
        return
    try:
        # a lease break signals the holder, SIGIO by default, which would kill us: SIGURG is
        # ignored unless handled (we only hold the lease for two renames)
        fcntl.fcntl(fd, fcntl.F_SETSIG, signal.SIGURG)
        try:
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EBUSY):
                log.warning(
                    "cannot tell whether an earlier release still uses its checkpoint (no file "
                    "lease here); keeping its names",
                    extra={"path": str(path), "error": str(exc)},
                )
            yield False
            return
        try:
            yield True
        finally:
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
    finally:
        os.close(fd)


def _written_ns(path: Path) -> int:
    """When the snapshot at ``path`` or its journal was last written (0: neither exists)."""
    return max((p.stat().st_mtime_ns for p in (path, _journal(path)) if p.exists()), default=0)


def _set_aside_pair(path: Path, why: str) -> Path:
    """Rename the snapshot at ``path`` and its journal aside with one suffix (durably)."""
    moved = _set_aside(path, why)
    journal = _journal(path)
    if journal.exists():
        os.rename(journal, journal.with_name(journal.name + moved.name[len(path.name) :]))
        fsync_dir(path.parent)
    return moved


def _move(legacy: Path, target: Path) -> None:
    """Our earlier ``legacy`` files to ``target``'s names (its lock and a lease held).

    Both names holding a snapshot (a downgrade to the earlier release and back; or, rarely, an
    agent of it restarted after the move): the one written last is the node's state and is
    kept; the other is set aside (``.superseded-<ts>``), never deleted. A crash between the two
    renames leaves no snapshot at ``target``, so it is not mistaken for this."""
    if target.exists():
        older = target if _written_ns(legacy) > _written_ns(target) else legacy
        moved = _set_aside_pair(older, "superseded")
        log.warning(
            "our checkpoint exists under both names; kept the one written last, set the other "
            "aside",
            extra={"kept": str(legacy if older is target else target), "moved_to": str(moved)},
        )
        if older is legacy:
            return
    # journal first: until the snapshot moves, the next start migrates again
    if _journal(legacy).exists():
        os.rename(_journal(legacy), _journal(target))
    os.rename(legacy, target)
    log.info(
        "moved the checkpoint of an earlier release to its own name (NVIDIA's plugin "
        "reads checkpoint.json)",
        extra={"from": str(legacy), "to": str(target)},
    )
    fsync_dir(legacy.parent)


@contextmanager
def checkpoint_names(legacy: Path, target: Path) -> Iterator[Path]:
    """Where to open our checkpoint, ``target`` or ``legacy``: open it inside the block.

    ``legacy`` in our format (an earlier release's) is moved to ``target``'s names (bytes
    unchanged) when no process has its journal open (:func:`sole_user`). While one has, an
    agent of that release runs beside us (a rolling update: docs/plugin.md) and keeps writing
    there: the block gets ``legacy``, and both share the files under ``checkpoint.lock`` as two
    instances of one release do; ``Checkpoint.relocate`` moves them once it is gone. The
    decision is made under ``checkpoint.lock``, and the journal is kept open until the block
    ends, so that no other instance moves the files before ours is open on them.
    """
    if not legacy.exists():
        yield target
        return
    lock = os.open(_lock(legacy), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    pin, names = -1, target
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if classify(legacy)[0] == "ours":
            with sole_user(_journal(legacy)) as alone:
                if alone:
                    _move(legacy, target)
            if not alone:
                pin = os.open(_journal(legacy), os.O_RDONLY | os.O_CLOEXEC)
                names = legacy
                log.info(
                    "an agent of an earlier release still uses checkpoint.json: sharing it, "
                    "moved to our own name once that agent is gone",
                    extra={"path": str(legacy)},
                )
    finally:
        os.close(lock)
    if names == target:
        _lock(legacy).unlink(missing_ok=True)
    try:
        yield names
    finally:
        if pin >= 0:
            os.close(pin)


def migrate_own_checkpoint(legacy: Path, target: Path) -> bool:
    """Move our earlier release's ``checkpoint.json`` (+ journal) to ``target``'s names, bytes
    unchanged, unless a process still has them open (:func:`checkpoint_names`). Run while no
    checkpoint of ours is open on either names. Idempotent; True when moved.

    Both names holding a snapshot: the one written last wins, the other is set aside
    (:func:`_move`).
    """
    ours = classify(legacy)[0] == "ours"
    with checkpoint_names(legacy, target) as names:
        return ours and names == target


def stale_state(legacy: Path, target: Path) -> tuple[dict[str, ClaimRecord], Path | None]:
    """Set our state at ``target`` aside when NVIDIA's plugin ran after it (docs/migration.md,
    "Switching back and forth"): ``legacy`` is NVIDIA's checkpoint, written after every file of
    ours. We never write ``checkpoint.json`` and rename NVIDIA's aside when adopting it, so such
    a file is NVIDIA's plugin's work since; a crash in the middle of an adoption leaves our
    journal (or fresh snapshot) newer than NVIDIA's file, so it is not mistaken for this. Run
    before our checkpoint is opened. Returns the claims our state held (to clear their specs)
    and where it was moved; ``({}, None)`` when it is not stale."""
    if classify(legacy)[0] != "nvidia":
        return {}, None
    try:
        ours = max(p.stat().st_mtime_ns for p in (target, _journal(target)) if p.exists())
    except ValueError:
        return {}, None  # no state of ours
    if legacy.stat().st_mtime_ns <= ours:
        return {}, None
    try:
        claims = read_state(target)[1]
    except (CheckpointError, OSError, ValueError):
        claims = {}
    moved = _set_aside_pair(target, "stale")
    log.warning(
        "our checkpoint is older than NVIDIA's (its plugin ran after ours): set aside, none of "
        "its claims counts as prepared",
        extra={"moved_to": str(moved), "claims": sorted(claims)},
    )
    return claims, moved


def recorded_names(legacy: Path, *, boot_id: str) -> frozenset[str]:
    """The device names a ``checkpoint.json`` at ``legacy`` records for this boot, read-only:
    NVIDIA's (the claims :func:`adopt_nvidia_checkpoint` will record) or an earlier release's.
    For mig/dynamic.py, which decides which MIG devices are ours before the plugin opens."""
    kind, obj = classify(legacy)
    if kind == "ours":
        recorded_boot, claims = read_state(legacy)
        if recorded_boot != boot_id:
            return frozenset()
        return frozenset(d.device for r in claims.values() for d in r.devices)
    if kind != "nvidia":
        return frozenset()
    version = obj["v2"] if isinstance(obj.get("v2"), dict) else obj["v1"]
    if str(version.get("nodeBootID") or obj.get("nodeBootID") or boot_id) != boot_id:
        return frozenset()
    return frozenset(
        str(result.get("device"))
        for entry in (version.get("preparedClaims") or {}).values()
        for result in get(entry, "status", "allocation", "devices", "results") or []
    )


@dataclass
class Adoption:
    """What :func:`adopt_nvidia_checkpoint` did, for the log line and the Node Event."""

    found: bool = False
    moved_to: Path | None = None
    adopted: list[str] = field(default_factory=list)
    rolled_back: list[str] = field(default_factory=list)  # PrepareStarted: recorded to undo
    discarded_after_reboot: int = 0
    stale: list[str] = field(default_factory=list)  # our claims from before NVIDIA's plugin ran
    stale_moved_to: Path | None = None
    skipped: dict[str, str] = field(default_factory=dict)  # claim UID -> why
    unreadable: str = ""

    def message(self) -> str:
        if not self.found:
            return ""
        where = self.moved_to.name if self.moved_to is not None else "its place"
        if self.unreadable:
            return (
                f"NVIDIA's DRA checkpoint could not be read ({self.unreadable}); it was moved "
                f"to {where} and nothing was adopted."
            )
        parts = [f"adopted {len(self.adopted)} claim(s) prepared by NVIDIA's DRA driver"]
        if self.rolled_back:
            parts.append(f"{len(self.rolled_back)} half-prepared claim(s) to roll back")
        if self.stale:
            where_ours = self.stale_moved_to.name if self.stale_moved_to else "aside"
            parts.append(
                f"{len(self.stale)} claim(s) of gpu-dra's own from before NVIDIA's driver ran "
                f"set aside as stale (its checkpoint is newer; ours moved to {where_ours})"
            )
        if self.discarded_after_reboot:
            parts.append(f"{self.discarded_after_reboot} claim(s) from an earlier boot dropped")
        if self.skipped:
            parts.append(
                "not adopted: "
                + "; ".join(f"{uid}: {why}" for uid, why in sorted(self.skipped.items()))
            )
        return ", ".join(parts) + f"; NVIDIA's checkpoint was moved to {where}."


def adopt_nvidia_checkpoint(
    legacy: Path,
    *,
    checkpoint: Checkpoint,
    specs: cdi.CdiSpecDir,
    targets: Mapping[str, DeviceTarget],
    driver_name: str,
    node_name: str,
    cdi_vendor: str,
    steps: Sequence[Step] = (),
    stale: Mapping[str, ClaimRecord] | None = None,
    stale_moved_to: Path | None = None,
) -> Adoption:
    """Import NVIDIA's checkpoint at ``legacy`` into ``checkpoint`` (open), then rename it
    aside. Idempotent and crash-safe (module docstring); never raises for bad input.
    ``steps``: the preparer's, each adding to an adopted device's recorded config what its
    undo needs (Step.adopted).

    ``stale``: our own claims :func:`stale_state` set aside. Their ``.json`` specs go before
    the import is committed, except where NVIDIA's checkpoint holds the claim without its own
    ``.yaml`` spec: ours then serves NVIDIA's device IDs (the same names) and is adopted."""
    result = Adoption(stale=sorted(stale or {}), stale_moved_to=stale_moved_to)
    result.found = bool(result.stale)
    kind, obj = classify(legacy)
    if kind in ("absent", "ours"):
        return result
    result.found = True
    if kind == "unreadable":
        result.unreadable = str(obj)
        result.moved_to = _set_aside(legacy, "unreadable")
        log.error(
            "NVIDIA's checkpoint is unreadable; moved it aside, nothing adopted",
            extra={"path": str(legacy), "moved_to": str(result.moved_to), "reason": obj},
        )
        return result
    version = obj["v2"] if isinstance(obj.get("v2"), dict) else obj["v1"]
    boot_id = version.get("nodeBootID") or obj.get("nodeBootID")
    claims = version.get("preparedClaims") or {}
    if not isinstance(claims, dict):
        claims = {}
    if boot_id and str(boot_id) != checkpoint.boot_id:
        result.discarded_after_reboot = len(claims)
        claims = {}
    records: dict[str, ClaimRecord] = {}
    for uid, entry in sorted(claims.items()):
        try:
            records[str(uid)] = _record(
                str(uid), entry, specs=specs, targets=targets, driver_name=driver_name,
                node_name=node_name, cdi_vendor=cdi_vendor, steps=steps,
                ours_stale=str(uid) in result.stale,
            )  # fmt: skip
        except (PrepareError, CdiError, KeyError, TypeError, ValueError, AttributeError) as exc:
            result.skipped[str(uid)] = str(exc) or type(exc).__name__
    for uid in result.stale:
        try:
            if uid not in records:
                specs.remove(uid)  # ours (and an earlier adopted .yaml): nobody holds it now
            elif specs.is_foreign(uid):
                specs.path_for(uid).unlink(missing_ok=True)  # NVIDIA's .yaml serves its names
        except (CdiError, OSError) as exc:
            log.warning("cannot remove a stale claim's spec", extra={"claim_uid": uid,
                        "error": str(exc)})  # fmt: skip

    def op(table: Claims) -> None:
        for uid, record in records.items():
            if uid not in table:  # imported before a crash, or prepared since
                table[uid] = record

    checkpoint.transact(op)  # fdatasync'd before NVIDIA's file moves
    for uid, record in records.items():
        (result.rolled_back if record.phase == PREPARE_STARTED else result.adopted).append(uid)
    result.moved_to = _set_aside(legacy, "nvidia-adopted")
    log.info(
        "adopted the claims NVIDIA's DRA driver prepared; its checkpoint was moved aside",
        extra={"adopted": result.adopted, "rolled_back": result.rolled_back,
               "skipped": result.skipped, "discarded_after_reboot": result.discarded_after_reboot,
               "moved_to": str(result.moved_to)},
    )  # fmt: skip
    return result


def _record(
    uid: str,
    entry: Mapping[str, Any],
    *,
    specs: cdi.CdiSpecDir,
    targets: Mapping[str, DeviceTarget],
    driver_name: str,
    node_name: str,
    cdi_vendor: str,
    steps: Sequence[Step],
    ours_stale: bool = False,
) -> ClaimRecord:
    """One of NVIDIA's claims as our record; PrepareError (or a lookup error) says why not."""
    state = entry.get("checkpointState", PREPARE_COMPLETED)  # v1 holds completed claims only
    if state not in (PREPARE_STARTED, PREPARE_COMPLETED):
        raise ValueError(f"unknown checkpointState {state!r}")
    spec = specs.foreign_path(uid)  # CdiError for a UID that is no UUID
    if ours_stale and not spec.exists() and specs.path_for(uid).exists():
        spec = specs.path_for(uid)  # ours, of the same device names: it serves NVIDIA's IDs
    if state == PREPARE_COMPLETED and not spec.exists():
        raise PrepareError(f"its CDI spec {spec.name} is missing")
    namespace, name = str(entry.get("namespace") or ""), str(entry.get("name") or "")
    claim = {"metadata": {"uid": uid}, "status": entry.get("status") or {}}
    plan = plan_claim(
        ClaimRef(namespace=namespace or "-", name=name or "-", uid=uid),
        claim,
        driver_name=driver_name,
        node_name=node_name,
        targets=targets,
    )
    theirs = _nvidia_devices(entry)
    devices = []
    for planned in plan.devices:
        d = theirs.get((planned.target.name, planned.request)) or theirs.get(
            (planned.target.name, "*"), {}
        )
        config = dict(planned.config_json)
        for step in steps:
            config.update(step.adopted(planned, claim_uid=uid))
        consumed = planned.result.get("consumedCapacity") or {}
        ids = d.get("CDIDeviceIDs") or [
            cdi.cdi_device_id(vendor=cdi_vendor, claim_uid=uid, device_name=planned.target.name)
        ]
        devices.append(
            PreparedDevice(
                request_names=tuple(str(r) for r in d.get("Requests") or [planned.request]),
                pool=str(d.get("PoolName") or planned.pool),
                device=planned.target.name,
                cdi_device_ids=tuple(str(c) for c in ids),
                share_id=None if not d.get("ShareID") else str(d["ShareID"]),
                admin_access=planned.admin_access,
                config=config,
                consumed_capacity={str(k): str(v) for k, v in consumed.items()},
            )
        )
    return ClaimRecord(uid=uid, namespace=namespace, name=name, phase=state, devices=tuple(devices))


def _nvidia_devices(entry: Mapping[str, Any]) -> dict[tuple[str, str], Mapping[str, Any]]:
    """NVIDIA's prepared devices (the ``D`` of each gpu or mig entry), by (device, request)."""
    found: dict[tuple[str, str], Mapping[str, Any]] = {}
    for group in entry.get("preparedDevices") or []:
        for device in get(group, "devices") or []:
            for kind in ("gpu", "mig"):
                d = get(device, kind, "device")
                if isinstance(d, Mapping):
                    for request in [*(d.get("Requests") or []), "*"]:
                        found[(str(d.get("DeviceName")), str(request))] = d
    return found


def _set_aside(path: Path, why: str) -> Path:
    """Rename ``path`` to ``<name>.<why>-<timestamp>`` in its directory (durably)."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = path.with_name(f"{path.name}.{why}-{stamp}")
    n = 0
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.{why}-{stamp}-{n}")
    os.rename(path, target)
    fsync_dir(path.parent)
    return target
