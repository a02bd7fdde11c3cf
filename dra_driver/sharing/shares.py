"""Consumable shares (KEP-5075, ``DRAConsumableCapacity``): devices several claims hold at once,
what one share may consume, and what a share's container is told. Pure.

Place in the flow: ``devices.node_devices`` -> :func:`shareable` (chosen by
``--consumable-shares``) -> slices.py publishes ``allowMultipleAllocations`` and the
``requestPolicy`` of each capacity. The scheduler then gives each allocation result on such a
device a ``shareID`` and its ``consumedCapacity``; the share step (share_step.py) checks
them with :func:`share_of_result` / :func:`capacity_problem` and the preparer writes one CDI
device per share, named by ``share_device_name`` (prepare/plan.py: the checkpoint and the
rebuild from specs read it too), whose environment :func:`share_env` computes from the consumed
capacity alone. The shared MPS daemon of a device is run by a :class:`ShareEnforcer` (the MPS
module).

Modes, as NVIDIA's driver names them (nvidia-compat.md "Consumable shares"), plus ``compute``:

* ``disabled`` (default): nothing changes; devices are allocated whole.
* ``unlimited``: ``memory`` (rounded down to a multiple of 1Mi, so the policy's step divides it)
  with policy default 0, validRange {min 0, max memory, step 1Mi}: a claim that asks for no
  memory consumes none.
* ``memory``: the same range with min 1Mi and default all memory: a claim that asks for none
  takes the whole device.
* ``N`` (an integer, at least 2): ``unlimited`` plus a capacity ``shares`` of value N, policy
  default 1, validRange {min 1, max N, step 1}. (N = 1 is refused: the API server requires
  min + step <= value, and one share is no sharing.)
* ``compute``: ``unlimited`` plus a capacity ``compute`` of value 100 (percent of the device's
  streaming multiprocessors), policy default 100, validRange {min 1, max 100, step 1}: a claim
  that does not ask for compute takes all of it.

A device that allows multiple allocations has all of its capacities consumed (KEP-5075): one
without a requestPolicy is consumed whole by every share. So the other capacities of a MIG
device (multiprocessors, engines, memory slices) get a policy of default 0 and validRange
{min 0, max value, step 1}; otherwise the first share would take the whole MIG device.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Literal, Protocol

from dra_driver.devices import Device, NodeDevices, RequestPolicy
from dra_driver.quantity import QuantityError, binary, decimal, format_quantity, parse_quantity

MODES = ("disabled", "unlimited", "memory", "compute")
MEMORY = "memory"
SHARES = "shares"
COMPUTE = "compute"
MIB = 1024 * 1024
COMPUTE_PERCENT = 100
ENV_MEMORY_LIMIT = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
ENV_THREAD_PERCENTAGE = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
_UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
_SHARE_ID = re.compile(rf"^{_UUID}$")


@dataclass(frozen=True)
class Share:
    """One allocation result on a shareable device (KEP-5075): its ``shareID`` and
    ``consumedCapacity`` (canonical quantities, as the scheduler wrote them), checked
    (:func:`share_of_result`). The share step puts both on the claim's planned device, which
    the preparer records and names its CDI device by."""

    share_id: str
    consumed: Mapping[str, str]


@dataclass(frozen=True)
class SharesMode:
    """A parsed ``--consumable-shares`` value; ``count`` is set for the integer mode."""

    kind: Literal["disabled", "unlimited", "memory", "compute", "shares"] = "disabled"
    count: int = 0

    @property
    def enabled(self) -> bool:
        return self.kind != "disabled"

    def __str__(self) -> str:
        return str(self.count) if self.kind == "shares" else self.kind


DISABLED = SharesMode()


def parse_mode(text: str) -> SharesMode:
    """``disabled``, ``unlimited``, ``memory``, ``compute`` or an integer N >= 2; ValueError
    says what is accepted."""
    value = text.strip()
    if value in MODES:
        return SharesMode(kind=value)  # type: ignore[arg-type]
    if value.isdigit():
        count = int(value)
        if count < 2:
            raise ValueError(
                f"{count}: use at least 2 shares (one share is the whole device: use disabled)"
            )
        if count >= 2**31:
            raise ValueError(f"{count} shares is more than the API allows (int32)")
        return SharesMode(kind="shares", count=count)
    raise ValueError("use disabled, unlimited, memory, compute or a number of shares (>= 2)")


# --- publishing ------------------------------------------------------------------------------


def shareable(node_devices: NodeDevices, mode: SharesMode) -> NodeDevices:
    """``node_devices`` with every GPU and MIG device made shareable as ``mode`` says (itself
    when disabled). The result still has to pass ``devices.validate_device`` (slices.py does).

    Devices that consume shared counters (a partitionable GPU under ``--mig-mode dynamic``: its
    whole device and its placements) stay allocated whole: a placement's MIG device is created
    for the claim that gets it, so there is nothing for several claims to share yet."""
    if not mode.enabled:
        return node_devices
    return replace(
        node_devices,
        devices=tuple(d if d.consumes_counters else _share(d, mode) for d in node_devices.devices),
    )


def _share(device: Device, mode: SharesMode) -> Device:
    capacity = dict(device.capacity)
    policies: dict[str, RequestPolicy] = {}
    for name, value in capacity.items():
        if name == MEMORY:
            continue
        # Consumed whole by every share without a policy (module docstring). A range needs
        # min + step <= value: a capacity of 0 gets the one valid value 0.
        policies[name] = (
            RequestPolicy(default="0", range_min="0", range_max=value, range_step="1")
            if parse_quantity(value).value >= 1
            else RequestPolicy(default="0", valid_values=("0",))
        )
    memory, memory_policy = _memory(parse_quantity(capacity[MEMORY]).value, mode)
    capacity[MEMORY] = memory
    policies[MEMORY] = memory_policy
    extra = device_capacity(mode, memory_bytes=0)
    for name in (SHARES, COMPUTE):
        if name in extra:
            capacity[name] = extra[name]
            policies[name] = RequestPolicy(
                default=extra[name] if name == COMPUTE else "1",
                range_min="1",
                range_max=extra[name],
                range_step="1",
            )
    return replace(
        device, capacity=capacity, allow_multiple_allocations=True, request_policies=policies
    )


def _memory(memory_bytes: Fraction, mode: SharesMode) -> tuple[str, RequestPolicy]:
    rounded = binary(int(memory_bytes) // MIB * MIB)
    if mode.kind == "memory":
        return rounded, RequestPolicy(
            default=rounded, range_min=binary(MIB), range_max=rounded, range_step=binary(MIB)
        )
    return rounded, RequestPolicy(
        default="0", range_min="0", range_max=rounded, range_step=binary(MIB)
    )


def device_capacity(mode: SharesMode, *, memory_bytes: int) -> dict[str, str]:
    """What a shareable device of ``memory_bytes`` publishes of the capacities shares are
    counted in: ``memory`` (rounded down to 1Mi), ``shares`` (integer mode), ``compute``
    (compute mode). Empty when disabled."""
    if not mode.enabled:
        return {}
    out = {MEMORY: binary(memory_bytes // MIB * MIB)}
    if mode.kind == "shares":
        out[SHARES] = decimal(mode.count)
    if mode.kind == "compute":
        out[COMPUTE] = decimal(COMPUTE_PERCENT)
    return out


# --- one share, at prepare -------------------------------------------------------------------


def share_of_result(
    *, share_id: object, consumed: object, device: str, shareable_device: bool
) -> Share | None:
    """The share an allocation result holds (None: the device is held whole).

    Raises ValueError, worded for a per-claim error, when the result cannot be prepared: a
    shareID on a device this node does not publish as shareable, a shareable device's result
    without one, a shareID that is not a lowercase UUID, consumedCapacity without a shareID (or
    missing, or with values that are not non-negative quantities).
    """
    has_id = share_id not in (None, "")
    if not has_id:
        if consumed not in (None, {}):
            raise ValueError(f"device {device}: consumedCapacity without a shareID")
        if shareable_device:
            raise ValueError(
                f"device {device} allows multiple allocations (--consumable-shares), but its "
                "allocation result has no shareID: it was allocated before sharing was turned "
                "on; re-create the claim"
            )
        return None
    if not shareable_device:
        raise ValueError(
            f"device {device}: the allocation result has shareID {share_id}, but this node does "
            "not publish the device with allowMultipleAllocations (--consumable-shares is "
            "disabled, or the device is a partitionable GPU's placement or whole GPU, which stay "
            "whole)"
        )
    if not isinstance(share_id, str) or not _SHARE_ID.match(share_id):
        raise ValueError(f"device {device}: shareID {share_id!r} is not a lowercase UUID")
    if not isinstance(consumed, Mapping) or not consumed:
        raise ValueError(f"device {device}: share {share_id} has no consumedCapacity")
    canonical: dict[str, str] = {}
    for name, value in consumed.items():
        try:
            quantity = parse_quantity(str(value))
        except QuantityError as exc:
            raise ValueError(f"device {device}: consumedCapacity {name}: {exc}") from None
        if quantity.value < 0:
            raise ValueError(f"device {device}: consumedCapacity {name} {value} is negative")
        canonical[str(name)] = quantity.canonical()
    return Share(share_id=share_id, consumed=canonical)


def capacity_problem(
    capacity: Mapping[str, str], shares: Iterable[Mapping[str, str]], *, device: str
) -> str | None:
    """Why ``shares`` together consume more of ``device`` than its ``capacity`` (the
    capacities shares are counted in: :func:`device_capacity`), or None."""
    totals: dict[str, Fraction] = {}
    for consumed in shares:
        for name, value in consumed.items():
            if name in capacity:
                totals[name] = totals.get(name, Fraction(0)) + parse_quantity(value).value
    for name, total in totals.items():
        have = parse_quantity(capacity[name])
        if total > have.value:
            return (
                f"{name}: shares consume {format_quantity(total, have.format)} of device {device}, "
                f"which has {capacity[name]}"
            )
    return None


def share_env(*, device_uuid: str, consumed: Mapping[str, str]) -> tuple[str, ...]:
    """The environment MPS clients read, from the share's consumed capacity alone.

    ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=<uuid>=<MiB>M`` when it consumes memory (the device by
    UUID, as NVIDIA's driver names it; whole MiB, rounded down so the limit never exceeds the
    share); ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=<percent>`` when it consumes compute (an integer
    percentage of the device's SMs). A share that consumes no memory (``unlimited`` without a
    request) gets no memory limit.
    """
    env = []
    memory = consumed.get(MEMORY)
    if memory is not None:
        mib = int(parse_quantity(memory).value) // MIB
        if mib > 0:
            env.append(f"{ENV_MEMORY_LIMIT}={device_uuid}={mib}M")
    compute = consumed.get(COMPUTE)
    if compute is not None:
        env.append(f"{ENV_THREAD_PERCENTAGE}={int(parse_quantity(compute).value)}")
    return tuple(env)


def share_owner(device: str) -> str:
    """The owner key of a device's shared MPS daemon: one daemon per device for all shares."""
    return f"shares-{device}"


class ShareEnforcer(Protocol):
    """Runs the shared MPS daemon that enforces the shares of a device (the MPS module).

    Both calls are idempotent and may block (a daemon is started or stopped); they raise
    ``errors.ShareEnforcementFailed`` on failure. The preparer calls ``acquire`` before the
    first share of a device is recorded complete, and ``release`` after its last share is
    gone from the checkpoint.
    """

    def acquire(self, *, gpu_uuids: frozenset[str], owner: str) -> None: ...

    def release(self, *, gpu_uuids: frozenset[str], owner: str) -> None: ...
