"""Prepare and unprepare of ResourceClaims on this node: the work behind the kubelet's calls.

Flow position: plugin/ (gRPC) -> here -> cdi/ (spec files) + state/ (checkpoint).

- ``preparer.py``: the core (record, run the steps, write the spec, record completion; undo in
  reverse; reconcile), which knows no feature; ``ClaimPreparer``, what plugin/ serves;
- ``step.py``: the step protocol each feature implements (sharing/, mig/; node/ wires them);
- ``plan.py``: a claim checked and decoded before anything changes; ``targets.py``: the devices
  a claim may be allocated; ``outcome.py``: per-claim answers and error types;
  ``rebuild.py``: the state rebuilt from the CDI specs after the checkpoint was lost;
- ``state/``: the one owner of prepare's state (the checkpoint and its locks, switching over
  from NVIDIA's driver, recovery and the reconcile loop, the Preparer built over them:
  ``state.nodestate.PrepareState``, which node/ opens); ``deviceconfig.py`` (the opaque
  configs).

The names other packages import are re-exported here.
"""

from dra_driver.prepare.outcome import ERROR_TYPES, Outcome, error_type
from dra_driver.prepare.plan import (
    ClaimPlan,
    ClaimRef,
    ClaimSource,
    PlannedDevice,
    Share,
    default_config_json,
    reserved_pods,
    validate_ref,
)
from dra_driver.prepare.preparer import ClaimPreparer, Preparer
from dra_driver.prepare.step import NodeState, Step, StepFactory, no_steps
from dra_driver.prepare.targets import DeviceTarget, DynamicSlot, device_targets

__all__ = [
    "ERROR_TYPES",
    "ClaimPlan",
    "ClaimPreparer",
    "ClaimRef",
    "ClaimSource",
    "DeviceTarget",
    "DynamicSlot",
    "NodeState",
    "Outcome",
    "PlannedDevice",
    "Preparer",
    "Share",
    "Step",
    "StepFactory",
    "default_config_json",
    "device_targets",
    "error_type",
    "no_steps",
    "reserved_pods",
    "validate_ref",
]
