"""The step protocol: what a feature (time slicing, MPS, consumable shares, dynamic MIG, the
whole-GPU MIG-mode switch) does to the devices of a prepared claim, so the preparer core can run
it without knowing it.

Flow position: node/ builds the steps (a :data:`StepFactory`) -> the preparer calls them, in
the order given, for every claim; each feature's step lives in its own package beside its pure
model (sharing/, mig/). The core calls, for one claim:

1. :meth:`Step.plan` for every step, before anything on the node changes: validate what the
   claim asks of this feature, refine devices, return the step's plan (None: the step has
   nothing to do for this claim, and is not called again for it);
2. :meth:`Step.check` inside the checkpoint transaction that records the claim (both
   ``PrepareStarted`` and ``PrepareCompleted``): refuse what conflicts with other claims;
3. :meth:`Step.apply`, in order: change the node, calling ``started()`` first (it records the
   claim ``PrepareStarted`` durably, once per prepare), so a crash leaves a record whose
   rollback undoes it; a failure rolls the whole claim back;
4. :meth:`Step.edit` for each CDI device of the claim's spec (env, mounts), then the core
   records ``PrepareCompleted``.

Undo (unprepare, rollback), in reverse order: :meth:`Step.release` while the claim's record
still names what is undone (a MIG instance, an MPS daemon serving one), then the record goes,
then :meth:`Step.restore`, which sets the node to what the remaining claims ask.
:meth:`Step.keeps_record` makes the core remove the claim's spec before its record (the order
dynamic MIG needs). :meth:`Step.reconcile` runs at start and on every pass; :meth:`Step.recorded`
gives a prepared claim's plan (and repairs its devices) when reconcile looks at it;
:meth:`Step.adopted` adds to the records of claims adopted from NVIDIA's driver at start
(state/switchover.py) what the step needs to undo what that driver set up for them.

Every method but :meth:`Step.plan` has a default that does nothing, so a step implements what it
needs by subclassing :class:`Step` explicitly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pathlib import Path

    from dra_driver import cdi
    from dra_driver.prepare.plan import ClaimPlan, PlannedDevice
    from dra_driver.prepare.state.checkpoint import ClaimLocks, ClaimRecord, Claims
    from dra_driver.prepare.targets import DeviceTarget


class NodeState(Protocol):
    """What a step may read of the preparer: the devices, the checkpoint's claims, the claim
    locks, and the claims being prepared right now."""

    @property
    def targets(self) -> Mapping[str, DeviceTarget]:
        """The devices prepare accepts now (one version; replaced whole on re-discovery)."""
        ...

    @property
    def locks(self) -> ClaimLocks:
        """The claim locks (a step's repair skips a claim someone is working on)."""
        ...

    @property
    def state_dir(self) -> Path:
        """The directory of the checkpoint, where steps keep their own durable marks."""
        ...

    def records(self) -> Mapping[str, ClaimRecord]:
        """The checkpoint's claims now (either phase; another instance's included)."""
        ...

    def record(self, uid: str) -> ClaimRecord | None:
        """The checkpoint's record of claim ``uid`` now."""
        ...

    def in_flight(self) -> Sequence[ClaimPlan]:
        """The claims being prepared now, planned and not yet recorded complete or rolled
        back."""
        ...


class Step(Protocol):
    """One feature's part in preparing a claim (see the module docstring for when each method
    is called). A step's plan is whatever it needs to carry from plan to apply and edit; the
    core only passes it back. Methods run under the claim's lock, except :meth:`reconcile`."""

    def plan(self, claim: ClaimPlan) -> Any | None:
        """Validate what ``claim`` asks of this step from its configs and allocation results
        (a PrepareError, worded for the claim, refuses it), before anything changes; may
        replace devices in ``claim.devices`` by refined ones. None: nothing to do."""
        raise NotImplementedError

    def check(self, plan: Any, claim: ClaimPlan, *, claims: Claims) -> None:
        """Inside the transaction that records ``claim``: raise DeviceConflict (naming the
        holders) when ``claims`` (the checkpoint's, this claim's own record included) hold
        what this claim cannot share with them."""
        return None

    def apply(self, plan: Any, claim: ClaimPlan, *, started: Callable[[], None]) -> None:
        """Change the node for ``claim``; call ``started()`` before the first change (it
        records the claim ``PrepareStarted``, durably). May refine ``claim.devices``. A failure
        raises; the core then rolls the claim back (release, record, restore)."""
        return None

    def edit(self, plan: Any, device: PlannedDevice, *, spec: cdi.ClaimDevice) -> cdi.ClaimDevice:
        """The CDI device ``spec`` of ``device`` with what this step adds (env, mounts)."""
        return spec

    def recorded(self, record: ClaimRecord, claim: ClaimPlan) -> Any | None:
        """The plan of a prepared claim (``claim``: its record's devices this node has), for its
        spec when reconcile writes it again; bring back on the node what the claim needs that is
        gone (a MIG instance), refining ``claim.devices``. A DraError (logged here) skips the
        claim in this pass."""
        return None

    def adopted(self, device: PlannedDevice, *, claim_uid: str) -> Mapping[str, Any]:
        """What the recorded config of ``device``, of claim ``claim_uid`` adopted from NVIDIA's
        checkpoint at start, gets besides its effective config, so that this step's undo finds
        what NVIDIA's driver set up for it (its MPS Deployment). Pure; before the step's
        reconcile runs."""
        return {}

    def keeps_record(self, record: ClaimRecord) -> bool:
        """Whether the claim's record must outlive :meth:`release` (it names what release
        destroys): the core then removes the spec first, then releases, then the record."""
        return False

    def release(self, record: ClaimRecord) -> None:
        """Undo, while ``record`` is still in the checkpoint (rollback, or :meth:`keeps_record`;
        else just after the record went), what must go before the record does. A failure that
        must keep the record raises (MigFailed); others are logged and left to reconcile."""
        return None

    def restore(self, record: ClaimRecord) -> None:
        """After ``record`` left the checkpoint: set what it asked for back to what the
        remaining claims ask. Failures are logged and left to reconcile."""
        return None

    def reconcile(self) -> Mapping[str, int]:
        """Make the node agree with the checkpoint (what a crash, a reboot or a failed undo
        left); at start and on every pass. Returns counters for the pass's log line."""
        return {}

    def close(self) -> None:
        """Release what the step holds (an NVML session); the preparer is closing."""
        return None


StepFactory = Callable[[NodeState], Sequence[Step]]
"""Builds a preparer's steps, in prepare order, given what they may read of it (node/ wires
this from the agent's flags)."""


def no_steps(state: NodeState) -> Sequence[Step]:
    """No feature: claims get their devices' nodes and driver files only."""
    del state
    return ()


def steps_of(claim: ClaimPlan, steps: Iterable[Step]) -> list[tuple[Step, Any]]:
    """Each step that has something to do for ``claim``, with its plan, in order."""
    planned = []
    for step in steps:
        plan = step.plan(claim)
        if plan is not None:
            planned.append((step, plan))
    return planned
