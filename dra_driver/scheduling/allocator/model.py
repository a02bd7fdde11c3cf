"""The allocator's values: the inputs normalised from API JSON, and what it answers. Pure.

``parse`` turns ResourceClaims, DeviceClasses, ResourceSlices and DeviceTaintRules into the
input values here; ``allocation.allocate`` answers with an ``AllocationResult`` (allocations, or
per request a ``RequestDiagnosis``). ``Abort`` and ``TooMany`` are the two ways a search ends
early, as the scheduler's allocator does: an error that gives up the node, and more than
``MAX_RESULTS_PER_CLAIM`` devices for one claim.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Final

from dra_driver.quantity import Format
from dra_driver.scheduling import cel

MAX_RESULTS_PER_CLAIM: Final = 32  # AllocationResultsMaxSize
DeviceID = tuple[str, str, str]  # (driver, pool, device)
PoolID = tuple[str, str]  # (driver, pool)
JSON = dict[str, Any]


# ---------------------------------------------------------------------------------------------
# Normalised inputs


@dataclass(frozen=True)
class Node:
    """The node the scheduler tries: name and labels (for slices with a nodeSelector)."""

    name: str
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class CapacityPolicy:
    default: Fraction | None = None
    valid_values: tuple[Fraction, ...] = ()
    range_min: Fraction | None = None
    range_max: Fraction | None = None
    range_step: Fraction | None = None


@dataclass(frozen=True)
class Taint:
    key: str
    value: str
    effect: str
    rule: str = ""  # the DeviceTaintRule that put it on the device; "" for the slice's own

    def __str__(self) -> str:
        return (
            f"{self.key}={self.value}:{self.effect}" if self.value else f"{self.key}:{self.effect}"
        )


@dataclass(frozen=True)
class Toleration:
    key: str = ""
    operator: str = "Equal"
    value: str = ""
    effect: str = ""

    def tolerates(self, taint: Taint) -> bool:
        if self.effect and self.effect != taint.effect:
            return False
        if self.operator == "Exists":
            return not self.key or self.key == taint.key
        return self.key == taint.key and self.value == taint.value


@dataclass(frozen=True, eq=False)
class SliceDevice:
    """One device of a slice, normalised (v1beta1 ``basic`` unwrapped)."""

    name: str
    attributes: Mapping[str, Any]  # qualified-as-published name -> CEL value
    capacity: Mapping[str, Fraction]
    capacity_formats: Mapping[str, Format]
    policies: Mapping[str, CapacityPolicy]
    consumes_counters: tuple[tuple[str, Mapping[str, Fraction]], ...]
    taints: tuple[Taint, ...]
    allow_multiple_allocations: bool
    node_name: str | None
    all_nodes: bool
    node_selector: JSON | None
    cel_device: cel.DeviceObject
    # KEP-5007 (DRADeviceBindingConditions): conditions the scheduler waits for in the claim's
    # device status before binding the pod, those that fail the binding, and whether the
    # allocation is pinned to the node it was made for.
    binding_conditions: tuple[str, ...] = ()
    binding_failure_conditions: tuple[str, ...] = ()
    binds_to_node: bool = False


@dataclass(frozen=True, eq=False)
class Slice:
    name: str
    driver: str
    pool: str
    generation: int
    resource_slice_count: int
    node_name: str | None
    all_nodes: bool
    node_selector: JSON | None
    per_device_node_selection: bool
    devices: tuple[SliceDevice, ...]
    shared_counters: Mapping[str, Mapping[str, Fraction]]

    @property
    def has_binding_conditions(self) -> bool:
        """Whether a device of this slice has binding conditions (the scheduler tries pools
        holding one after the others)."""
        return any(d.binding_conditions for d in self.devices)


@dataclass(frozen=True)
class ExactRequest:
    """``exactly`` of a request, or one ``firstAvailable`` sub-request."""

    name: str
    device_class_name: str
    selectors: tuple[str, ...] = ()
    allocation_mode: str = "ExactCount"
    count: int = 1
    admin_access: bool = False
    tolerations: tuple[Toleration, ...] = ()
    capacity_requests: Mapping[str, Fraction] = field(default_factory=dict)


@dataclass(frozen=True)
class Request:
    name: str
    exactly: ExactRequest | None
    first_available: tuple[ExactRequest, ...] = ()


@dataclass(frozen=True)
class Constraint:
    requests: tuple[str, ...]
    match_attribute: str | None = None
    distinct_attribute: str | None = None


@dataclass(frozen=True)
class Claim:
    namespace: str
    name: str
    requests: tuple[Request, ...]
    constraints: tuple[Constraint, ...] = ()
    config: tuple[JSON, ...] = ()
    uid: str = ""

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}" if self.namespace else self.name


@dataclass(frozen=True)
class DeviceClass:
    name: str
    selectors: tuple[str, ...] = ()
    config: tuple[JSON, ...] = ()


@dataclass(frozen=True)
class DeviceTaintRule:
    """A DeviceTaintRule: ``taint`` on every device its ``spec.deviceSelector`` picks.

    Unset fields match any device; a rule without a selector matches none (API docs of
    DeviceTaintSelector). ``device_class`` and ``selectors`` exist only in v1alpha3 before 1.35.
    """

    name: str
    taint: Taint
    selected: bool = True  # False: the rule has no deviceSelector
    driver: str | None = None
    pool: str | None = None
    device: str | None = None
    device_class: str | None = None
    selectors: tuple[str, ...] = ()


@dataclass(frozen=True)
class AllocatedState:
    """What claims that are already allocated hold, and their allocations."""

    exclusive: Mapping[DeviceID, str] = field(default_factory=dict)  # device -> claim key
    shared_capacity: Mapping[DeviceID, Mapping[str, Fraction]] = field(default_factory=dict)
    shared_holders: Mapping[DeviceID, tuple[str, ...]] = field(default_factory=dict)
    claims: Mapping[str, ClaimAllocation] = field(default_factory=dict)  # claim key -> allocation
    uids: Mapping[str, str] = field(default_factory=dict)  # claim uid -> claim key

    def holders(self, dev: DeviceID) -> tuple[str, ...]:
        """The claims that hold ``dev`` (admin-access allocations hold nothing)."""
        if dev in self.exclusive:
            return (self.exclusive[dev],)
        return tuple(self.shared_holders.get(dev, ()))

    def existing(self, claim: Claim) -> ClaimAllocation | None:
        """The allocation ``claim`` already has: found by UID, else by namespace/name (a claim
        without a namespace is looked up as given, then in ``default``, where kubectl would
        create it without ``-n``)."""
        key = self.uids.get(claim.uid) if claim.uid else None
        if key is None:
            key = claim.key
            if key not in self.claims and not claim.namespace:
                key = f"default/{claim.name}"
        return self.claims.get(key)


# ---------------------------------------------------------------------------------------------
# Results


@dataclass(frozen=True)
class DeviceResult:
    request: str
    driver: str
    pool: str
    device: str
    admin_access: bool = False
    tolerations: tuple[Toleration, ...] = ()
    share_id: str | None = None
    consumed_capacity: Mapping[str, str] = field(default_factory=dict)
    binding_conditions: tuple[str, ...] = ()
    binding_failure_conditions: tuple[str, ...] = ()


@dataclass(frozen=True)
class ClaimAllocation:
    claim: str
    results: tuple[DeviceResult, ...]
    config: tuple[JSON, ...]
    node_selector: JSON | None
    existing: bool = False  # already allocated (status.allocation): shown, not allocated again


@dataclass(frozen=True)
class DeviceVerdict:
    """Why one device cannot serve one request; no reasons means it could."""

    driver: str
    pool: str
    device: str
    reasons: tuple[str, ...]
    in_use_by: tuple[str, ...] = ()  # allocated claims that keep it from this request


@dataclass(frozen=True)
class RequestDiagnosis:
    claim: str
    request: str
    device_class: str
    wanted: str  # "2" or "all"
    summary: str
    verdicts: tuple[DeviceVerdict, ...]
    all_taken: bool = False  # some devices match, and allocated claims keep all of them from it


@dataclass(frozen=True)
class AllocationResult:
    node: str
    satisfiable: bool
    allocations: tuple[ClaimAllocation, ...] = ()
    error: str | None = None  # a CEL runtime error or an invalid setup that aborts the attempt
    diagnoses: tuple[RequestDiagnosis, ...] = ()
    notes: tuple[str, ...] = ()


class Abort(Exception):
    """A CEL runtime error or an impossible 'All' request: the scheduler gives up the node."""


class TooMany(Exception):
    """More than 32 devices for one claim: backtrack harder (errAllocationResultMaxSizeExceeded)."""
