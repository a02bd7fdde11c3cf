"""Which devices a request may take: the pools that reach the node (highest generation,
complete, valid), the devices on the node, and the CEL selectors (class before request). Pure.

A ``Candidate`` is one device of a usable pool; a ``RequestData`` is one request (or
``firstAvailable`` sub-request) of one claim with its class. A CEL runtime error in a selector is
not "false": it aborts the attempt (``Abort``), as in the scheduler.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction

from dra_driver.errors import CelRuntimeError
from dra_driver.scheduling import cel
from dra_driver.scheduling.allocator.model import (
    JSON,
    Abort,
    Claim,
    DeviceClass,
    DeviceID,
    ExactRequest,
    Node,
    PoolID,
    Slice,
    SliceDevice,
)


@dataclass(eq=False)
class Pool:
    driver: str
    name: str
    slices: list[Slice]
    incomplete: bool = False
    invalid: str = ""
    counter_sets: dict[str, Mapping[str, Fraction]] = field(default_factory=dict)

    @property
    def pool_id(self) -> PoolID:
        return (self.driver, self.name)

    @property
    def has_binding_conditions(self) -> bool:
        return any(s.has_binding_conditions for s in self.slices)


def node_selector_matches(selector: JSON | None, node: Node) -> bool:
    """A core NodeSelector (terms ORed, requirements ANDed) against the node's name and labels."""
    if not selector:
        return False
    for term in selector.get("nodeSelectorTerms") or []:
        reqs = [("field", r) for r in term.get("matchFields") or []] + [
            ("label", r) for r in term.get("matchExpressions") or []
        ]
        if reqs and all(_requirement(kind, r, node) for kind, r in reqs):
            return True
    return False


def _requirement(kind: str, r: JSON, node: Node) -> bool:
    key, op, values = r.get("key"), r.get("operator"), [str(v) for v in r.get("values") or []]
    if kind == "field":
        have: str | None = node.name if key == "metadata.name" else None
    else:
        have = node.labels.get(str(key))
    if op == "In":
        return have is not None and have in values
    if op == "NotIn":
        return have is None or have not in values
    if op == "Exists":
        return have is not None
    if op == "DoesNotExist":
        return have is None
    if op in ("Gt", "Lt") and have is not None and values:
        try:
            a, b = int(have), int(values[0])
        except ValueError:
            return False
        return a > b if op == "Gt" else a < b
    return False


def device_on_node(s: Slice, d: SliceDevice, node: Node) -> bool:
    if not s.per_device_node_selection:
        return True
    if d.node_name:
        return d.node_name == node.name
    if d.all_nodes:
        return True
    return node_selector_matches(d.node_selector, node)


def gather_pools(
    slices: Sequence[Slice], node: Node, *, binding_conditions: bool = True
) -> list[Pool]:
    """The pools with slices reaching ``node``, at their highest generation, by (driver, pool).

    With ``binding_conditions`` (DRADeviceBindingConditions on), as the scheduler's
    ``GatherPools`` does: pools holding a device with binding conditions come after every other
    pool, so the allocation prefers devices that need no binding step. Within a pool, slices stay
    in name order whether or not they hold such a device (``buildPool`` sorts by name only).
    """
    by_pool: dict[PoolID, list[Slice]] = {}
    for s in slices:
        by_pool.setdefault((s.driver, s.pool), []).append(s)
    pools = []
    for (driver, name), group in sorted(by_pool.items()):
        top = max(s.generation for s in group)
        current = sorted((s for s in group if s.generation == top), key=lambda s: s.name)
        reaching = [
            s
            for s in current
            if (s.node_name == node.name if s.node_name else s.all_nodes)
            or (s.node_selector and node_selector_matches(s.node_selector, node))
            or s.per_device_node_selection
            or (s.shared_counters and not s.devices)
        ]
        if not any(s.devices for s in reaching):
            continue
        pool = Pool(driver, name, reaching)
        pool.incomplete = len(current) != max(s.resource_slice_count for s in current)
        names: set[str] = set()
        for s in current:
            for cs_name, counters in s.shared_counters.items():
                pool.counter_sets[cs_name] = counters
            for d in s.devices:
                if d.name in names:
                    pool.invalid = f"device name {d.name} is not unique in the pool"
                names.add(d.name)
        pools.append(pool)
    if binding_conditions:
        pools.sort(key=lambda p: p.has_binding_conditions)
    return pools


@dataclass(eq=False)
class Candidate:
    pool: Pool
    slice: Slice
    device: SliceDevice
    on_node: bool = True

    @property
    def id(self) -> DeviceID:
        return (self.pool.driver, self.pool.name, self.device.name)


@dataclass(eq=False)
class RequestData:
    claim_index: int
    request: ExactRequest
    parent: str | None  # main request name of a sub-request
    device_class: DeviceClass
    num_devices: int = 0
    all_devices: list[Candidate] = field(default_factory=list)
    all_error: str = ""

    @property
    def full_name(self) -> str:
        return f"{self.parent}/{self.request.name}" if self.parent else self.request.name


def selectors_match(data: RequestData, cand: Candidate, claim: Claim) -> bool:
    dev = cand.device.cel_device
    for i, expr in enumerate(data.device_class.selectors):
        program = cel.compile_selector(expr)
        try:
            if not program.matches(dev):
                return False
        except CelRuntimeError as exc:
            raise Abort(
                f"class {data.device_class.name}: selector #{i} on device {'/'.join(cand.id)}: "
                f"CEL runtime error: {exc}"
            ) from None
    for i, expr in enumerate(data.request.selectors):
        program = cel.compile_selector(expr)
        try:
            if not program.matches(dev):
                return False
        except CelRuntimeError as exc:
            raise Abort(
                f"claim {claim.key}: request {data.full_name}: selector #{i} on device "
                f"{'/'.join(cand.id)}: CEL runtime error: {exc}"
            ) from None
    return True
