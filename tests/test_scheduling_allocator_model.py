"""scheduling/allocator/model.py: what the allocator's own types decide (tolerations, who holds
a device, which allocation a claim already has), as the scheduler decides it."""

from __future__ import annotations

import pytest

from dra_driver.scheduling.allocator.model import (
    AllocatedState,
    Claim,
    ClaimAllocation,
    Taint,
    Toleration,
)

TAINT = Taint(key="gpu.nvidia.com/xid", value="79", effect="NoSchedule")


@pytest.mark.parametrize(
    ("toleration", "tolerated"),
    [
        (Toleration(operator="Exists"), True),  # no key, no effect: every taint
        (Toleration(key="gpu.nvidia.com/xid", operator="Exists"), True),
        (Toleration(key="other", operator="Exists"), False),
        (Toleration(key="gpu.nvidia.com/xid", operator="Exists", effect="NoSchedule"), True),
        (Toleration(key="gpu.nvidia.com/xid", operator="Exists", effect="NoExecute"), False),
        (Toleration(operator="Exists", effect="NoExecute"), False),
        (Toleration(key="gpu.nvidia.com/xid", value="79"), True),  # Equal: key and value
        (Toleration(key="gpu.nvidia.com/xid", value="79", effect="NoSchedule"), True),
        (Toleration(key="gpu.nvidia.com/xid", value="48"), False),
        (Toleration(key="other", value="79"), False),
        (Toleration(key="other", value="48"), False),
        (Toleration(key="gpu.nvidia.com/xid", value="79", effect="NoExecute"), False),
    ],
)
def test_a_toleration_tolerates_a_taint_as_the_scheduler_decides(
    toleration: Toleration, tolerated: bool
) -> None:
    assert toleration.tolerates(TAINT) is tolerated


def test_the_holders_of_a_device_are_its_exclusive_claim_or_its_sharers() -> None:
    whole, shared, free = ("d", "p", "gpu-0"), ("d", "p", "gpu-1"), ("d", "p", "gpu-2")
    state = AllocatedState(exclusive={whole: "ns/a"}, shared_holders={shared: ("ns/b", "ns/c")})
    assert state.holders(whole) == ("ns/a",)
    assert state.holders(shared) == ("ns/b", "ns/c")
    assert state.holders(free) == ()


def _allocation(key: str) -> ClaimAllocation:
    return ClaimAllocation(claim=key, results=(), config=(), node_selector=None, existing=True)


def test_a_claims_allocation_is_found_by_uid_then_by_name_then_in_default() -> None:
    by_key = {k: _allocation(k) for k in ("ns/a", "default/b", "c")}
    state = AllocatedState(claims=by_key, uids={"uid-a": "ns/a"})
    # by UID, whatever name the claim is given
    assert state.existing(Claim("other", "x", (), uid="uid-a")) is by_key["ns/a"]
    # an unknown UID: by namespace/name
    assert state.existing(Claim("ns", "a", (), uid="uid-z")) is by_key["ns/a"]
    # no namespace: as given first, then in default (kubectl's namespace without -n)
    assert state.existing(Claim("", "c", ())) is by_key["c"]
    assert state.existing(Claim("", "b", ())) is by_key["default/b"]
    # a claim with a namespace is never looked for in default
    assert state.existing(Claim("ns", "b", ())) is None
    assert state.existing(Claim("", "d", ())) is None


def test_a_taint_reads_as_kubectl_writes_it() -> None:
    assert str(TAINT) == "gpu.nvidia.com/xid=79:NoSchedule"
    assert str(Taint(key="gpu.nvidia.com/unhealthy", value="", effect="NoExecute")) == (
        "gpu.nvidia.com/unhealthy:NoExecute"
    )
