"""The preparer core: records a claim, runs the steps that apply to its devices, writes its CDI
spec, records completion; undoes the steps in reverse on unprepare or rollback; repairs the
node against the checkpoint (``reconcile``). It knows no feature: time slicing, MPS, shares and
MIG are steps (step.py) that node/ hands it.

Flow position: plugin/ (gRPC) -> here -> plan.py (the claim checked) -> the steps -> cdi/
(spec files) + state/checkpoint.py (state). Repair (reconcile, the rebuild from specs) is
repair.py's class, which works on a Preparer.

Prepare of one claim (spec C.7, nvidia-compat.md "Checkpoint"):
1. Validate what the kubelet sent (the UID is a UUID, so it can safely name a file).
2. Hold the claim's lock; a claim already ``PrepareCompleted`` (with its spec on disk) returns the
   recorded answer without side effects (idempotent); a half-done one is rolled back first.
3. GET the ResourceClaim and plan it (plan.py); each step plans from it and refuses what it
   cannot carry out, before anything changes.
4. Each step applies in order; the first that changes the node has the claim recorded
   ``PrepareStarted`` (durably) first; a failure rolls the claim back.
5. Make the device nodes the spec names that are missing (cdi/devnodes.py), write the CDI
   spec (with each step's edits), record ``PrepareCompleted`` (the same checks, the steps'
   included); answer one Device per result.

Unprepare drops the claim from the checkpoint, then removes its spec, then has the steps undo in
reverse (a step whose undo needs the record, dynamic MIG, makes it spec, undo, record); an
unknown claim succeeds. ``reconcile`` repairs what a crash, a reboot or a damaged checkpoint
left behind: half-done claims, orphaned and missing specs, stale claims, and each step's own.

Errors of one claim never fail the others: ``prepare_batch``/``unprepare_batch`` return a
per-claim outcome, and independent claims of a batch run concurrently.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

from dra_driver import cdi
from dra_driver.errors import (
    CdiError,
    CheckpointError,
    ClaimFetchFailed,
    ClaimNotFound,
    DeviceConflict,
    KubeError,
    PrepareError,
)
from dra_driver.prepare.limits import batch_refusal
from dra_driver.prepare.outcome import Outcome, error_type
from dra_driver.prepare.plan import (
    ClaimPlan,
    ClaimRef,
    ClaimSource,
    PlannedDevice,
    answer,
    get,
    owner,
    plan_claim,
    reserved_pods,
    stale_reason,
    validate_ref,
)
from dra_driver.prepare.state.checkpoint import (
    PREPARE_COMPLETED,
    PREPARE_STARTED,
    Checkpoint,
    ClaimLocks,
    ClaimRecord,
    Claims,
    Phase,
    PreparedDevice,
)
from dra_driver.prepare.step import Step, StepFactory, no_steps, steps_of
from dra_driver.prepare.targets import DeviceTarget, TargetSet

log = logging.getLogger("dra_driver.prepare")  # the one logger of prepare, steps included

_Planned = list[tuple[Step, Any]]  # the steps that apply to a claim, with their plans


class ClaimPreparer(Protocol):
    """What the kubelet plugin serves (plugin/kubelet.py): batches of claims prepared and
    unprepared, one outcome per distinct claim UID, one bad claim never failing the others.
    prepare/state's PrepareState is one (over a Preparer)."""

    def prepare_batch(self, refs: Sequence[ClaimRef]) -> dict[str, Outcome]: ...

    def unprepare_batch(self, refs: Sequence[ClaimRef]) -> dict[str, Outcome]: ...


class _Node:
    """What the steps may read of a preparer (step.NodeState)."""

    def __init__(self, preparer: Preparer) -> None:
        self._preparer = preparer

    @property
    def targets(self) -> Mapping[str, DeviceTarget]:
        return self._preparer.targets

    @property
    def locks(self) -> ClaimLocks:
        return self._preparer.locks

    @property
    def state_dir(self) -> Path:
        return self._preparer.checkpoint.path.parent

    def records(self) -> Mapping[str, ClaimRecord]:
        return self._preparer.checkpoint.snapshot()

    def record(self, uid: str) -> ClaimRecord | None:
        return self._preparer.checkpoint.get(uid)

    def in_flight(self) -> Sequence[ClaimPlan]:
        return tuple(self._preparer._planning.values())


class Preparer:
    """Prepares and unprepares claims; safe to call from many threads and two processes.
    ``steps`` builds the features' steps (node/ wires them; none: devices and driver files
    only)."""

    def __init__(
        self,
        *,
        driver_name: str,
        node_name: str,
        cdi_vendor: str,
        targets: Mapping[str, DeviceTarget],
        files: cdi.DriverFiles,
        specs: cdi.CdiSpecDir,
        checkpoint: Checkpoint,
        locks: ClaimLocks,
        claims: ClaimSource,
        max_parallel_claims: int = 16,
        steps: StepFactory = no_steps,
    ) -> None:
        self.driver_name = driver_name
        self.node_name = node_name
        self.cdi_vendor = cdi_vendor
        self._current = TargetSet.build(targets, files)
        self.check_nodes(self._current)  # here, not on the first prepare of each device
        self._spec_encoder = cdi.ClaimSpecEncoder(vendor=cdi_vendor, files=files)
        self.specs = specs
        self.checkpoint = checkpoint
        self.locks = locks
        self.claims = claims
        self._pool = ThreadPoolExecutor(max_workers=max_parallel_claims, thread_name_prefix="claim")
        # Separate from _pool: a claim running in _pool waits on its spec's fsync. One thread:
        # it is used only while a single prepare is in flight (_sync_spec).
        self._spec_writes = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cdi-sync")
        self._in_flight = 0
        self._in_flight_lock = threading.Lock()
        # claim uid -> the pods its status.reservedFor named when prepare or reconcile last read
        # it (for telemetry: which pod holds a device). Costs no request of its own.
        self._pods: dict[str, tuple[str, ...]] = {}
        # claim uid -> its plan, while it is being prepared (a step keeps what such a claim
        # is about to use: step.NodeState.in_flight).
        self._planning: dict[str, ClaimPlan] = {}
        self.steps: tuple[Step, ...] = tuple(steps(_Node(self)))
        # Only these can make unprepare keep the record until their undo (saves a checkpoint
        # read on every unprepare otherwise).
        self._keepers = tuple(
            s for s in self.steps if type(s).keeps_record is not Step.keeps_record
        )

    @property
    def targets(self) -> Mapping[str, DeviceTarget]:
        """The devices prepare accepts now (read-only; replaced whole by set_targets)."""
        return self._current.targets

    @property
    def current(self) -> TargetSet:
        """The current version of the devices (replaced whole by set_targets)."""
        return self._current

    @property
    def files(self) -> cdi.DriverFiles:
        """The driver files the current targets' device nodes were made from."""
        return self._current.files

    def set_targets(self, targets: Mapping[str, DeviceTarget], files: cdi.DriverFiles) -> None:
        """Make ``targets`` the devices prepare accepts (after a re-discovery changed them).

        The new version, device nodes included, is built first and then swapped in with one
        assignment: a prepare, a reconcile pass or a scrape reads the old devices or the new
        ones, never a mix, and no lock is taken on the prepare path. ``files`` may differ from
        the current files only in the device numbers a driver reload changes
        (cdi.DriverFiles.renumbered_from); the edits every spec shares stay those the specs were
        made with. Claims already prepared keep their specs, and one holding a device that is
        gone can still be unprepared (unprepare needs no target).
        """
        if not files.renumbered_from(self._current.files):
            raise ValueError("set_targets: only the device numbers of the files may change")
        current = TargetSet.build(targets, files)
        self.check_nodes(current)  # here, not on the first prepare of each device
        self._current = current

    @staticmethod
    def check_nodes(current: TargetSet) -> None:
        """Note which of the devices' own nodes exist now (one stat each, in the caller's
        thread: the agent's start, a re-discovery, the reconcile loop), so that a prepare only
        looks for (and makes) the ones that did not (TargetSet.own_nodes_checked)."""
        current.own_nodes_checked.update(current.files.present_nodes(current.own_node_paths()))

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._spec_writes.shutdown(wait=True, cancel_futures=True)
        for step in self.steps:
            step.close()

    # -- batches -----------------------------------------------------------------------------

    def prepare_batch(self, refs: Sequence[ClaimRef]) -> dict[str, Outcome]:
        """Prepare every claim; one outcome per distinct UID, claims handled concurrently."""
        return self._batch(refs, self._prepare_outcome)

    def unprepare_batch(self, refs: Sequence[ClaimRef]) -> dict[str, Outcome]:
        return self._batch(refs, self._unprepare_outcome)

    def _batch(
        self, refs: Sequence[ClaimRef], one: Callable[[ClaimRef], Outcome]
    ) -> dict[str, Outcome]:
        unique = list({r.uid: r for r in refs}.values())
        refused = batch_refusal(len(unique))
        if refused is not None:
            return {
                r.uid: Outcome(error=str(refused), error_type=error_type(refused)) for r in unique
            }
        if len(unique) <= 1:
            return {r.uid: one(r) for r in unique}
        return dict(zip((r.uid for r in unique), self._pool.map(one, unique), strict=True))

    def _prepare_outcome(self, ref: ClaimRef) -> Outcome:
        try:
            return Outcome(devices=self.prepare(ref))
        except (PrepareError, CdiError, CheckpointError) as exc:
            log.warning(
                "prepare failed",
                extra={
                    "claim_uid": ref.uid,
                    "claim": f"{ref.namespace}/{ref.name}",
                    "error": str(exc),
                },
            )
            return Outcome(error=str(exc), error_type=error_type(exc))

    def _unprepare_outcome(self, ref: ClaimRef) -> Outcome:
        try:
            return Outcome(devices=self.unprepare(ref))
        except (PrepareError, CdiError, CheckpointError) as exc:
            log.warning("unprepare failed", extra={"claim_uid": ref.uid, "error": str(exc)})
            return Outcome(error=str(exc), error_type=error_type(exc))

    # -- one claim ---------------------------------------------------------------------------

    def prepare(self, ref: ClaimRef) -> tuple[PreparedDevice, ...]:
        """Prepare one claim. Idempotent: a prepared claim returns its recorded devices."""
        validate_ref(ref)
        with self._in_flight_lock:
            self._in_flight += 1
        try:
            return self._prepare(ref)
        finally:
            with self._in_flight_lock:
                self._in_flight -= 1
            self._planning.pop(ref.uid, None)

    def _prepare(self, ref: ClaimRef) -> tuple[PreparedDevice, ...]:
        with self.locks.hold(ref.uid):
            record = self.checkpoint.get(ref.uid)
            if record is not None:
                if (
                    record.phase == PREPARE_COMPLETED
                    and record.namespace
                    and self.specs.has_spec(ref.uid)  # NVIDIA's .yaml for an adopted claim
                ):
                    return record.devices
                # half done (or rebuilt without its claim): undo, then prepare from scratch
                self.roll_back(record)
            claim = self._fetch(ref)
            plan = plan_claim(
                ref,
                claim,
                driver_name=self.driver_name,
                node_name=self.node_name,
                targets=self._current.targets,  # one version of the devices for the whole claim
            )
            steps = steps_of(plan, self.steps)
            devices = tuple(
                answer(d, claim_uid=ref.uid, cdi_vendor=self.cdi_vendor) for d in plan.devices
            )
            if steps:
                self._planning[ref.uid] = plan
                self._apply(plan, steps, devices)
            # The spec goes to a temp file and is fsync'd (see _sync_spec: alone, in a helper
            # thread, overlapping the checkpoint's append and fdatasync). When no step changed
            # the node the record is written once, as PrepareCompleted: the only change this
            # prepare makes on the node is the spec (device nodes the driver lacked stay: they
            # are the driver's), and it becomes visible (the rename) only after the record is
            # durable. A crash before the rename leaves a temp file (reconcile removes it) and
            # a record without its spec (the next prepare of the claim, or reconcile, writes it
            # again); the kubelet hears of success only after both are durable.
            capabilities = frozenset().union(*(d.capabilities for d in plan.devices))
            try:
                spec = self.encode_spec(ref.uid, plan.devices, capabilities, steps, make_nodes=True)
                pending = self.specs.begin(ref.uid, spec)
            except BaseException:
                self._roll_back_quietly(ref.uid)  # undo what the steps changed
                raise
            try:
                synced = self._sync_spec(pending)
                try:
                    self._record(plan, devices, steps, phase=PREPARE_COMPLETED)
                finally:
                    # waits: the temp file is busy till then
                    sync_error = synced.exception() if synced is not None else None
                if sync_error is not None:
                    raise sync_error
                pending.commit()
            except BaseException:
                pending.abort()
                self._roll_back_quietly(ref.uid)
                raise
            self._pods[ref.uid] = reserved_pods(claim)
            return devices

    def _apply(self, plan: ClaimPlan, steps: _Planned, devices: tuple[PreparedDevice, ...]) -> None:
        """Run each step's apply in order. The first step that changes the node has the claim
        recorded ``PrepareStarted`` first (durably, with every check: docs/plugin.md,
        "Durability"), so a crash from then on leaves a record whose rollback undoes it. A
        failure rolls the claim back (its steps undone in reverse). Claim lock held."""
        recorded = False

        def started() -> None:
            nonlocal recorded
            if not recorded:
                self._record(plan, devices, steps, phase=PREPARE_STARTED)
                recorded = True

        for step, step_plan in steps:
            try:
                step.apply(step_plan, plan, started=started)
            except BaseException:
                self._roll_back_quietly(plan.ref.uid)
                raise

    def _record(
        self,
        plan: ClaimPlan,
        devices: tuple[PreparedDevice, ...],
        steps: _Planned,
        *,
        phase: Phase,
    ) -> None:
        """Record the claim in ``phase`` (durably), refusing a device another recorded claim
        holds whole (admin access aside; a share conflicts only with a claim holding its device
        whole), and whatever a step refuses (its check); checked and recorded in one step, so
        two claims racing for a device cannot both have it. The claim's lock is held by the
        caller. A conflict with claims no pod can use any more clears them and tries again."""
        ref = plan.ref
        wanted = {d.target.name for d in plan.devices if not d.admin_access and d.share_id is None}
        shared = {
            d.target.name for d in plan.devices if not d.admin_access and d.share_id is not None
        }

        def op(claims: Claims) -> None:
            for name in sorted(wanted | shared):
                for other in claims.holding(name):
                    if other.uid == ref.uid:
                        continue
                    for held in other.devices:
                        if held.device != name:
                            continue
                        whole = name in wanted or held.share_id is None
                        if whole and not held.admin_access:
                            raise DeviceConflict(
                                f"device {name} is already prepared for claim {owner(other)}",
                                holders=(other.uid,),
                            )
            for step, step_plan in steps:
                step.check(step_plan, plan, claims=claims)
            claims[ref.uid] = ClaimRecord(
                uid=ref.uid, namespace=ref.namespace, name=ref.name, phase=phase, devices=devices
            )

        try:
            self.checkpoint.transact(op)
        except DeviceConflict as exc:
            if not self.clear_stale(exc.holders, holding=ref.uid):
                raise
            self.checkpoint.transact(op)

    def encode_spec(
        self,
        claim_uid: str,
        devices: Iterable[PlannedDevice],
        capabilities: frozenset[str],
        steps: _Planned,
        *,
        make_nodes: bool = False,
    ) -> bytes:
        """The claim's spec: its devices' nodes (one CDI device per share of a device), each
        with what the steps add (env, mounts), and the driver files of ``capabilities`` (the
        union of what its devices' configs ask for). ``make_nodes`` (prepare): first make
        every device node it names that is missing (cdi/devnodes.py; CdiError naming one
        that cannot be made)."""
        current = self._current
        unique = {d.cdi_name: d for d in devices}
        out = []
        for name, device in sorted(unique.items()):
            spec = current.spec_device(device.target)
            if device.share_id is not None:
                spec = replace(spec, name=name)
            for step, step_plan in steps:
                spec = step.edit(step_plan, device, spec=spec)
            out.append(spec)
        if make_nodes:
            # each node once per version of the devices and per reconcile pass, not on every
            # prepare (TargetSet.nodes_checked, own_nodes_checked)
            shared = capabilities not in current.nodes_checked
            checked = current.own_nodes_checked
            own = [node.path for device in out for node in device.nodes if node.path not in checked]
            if own or shared:
                current.files.ensure_claim_nodes(own, capabilities, shared=shared)
                checked.update(own)
                if shared:
                    current.nodes_checked.add(capabilities)
        return self._spec_encoder.encode(claim_uid, out, capabilities)

    def _sync_spec(self, pending: cdi.PendingSpec) -> Future[None] | None:
        """fsync the spec's temp file: in a helper thread when this is the only prepare in
        flight and the spec is on a disk, so the spec's sync and the checkpoint's overlap
        instead of adding up (the rest of the write stays in this thread: two threads of Python
        would only take turns); here and now when others are in flight, whose work fills the
        wait anyway, so the handoff (a few tens of microseconds of the interpreter per prepare,
        under the load where they count) is saved, and when the CDI directory is on a tmpfs
        (/run/cdi on a node), where fsync returns at once. None when synced here (raises on
        failure)."""
        with self._in_flight_lock:
            alone = self._in_flight == 1
        if alone and not self.specs.in_memory:
            return self._spec_writes.submit(pending.sync)
        pending.sync()
        return None

    def unprepare(self, ref: ClaimRef) -> tuple[PreparedDevice, ...]:
        """Unprepare one claim; the devices it held (none: unknown or already unprepared
        claims succeed too)."""
        validate_ref(ref, need_names=False)
        with self.locks.hold(ref.uid):
            record = self.unprepare_locked(ref.uid)
        return () if record is None else record.devices

    def unprepare_locked(self, uid: str) -> ClaimRecord | None:
        """Unprepare ``uid``, its lock held by the caller (Repair; clear_stale); the record it
        had, if any. Logs nothing: each caller says why (the kubelet's: plugin/dra.py's
        ClaimLog)."""
        if self._keepers:
            record = self.checkpoint.get(uid)
            if record is not None and any(s.keeps_record(record) for s in self._keepers):
                # Spec, the steps' release, then the record (dynamic MIG, docs/plugin.md
                # "Dynamic MIG": an instance stays named by a record until it is destroyed). A
                # failure that must keep the record (MigFailed: processes run in it) fails the
                # unprepare; the kubelet tries again.
                self.specs.remove(uid, sync_dir=False)
                for step in reversed(self.steps):
                    step.release(record)
                self.checkpoint.transact(lambda claims: claims.discard(uid), durable=False)
                self._pods.pop(uid, None)
                for step in reversed(self.steps):
                    step.restore(record)
                return record
        # Nothing here is synced before the kubelet hears of success (docs/plugin.md,
        # "Durability"): the record's removal is appended (a crash of this process cannot lose
        # it: it is in the kernel), and only a power loss could, after which the node reboots
        # and the boot ID check drops every claim. Had a removal been lost anyway, the claim
        # would be found stale against the API server (reconcile, and prepare of another claim
        # that wants its devices) and cleared: a device is never blocked by it.
        record = self.checkpoint.transact(lambda claims: claims.discard(uid), durable=False)
        # The record goes first: a crash now leaves only an orphaned spec, which reconcile
        # removes, never a recorded claim without its spec. For the same reason the removal
        # need not be synced: a spec that comes back after a power loss is an orphan too.
        self.specs.remove(uid, sync_dir=False)
        self._pods.pop(uid, None)
        if record is not None:
            # After the record: a crash before this leaves what the steps changed with no
            # claim asking for it, which each step's reconcile sets back (their marks are the
            # trace a crash leaves). A failure never fails the unprepare (logged; reconcile
            # retries).
            for step in reversed(self.steps):
                step.release(record)
            for step in reversed(self.steps):
                step.restore(record)
        return record

    def roll_back(self, record: ClaimRecord) -> None:
        """Undo a half-done prepare (lock held): the spec first, then the steps' release in
        reverse (a MigFailed keeps the record, for a later try), then the record, then the
        steps' restore in reverse."""
        self.specs.remove(record.uid)
        for step in reversed(self.steps):
            step.release(record)
        self.checkpoint.transact(lambda claims: claims.discard(record.uid))
        for step in reversed(self.steps):
            step.restore(record)

    def _roll_back_quietly(self, uid: str) -> None:
        try:
            record = self.checkpoint.get(uid)
            if record is not None:
                self.roll_back(record)
            else:
                self.specs.remove(uid)
        except (CdiError, CheckpointError, PrepareError) as exc:
            log.error(
                "rolling back a failed prepare failed; reconcile will retry",
                extra={"claim_uid": uid, "error": str(exc)},
            )

    def _fetch(self, ref: ClaimRef) -> Mapping[str, Any]:
        try:
            claim = self.claims.get_resource_claim(namespace=ref.namespace, name=ref.name)
        except KubeError as exc:
            raise ClaimFetchFailed(
                f"cannot get ResourceClaim {ref.namespace}/{ref.name}: {exc}"
            ) from exc
        if claim is None:
            raise ClaimNotFound(f"ResourceClaim {ref.namespace}/{ref.name} does not exist")
        return claim

    def clear_stale(self, holders: Iterable[str], *, holding: str | None = None) -> bool:
        """Unprepare those of ``holders`` (claims holding devices a prepare wants) that the API
        server says no pod can use any more: a record whose unprepare was lost never blocks a
        device. True when one was cleared. A holder being worked on right now is left alone.
        ``holding``: the claim whose lock the caller holds (the prepare that wants the
        devices); a holder whose lock shares its stripe is not thereby "being worked on"."""
        cleared = False
        for uid in holders:
            record = self.checkpoint.get(uid)
            if record is None or not record.namespace:
                continue
            reason = self.stale_reason(record)
            if reason is None:
                continue
            with self.locks.try_hold(uid, holding=holding) as held:
                if held and self.checkpoint.get(uid) == record:
                    log.warning(
                        "unpreparing a stale claim that held a device another claim needs",
                        extra={"claim_uid": uid, "claim": f"{record.namespace}/{record.name}",
                               "reason": reason},
                    )  # fmt: skip
                    self.unprepare_locked(uid)
                    cleared = True
        return cleared

    def stale_reason(self, record: ClaimRecord) -> str | None:
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

    def forget_pods_but(self, live: Mapping[str, ClaimRecord]) -> None:
        """Forget the pods of claims no longer in ``live`` (the checkpoint's claims now)."""
        for uid in list(self._pods):
            if uid not in live:
                self._pods.pop(uid, None)

    # -- state -------------------------------------------------------------------------------

    def claim_pods(self) -> dict[str, tuple[str, ...]]:
        """Claim uid -> the pods its ``status.reservedFor`` named when this process last read the
        claim (its prepare, or a reconcile pass: every prepared claim at start, then every
        reconcile interval). A claim not read since this process started has none yet."""
        return dict(self._pods)
