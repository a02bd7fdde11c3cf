"""Repair: what a crash, a reboot or a damaged checkpoint left behind, set right against the
checkpoint (the preparer's ``reconcile``), and the prepared-claim state rebuilt from the CDI specs
on disk after the checkpoint was lost (``rebuild_from_specs``).

Flow position: prepare/state/nodestate.py (at start, then every reconcile interval; after a
damaged checkpoint was set aside) -> :class:`Repair` (over the Preparer it repairs: its claims,
specs and steps) -> cdi/ + the checkpoint, then each step's own reconcile.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from dra_driver import cdi
from dra_driver.errors import CdiError, DraError, PrepareError
from dra_driver.prepare.plan import (
    parse_share_device_name,
    recorded_capabilities,
    recorded_claim,
)
from dra_driver.prepare.preparer import Preparer
from dra_driver.prepare.state.checkpoint import (
    PREPARE_COMPLETED,
    PREPARE_STARTED,
    Checkpoint,
    ClaimRecord,
    Claims,
    PreparedDevice,
)
from dra_driver.prepare.step import Step
from dra_driver.prepare.targets import DeviceTarget

log = logging.getLogger("dra_driver.prepare")  # the one logger of prepare, steps included


def rebuild_from_specs(
    specs: cdi.CdiSpecDir,
    checkpoint: Checkpoint,
    *,
    node_name: str,
    cdi_vendor: str,
    booted_at_s: float = 0.0,
) -> int:
    """Record every claim that has a spec of ours on disk; returns how many were added.

    The spec names the claim's devices (and shares), so they stay protected against double
    use. The claim's namespace/name are unknown until the kubelet prepares it again, which then
    fetches the claim and re-answers from scratch (the spec content is deterministic). Specs
    written before ``booted_at_s`` (the node's boot time) are from an earlier boot: nothing is
    prepared after a reboot, so they are left for reconcile to remove. An unreadable spec is
    removed.
    """
    rebuilt: dict[str, ClaimRecord] = {}
    for uid in sorted(specs.claim_uids()):
        try:
            if specs.path_for(uid).stat().st_mtime < booted_at_s:
                continue
        except FileNotFoundError:
            continue
        content = specs.read(uid)
        if content is None:
            continue
        try:
            names = cdi.device_names_in_spec(content, claim_uid=uid)
        except CdiError as exc:
            log.warning(
                "removing an unreadable CDI spec", extra={"claim_uid": uid, "error": str(exc)}
            )
            specs.remove(uid)
            continue
        rebuilt[uid] = ClaimRecord(
            uid=uid,
            namespace="",
            name="",
            phase=PREPARE_COMPLETED,
            devices=tuple(
                PreparedDevice(
                    request_names=(),
                    pool=node_name,
                    device=parse_share_device_name(name)[0],
                    cdi_device_ids=(
                        cdi.cdi_device_id(vendor=cdi_vendor, claim_uid=uid, device_name=name),
                    ),
                    share_id=parse_share_device_name(name)[1],
                )
                for name in names
            ),
        )

    def op(claims: Claims) -> int:
        added = 0
        for uid, record in rebuilt.items():
            if uid not in claims:
                claims[uid] = record
                added += 1
        return added

    return checkpoint.transact(op)


class Repair:
    """Sets the node right against the checkpoint for ``preparer``: its claims, its specs, its
    steps (all the preparer's; this class only repairs them, at start and on every pass of the
    state's reconcile loop, prepare/state/nodestate.py)."""

    def __init__(self, preparer: Preparer) -> None:
        self._preparer = preparer
        self.specs = preparer.specs
        self.checkpoint = preparer.checkpoint
        self.locks = preparer.locks
        self.steps = preparer.steps

    def reconcile(self) -> dict[str, int]:
        """Repair the node's state; run at start and periodically. Returns what it did.

        - temp files of spec writes a crash interrupted are deleted; spare spec files a dead
          instance left are adopted (or deleted, past ``max_spares``);
        - claims left ``PrepareStarted`` by a crash are rolled back;
        - CDI specs of ours that no claim in the checkpoint owns are removed;
        - claims whose spec disappeared (or rebuilt ones) get their spec written again; one
          holding a partitioned device (dynamic MIG) has its spec compared and rewritten when
          its instance was made again;
        - claims no pod can use any more (deleted, re-created, deallocated, reserved for no
          pod: plan.stale_reason) are unprepared;
        - then each step reconciles the node with the checkpoint.
        Claims another thread or instance is working on right now are left alone.
        """
        done = {"rolled_back": 0, "orphan_specs_removed": 0, "specs_rewritten": 0,
                "unprepared_gone": 0, "temp_files_removed": 0}  # fmt: skip
        preparer = self._preparer
        devices = preparer.current
        devices.recheck_nodes()  # a node removed since is made again by the next prepare
        preparer.check_nodes(devices)  # those there now need no look on the prepare path
        _, done["stale_spares_removed"] = self.specs.collect_spares()
        for uid, temp in self.specs.temp_files():  # spec writes happen under the claim's lock
            with self.locks.try_hold(uid) as held:
                if held and self.specs.remove_temp_file(temp):
                    done["temp_files_removed"] += 1
        records = self.checkpoint.snapshot()
        for uid, record in records.items():
            if record.phase != PREPARE_STARTED:
                continue
            with self.locks.try_hold(uid) as held:
                current = self.checkpoint.get(uid) if held else None
                if current is not None and current.phase == PREPARE_STARTED:
                    try:
                        preparer.roll_back(current)
                    except PrepareError as exc:
                        log.error(
                            "cannot roll back a half-done prepare; will retry",
                            extra={"claim_uid": uid, "error": str(exc)},
                        )
                        continue
                    done["rolled_back"] += 1
        for uid in sorted(self.specs.claim_uids() - set(records)):
            with self.locks.try_hold(uid) as held:
                if held and self.checkpoint.get(uid) is None and self.specs.remove(uid):
                    done["orphan_specs_removed"] += 1
        targets = preparer.current.targets  # one version for the pass
        for uid, record in self.checkpoint.snapshot().items():
            if record.phase != PREPARE_COMPLETED:
                continue
            with self.locks.try_hold(uid) as held:
                if not held:
                    continue
                reason = preparer.stale_reason(record) if record.namespace else None
                if reason is None:
                    if self._rewrite_spec(record, targets):
                        done["specs_rewritten"] += 1
                    continue
                log.info(
                    "unpreparing a claim no pod can use any more",
                    extra={"claim_uid": uid, "claim": f"{record.namespace}/{record.name}",
                           "reason": reason},
                )  # fmt: skip
                preparer.unprepare_locked(uid)
                done["unprepared_gone"] += 1
        for step in self.steps:
            for key, n in step.reconcile().items():
                done[key] = done.get(key, 0) + n
        preparer.forget_pods_but(self.checkpoint.snapshot())  # another instance unprepared
        return done

    def _rewrite_spec(self, record: ClaimRecord, targets: Mapping[str, DeviceTarget]) -> bool:
        """Write a prepared claim's spec again when it is missing; one holding a partitioned
        device (its instance may have been made again, with other ids) is compared and written
        when it differs. Each step gives its plan of the claim (and repairs what it needs:
        step.Step.recorded). A device gone since the claim was prepared (the plugin reports
        those) has no nodes to give; a spec needs at least one device. True when written."""
        if self.specs.is_foreign(record.uid):
            return False  # adopted from NVIDIA's driver: its spec stays as it is (switchover)
        claim = recorded_claim(record, targets)
        compare = any(d.target.partitioned for d in claim.devices)
        if not compare and self.specs.path_for(record.uid).exists():
            return False
        steps: list[tuple[Step, object]] = []
        try:
            for step in self.steps:
                step_plan = step.recorded(record, claim)
                if step_plan is not None:
                    steps.append((step, step_plan))
        except DraError:
            return False  # the step logged why; the next pass tries again
        if not claim.devices:
            return False
        spec = self._preparer.encode_spec(
            record.uid, claim.devices, recorded_capabilities(record), steps
        )
        if compare and spec == self.specs.read(record.uid):
            return False
        self.specs.write(record.uid, spec)
        return True

    def rebuild_from_specs(self, *, booted_at_s: float = 0.0) -> int:
        """After the checkpoint was lost: record every claim that has a spec of ours on disk
        (below)."""
        return rebuild_from_specs(
            self.specs,
            self.checkpoint,
            node_name=self._preparer.node_name,
            cdi_vendor=self._preparer.cdi_vendor,
            booted_at_s=booted_at_s,
        )
