"""The scheduler's structured-parameters allocation for the pools of one node. Pure.

Input: ResourceClaims (v1, v1beta2 or v1beta1 JSON), DeviceClasses, ResourceSlices (v1 or
v1beta1 JSON), DeviceTaintRules and the claims already allocated. Output: the allocation the
kube-scheduler's DRA plugin would make on that node, or, per request, why each device is unusable
(naming the claims that hold a device in use).

Behaviour follows ``dra:structured/internal/{stable,incubating,experimental}`` (spec D, E):
only the highest generation of a pool counts; incomplete or invalid pools are skipped (an
``allocationMode: All`` request fails on them); pools in (driver, pool) order, slices in name
order, devices in slice order; first fit with backtracking, trying device combinations (not
permutations) within a request; ``firstAvailable`` sub-requests in order; class selectors before
request selectors; a CEL runtime error aborts the attempt (it is not "false"); devices in use by
other claims are excluded (admin access excepted); shared counters (partitionable devices),
taints/tolerations (a slice's own and those DeviceTaintRules add), ``matchAttribute``/
``distinctAttribute`` constraints, consumable capacity (``allowMultipleAllocations``,
``capacity.requests``, ``requestPolicy``) and binding conditions (DRADeviceBindingConditions:
pools holding devices with ``bindingConditions`` tried last, results carrying them,
``bindsToNode``; with the feature off such devices are not selectable). A claim that is
already allocated keeps its allocation: the scheduler only checks that its node can use it
(spec D.3, ``status.allocation``).

Modules, in the order of the flow: ``model`` (the values) -> ``parse`` (API JSON -> values) ->
``taints`` -> ``candidates`` (which devices a request may take) -> ``constraints``,
``capacity`` (consumable capacity), ``counters`` (shared counters) -> ``search`` (the
backtracking) -> ``reasons`` (why a device was rejected) -> ``allocation`` (``allocate``).
This package re-exports the public names of each.
"""

from __future__ import annotations

from dra_driver.scheduling.allocator.allocation import allocate, compile_selectors
from dra_driver.scheduling.allocator.candidates import gather_pools
from dra_driver.scheduling.allocator.capacity import capacity_problem
from dra_driver.scheduling.allocator.constraints import lookup_attribute
from dra_driver.scheduling.allocator.model import (
    MAX_RESULTS_PER_CLAIM,
    AllocatedState,
    AllocationResult,
    CapacityPolicy,
    Claim,
    ClaimAllocation,
    Constraint,
    DeviceClass,
    DeviceID,
    DeviceResult,
    DeviceTaintRule,
    DeviceVerdict,
    ExactRequest,
    Node,
    PoolID,
    Request,
    RequestDiagnosis,
    Slice,
    SliceDevice,
    Taint,
    Toleration,
)
from dra_driver.scheduling.allocator.parse import (
    allocated_state,
    parse_claim,
    parse_device_class,
    parse_device_taint_rule,
    parse_slice,
)
from dra_driver.scheduling.allocator.taints import apply_taint_rules

__all__ = [
    "MAX_RESULTS_PER_CLAIM",
    "AllocatedState",
    "AllocationResult",
    "CapacityPolicy",
    "Claim",
    "ClaimAllocation",
    "Constraint",
    "DeviceClass",
    "DeviceID",
    "DeviceResult",
    "DeviceTaintRule",
    "DeviceVerdict",
    "ExactRequest",
    "Node",
    "PoolID",
    "Request",
    "RequestDiagnosis",
    "Slice",
    "SliceDevice",
    "Taint",
    "Toleration",
    "allocate",
    "allocated_state",
    "apply_taint_rules",
    "capacity_problem",
    "compile_selectors",
    "gather_pools",
    "lookup_attribute",
    "parse_claim",
    "parse_device_class",
    "parse_device_taint_rule",
    "parse_slice",
]
