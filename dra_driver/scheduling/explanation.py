"""What ``explain`` computes: claims allocated together on every node of an inventory, as the
scheduler would try them (``ExplainResult``). Pure: the inputs are API JSON already read.

Slices are grouped by node (cluster-wide slices join every node); each node is tried with the
allocator (``scheduling.allocator``), first without diagnosis, and only when no node fits again
with every device's reasons. DeviceTaintRules are applied to the slices first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dra_driver.scheduling import allocator
from dra_driver.scheduling.allocator import (
    AllocationResult,
    Claim,
    DeviceClass,
    DeviceTaintRule,
    Node,
    Slice,
)
from dra_driver.scheduling.environment import NEWEST_VERSION, device_binding_conditions

JSON = dict[str, Any]


@dataclass(frozen=True)
class ExplainResult:
    """The outcome for a set of claims over every node of an inventory."""

    claims: tuple[str, ...]
    satisfiable: bool
    chosen: AllocationResult | None  # the first satisfiable node in name order
    satisfiable_nodes: tuple[str, ...]
    nodes: tuple[AllocationResult, ...]  # every node checked (diagnosed when none fits)
    notes: tuple[str, ...] = ()  # about the inputs: what was read from the cluster


def allocate(
    claims: JSON | Sequence[JSON],
    classes: Sequence[JSON],
    slices: Sequence[JSON],
    *,
    allocated: Sequence[JSON] = (),
    taint_rules: Sequence[JSON] = (),
    node: str | None = None,
    notes: Sequence[str] = (),
    k8s_version: str = NEWEST_VERSION,
) -> ExplainResult:
    """Allocate ``claims`` (JSON, allocated together) on the nodes of ``slices``.

    ``allocated``: ResourceClaims with ``status.allocation`` (others are ignored): their devices,
    counters and capacity are in use, and a claim of ``claims`` among them keeps its allocation.
    ``taint_rules``: DeviceTaintRules, whose taints are added to the devices they select.
    ``node`` limits the check to one node; ``notes`` are passed through to the result. Selectors
    compile as new expressions of an API server of ``k8s_version`` (``environment.py``). Raise
    ExplainError (or CelCompileError) for bad input.
    """
    claim_objs = [claims] if isinstance(claims, dict) else list(claims)
    parsed = [allocator.parse_claim(c) for c in claim_objs]
    class_map = _classes(classes)
    parsed_slices = [allocator.parse_slice(s) for s in slices]
    state = allocator.allocated_state(allocated)
    rules = [allocator.parse_device_taint_rule(r) for r in taint_rules]
    return explain_parsed(
        parsed,
        class_map,
        parsed_slices,
        allocated=state,
        taint_rules=rules,
        node=node,
        notes=notes,
        k8s_version=k8s_version,
    )


def explain_parsed(
    claims: Sequence[Claim],
    classes: dict[str, DeviceClass],
    slices: Sequence[Slice],
    *,
    allocated: allocator.AllocatedState | None = None,
    taint_rules: Sequence[DeviceTaintRule] = (),
    node: str | None = None,
    notes: Sequence[str] = (),
    k8s_version: str = NEWEST_VERSION,
) -> ExplainResult:
    keys = tuple(c.key for c in claims)
    allocator.compile_selectors(claims, classes, k8s_version=k8s_version)
    slices = allocator.apply_taint_rules(slices, taint_rules, classes=classes)
    by_node: dict[str, list[Slice]] = {}
    shared: list[Slice] = []
    for s in slices:
        if s.node_name:
            by_node.setdefault(s.node_name, []).append(s)
        else:
            shared.append(s)
    names = sorted(by_node) if node is None else [node]
    if not names:
        names = [""]  # only cluster-wide slices: any node will do
    binding = device_binding_conditions(k8s_version)
    notes = (*notes, *_binding_notes(slices, k8s_version, enabled=binding))

    def allocate_all(*, diagnose: bool) -> list[allocator.AllocationResult]:
        return [
            allocator.allocate(
                claims,
                classes=classes,
                slices=by_node.get(name, []) + shared,
                node=Node(name, {"kubernetes.io/hostname": name}),
                allocated=allocated,
                diagnose=diagnose,
                binding_conditions=binding,
            )
            for name in names
        ]

    results = allocate_all(diagnose=False)
    fitting = tuple(r.node for r in results if r.satisfiable)
    if not fitting:  # only then is every device's "why not" worth its cost
        results = allocate_all(diagnose=True)
    chosen = next((r for r in results if r.satisfiable), None)
    return ExplainResult(keys, bool(fitting), chosen, fitting, tuple(results), tuple(notes))


def _binding_notes(slices: Sequence[Slice], k8s_version: str, *, enabled: bool) -> list[str]:
    """What DRADeviceBindingConditions does to the devices that have binding conditions."""
    pools = sorted({f"{s.driver}/{s.pool}" for s in slices if s.has_binding_conditions})
    if not pools:
        return []
    where = ", ".join(pools[:3]) + (", ..." if len(pools) > 3 else "")
    if not enabled:
        return [
            f"devices with bindingConditions (pools {where}) are not selectable: "
            f"DRADeviceBindingConditions is off by default in Kubernetes {k8s_version} "
            "(beta and on from 1.36)"
        ]
    return [
        f"pools holding devices with bindingConditions ({where}) are tried after all other "
        "pools (DRADeviceBindingConditions); a claim given such a device is bound to the pod "
        "only once its device status has those conditions True"
    ]


def _classes(objs: Sequence[JSON]) -> dict[str, DeviceClass]:
    out: dict[str, DeviceClass] = {}
    for obj in objs:
        cls = allocator.parse_device_class(obj)
        out[cls.name] = cls
    return out
