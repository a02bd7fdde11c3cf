"""Why a request cannot be allocated: per request, every device of the node's pools with the
reasons it is unusable (pool, node, in use, selectors, taints, capacity, counters) and the
claims that keep it from the request, and a one-line summary. Pure.

Run only when the search failed (``allocate(diagnose=True)``): it reads the failed search's
state (what allocated claims hold, the counters left) and re-checks each device on its own.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction

from dra_driver.quantity import format_quantity
from dra_driver.scheduling import cel
from dra_driver.scheduling.allocator.candidates import (
    Candidate,
    Pool,
    RequestData,
    device_on_node,
)
from dra_driver.scheduling.allocator.capacity import capacity_problem, consumed_for
from dra_driver.scheduling.allocator.constraints import MISSING, ConstraintTracker, lookup_attribute
from dra_driver.scheduling.allocator.model import Abort, DeviceVerdict, Node, RequestDiagnosis
from dra_driver.scheduling.allocator.search import Search
from dra_driver.scheduling.allocator.taints import taint_blocks


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


def diagnose(search: Search, node: Node) -> tuple[RequestDiagnosis, ...]:
    """Per request of the failed ``search``, a verdict on every device of its pools."""
    out = []
    every = [Candidate(p, s, d) for p in search.pools for s in p.slices for d in s.devices]
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


def _device_reasons(search: Search, data: RequestData, cand: Candidate, node: Node) -> _Why:
    why = _Why()
    reasons = why.reasons
    pool = cand.pool
    if pool.invalid:
        reasons.append(f"pool {pool.name} is invalid: {pool.invalid}")
    elif pool.incomplete:
        reasons.append(f"pool {pool.name} is incomplete (not all of its slices are published)")
    on_node = device_on_node(cand.slice, cand.device, node)
    if not on_node:
        reasons.append(f"not available on node {node.name}")
    req = data.request
    dev = cand.id
    holder = search.allocated.exclusive.get(dev)
    if holder is not None and not req.admin_access and not cand.device.allow_multiple_allocations:
        reasons.append(f"in use by {holder}")
        why.blame([holder])
        why.allocated = True
    unsupported = bool(cand.device.binding_conditions) and not search.binding_conditions
    selector = [] if unsupported else _selector_reasons(data, cand)
    if unsupported:
        reasons.append(
            "has bindingConditions ("
            + ", ".join(cand.device.binding_conditions)
            + "): not selectable with DRADeviceBindingConditions off (the default before 1.36)"
        )
    reasons.extend(selector)
    why.matches = (
        on_node and not unsupported and not selector and not pool.invalid and not pool.incomplete
    )
    taint = taint_blocks(cand.device, req)
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
        reasons.extend(_counter_reasons(search, cand, why))
    return why


_INDEXED_COUNTER = re.compile(r"^(.*-)(0|[1-9][0-9]*)$")
_MI = 1024 * 1024


def _show_counter(value: Fraction) -> str:
    # Counters lose their quantity format when parsed; whole MiB read better in binary units.
    if value.denominator == 1 and value >= _MI and value % _MI == 0:
        return format_quantity(value, "BinarySI")
    return format_quantity(value)


def _span(prefix: str, indices: Sequence[int]) -> str:
    """``memory-slice-4..7`` for consecutive indices, else each name."""
    ordered = sorted(indices)
    if len(ordered) > 1 and ordered == list(range(ordered[0], ordered[-1] + 1)):
        return f"{prefix}{ordered[0]}..{ordered[-1]}"
    return ", ".join(f"{prefix}{i}" for i in ordered)


def _counter_reasons(search: Search, cand: Candidate, why: _Why) -> list[str]:
    """Per counter set the device cannot take its counters from, one reason.

    Indexed counters (``memory-slice-<i>``: which parts of a partitionable device a partition
    covers) are shown as the span the device needs and, for each one taken, the allocated
    devices (and claims) holding it: "3g.40gb at placement 4 needs memory-slice-4..7 of
    gpu-0-counter-set; memory-slice-6 is used by gpu-0-mig-1g10gb-19-6 of claim ns/c". The
    label comes from the device's ``profile`` attribute when it has one (MIG devices). Other
    counters: "multiprocessors: needs 60, 56 left (used by ...)".
    """
    pool = cand.pool
    avail = search.counters.available(pool)
    out: list[str] = []
    profile = next(
        (v for k, v in cand.device.attributes.items() if k.rpartition("/")[2] == "profile"),
        None,
    )
    for cs, counters in cand.device.consumes_counters:
        have_set = avail.get(cs, {})
        spans: dict[str, list[int]] = {}
        taken: dict[str, dict[str, list[int]]] = {}  # prefix -> holders -> indices
        plain: list[str] = []
        for n, v in counters.items():
            have = have_set.get(n)
            if have is None:
                out.append(f"consumes unknown counter {cs}/{n}")
                continue
            indexed = _INDEXED_COUNTER.match(n)
            if indexed:
                spans.setdefault(indexed[1], []).append(int(indexed[2]))
            if v <= have:
                continue
            users = _counter_holders(search, pool, cs, n)
            why.blame(c for _, c in users)
            held = ", ".join(f"{d} of claim {c}" for d, c in users[:3])
            if indexed:
                by_holder = taken.setdefault(indexed[1], {})
                by_holder.setdefault(held, []).append(int(indexed[2]))
            else:
                plain.append(
                    f"{n}: needs {_show_counter(v)}, {_show_counter(max(have, Fraction(0)))} left"
                    + (f" (used by {held})" if users else "")
                )
        parts = []
        for prefix, by_holder in taken.items():
            indices = spans[prefix]
            lead = (
                f"{profile} at placement {min(indices)} needs"
                if isinstance(profile, str) and len(taken) == 1
                else "needs"
            )
            notes = [
                f"{_span(prefix, held_indices)} "
                + ("is" if len(held_indices) == 1 else "are")
                + (f" used by {held}" if held else " not available")
                for held, held_indices in by_holder.items()
            ]
            parts.append(f"{lead} {_span(prefix, indices)} of {cs}; " + "; ".join(notes))
        if plain:
            parts.append(f"counters of {cs}: " + "; ".join(plain))
        out.extend(parts)
    return out


def _selector_reasons(data: RequestData, cand: Candidate) -> list[str]:
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


def _counter_holders(search: Search, pool: Pool, cs: str, counter: str) -> list[tuple[str, str]]:
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


def _taken(whys: Sequence[tuple[Candidate, _Why]]) -> tuple[list[str], bool]:
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


def _selects(search: Search, key: tuple[int, int, int], cand: Candidate) -> bool:
    try:
        return search.selector_verdict(key, cand)
    except Abort:  # a CEL runtime error: the search was given up on it
        return False


def _capacity_short(search: Search, data: RequestData, cand: Candidate) -> bool:
    """Whether ``cand`` allows multiple allocations and its capacity cannot hold ``data``'s
    share beside what allocated claims hold and the shares of the other requests that can take
    no other device (each one's smallest share among its alternatives that can take one)."""
    device = cand.device
    if not device.allow_multiple_allocations:
        return False
    own = (data.claim_index, data.parent or data.request.name)
    alternatives: dict[tuple[int, str], list[tuple[bool, dict[str, Fraction]]]] = {}
    for key, other in search.datas.items():
        group = (other.claim_index, other.parent or other.request.name)
        if group == own:
            continue
        fits = {c.id for c in search.candidates if _selects(search, key, c)}
        if fits:
            share = {n: consumed_for(other.request, device, n) for n in device.capacity}
            alternatives.setdefault(group, []).append((fits == {cand.id}, share))
    taken = dict(search.allocated.shared_capacity.get(cand.id, {}))
    for options in alternatives.values():
        if not all(only_here for only_here, _ in options):
            continue  # it may take another device
        for n in device.capacity:
            least = min(share[n] for _, share in options)
            taken[n] = taken.get(n, Fraction(0)) + least
    return capacity_problem(data.request, device, taken) is not None


def _summary(search: Search, data: RequestData, whys: Sequence[tuple[Candidate, _Why]]) -> str:
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
    if search.aborted is not None:  # enough devices, but the search never got to place them
        return (
            f"{len(usable)} devices usable ({names}), but the attempt was given up on the "
            "error above" + also
        )
    claim = search.claims[data.claim_index]
    for con in claim.constraints:
        probe = ConstraintTracker(con)
        if not probe.applies(data):
            continue
        groups: dict[str, int] = {}
        missing = 0
        for cand in usable:
            value = lookup_attribute(cand, probe.attribute)
            if value is MISSING:
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
    if all(_capacity_short(search, data, c) for c in usable):
        # Before the counters: the shares of one device take its counters once, so a shared
        # device whose capacity runs out is no counter problem (issue 37 item 6).
        whose = "its" if len(usable) == 1 else "each one's"
        return (
            f"{len(usable)} devices usable ({names}), but {whose} capacity cannot hold this "
            "request's share beside the shares of the other requests that can take no other "
            "device" + also
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
