"""Shared counters of partitionable devices (KEP-4815): what each pool's counter sets have left
after the claims already allocated, and what the search's placements take of them. Pure.

A device that consumes counters fits only while every counter it consumes has enough left; a
device that consumes a counter set or counter its pool does not define aborts the attempt
(``Abort``), as in the scheduler. ``reasons`` reads ``available`` to say which counters are taken.
"""

from __future__ import annotations

from fractions import Fraction

from dra_driver.scheduling.allocator.candidates import Candidate, Pool
from dra_driver.scheduling.allocator.model import Abort, AllocatedState, PoolID


class Counters:
    """The counters of the pools of one search: available (after allocated claims) and used."""

    def __init__(self, allocated: AllocatedState) -> None:
        self.allocated = allocated
        self.used: dict[PoolID, dict[str, dict[str, Fraction]]] = {}
        self.cached: dict[PoolID, dict[str, dict[str, Fraction]]] = {}

    def available(self, pool: Pool) -> dict[str, dict[str, Fraction]]:
        """What the counter sets of ``pool`` have left after the claims already allocated
        (computed once per pool; the search's own use is in ``used``)."""
        avail = self.cached.get(pool.pool_id)
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
            self.cached[pool.pool_id] = avail
        return avail

    def take(self, cand: Candidate) -> bool:
        """Take the counters ``cand`` consumes; False, taking nothing, if one has too little."""
        avail = self.available(cand.pool)
        used = self.used.setdefault(cand.pool.pool_id, {})
        for cs, counters in cand.device.consumes_counters:
            if cs not in avail:
                raise Abort(
                    f"device {'/'.join(cand.id)} consumes counter set {cs}, which pool "
                    f"{cand.pool.name} does not define"
                )
            for n, v in counters.items():
                if n not in avail[cs]:
                    raise Abort(f"device {'/'.join(cand.id)} consumes unknown counter {cs}/{n}")
                if used.get(cs, {}).get(n, Fraction(0)) + v > avail[cs][n]:
                    return False
        for cs, counters in cand.device.consumes_counters:
            bucket = used.setdefault(cs, {})
            for n, v in counters.items():
                bucket[n] = bucket.get(n, Fraction(0)) + v
        return True

    def give(self, cand: Candidate) -> None:
        """Give back what ``take`` took for ``cand`` (the search backtracks)."""
        used = self.used[cand.pool.pool_id]
        for cs, counters in cand.device.consumes_counters:
            for n, v in counters.items():
                used[cs][n] -= v
