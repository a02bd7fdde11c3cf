"""Switching a running node in place: the state file NVIDIA's plugin and our earlier releases
both called ``checkpoint.json``, sorted out once at start, before the plugin serves.

Flow position: plugin/server.py (start) -> :func:`migrate_own_checkpoint` before the checkpoint
is opened, :func:`adopt_nvidia_checkpoint` right after it (before the first reconcile) ->
checkpoint.py + cdi/. Format of NVIDIA's file, spec names and MPS Deployments:
shared/spec/nvidia-compat.md "Switching in place"; the operator's side: docs/migration.md.

- Our own state lives in ``gpu-dra-checkpoint.json`` (+ ``.journal``, ``.lock``), so NVIDIA's
  plugin never reads it. A ``checkpoint.json`` in our format (an earlier release) is moved to
  the new names by two renames, journal first: this runs before the checkpoint is opened, so a
  crash between them leaves a state the next start finishes (the snapshot is still ours at the
  old name). The bytes are unchanged.
- A ``checkpoint.json`` in NVIDIA's format (``v2``, else ``v1``) of this boot is imported: every
  claim becomes a record of ours (``PrepareStarted`` ones too, which the first reconcile rolls
  back as ours), written and fdatasync'd in one transaction; only then is NVIDIA's file renamed
  aside (``checkpoint.json.nvidia-adopted-<ts>``), never deleted. A kill -9 before the rename
  imports again at the next start: claims already recorded are skipped, so it happens exactly
  once. An adopted claim keeps its ``.yaml`` spec (cdi.CdiSpecDir.foreign_path) until its
  unprepare removes it; its NVIDIA MPS Deployment is named in its recorded config
  (:data:`NVIDIA_MPS_KEY`, read by sharing/mps_step.py), stopped at its unprepare.
- Bad input never fails the start: an unreadable file is renamed aside
  (``.unreadable-<ts>``); a claim whose device this node lacks, whose config or allocation we
  cannot read, or whose completed spec is missing is left out and reported.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from dra_driver import cdi
from dra_driver.errors import CdiError, PrepareError
from dra_driver.fsutil import fsync_dir
from dra_driver.prepare.checkpoint import (
    PREPARE_COMPLETED,
    PREPARE_STARTED,
    Checkpoint,
    ClaimRecord,
    Claims,
    PreparedDevice,
)
from dra_driver.prepare.plan import ClaimRef, get, plan_claim
from dra_driver.prepare.targets import DeviceTarget

log = logging.getLogger("dra_driver.prepare")

LEGACY_NAME = "checkpoint.json"  # NVIDIA's state file, and ours before gpu-dra-checkpoint.json
STATE_NAME = "gpu-dra-checkpoint.json"
# NVIDIA's chart installs into this namespace; its MPS Deployments live there
NVIDIA_NAMESPACE = "nvidia-dra-driver-gpu"
# in an adopted MPS device's recorded config: "<namespace>/<name>" of NVIDIA's Deployment
NVIDIA_MPS_KEY = "nvidiaMpsDeployment"

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


def migrate_own_checkpoint(legacy: Path, target: Path) -> bool:
    """Move our earlier release's ``checkpoint.json`` (+ journal) to ``target``'s names, bytes
    unchanged. Run before the checkpoint at ``target`` is opened. Idempotent; True when moved.

    A target snapshot that already exists wins (a crash after its rename): the leftovers at the
    old names are then removed, never read.
    """
    kind, _ = classify(legacy)
    legacy_journal = legacy.with_name(legacy.stem + ".journal")
    if kind != "ours":
        return False
    target_journal = target.with_name(target.stem + ".journal")
    lock = os.open(legacy.with_name(legacy.stem + ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # an instance of an earlier release may still write
        if target.exists():
            log.warning(
                "removing our earlier checkpoint left at NVIDIA's path by an interrupted "
                "migration; the migrated one is in use",
                extra={"path": str(legacy), "migrated": str(target)},
            )
            legacy_journal.unlink(missing_ok=True)
            legacy.unlink(missing_ok=True)
        else:
            # journal first: until the snapshot moves, the next start migrates again
            if legacy_journal.exists():
                os.rename(legacy_journal, target_journal)
            os.rename(legacy, target)
            log.info(
                "moved the checkpoint of an earlier release to its own name (NVIDIA's plugin "
                "reads checkpoint.json)",
                extra={"from": str(legacy), "to": str(target)},
            )
        fsync_dir(legacy.parent)
    finally:
        os.close(lock)
    legacy.with_name(legacy.stem + ".lock").unlink(missing_ok=True)
    return True


@dataclass
class Adoption:
    """What :func:`adopt_nvidia_checkpoint` did, for the log line and the Node Event."""

    found: bool = False
    moved_to: Path | None = None
    adopted: list[str] = field(default_factory=list)
    rolled_back: list[str] = field(default_factory=list)  # PrepareStarted: recorded to undo
    discarded_after_reboot: int = 0
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
    nvidia_namespace: str = NVIDIA_NAMESPACE,
) -> Adoption:
    """Import NVIDIA's checkpoint at ``legacy`` into ``checkpoint`` (open), then rename it
    aside. Idempotent and crash-safe (module docstring); never raises for bad input."""
    result = Adoption()
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
                node_name=node_name, cdi_vendor=cdi_vendor, nvidia_namespace=nvidia_namespace,
            )  # fmt: skip
        except (PrepareError, CdiError, KeyError, TypeError, ValueError, AttributeError) as exc:
            result.skipped[str(uid)] = str(exc) or type(exc).__name__

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
    nvidia_namespace: str,
) -> ClaimRecord:
    """One of NVIDIA's claims as our record; PrepareError (or a lookup error) says why not."""
    state = entry.get("checkpointState", PREPARE_COMPLETED)  # v1 holds completed claims only
    if state not in (PREPARE_STARTED, PREPARE_COMPLETED):
        raise ValueError(f"unknown checkpointState {state!r}")
    spec = specs.foreign_path(uid)  # CdiError for a UID that is no UUID
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
        sharing = config.get("sharing")
        if isinstance(sharing, Mapping) and sharing.get("strategy") == "MPS":
            config[NVIDIA_MPS_KEY] = f"{nvidia_namespace}/mps-control-daemon-{uid}"
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
