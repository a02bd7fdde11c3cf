"""Repair: what a crash, a reboot or a damaged checkpoint left behind, set right against the
checkpoint (the preparer's ``reconcile``), and the prepared-claim state rebuilt from the CDI specs
on disk after the checkpoint was lost (``rebuild_from_specs``).

Flow position: plugin/ (at start, then every reconcile interval; after a damaged checkpoint was
set aside) -> Preparer.reconcile / rebuild_from_specs (the :class:`Repair` half of the
preparer) -> cdi/ + checkpoint.py, then each step's own reconcile.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from dra_driver import cdi
from dra_driver.errors import CdiError, DraError, KubeError, PrepareError
from dra_driver.prepare.plan import (
    ClaimSource,
    PlannedDevice,
    get,
    parse_share_device_name,
    recorded_capabilities,
    recorded_claim,
    reserved_pods,
    stale_reason,
)
from dra_driver.prepare.state.checkpoint import (
    PREPARE_COMPLETED,
    PREPARE_STARTED,
    Checkpoint,
    ClaimLocks,
    ClaimRecord,
    Claims,
    PreparedDevice,
)
from dra_driver.prepare.step import Step
from dra_driver.prepare.targets import DeviceTarget, TargetSet

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
    """The repair half of prepare.Preparer (its state and its undo are the preparer's)."""

    driver_name: str
    node_name: str
    cdi_vendor: str
    specs: cdi.CdiSpecDir
    checkpoint: Checkpoint
    locks: ClaimLocks
    claims: ClaimSource
    steps: tuple[Step, ...]
    _pods: dict[str, tuple[str, ...]]
    _current: TargetSet

    def _roll_back(self, record: ClaimRecord) -> None:
        raise NotImplementedError

    def _unprepare_locked(self, uid: str) -> None:
        raise NotImplementedError

    def _encode_spec(
        self,
        claim_uid: str,
        devices: Iterable[PlannedDevice],
        capabilities: frozenset[str],
        steps: list[tuple[Step, object]],
    ) -> bytes:
        raise NotImplementedError

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
        self._current.nodes_checked.clear()  # the next prepare checks the shared nodes again
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
                        self._roll_back(current)
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
        targets = self._current.targets  # one version for the pass
        for uid, record in self.checkpoint.snapshot().items():
            if record.phase != PREPARE_COMPLETED:
                continue
            with self.locks.try_hold(uid) as held:
                if not held:
                    continue
                reason = self._stale_reason(record) if record.namespace else None
                if reason is None:
                    if self._rewrite_spec(record, targets):
                        done["specs_rewritten"] += 1
                    continue
                log.info(
                    "unpreparing a claim no pod can use any more",
                    extra={"claim_uid": uid, "claim": f"{record.namespace}/{record.name}",
                           "reason": reason},
                )  # fmt: skip
                self._unprepare_locked(uid)
                done["unprepared_gone"] += 1
        for step in self.steps:
            for key, n in step.reconcile().items():
                done[key] = done.get(key, 0) + n
        live = self.checkpoint.snapshot()  # claims another instance unprepared
        for uid in list(self._pods):
            if uid not in live:
                self._pods.pop(uid, None)
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
        spec = self._encode_spec(record.uid, claim.devices, recorded_capabilities(record), steps)
        if compare and spec == self.specs.read(record.uid):
            return False
        self.specs.write(record.uid, spec)
        return True

    def _clear_stale(self, holders: Iterable[str]) -> bool:
        """Unprepare those of ``holders`` (claims holding devices a prepare wants) that the API
        server says no pod can use any more: a record whose unprepare was lost never blocks a
        device. True when one was cleared. A holder being worked on right now is left alone."""
        cleared = False
        for uid in holders:
            record = self.checkpoint.get(uid)
            if record is None or not record.namespace:
                continue
            reason = self._stale_reason(record)
            if reason is None:
                continue
            with self.locks.try_hold(uid) as held:
                if held and self.checkpoint.get(uid) == record:
                    log.warning(
                        "unpreparing a stale claim that held a device another claim needs",
                        extra={"claim_uid": uid, "claim": f"{record.namespace}/{record.name}",
                               "reason": reason},
                    )  # fmt: skip
                    self._unprepare_locked(uid)
                    cleared = True
        return cleared

    def _stale_reason(self, record: ClaimRecord) -> str | None:
        """Why no pod on this node can use the prepared claim any more, by the API server
        (plan.stale_reason); None while one may, or when the server cannot be asked (never
        guess). Remembers the pods the claim is reserved for."""
        try:
            claim = self.claims.get_resource_claim(namespace=record.namespace, name=record.name)
        except KubeError as exc:
            log.warning(
                "cannot check whether a prepared claim is still in use; will retry",
                extra={"claim_uid": record.uid, "error": str(exc)},
            )
            return None
        if claim is not None and get(claim, "metadata", "uid") == record.uid:
            self._pods[record.uid] = reserved_pods(claim)
        return stale_reason(record, claim, driver_name=self.driver_name, node_name=self.node_name)

    def rebuild_from_specs(self, *, booted_at_s: float = 0.0) -> int:
        """After the checkpoint was lost: record every claim that has a spec of ours on disk
        (below)."""
        return rebuild_from_specs(
            self.specs,
            self.checkpoint,
            node_name=self.node_name,
            cdi_vendor=self.cdi_vendor,
            booted_at_s=booted_at_s,
        )
