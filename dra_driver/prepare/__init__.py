"""Prepare and unprepare of ResourceClaims on this node: the work behind the kubelet's calls.

Flow position: plugin/ (gRPC) -> here -> cdi/ (spec files) + state/ (checkpoint).

- ``preparer.py``: the core (record, run the steps, write the spec, record completion; undo in
  reverse; reconcile), which knows no feature; ``ClaimPreparer``, what plugin/ serves;
  ``repair.py``: reconcile and the rebuild from the CDI specs, over a Preparer;
- ``step.py``: the step protocol each feature implements (sharing/, mig/; node/ wires them);
- ``plan.py``: a claim checked and decoded before anything changes; ``targets.py``: the devices
  a claim may be allocated (``TargetsOf``: mig/ has its own for dynamic MIG); ``outcome.py``:
  per-claim answers and error types; ``limits.py``: the sizes a claim or batch may have;
  ``setaside.py``: a damaged file renamed aside;
- ``state/``: the one owner of prepare's state (the checkpoint and its locks, switching over
  from NVIDIA's driver, recovery and the reconcile loop, the Preparer built over them:
  ``state.nodestate.PrepareState``, which node/ opens); ``deviceconfig.py`` (the opaque
  configs, loaded with the first claim that carries one).

This module is prepare's face: the wings (sharing/, mig/, ...), node/ and plugin/ import the
names below from here, never a submodule (.importlinter, "prepare's face"); a pure module of
a wing imports the pure module it names (its I/O-free part) instead.
"""

from dra_driver.prepare.outcome import ERROR_TYPES, Outcome, error_type
from dra_driver.prepare.plan import (
    ClaimPlan,
    ClaimRef,
    ClaimSource,
    PlannedDevice,
    default_config_json,
    owner,
    reserved_pods,
    validate_ref,
)
from dra_driver.prepare.preparer import ClaimPreparer, Preparer
from dra_driver.prepare.state.checkpoint import (
    BOOT_ID_PATH,
    PREPARE_COMPLETED,
    PREPARE_STARTED,
    Checkpoint,
    ClaimLocks,
    ClaimRecord,
    Claims,
    PreparedDevice,
)
from dra_driver.prepare.state.nodestate import (
    DEFAULT_RECONCILE_INTERVAL_S,
    PrepareState,
    recorded_device_names,
    recorded_device_names_on_disk,
)
from dra_driver.prepare.state.settings import StateSettings
from dra_driver.prepare.step import NodeState, Step, StepFactory, no_steps
from dra_driver.prepare.targets import DeviceTarget, TargetsOf, device_targets, gpu_targets

__all__ = [
    "BOOT_ID_PATH",
    "DEFAULT_RECONCILE_INTERVAL_S",
    "ERROR_TYPES",
    "PREPARE_COMPLETED",
    "PREPARE_STARTED",
    "Checkpoint",
    "ClaimLocks",
    "ClaimPlan",
    "ClaimPreparer",
    "ClaimRecord",
    "ClaimRef",
    "ClaimSource",
    "Claims",
    "DeviceTarget",
    "NodeState",
    "Outcome",
    "PlannedDevice",
    "PrepareState",
    "PreparedDevice",
    "Preparer",
    "StateSettings",
    "Step",
    "StepFactory",
    "TargetsOf",
    "default_config_json",
    "device_targets",
    "error_type",
    "gpu_targets",
    "no_steps",
    "owner",
    "recorded_device_names",
    "recorded_device_names_on_disk",
    "reserved_pods",
    "validate_ref",
]
