"""Consumable capacity (KEP-5075): devices that allow multiple allocations, shares of them
requested through ``capacity.requests`` and rounded by a ``requestPolicy``. Pure.

``consumed_for`` is what one request consumes of a capacity, ``capacity_problem`` says why a
request does not fit (it is also the reason ``explain`` shows), and ``SharedCapacity`` adds up
what allocated claims and the search's own placements consume of each device.
"""

from __future__ import annotations

from collections.abc import Mapping
from fractions import Fraction

from dra_driver.quantity import Format, format_quantity
from dra_driver.scheduling.allocator.model import (
    AllocatedState,
    CapacityPolicy,
    DeviceID,
    ExactRequest,
    SliceDevice,
)


def consumed_for(request: ExactRequest | None, device: SliceDevice, name: str) -> Fraction:
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
        consumed = consumed_for(request, device, name)
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


class SharedCapacity:
    """What is consumed of each device that allows multiple allocations: by the claims already
    allocated (``AllocatedState.shared_capacity``) and by the search's placements."""

    def __init__(self, allocated: AllocatedState) -> None:
        self.allocated = allocated
        self.taken: dict[DeviceID, dict[str, Fraction]] = {}

    def in_use(self, dev: DeviceID) -> dict[str, Fraction]:
        """Per capacity, how much of ``dev`` is consumed now."""
        total = dict(self.allocated.shared_capacity.get(dev, {}))
        for n, v in self.taken.get(dev, {}).items():
            total[n] = total.get(n, Fraction(0)) + v
        return total

    def take(self, dev: DeviceID, consumed: Mapping[str, Fraction]) -> None:
        bucket = self.taken.setdefault(dev, {})
        for n, v in consumed.items():
            bucket[n] = bucket.get(n, Fraction(0)) + v

    def give(self, dev: DeviceID, consumed: Mapping[str, Fraction]) -> None:
        """Undo a ``take`` of the same amounts (the search backtracks)."""
        bucket = self.taken[dev]
        for n, v in consumed.items():
            bucket[n] -= v
        if not any(bucket.values()):
            del self.taken[dev]
