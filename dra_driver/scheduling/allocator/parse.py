"""API objects -> the allocator's input values (``model``): ResourceClaims and their templates
(v1, v1beta2, v1beta1), DeviceClasses, ResourceSlices (v1 or v1beta1, ``basic`` unwrapped),
DeviceTaintRules, and what already allocated claims hold. Pure.

Everything the API server would reject that matters to the allocation is an ExplainError that
names the field; CEL selectors are kept as text (``allocation.compile_selectors`` compiles them).
"""

from __future__ import annotations

from collections.abc import Iterable
from fractions import Fraction
from typing import Any, Final

from dra_driver.errors import ExplainError
from dra_driver.quantity import Format, QuantityError, parse_quantity
from dra_driver.scheduling import cel
from dra_driver.scheduling.allocator.model import (
    JSON,
    AllocatedState,
    CapacityPolicy,
    Claim,
    ClaimAllocation,
    Constraint,
    DeviceClass,
    DeviceID,
    DeviceResult,
    DeviceTaintRule,
    ExactRequest,
    Request,
    Slice,
    SliceDevice,
    Taint,
    Toleration,
)


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
            _obj(c, f"DeviceClass {name}: spec.config")
            for c in _list(spec.get("config"), f"DeviceClass {name}: spec.config")
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
        ccw = f"{where}.consumesCounters[{i}]"
        cc = _obj(raw_cc, ccw)
        counters = {
            str(n): _quantity(_obj(c, f"{ccw}.counters.{n}").get("value"), f"{ccw}.{n}")[0]
            for n, c in _obj(cc.get("counters"), f"{ccw}.counters").items()
        }
        consumes.append((str(cc.get("counterSet", "")), counters))
    taints = tuple(
        Taint(str(t.get("key", "")), str(t.get("value", "")), str(t.get("effect", "")))
        for t in (_obj(t, f"{where}.taints") for t in _list(body.get("taints"), f"{where}.taints"))
    )
    multi = bool(body.get("allowMultipleAllocations"))
    binding = _strings(body.get("bindingConditions"), f"{where}.bindingConditions")
    failure = _strings(body.get("bindingFailureConditions"), f"{where}.bindingFailureConditions")
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
        binding_conditions=binding,
        binding_failure_conditions=failure,
        binds_to_node=bool(body.get("bindsToNode")),
    )


def _strings(value: Any, where: str) -> tuple[str, ...]:
    out = []
    for i, item in enumerate(_list(value, where)):
        if not isinstance(item, str) or not item:
            raise _fail(f"{where}[{i}]", f"expected a condition type, got {item!r}")
        out.append(item)
    return tuple(out)


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
        csw = f"{where}: spec.sharedCounters[{i}]"
        cs = _obj(raw_cs, csw)
        counters[str(cs.get("name", ""))] = {
            str(n): _quantity(
                _obj(c, f"{csw}.counters.{n}").get("value"), f"{where}: sharedCounters[{i}].{n}"
            )[0]
            for n, c in _obj(cs.get("counters"), f"{csw}.counters").items()
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
        for i, raw in enumerate(_list(devices.get("results"), f"{where}.devices.results")):
            rw = f"{where}.devices.results[{i}]"
            r = _obj(raw, rw)
            dev: DeviceID = (str(r.get("driver")), str(r.get("pool")), str(r.get("device")))
            consumed = _obj(r.get("consumedCapacity"), f"{rw}.consumedCapacity")
            results.append(
                DeviceResult(
                    request=str(r.get("request", "")),
                    driver=dev[0],
                    pool=dev[1],
                    device=dev[2],
                    admin_access=bool(r.get("adminAccess")),
                    tolerations=_tolerations(r.get("tolerations"), f"{rw}.tolerations"),
                    share_id=str(r["shareID"]) if r.get("shareID") else None,
                    consumed_capacity={str(n): str(v) for n, v in consumed.items()},
                    binding_conditions=_strings(
                        r.get("bindingConditions"), f"{rw}.bindingConditions"
                    ),
                    binding_failure_conditions=_strings(
                        r.get("bindingFailureConditions"), f"{rw}.bindingFailureConditions"
                    ),
                )
            )
            if r.get("adminAccess"):
                continue
            if r.get("shareID"):
                agg = shared.setdefault(dev, {})
                for n, v in consumed.items():
                    used = _quantity(v, f"{rw}.consumedCapacity.{n}")[0]
                    agg[str(n)] = agg.get(str(n), Fraction(0)) + used
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
