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
``distinctAttribute`` constraints and consumable capacity (``allowMultipleAllocations``,
``capacity.requests``, ``requestPolicy``). A claim that is already allocated keeps its
allocation: the scheduler only checks that its node can use it (spec D.3, ``status.allocation``).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Any, Final

from dra_driver.errors import CelCompileError, CelRuntimeError, ExplainError
from dra_driver.quantity import Format, QuantityError, format_quantity, parse_quantity
from dra_driver.scheduling import cel
from dra_driver.scheduling.environment import NEWEST_VERSION

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


# ---------------------------------------------------------------------------------------------
# Parsing API objects


def _fail(where: str, message: str) -> ExplainError:
    return ExplainError(f"{where}: {message}" if where else message)


def _quantity(value: Any, where: str) -> tuple[Fraction, Format]:
    try:
        q = parse_quantity(str(value))
    except QuantityError as exc:
        raise _fail(where, str(exc)) from None
    return q.value, q.format


def _obj(value: Any, where: str) -> JSON:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _fail(where, f"expected an object, got {type(value).__name__}")
    return value


def _list(value: Any, where: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise _fail(where, f"expected a list, got {type(value).__name__}")
    return value


def _selectors(value: Any, where: str) -> tuple[str, ...]:
    out = []
    for i, sel in enumerate(_list(value, where)):
        expr = _obj(_obj(sel, f"{where}[{i}]").get("cel"), f"{where}[{i}].cel").get("expression")
        if not isinstance(expr, str):
            raise _fail(f"{where}[{i}]", "only CEL selectors are supported (cel.expression)")
        out.append(expr)
    return tuple(out)


def _tolerations(value: Any, where: str) -> tuple[Toleration, ...]:
    out = []
    for i, item in enumerate(_list(value, where)):
        t = _obj(item, f"{where}[{i}]")
        out.append(
            Toleration(
                key=str(t.get("key", "")),
                operator=str(t.get("operator") or "Equal"),
                value=str(t.get("value", "")),
                effect=str(t.get("effect", "")),
            )
        )
    return tuple(out)


def _exact(obj: JSON, name: str, where: str, *, sub: bool) -> ExactRequest:
    cls = obj.get("deviceClassName")
    if not isinstance(cls, str) or not cls:
        raise _fail(where, "deviceClassName is required")
    mode = str(obj.get("allocationMode") or "ExactCount")
    if mode not in ("ExactCount", "All"):
        raise _fail(where, f"allocationMode {mode!r} is not ExactCount or All")
    count = obj.get("count")
    if mode == "All":
        if count not in (None, 0):
            raise _fail(where, "count must not be set with allocationMode All")
        n = 0
    else:
        n = 1 if count is None else count
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            raise _fail(where, f"count must be a positive integer, got {count!r}")
    requests = _obj(_obj(obj.get("capacity"), f"{where}.capacity").get("requests"), where)
    caps = {str(k): _quantity(v, f"{where}.capacity.requests.{k}")[0] for k, v in requests.items()}
    admin = obj.get("adminAccess")
    if admin is not None and sub:
        raise _fail(where, "adminAccess is not allowed in a firstAvailable sub-request")
    return ExactRequest(
        name=name,
        device_class_name=cls,
        selectors=_selectors(obj.get("selectors"), f"{where}.selectors"),
        allocation_mode=mode,
        count=n,
        admin_access=bool(admin),
        tolerations=_tolerations(obj.get("tolerations"), f"{where}.tolerations"),
        capacity_requests=caps,
    )


_EXACT_FIELDS: Final = (
    "deviceClassName",
    "selectors",
    "allocationMode",
    "count",
    "adminAccess",
    "tolerations",
    "capacity",
)


def parse_claim(obj: JSON, *, where: str = "") -> Claim:
    """A ResourceClaim or ResourceClaimTemplate (v1, v1beta2, v1beta1) as a Claim.

    Raise ExplainError naming the field for anything the API server would reject that matters
    here (missing class, bad count, bad quantity, non-CEL selector).
    """
    kind = obj.get("kind", "ResourceClaim")
    meta = _obj(obj.get("metadata"), f"{where}metadata")
    spec = _obj(obj.get("spec"), f"{where}spec")
    if kind == "ResourceClaimTemplate":
        spec = _obj(spec.get("spec"), f"{where}spec.spec")
    devices = _obj(spec.get("devices"), f"{where}spec.devices")
    requests = []
    seen: set[str] = set()
    for i, raw in enumerate(_list(devices.get("requests"), f"{where}spec.devices.requests")):
        rw = f"{where}spec.devices.requests[{i}]"
        r = _obj(raw, rw)
        name = r.get("name")
        if not isinstance(name, str) or not name:
            raise _fail(rw, "name is required")
        if name in seen:
            raise _fail(rw, f"duplicate request name {name!r}")
        seen.add(name)
        first = _list(r.get("firstAvailable"), f"{rw}.firstAvailable")
        exactly = r.get("exactly")
        if exactly is None and any(f in r for f in _EXACT_FIELDS):
            exactly = {f: r[f] for f in _EXACT_FIELDS if f in r}  # v1beta1: flat fields
        if (exactly is None) == (not first):
            raise _fail(
                rw, "exactly one of exactly (or v1beta1 deviceClassName) and firstAvailable"
            )
        if exactly is not None:
            requests.append(
                Request(name, _exact(_obj(exactly, rw), name, f"{rw}.exactly", sub=False))
            )
        else:
            subs = []
            for j, raw_sub in enumerate(first):
                sw = f"{rw}.firstAvailable[{j}]"
                s = _obj(raw_sub, sw)
                sname = s.get("name")
                if not isinstance(sname, str) or not sname:
                    raise _fail(sw, "name is required")
                subs.append(_exact(s, sname, sw, sub=True))
            requests.append(Request(name, None, tuple(subs)))
    constraints = []
    for i, raw_c in enumerate(
        _list(devices.get("constraints"), f"{where}spec.devices.constraints")
    ):
        cw = f"{where}spec.devices.constraints[{i}]"
        c = _obj(raw_c, cw)
        match, distinct = c.get("matchAttribute"), c.get("distinctAttribute")
        if (match is None) == (distinct is None):
            raise _fail(cw, "exactly one of matchAttribute and distinctAttribute is required")
        attr = str(match or distinct)
        if "/" not in attr:
            raise _fail(cw, f"attribute {attr!r} must be fully qualified (domain/name)")
        constraints.append(
            Constraint(
                requests=tuple(str(x) for x in _list(c.get("requests"), f"{cw}.requests")),
                match_attribute=str(match) if match is not None else None,
                distinct_attribute=str(distinct) if distinct is not None else None,
            )
        )
    config = tuple(
        _obj(c, f"{where}spec.devices.config[{i}]")
        for i, c in enumerate(_list(devices.get("config"), f"{where}spec.devices.config"))
    )
    return Claim(
        namespace=str(meta.get("namespace", "")),
        name=str(meta.get("name") or meta.get("generateName") or "unnamed"),
        requests=tuple(requests),
        constraints=tuple(constraints),
        config=config,
        uid=str(meta.get("uid") or ""),
    )


def parse_device_class(obj: JSON) -> DeviceClass:
    meta = _obj(obj.get("metadata"), "metadata")
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        raise _fail("DeviceClass", "metadata.name is required")
    spec = _obj(obj.get("spec"), f"DeviceClass {name}: spec")
    return DeviceClass(
        name=name,
        selectors=_selectors(spec.get("selectors"), f"DeviceClass {name}: spec.selectors"),
        config=tuple(
            _obj(c, f"DeviceClass {name}: spec.config") for c in _list(spec.get("config"), "")
        ),
    )


def _policy(value: Any, where: str) -> CapacityPolicy | None:
    if value is None:
        return None
    p = _obj(value, where)
    rng = _obj(p.get("validRange"), f"{where}.validRange")

    def q(v: Any, w: str) -> Fraction | None:
        return None if v is None else _quantity(v, w)[0]

    return CapacityPolicy(
        default=q(p.get("default"), f"{where}.default"),
        valid_values=tuple(
            _quantity(v, f"{where}.validValues")[0] for v in _list(p.get("validValues"), where)
        ),
        range_min=q(rng.get("min"), f"{where}.validRange.min"),
        range_max=q(rng.get("max"), f"{where}.validRange.max"),
        range_step=q(rng.get("step"), f"{where}.validRange.step"),
    )


def _device(obj: JSON, driver: str, where: str) -> SliceDevice:
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise _fail(where, "device name is required")
    body = _obj(obj.get("basic"), where) if "basic" in obj else obj  # v1beta1 wraps in basic
    attrs: dict[str, Any] = {}
    for k, v in _obj(body.get("attributes"), f"{where}.attributes").items():
        try:
            attrs[str(k)] = cel.attribute_value(_obj(v, f"{where}.attributes.{k}"))
        except ValueError as exc:
            raise _fail(f"{where}.attributes.{k}", str(exc)) from None
    capacity: dict[str, Fraction] = {}
    formats: dict[str, Format] = {}
    policies: dict[str, CapacityPolicy] = {}
    for k, v in _obj(body.get("capacity"), f"{where}.capacity").items():
        cw = f"{where}.capacity.{k}"
        entry = _obj(v, cw) if isinstance(v, dict) else {"value": v}
        capacity[str(k)], formats[str(k)] = _quantity(entry.get("value"), cw)
        policy = _policy(entry.get("requestPolicy"), f"{cw}.requestPolicy")
        if policy is not None:
            policies[str(k)] = policy
    consumes = []
    for i, raw_cc in enumerate(_list(body.get("consumesCounters"), f"{where}.consumesCounters")):
        cc = _obj(raw_cc, f"{where}.consumesCounters[{i}]")
        counters = {
            str(n): _quantity(_obj(c, "").get("value"), f"{where}.consumesCounters[{i}].{n}")[0]
            for n, c in _obj(cc.get("counters"), "").items()
        }
        consumes.append((str(cc.get("counterSet", "")), counters))
    taints = tuple(
        Taint(str(t.get("key", "")), str(t.get("value", "")), str(t.get("effect", "")))
        for t in (_obj(t, f"{where}.taints") for t in _list(body.get("taints"), f"{where}.taints"))
    )
    multi = bool(body.get("allowMultipleAllocations"))
    cel_caps = {k: cel.CelQuantity(v, formats[k]) for k, v in capacity.items()}
    return SliceDevice(
        name=name,
        attributes=attrs,
        capacity=capacity,
        capacity_formats=formats,
        policies=policies,
        consumes_counters=tuple(consumes),
        taints=taints,
        allow_multiple_allocations=multi,
        node_name=body.get("nodeName"),
        all_nodes=bool(body.get("allNodes")),
        node_selector=body.get("nodeSelector"),
        cel_device=cel.device_variable(
            driver=driver, attributes=attrs, capacity=cel_caps, allow_multiple_allocations=multi
        ),
    )


def parse_slice(obj: JSON) -> Slice:
    """A ResourceSlice (v1, v1beta2 or v1beta1 JSON) as a Slice; ExplainError names bad fields."""
    meta = _obj(obj.get("metadata"), "metadata")
    name = str(meta.get("name") or meta.get("generateName") or "unnamed")
    where = f"ResourceSlice {name}"
    spec = _obj(obj.get("spec"), f"{where}: spec")
    driver = spec.get("driver")
    pool = _obj(spec.get("pool"), f"{where}: spec.pool")
    if not isinstance(driver, str) or not driver or not pool.get("name"):
        raise _fail(where, "spec.driver and spec.pool.name are required")
    counters = {}
    for i, raw_cs in enumerate(_list(spec.get("sharedCounters"), f"{where}: spec.sharedCounters")):
        cs = _obj(raw_cs, f"{where}: spec.sharedCounters[{i}]")
        counters[str(cs.get("name", ""))] = {
            str(n): _quantity(_obj(c, "").get("value"), f"{where}: sharedCounters[{i}].{n}")[0]
            for n, c in _obj(cs.get("counters"), "").items()
        }
    devices = tuple(
        _device(_obj(d, f"{where}: spec.devices[{i}]"), driver, f"{where}: spec.devices[{i}]")
        for i, d in enumerate(_list(spec.get("devices"), f"{where}: spec.devices"))
    )
    return Slice(
        name=name,
        driver=driver,
        pool=str(pool["name"]),
        generation=int(pool.get("generation", 0)),
        resource_slice_count=int(pool.get("resourceSliceCount", 1)),
        node_name=spec.get("nodeName") or None,
        all_nodes=bool(spec.get("allNodes")),
        node_selector=spec.get("nodeSelector"),
        per_device_node_selection=bool(spec.get("perDeviceNodeSelection")),
        devices=devices,
        shared_counters=counters,
    )


def allocated_state(claims: Iterable[JSON]) -> AllocatedState:
    """What allocated claims hold, as the scheduler counts it, and each claim's allocation.

    Claims without ``status.allocation`` are skipped. A result with ``adminAccess`` holds
    nothing (it neither blocks nor is blocked, spec D.3); one with ``shareID`` holds its
    ``consumedCapacity`` of a device that allows multiple allocations; any other holds its device
    (and, through it, the shared counters it consumes).
    """
    exclusive: dict[DeviceID, str] = {}
    shared: dict[DeviceID, dict[str, Fraction]] = {}
    shared_holders: dict[DeviceID, list[str]] = {}
    allocations: dict[str, ClaimAllocation] = {}
    uids: dict[str, str] = {}
    for obj in claims:
        meta = _obj(obj.get("metadata"), "metadata")
        key = f"{meta.get('namespace', '')}/{meta.get('name', '')}".lstrip("/")
        status = _obj(obj.get("status"), f"{key}: status")
        if status.get("allocation") is None:
            continue
        where = f"{key}: status.allocation"
        allocation = _obj(status.get("allocation"), where)
        devices = _obj(allocation.get("devices"), f"{where}.devices")
        results = []
        for raw in _list(devices.get("results"), f"{where}.devices.results"):
            r = _obj(raw, f"{where}.devices.results")
            dev: DeviceID = (str(r.get("driver")), str(r.get("pool")), str(r.get("device")))
            consumed = _obj(r.get("consumedCapacity"), f"{where}.devices.results")
            results.append(
                DeviceResult(
                    request=str(r.get("request", "")),
                    driver=dev[0],
                    pool=dev[1],
                    device=dev[2],
                    admin_access=bool(r.get("adminAccess")),
                    tolerations=_tolerations(r.get("tolerations"), f"{where}.tolerations"),
                    share_id=str(r["shareID"]) if r.get("shareID") else None,
                    consumed_capacity={str(n): str(v) for n, v in consumed.items()},
                )
            )
            if r.get("adminAccess"):
                continue
            if r.get("shareID"):
                agg = shared.setdefault(dev, {})
                for n, v in consumed.items():
                    agg[str(n)] = agg.get(str(n), Fraction(0)) + _quantity(v, key)[0]
                holders = shared_holders.setdefault(dev, [])
                if key not in holders:
                    holders.append(key)
            else:
                exclusive[dev] = key
        allocations[key] = ClaimAllocation(
            claim=key,
            results=tuple(results),
            config=tuple(
                _obj(c, f"{where}.devices.config")
                for c in _list(devices.get("config"), f"{where}.devices.config")
            ),
            node_selector=allocation.get("nodeSelector") or None,
            existing=True,
        )
        if meta.get("uid"):
            uids[str(meta["uid"])] = key
    return AllocatedState(
        exclusive,
        shared,
        {d: tuple(h) for d, h in shared_holders.items()},
        allocations,
        uids,
    )


def parse_device_taint_rule(obj: JSON) -> DeviceTaintRule:
    """A DeviceTaintRule (v1alpha3, v1beta2 or v1 JSON); ExplainError names bad fields."""
    meta = _obj(obj.get("metadata"), "metadata")
    name = str(meta.get("name") or "unnamed")
    where = f"DeviceTaintRule {name}"
    spec = _obj(obj.get("spec"), f"{where}: spec")
    t = _obj(spec.get("taint"), f"{where}: spec.taint")
    if not t.get("key") or not t.get("effect"):
        raise _fail(where, "spec.taint.key and spec.taint.effect are required")
    taint = Taint(str(t["key"]), str(t.get("value") or ""), str(t["effect"]), rule=name)
    if spec.get("deviceSelector") is None:
        return DeviceTaintRule(name, taint, selected=False)
    sel = _obj(spec.get("deviceSelector"), f"{where}: spec.deviceSelector")

    def field_(k: str) -> str | None:
        v = sel.get(k)
        return str(v) if v else None

    return DeviceTaintRule(
        name,
        taint,
        driver=field_("driver"),
        pool=field_("pool"),
        device=field_("device"),
        device_class=field_("deviceClassName"),
        selectors=_selectors(sel.get("selectors"), f"{where}: spec.deviceSelector.selectors"),
    )


def apply_taint_rules(
    slices: Sequence[Slice],
    rules: Sequence[DeviceTaintRule],
    *,
    classes: Mapping[str, DeviceClass],
) -> list[Slice]:
    """``slices`` with the taints of ``rules`` added to the devices the rules select: the
    devices as the scheduler sees them (its DeviceTaintRule tracker patches them the same way).
    A rule's class or CEL selectors (v1alpha3 before 1.35) that fail on a device, with false or
    a runtime error, do not select it; an unknown class selects nothing."""
    if not rules:
        return list(slices)
    out = []
    for s in slices:
        devices = []
        for d in s.devices:
            extra = tuple(r.taint for r in rules if _rule_selects(r, s, d, classes))
            devices.append(replace(d, taints=d.taints + extra) if extra else d)
        changed = any(a is not b for a, b in zip(devices, s.devices, strict=True))
        out.append(replace(s, devices=tuple(devices)) if changed else s)
    return out


def _rule_selects(
    rule: DeviceTaintRule, s: Slice, d: SliceDevice, classes: Mapping[str, DeviceClass]
) -> bool:
    if not rule.selected:
        return False
    for wanted, have in ((rule.driver, s.driver), (rule.pool, s.pool), (rule.device, d.name)):
        if wanted is not None and wanted != have:
            return False
    exprs = rule.selectors
    if rule.device_class is not None:
        cls = classes.get(rule.device_class)
        if cls is None:
            return False
        exprs = cls.selectors + exprs
    for expr in exprs:
        try:
            if not cel.compile_selector(expr).matches(d.cel_device):
                return False
        except (CelRuntimeError, CelCompileError):  # a stored rule the API server accepted
            return False
    return True


# ---------------------------------------------------------------------------------------------
# Pools


@dataclass(eq=False)
class _Pool:
    driver: str
    name: str
    slices: list[Slice]
    incomplete: bool = False
    invalid: str = ""
    counter_sets: dict[str, Mapping[str, Fraction]] = field(default_factory=dict)

    @property
    def pool_id(self) -> PoolID:
        return (self.driver, self.name)


def _selector_matches(selector: JSON | None, node: Node) -> bool:
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


def _device_on_node(s: Slice, d: SliceDevice, node: Node) -> bool:
    if not s.per_device_node_selection:
        return True
    if d.node_name:
        return d.node_name == node.name
    if d.all_nodes:
        return True
    return _selector_matches(d.node_selector, node)


def gather_pools(slices: Sequence[Slice], node: Node) -> list[_Pool]:
    """The pools with slices reaching ``node``, at their highest generation, by (driver, pool)."""
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
            or (s.node_selector and _selector_matches(s.node_selector, node))
            or s.per_device_node_selection
            or (s.shared_counters and not s.devices)
        ]
        if not any(s.devices for s in reaching):
            continue
        pool = _Pool(driver, name, reaching)
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
    return pools


# ---------------------------------------------------------------------------------------------
# The search


@dataclass(eq=False)
class _Candidate:
    pool: _Pool
    slice: Slice
    device: SliceDevice
    on_node: bool = True

    @property
    def id(self) -> DeviceID:
        return (self.pool.driver, self.pool.name, self.device.name)


@dataclass(eq=False)
class _ReqData:
    claim_index: int
    request: ExactRequest
    parent: str | None  # main request name of a sub-request
    device_class: DeviceClass
    num_devices: int = 0
    all_devices: list[_Candidate] = field(default_factory=list)
    all_error: str = ""

    @property
    def full_name(self) -> str:
        return f"{self.parent}/{self.request.name}" if self.parent else self.request.name


@dataclass(eq=False)
class _Placed:
    data: _ReqData
    cand: _Candidate
    share_id: str | None
    consumed: dict[str, Fraction]
    took_counters: bool = False


class _Abort(Exception):
    """A CEL runtime error or an impossible 'All' request: the scheduler gives up the node."""


class _Constraint:
    def __init__(self, c: Constraint) -> None:
        self.c = c
        self.attribute = c.match_attribute or c.distinct_attribute or ""
        self.values: list[Any] = []

    def applies(self, data: _ReqData) -> bool:
        if not self.c.requests:
            return True
        return (
            data.parent or data.request.name
        ) in self.c.requests or data.full_name in self.c.requests

    def add(self, data: _ReqData, cand: _Candidate) -> bool:
        if not self.applies(data):
            return True
        value = lookup_attribute(cand, self.attribute)
        if value is _MISSING:
            return False
        if self.c.match_attribute is not None:
            if self.values and not _attr_overlap(self.values[-1], value):
                return False
            narrowed = value if not self.values else _attr_intersection(self.values[-1], value)
            self.values.append(narrowed)
        else:
            if any(_attr_overlap(v, value) for v in self.values):
                return False
            self.values.append(value)
        return True

    def remove(self, data: _ReqData) -> None:
        if self.applies(data):
            self.values.pop()


_MISSING: Final = object()


def lookup_attribute(cand: _Candidate, qualified: str) -> Any:
    """A fully-qualified attribute of a device; also finds it unqualified in the driver's domain."""
    attrs = cand.device.attributes
    if qualified in attrs:
        return attrs[qualified]
    domain, _, ident = qualified.partition("/")
    if domain == cand.pool.driver and ident in attrs:
        return attrs[ident]
    return _MISSING


def _as_set(v: Any) -> list[str]:
    items = v if isinstance(v, list) else [v]
    return [f"{type(x).__name__}:{x}" for x in items]


def _attr_overlap(a: Any, b: Any) -> bool:
    return bool(set(_as_set(a)) & set(_as_set(b)))


def _attr_intersection(a: Any, b: Any) -> Any:
    if not isinstance(a, list) and not isinstance(b, list):
        return a
    keep = set(_as_set(b))
    items = a if isinstance(a, list) else [a]
    return [x for x in items if f"{type(x).__name__}:{x}" in keep]


def _consumed_for(request: ExactRequest | None, device: SliceDevice, name: str) -> Fraction:
    cap = device.capacity[name]
    policy = device.policies.get(name)
    requested = request.capacity_requests.get(name) if request else None
    if requested is None:
        return policy.default if policy and policy.default is not None else cap
    if policy is None:
        return requested
    if policy.range_min is not None:
        if requested < policy.range_min:
            return policy.range_min
        if policy.range_step is None:
            return requested
        steps = -(-(requested - policy.range_min) // policy.range_step)
        return policy.range_min + steps * policy.range_step
    for valid in policy.valid_values:
        if requested <= valid:
            return valid
    return requested


def _violation(value: Fraction, policy: CapacityPolicy | None, fmt: Format) -> str | None:
    """Why a consumed amount breaks ``policy`` (KEP-5075 ``violatesPolicy``), or None."""
    if policy is None or (policy.default is not None and value == policy.default):
        return None
    if policy.range_min is not None:
        if policy.range_max is not None and value > policy.range_max:
            return f"more than the requestPolicy's maximum {format_quantity(policy.range_max, fmt)}"
        if policy.range_step is not None and (value - policy.range_min) % policy.range_step != 0:
            return "not the requestPolicy's minimum plus a multiple of its step"
        return None
    if policy.valid_values and value not in policy.valid_values:
        shown = ", ".join(format_quantity(v, fmt) for v in policy.valid_values)
        return f"more than the requestPolicy's largest valid value (valid: {shown})"
    return None


def capacity_problem(
    request: ExactRequest, device: SliceDevice, already: Mapping[str, Fraction]
) -> str | None:
    """Why ``request`` cannot take its capacity share of ``device`` (None: it can), as
    ``memory: 30Gi requested, 12Gi left on gpu-2``. ``already``: what other allocations
    consume of the device (a device that allows multiple allocations)."""
    for name in request.capacity_requests:
        if name not in device.capacity:
            return f"{name}: requested, but {device.name} has no capacity {name}"
    for name, cap in device.capacity.items():
        consumed = _consumed_for(request, device, name)
        fmt = device.capacity_formats.get(name, "DecimalSI")
        asked = request.capacity_requests.get(name)
        if asked is None:
            how = (
                " (the requestPolicy's default)"
                if name in device.policies
                else " (all of it: not asked for, and no requestPolicy)"
            )
        elif asked != consumed:
            how = f" ({format_quantity(asked, fmt)} rounded up by the requestPolicy)"
        else:
            how = ""
        shown = f"{name}: {format_quantity(consumed, fmt)} requested{how}"
        violation = _violation(consumed, device.policies.get(name), fmt)
        if violation is not None:
            return f"{shown}, {violation} on {device.name}"
        used = already.get(name, Fraction(0))
        if used + consumed > cap:
            left = max(cap - used, Fraction(0))
            return f"{shown}, {format_quantity(left, fmt)} left on {device.name}"
    return None


class _Search:
    def __init__(
        self,
        claims: Sequence[Claim],
        datas: dict[tuple[int, int, int], _ReqData],
        pools: list[_Pool],
        allocated: AllocatedState,
    ) -> None:
        self.claims = claims
        self.datas = datas
        self.pools = pools
        self.allocated = allocated
        self.candidates = [
            _Candidate(p, s, d)
            for p in pools
            if not p.incomplete and not p.invalid
            for s in p.slices
            for d in s.devices
        ]
        self.allocating: dict[DeviceID, set[int]] = {}
        self.capacity: dict[DeviceID, dict[str, Fraction]] = {}
        self.counters_used: dict[PoolID, dict[str, dict[str, Fraction]]] = {}
        self.available: dict[PoolID, dict[str, dict[str, Fraction]]] = {}
        self.match_cache: dict[tuple[DeviceID, tuple[int, int, int]], bool] = {}
        self.constraints = [[_Constraint(c) for c in claim.constraints] for claim in claims]
        self.placed: list[list[_Placed]] = [[] for _ in claims]
        self.selected_sub: dict[tuple[int, int], int] = {}
        self.steps = 0

    # -- checks shared with the diagnosis
    def selector_verdict(self, key: tuple[int, int, int], cand: _Candidate) -> bool:
        cache_key = (cand.id, key)
        hit = self.match_cache.get(cache_key)
        if hit is not None:
            return hit
        data = self.datas[key]
        ok = _selectors_match(data, cand, self.claims[data.claim_index])
        if ok and not cand.on_node:
            ok = False
        self.match_cache[cache_key] = ok
        return ok

    def in_use(self, dev: DeviceID) -> bool:
        return dev in self.allocated.exclusive or bool(self.allocating.get(dev))

    def available_counters(self, pool: _Pool) -> dict[str, dict[str, Fraction]]:
        avail = self.available.get(pool.pool_id)
        if avail is None:
            avail = {n: dict(c) for n, c in pool.counter_sets.items()}
            for s in pool.slices:
                for d in s.devices:
                    dev = (pool.driver, pool.name, d.name)
                    if dev in self.allocated.exclusive or dev in self.allocated.shared_capacity:
                        for cs, counters in d.consumes_counters:
                            for n, v in counters.items():
                                if n in avail.get(cs, {}):
                                    avail[cs][n] -= v
            self.available[pool.pool_id] = avail
        return avail

    def take_counters(self, cand: _Candidate) -> bool:
        avail = self.available_counters(cand.pool)
        used = self.counters_used.setdefault(cand.pool.pool_id, {})
        for cs, counters in cand.device.consumes_counters:
            if cs not in avail:
                raise _Abort(
                    f"device {'/'.join(cand.id)} consumes counter set {cs}, which pool "
                    f"{cand.pool.name} does not define"
                )
            for n, v in counters.items():
                if n not in avail[cs]:
                    raise _Abort(f"device {'/'.join(cand.id)} consumes unknown counter {cs}/{n}")
                if used.get(cs, {}).get(n, Fraction(0)) + v > avail[cs][n]:
                    return False
        for cs, counters in cand.device.consumes_counters:
            bucket = used.setdefault(cs, {})
            for n, v in counters.items():
                bucket[n] = bucket.get(n, Fraction(0)) + v
        return True

    def give_counters(self, cand: _Candidate) -> None:
        used = self.counters_used[cand.pool.pool_id]
        for cs, counters in cand.device.consumes_counters:
            for n, v in counters.items():
                used[cs][n] -= v

    def shared_in_use(self, dev: DeviceID) -> dict[str, Fraction]:
        total = dict(self.allocated.shared_capacity.get(dev, {}))
        for n, v in self.capacity.get(dev, {}).items():
            total[n] = total.get(n, Fraction(0)) + v
        return total

    # -- the recursion (mirrors allocateOne)
    def run(self) -> bool:
        return self.one(0, 0, 0, 0, sub=False, start=0)

    def one(self, c: int, r: int, s: int, d: int, *, sub: bool, start: int) -> bool:
        self.steps += 1
        if c >= len(self.claims):
            return True
        claim = self.claims[c]
        if r >= len(claim.requests):
            try:
                return self.one(c + 1, 0, 0, 0, sub=False, start=0)
            except _TooMany:
                return False
        key = (c, r, s)
        data = self.datas[key]
        if not sub and data.parent is not None:
            all_too_many = True
            for si in range(len(claim.requests[r].first_available)):
                try:
                    ok = self.one(c, r, si, 0, sub=True, start=0)
                except _TooMany:
                    continue
                all_too_many = False
                if ok:
                    self.selected_sub[(c, r)] = si
                    return True
            if all_too_many:
                raise _TooMany
            return False
        req = data.request
        if req.allocation_mode == "All" and data.all_error:
            raise _Abort(data.all_error)
        if req.allocation_mode == "All" and not data.all_devices:
            return False
        if d >= data.num_devices:
            return self.one(c, r + 1, 0, 0, sub=False, start=0)
        if len(self.placed[c]) + data.num_devices - d > MAX_RESULTS_PER_CLAIM:
            raise _TooMany
        if req.allocation_mode == "All":
            cand = data.all_devices[d]
            placed = self.place(key, cand, must=True)
            if placed is None:
                return False
            if self.one(c, r, s, d + 1, sub=sub, start=0):
                return True
            self.unplace(key, placed)
            return False
        for i in range(start, len(self.candidates)):
            cand = self.candidates[i]
            dev = cand.id
            if req.admin_access:
                if c in self.allocating.get(dev, ()):
                    continue
            elif not cand.device.allow_multiple_allocations and self.in_use(dev):
                continue
            if not self.selector_verdict(key, cand):
                continue
            placed = self.place(key, cand, must=False)
            if placed is None:
                continue
            try:
                if self.one(c, r, s, d + 1, sub=sub, start=i + 1):
                    return True
            except _TooMany:
                self.unplace(key, placed)
                raise
            self.unplace(key, placed)
        return False

    def place(self, key: tuple[int, int, int], cand: _Candidate, *, must: bool) -> _Placed | None:
        data = self.datas[key]
        req = data.request
        dev = cand.id
        multi = cand.device.allow_multiple_allocations
        c = data.claim_index
        if not multi and req.admin_access and c in self.allocating.get(dev, ()):
            return None
        if not req.admin_access and self.in_use(dev) and not multi:
            return None
        shared = self.shared_in_use(dev) if multi else {}
        if capacity_problem(req, cand.device, shared) is not None:
            return None
        skip_counters = multi and bool(shared)
        took = False
        if cand.device.consumes_counters and not skip_counters:
            if not self.take_counters(cand):
                return None
            took = True
        if _taint_blocks(cand.device, req):
            if took:
                self.give_counters(cand)
            return None
        for added, con in enumerate(self.constraints[c]):
            if not con.add(data, cand):
                for undo in self.constraints[c][:added]:
                    undo.remove(data)
                if took:
                    self.give_counters(cand)
                if must:
                    raise _Abort(
                        f"claim {self.claims[c].key}, request {data.full_name}: cannot add device "
                        f"{'/'.join(dev)} because a claim constraint would not be satisfied"
                    )
                return None
        consumed: dict[str, Fraction] = {}
        share_id = None
        if multi:
            consumed = {n: _consumed_for(req, cand.device, n) for n in cand.device.capacity}
            bucket = self.capacity.setdefault(dev, {})
            for n, v in consumed.items():
                bucket[n] = bucket.get(n, Fraction(0)) + v
            share_id = str(
                uuid.uuid5(
                    uuid.NAMESPACE_URL,
                    f"{self.claims[c].key}/{data.full_name}/{'/'.join(dev)}/{len(self.placed[c])}",
                )
            )
        else:
            self.allocating.setdefault(dev, set()).add(c)
        placed = _Placed(data, cand, share_id, consumed, took)
        self.placed[c].append(placed)
        return placed

    def unplace(self, key: tuple[int, int, int], placed: _Placed) -> None:
        data = placed.data
        c = data.claim_index
        dev = placed.cand.id
        self.placed[c].remove(placed)
        if placed.share_id is not None:
            bucket = self.capacity[dev]
            for n, v in placed.consumed.items():
                bucket[n] -= v
            if not any(bucket.values()):
                del self.capacity[dev]
        else:
            self.allocating[dev].discard(c)
        for con in reversed(self.constraints[c]):
            con.remove(data)
        if placed.took_counters:
            self.give_counters(placed.cand)


class _TooMany(Exception):
    """More than 32 devices for one claim: backtrack harder (errAllocationResultMaxSizeExceeded)."""


def _taint_blocks(device: SliceDevice, req: ExactRequest) -> Taint | None:
    for taint in device.taints:
        if taint.effect in ("NoSchedule", "NoExecute") and not any(
            t.tolerates(taint) for t in req.tolerations
        ):
            return taint
    return None


def _selectors_match(data: _ReqData, cand: _Candidate, claim: Claim) -> bool:
    dev = cand.device.cel_device
    for i, expr in enumerate(data.device_class.selectors):
        program = cel.compile_selector(expr)
        try:
            if not program.matches(dev):
                return False
        except CelRuntimeError as exc:
            raise _Abort(
                f"class {data.device_class.name}: selector #{i} on device {'/'.join(cand.id)}: "
                f"CEL runtime error: {exc}"
            ) from None
    for i, expr in enumerate(data.request.selectors):
        program = cel.compile_selector(expr)
        try:
            if not program.matches(dev):
                return False
        except CelRuntimeError as exc:
            raise _Abort(
                f"claim {claim.key}: request {data.full_name}: selector #{i} on device "
                f"{'/'.join(cand.id)}: CEL runtime error: {exc}"
            ) from None
    return True


# ---------------------------------------------------------------------------------------------
# Entry point


def compile_selectors(
    claims: Sequence[Claim],
    classes: Mapping[str, DeviceClass],
    *,
    k8s_version: str = NEWEST_VERSION,
) -> None:
    """Compile every selector the claims use as new expressions of an API server of
    ``k8s_version`` (``environment.py``); raise CelCompileError/ExplainError naming it."""
    for claim in claims:
        for request in claim.requests:
            for exact in (request.exactly,) if request.exactly else request.first_available:
                name = f"{request.name}/{exact.name}" if request.exactly is None else request.name
                cls = classes.get(exact.device_class_name)
                if cls is None:
                    raise ExplainError(
                        f"claim {claim.key}: request {name}: device class "
                        f"{exact.device_class_name!r} not found "
                        f"(known: {', '.join(sorted(classes)) or 'none'})"
                    )
                for i, expr in enumerate(cls.selectors):
                    _compile(expr, f"DeviceClass {cls.name}: spec.selectors[{i}]", k8s_version)
                for i, expr in enumerate(exact.selectors):
                    where = f"claim {claim.key}: request {name}: selectors[{i}]"
                    _compile(expr, where, k8s_version)


def _compile(expr: str, where: str, k8s_version: str) -> None:
    # Evaluation elsewhere uses the newest environment's program: it declares everything an
    # older version does, so a selector that compiled here compiles there too.
    try:
        cel.compile_selector(expr, k8s_version)
    except CelCompileError as exc:
        raise CelCompileError(f"{where}: CEL compile error: {exc}") from None


def allocate(
    claims: Sequence[Claim],
    *,
    classes: Mapping[str, DeviceClass],
    slices: Sequence[Slice],
    node: Node,
    allocated: AllocatedState | None = None,
    diagnose: bool = True,
) -> AllocationResult:
    """Allocate all ``claims`` together on ``node`` as the scheduler would.

    A claim that ``allocated`` already holds an allocation for (same UID, else same
    namespace/name) keeps it, as the scheduler keeps ``status.allocation``: the node only has to
    be one its ``nodeSelector`` admits, and its devices stay in use. Raise ExplainError (or
    CelCompileError) for input errors: an unknown class, a selector that does not compile. A CEL
    runtime error is not an input error: like the scheduler, the attempt is aborted and the
    result carries the error. With ``diagnose``, an unsatisfiable result explains per request
    why each device was unusable.
    """
    allocated = allocated or AllocatedState()
    compile_selectors(claims, classes)
    pools = gather_pools(slices, node)
    notes = tuple(
        f"pool {p.driver}/{p.name} is "
        + (
            f"invalid ({p.invalid})"
            if p.invalid
            else "incomplete (not all of its slices are published)"
        )
        + "; its devices are not used"
        for p in pools
        if p.incomplete or p.invalid
    )
    existing = [allocated.existing(c) for c in claims]
    for claim, done in zip(claims, existing, strict=True):
        if done is None:
            continue
        notes += (
            f"claim {claim.key} is already allocated (status.allocation of {done.claim}): "
            "shown as it is, not allocated again",
        )
        if done.node_selector and not _selector_matches(done.node_selector, node):
            return AllocationResult(
                node=node.name,
                satisfiable=False,
                error=f"claim {claim.key} is already allocated, for {_nodes_of(done)}",
                notes=notes,
            )
    if all(done is not None for done in existing):
        return AllocationResult(
            node=node.name,
            satisfiable=True,
            allocations=tuple(done for done in existing if done is not None),
            notes=notes,
        )
    claims = [c for c, done in zip(claims, existing, strict=True) if done is None]
    datas = _request_data(claims, classes)
    search = _Search(claims, datas, pools, allocated)
    for cand in search.candidates:
        if cand.slice.per_device_node_selection:
            cand.on_node = _device_on_node(cand.slice, cand.device, node)
    error = None
    ok = False
    try:
        _fill_all_devices(search, datas, pools)
        ok = search.run()
    except _Abort as exc:
        error = str(exc)
    except _TooMany:
        error = f"more than {MAX_RESULTS_PER_CLAIM} devices requested by one claim"
    if ok and error is None:
        new = iter(_results(search, classes))
        return AllocationResult(
            node=node.name,
            satisfiable=True,
            allocations=tuple(next(new) if done is None else done for done in existing),
            notes=notes,
        )
    diagnoses = _diagnose(search, node) if diagnose else ()
    return AllocationResult(
        node=node.name, satisfiable=False, error=error, diagnoses=diagnoses, notes=notes
    )


def _nodes_of(allocation: ClaimAllocation) -> str:
    """The nodes an existing allocation's nodeSelector names, in words."""
    names = [
        str(v)
        for term in (allocation.node_selector or {}).get("nodeSelectorTerms") or []
        for r in term.get("matchFields") or []
        if r.get("key") == "metadata.name" and r.get("operator") == "In"
        for v in r.get("values") or []
    ]
    if names:
        return f"node {', '.join(names)}" if len(names) == 1 else f"nodes {', '.join(names)}"
    return "other nodes (its nodeSelector does not match this one)"


def _request_data(
    claims: Sequence[Claim], classes: Mapping[str, DeviceClass]
) -> dict[tuple[int, int, int], _ReqData]:
    datas = {}
    for ci, claim in enumerate(claims):
        for ri, request in enumerate(claim.requests):
            if request.exactly is not None:
                ex = request.exactly
                datas[(ci, ri, 0)] = _ReqData(ci, ex, None, classes[ex.device_class_name], ex.count)
            else:
                for si, sub in enumerate(request.first_available):
                    datas[(ci, ri, si)] = _ReqData(
                        ci, sub, request.name, classes[sub.device_class_name], sub.count
                    )
    return datas


def _fill_all_devices(
    search: _Search, datas: dict[tuple[int, int, int], _ReqData], pools: list[_Pool]
) -> None:
    for key, data in datas.items():
        if data.request.allocation_mode != "All":
            continue
        bad = [p for p in pools if p.incomplete or p.invalid]
        if bad:
            p = bad[0]
            data.all_error = (
                f"request {data.full_name}: asks for all devices, but resource pool "
                f"{p.driver}/{p.name} is currently {'invalid' if p.invalid else 'being updated'}"
            )
            continue
        data.all_devices = [c for c in search.candidates if search.selector_verdict(key, c)]
        data.num_devices = len(data.all_devices)


def _results(search: _Search, classes: Mapping[str, DeviceClass]) -> tuple[ClaimAllocation, ...]:
    out = []
    for ci, claim in enumerate(search.claims):
        placed = search.placed[ci]
        results = tuple(
            DeviceResult(
                request=p.data.full_name,
                driver=p.cand.pool.driver,
                pool=p.cand.pool.name,
                device=p.cand.device.name,
                admin_access=p.data.request.admin_access,
                tolerations=p.data.request.tolerations,
                share_id=p.share_id,
                consumed_capacity={
                    n: format_quantity(v, p.cand.device.capacity_formats.get(n, "DecimalSI"))
                    for n, v in p.consumed.items()
                },
            )
            for p in placed
        )
        out.append(
            ClaimAllocation(
                claim=claim.key,
                results=results,
                config=_configs(search, ci, claim),
                node_selector=_node_selector([p.cand for p in placed]),
            )
        )
    return tuple(out)


def _configs(search: _Search, ci: int, claim: Claim) -> tuple[JSON, ...]:
    chosen: list[_ReqData] = []
    for ri, request in enumerate(claim.requests):
        si = search.selected_sub.get((ci, ri), 0) if request.exactly is None else 0
        chosen.append(search.datas[(ci, ri, si)])
    configs: list[JSON] = []
    class_entries: dict[str, list[JSON]] = {}
    for data in chosen:
        cls = data.device_class
        if cls.name in class_entries:
            for entry in class_entries[cls.name]:
                entry["requests"].append(data.full_name)
            continue
        entries = [
            {
                "source": "FromClass",
                "requests": [data.full_name],
                **{k: v for k, v in c.items() if k != "requests"},
            }
            for c in cls.config
        ]
        class_entries[cls.name] = entries
        configs.extend(entries)
    for c in claim.config:
        wanted = [str(x) for x in c.get("requests") or []]
        body = {k: v for k, v in c.items() if k != "requests"}
        if not wanted:
            configs.append({"source": "FromClaim", "requests": [], **body})
            continue
        for data in chosen:
            if (data.parent or data.request.name) in wanted or data.full_name in wanted:
                configs.append({"source": "FromClaim", "requests": wanted, **body})
    return tuple(configs)


def _node_selector(cands: list[_Candidate]) -> JSON | None:
    exprs: list[JSON] = []
    fields: list[JSON] = []
    for cand in cands:
        s, d = cand.slice, cand.device
        node_name = d.node_name if s.per_device_node_selection else s.node_name
        selector = d.node_selector if s.per_device_node_selection else s.node_selector
        if node_name:
            return {
                "nodeSelectorTerms": [
                    {
                        "matchFields": [
                            {"key": "metadata.name", "operator": "In", "values": [node_name]}
                        ]
                    }
                ]
            }
        if selector:
            term = (selector.get("nodeSelectorTerms") or [{}])[0]
            for r in term.get("matchFields") or []:
                if r not in fields:
                    fields.append(r)
            for r in term.get("matchExpressions") or []:
                if r not in exprs:
                    exprs.append(r)
    if not exprs and not fields:
        return None
    term_out: JSON = {}
    if exprs:
        term_out["matchExpressions"] = exprs
    if fields:
        term_out["matchFields"] = fields
    return {"nodeSelectorTerms": [term_out]}


# ---------------------------------------------------------------------------------------------
# Diagnosis: per request, why each device is unusable


@dataclass
class _Why:
    """Why one device cannot serve one request, and whether allocated claims are the cause."""

    reasons: list[str] = field(default_factory=list)
    matches: bool = True  # its pool is usable, it is on the node and it passes the selectors
    in_use_by: list[str] = field(default_factory=list)  # claims holding it or what it needs
    allocated: bool = False  # held itself (not only its shared counters or capacity)

    def blame(self, holders: Iterable[str]) -> None:
        for h in holders:
            if h not in self.in_use_by:
                self.in_use_by.append(h)


def _diagnose(search: _Search, node: Node) -> tuple[RequestDiagnosis, ...]:
    out = []
    every = [_Candidate(p, s, d) for p in search.pools for s in p.slices for d in s.devices]
    for data in search.datas.values():
        claim = search.claims[data.claim_index]
        verdicts = []
        whys = []
        for cand in every:
            why = _device_reasons(search, data, cand, node)
            whys.append((cand, why))
            verdicts.append(
                DeviceVerdict(
                    cand.pool.driver,
                    cand.pool.name,
                    cand.device.name,
                    tuple(why.reasons),
                    tuple(why.in_use_by),
                )
            )
        req = data.request
        wanted = "all" if req.allocation_mode == "All" else str(req.count)
        matching = [w for _, w in whys if w.matches]
        out.append(
            RequestDiagnosis(
                claim=claim.key,
                request=data.full_name,
                device_class=data.device_class.name,
                wanted=wanted,
                summary=_summary(search, data, whys),
                verdicts=tuple(verdicts),
                all_taken=bool(matching) and all(w.in_use_by for w in matching),
            )
        )
    return tuple(out)


def _device_reasons(search: _Search, data: _ReqData, cand: _Candidate, node: Node) -> _Why:
    why = _Why()
    reasons = why.reasons
    pool = cand.pool
    if pool.invalid:
        reasons.append(f"pool {pool.name} is invalid: {pool.invalid}")
    elif pool.incomplete:
        reasons.append(f"pool {pool.name} is incomplete (not all of its slices are published)")
    on_node = _device_on_node(cand.slice, cand.device, node)
    if not on_node:
        reasons.append(f"not available on node {node.name}")
    req = data.request
    dev = cand.id
    holder = search.allocated.exclusive.get(dev)
    if holder is not None and not req.admin_access and not cand.device.allow_multiple_allocations:
        reasons.append(f"in use by {holder}")
        why.blame([holder])
        why.allocated = True
    selector = _selector_reasons(data, cand)
    reasons.extend(selector)
    why.matches = on_node and not selector and not pool.invalid and not pool.incomplete
    taint = _taint_blocks(cand.device, req)
    if taint is not None:
        source = f" (from DeviceTaintRule {taint.rule})" if taint.rule else ""
        reasons.append(f"taint {taint} is not tolerated{source}")
    multi = cand.device.allow_multiple_allocations
    shared = dict(search.allocated.shared_capacity.get(dev, {})) if multi else {}
    problem = capacity_problem(req, cand.device, shared)
    if problem is not None:
        holders = search.allocated.shared_holders.get(dev, ()) if multi else ()
        if holders and capacity_problem(req, cand.device, {}) is None:
            problem += f" (in use by {', '.join(holders)})"
            why.blame(holders)
        reasons.append(problem)
    if cand.device.consumes_counters and not pool.invalid:
        avail = search.available_counters(pool)
        for cs, counters in cand.device.consumes_counters:
            for n, v in counters.items():
                have = avail.get(cs, {}).get(n)
                if have is None:
                    reasons.append(f"consumes unknown counter {cs}/{n}")
                elif v > have:
                    users = _counter_holders(search, pool, cs, n)
                    reasons.append(
                        f"counter {cs}/{n}: needs {format_quantity(v)}, "
                        f"{format_quantity(max(have, Fraction(0)))} left"
                        + (
                            f" (used by {', '.join(f'{d} of claim {c}' for d, c in users[:3])})"
                            if users
                            else ""
                        )
                    )
                    why.blame(c for _, c in users)
    return why


def _selector_reasons(data: _ReqData, cand: _Candidate) -> list[str]:
    """The first failing selector, class before request, as the scheduler evaluates them."""
    device = cand.device.cel_device
    for label, selectors in (
        (f"class {data.device_class.name}", data.device_class.selectors),
        ("request", data.request.selectors),
    ):
        for i, expr in enumerate(selectors):
            why = cel.compile_selector(expr).why_false(device)
            if why:
                return [f"{label} selector #{i}: " + "; ".join(why)]
    return []


def _counter_holders(search: _Search, pool: _Pool, cs: str, counter: str) -> list[tuple[str, str]]:
    """(device, claim) of the allocated devices of ``pool`` that consume ``cs``/``counter``."""
    out = []
    for s in pool.slices:
        for d in s.devices:
            if not any(c == cs and counter in m for c, m in d.consumes_counters):
                continue
            for holder in search.allocated.holders((pool.driver, pool.name, d.name)):
                out.append((d.name, holder))
    return out


def _names(devices: Sequence[str], limit: int = 8) -> str:
    return ", ".join(devices[:limit]) + (" ..." if len(devices) > limit else "")


def _taken(whys: Sequence[tuple[_Candidate, _Why]]) -> tuple[list[str], bool]:
    """The matching devices kept from the request by allocated claims, as "dev (claims)", and
    whether every one of them is allocated itself (not only through counters or capacity)."""
    taken = [
        f"{c.device.name} ({', '.join(w.in_use_by)})" for c, w in whys if w.matches and w.in_use_by
    ]
    direct = all(w.allocated for _, w in whys if w.matches and w.in_use_by)
    return taken, direct


def _how(direct: bool) -> str:
    return "allocated" if direct else "taken by allocated claims"


def _all_taken(n: int, taken: list[str], direct: bool) -> str:
    """The headline when allocated claims hold every device that matches."""
    if n == 1:
        return f"the one matching device is {_how(direct)}: {taken[0]}"
    return f"all {n} matching devices are {_how(direct)}: {_names(taken)}"


def _summary(search: _Search, data: _ReqData, whys: Sequence[tuple[_Candidate, _Why]]) -> str:
    req = data.request
    total = len(whys)
    usable = [c for c, w in whys if not w.reasons]
    matching = [c for c, w in whys if w.matches]
    taken, direct = _taken(whys)
    names = _names([c.device.name for c in usable])
    are = "are" if len(taken) > 1 else "is"
    also = (
        f"; {len(taken)} matching device{'s' if len(taken) > 1 else ''} {are} {_how(direct)}: "
        f"{_names(taken)}"
        if taken
        else ""
    )
    if req.allocation_mode == "All":
        if data.all_error:
            return data.all_error
        if not matching:
            return f"needs all matching devices, but none of {total} matches"
        if taken:
            return (
                f"needs all {len(matching)} matching devices, but {len(taken)} {are} "
                f"{_how(direct)}: {_names(taken)}"
            )
        return (
            f"needs all {len(usable)} matching devices ({names}); "
            "not all of them can be allocated together"
        )
    if len(usable) < req.count:
        if not usable and taken and len(taken) == len(matching):
            return _all_taken(len(matching), taken, direct)
        return (
            f"needs {req.count}, {len(usable)} of {total} devices usable"
            + (f": {names}" if usable else "")
            + also
        )
    claim = search.claims[data.claim_index]
    for con in claim.constraints:
        probe = _Constraint(con)
        if not probe.applies(data):
            continue
        groups: dict[str, int] = {}
        missing = 0
        for cand in usable:
            value = lookup_attribute(cand, probe.attribute)
            if value is _MISSING:
                missing += 1
                continue
            for v in value if isinstance(value, list) else [value]:
                groups[cel.show_value(v)] = groups.get(cel.show_value(v), 0) + 1
        if con.match_attribute and (not groups or max(groups.values()) < req.count):
            shown = ", ".join(f"{k} x{n}" for k, n in sorted(groups.items()))
            return (
                f"needs {req.count} devices with the same {probe.attribute}; usable devices have "
                f"{shown or 'no such attribute'}"
                + (f" ({missing} lack it)" if missing else "")
                + also
            )
        if con.distinct_attribute and len(groups) < req.count:
            return (
                f"needs {req.count} devices with distinct {probe.attribute}; only "
                f"{len(groups)} distinct values among usable devices" + also
            )
    if any(c.device.consumes_counters for c in usable):
        return (
            f"{len(usable)} devices usable ({names}), but no {req.count} of them fit the shared "
            f"counters together (overlapping partitions) alongside the other requests" + also
        )
    return (
        f"{len(usable)} devices usable ({names}), but no combination satisfies the claim's "
        f"constraints together with its other requests" + also
    )


def format_fraction(value: Fraction) -> str:
    """A plain count (counters, capacities without a unit) in canonical decimal form."""
    return format_quantity(value)
