"""The search itself: first fit with backtracking over the candidates, as the scheduler's
``allocateOne`` recursion does (spec D). Pure.

Claims in order, requests in order, ``firstAvailable`` sub-requests in order; within a request,
device combinations (not permutations) in candidate order. Placing a device checks, in this
order: in use, consumable capacity (``capacity``), shared counters (``counters``), taints
(``taints``) and the claim's constraints (``constraints``); backtracking undoes each. An
``allocationMode: All`` request must take every matching device.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from dra_driver.scheduling.allocator.candidates import (
    Candidate,
    Pool,
    RequestData,
    selectors_match,
)
from dra_driver.scheduling.allocator.capacity import SharedCapacity, capacity_problem, consumed_for
from dra_driver.scheduling.allocator.constraints import ConstraintTracker
from dra_driver.scheduling.allocator.counters import Counters
from dra_driver.scheduling.allocator.model import (
    MAX_RESULTS_PER_CLAIM,
    Abort,
    AllocatedState,
    Claim,
    DeviceID,
    TooMany,
)
from dra_driver.scheduling.allocator.taints import taint_blocks


@dataclass(eq=False)
class Placed:
    data: RequestData
    cand: Candidate
    share_id: str | None
    consumed: dict[str, Fraction]
    took_counters: bool = False


class Search:
    """One attempt to allocate ``claims`` together, first fit with backtracking."""

    def __init__(
        self,
        claims: Sequence[Claim],
        datas: dict[tuple[int, int, int], RequestData],
        pools: list[Pool],
        allocated: AllocatedState,
        *,
        binding_conditions: bool,
    ) -> None:
        self.claims = claims
        # DRADeviceBindingConditions: off, a device with binding conditions is never selectable
        self.binding_conditions = binding_conditions
        self.datas = datas
        self.pools = pools
        self.allocated = allocated
        self.candidates = [
            Candidate(p, s, d)
            for p in pools
            if not p.incomplete and not p.invalid
            for s in p.slices
            for d in s.devices
        ]
        self.allocating: dict[DeviceID, set[int]] = {}
        self.shared = SharedCapacity(allocated)
        self.counters = Counters(allocated)
        self.match_cache: dict[tuple[DeviceID, tuple[int, int, int]], bool] = {}
        self.constraints = [[ConstraintTracker(c) for c in claim.constraints] for claim in claims]
        self.placed: list[list[Placed]] = [[] for _ in claims]
        self.selected_sub: dict[tuple[int, int], int] = {}
        self.aborted: str | None = None  # the error that ended the attempt (a CEL runtime error)

    # -- checks shared with the diagnosis
    def selector_verdict(self, key: tuple[int, int, int], cand: Candidate) -> bool:
        cache_key = (cand.id, key)
        hit = self.match_cache.get(cache_key)
        if hit is not None:
            return hit
        data = self.datas[key]
        if cand.device.binding_conditions and not self.binding_conditions:
            self.match_cache[cache_key] = False  # checked before any selector, as isSelectable
            return False
        ok = selectors_match(data, cand, self.claims[data.claim_index])
        if ok and not cand.on_node:
            ok = False
        self.match_cache[cache_key] = ok
        return ok

    def in_use(self, dev: DeviceID) -> bool:
        return dev in self.allocated.exclusive or bool(self.allocating.get(dev))

    # -- the recursion (mirrors allocateOne)
    def run(self) -> bool:
        return self.one(0, 0, 0, 0, sub=False, start=0)

    def one(self, c: int, r: int, s: int, d: int, *, sub: bool, start: int) -> bool:
        if c >= len(self.claims):
            return True
        claim = self.claims[c]
        if r >= len(claim.requests):
            try:
                return self.one(c + 1, 0, 0, 0, sub=False, start=0)
            except TooMany:
                return False
        key = (c, r, s)
        data = self.datas[key]
        if not sub and data.parent is not None:
            all_too_many = True
            for si in range(len(claim.requests[r].first_available)):
                try:
                    ok = self.one(c, r, si, 0, sub=True, start=0)
                except TooMany:
                    continue
                all_too_many = False
                if ok:
                    self.selected_sub[(c, r)] = si
                    return True
            if all_too_many:
                raise TooMany
            return False
        req = data.request
        if req.allocation_mode == "All" and not data.all_devices:
            return False
        if d >= data.num_devices:
            return self.one(c, r + 1, 0, 0, sub=False, start=0)
        if len(self.placed[c]) + data.num_devices - d > MAX_RESULTS_PER_CLAIM:
            raise TooMany
        if req.allocation_mode == "All":
            cand = data.all_devices[d]
            placed = self.place(key, cand, must=True)
            if placed is None:
                return False
            if self.one(c, r, s, d + 1, sub=sub, start=0):
                return True
            self.unplace(placed)
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
            except TooMany:
                self.unplace(placed)
                raise
            self.unplace(placed)
        return False

    def place(self, key: tuple[int, int, int], cand: Candidate, *, must: bool) -> Placed | None:
        data = self.datas[key]
        req = data.request
        dev = cand.id
        multi = cand.device.allow_multiple_allocations
        c = data.claim_index
        if not multi and req.admin_access and c in self.allocating.get(dev, ()):
            return None
        if not req.admin_access and self.in_use(dev) and not multi:
            return None
        shared = self.shared.in_use(dev) if multi else {}
        skip_counters = multi and bool(shared)
        took = False
        if cand.device.consumes_counters and not skip_counters:
            if not self.counters.take(cand):
                return None
            took = True
        if taint_blocks(cand.device, req):
            if took:
                self.counters.give(cand)
            return None
        for added, con in enumerate(self.constraints[c]):
            if not con.add(data, cand):
                for undo in self.constraints[c][:added]:
                    undo.remove(data)
                if took:
                    self.counters.give(cand)
                if must:
                    raise Abort(
                        f"claim {self.claims[c].key}, request {data.full_name}: cannot add device "
                        f"{'/'.join(dev)} because a claim constraint would not be satisfied"
                    )
                return None
        # Capacity comes after the constraints, as in the scheduler's allocateDevice: a device
        # an 'All' request must take fails the attempt on a constraint even without capacity.
        if capacity_problem(req, cand.device, shared) is not None:
            for con in reversed(self.constraints[c]):
                con.remove(data)
            if took:
                self.counters.give(cand)
            return None
        consumed: dict[str, Fraction] = {}
        share_id = None
        if multi:
            consumed = {n: consumed_for(req, cand.device, n) for n in cand.device.capacity}
            self.shared.take(dev, consumed)
            share_id = str(
                uuid.uuid5(
                    uuid.NAMESPACE_URL,
                    f"{self.claims[c].key}/{data.full_name}/{'/'.join(dev)}/{len(self.placed[c])}",
                )
            )
        else:
            self.allocating.setdefault(dev, set()).add(c)
        placed = Placed(data, cand, share_id, consumed, took)
        self.placed[c].append(placed)
        return placed

    def unplace(self, placed: Placed) -> None:
        data = placed.data
        c = data.claim_index
        dev = placed.cand.id
        self.placed[c].remove(placed)
        if placed.share_id is not None:
            self.shared.give(dev, placed.consumed)
        else:
            self.allocating[dev].discard(c)
        for con in reversed(self.constraints[c]):
            con.remove(data)
        if placed.took_counters:
            self.counters.give(placed.cand)
