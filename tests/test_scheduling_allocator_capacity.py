"""Consumable capacity: devices that allow multiple allocations
(scheduling/allocator/capacity.py)."""

from __future__ import annotations

from fractions import Fraction

from dra_driver.scheduling.allocator.capacity import SharedCapacity, capacity_problem, consumed_for
from dra_driver.scheduling.allocator.model import (
    AllocatedState,
    CapacityPolicy,
    DeviceID,
    ExactRequest,
    SliceDevice,
)
from tests.allocatordata import (
    allocated_claim,
    claim,
    devices_of,
    exactly,
    gpu,
    run,
    slice_,
)


def test_consumable_capacity_shares_a_device_until_it_is_full() -> None:
    shared = gpu("gpu-0", allowMultipleAllocations=True)
    shared["capacity"]["memory"]["requestPolicy"] = {
        "default": "10Gi",
        "validRange": {"min": "10Gi", "step": "10Gi"},
    }
    req = exactly(capacity={"requests": {"memory": "25Gi"}})
    result = run([claim(req, name="a"), claim(req, name="b")], [slice_([shared])])
    assert devices_of(result) == ["gpu-0", "gpu-0"]
    assert result.allocations[0].results[0].consumed_capacity == {"memory": "30Gi"}
    assert result.allocations[0].results[0].share_id
    full = run(
        [claim(req)], [slice_([shared])], allocated=[allocated_claim("gpu-0", share=True)] * 2
    )
    assert not full.satisfiable
    assert full.diagnoses[0].verdicts[0].reasons == (
        "memory: 30Gi requested (25Gi rounded up by the requestPolicy), 20Gi left on gpu-0 "
        "(in use by ns/other)",
    )
    assert full.diagnoses[0].summary == (
        "the one matching device is taken by allocated claims: gpu-0 (ns/other)"
    )


# -- the functions themselves: rounding, policy violations, the reason's words, the sums --------

Gi = Fraction(2**30)


def device(memory: Fraction, policy: CapacityPolicy | None = None, **more: Fraction) -> SliceDevice:
    capacity = {"memory": memory, **more}
    return SliceDevice(
        name="gpu-0",
        attributes={},
        capacity=capacity,
        capacity_formats={"memory": "BinarySI"},  # the others: no format, DecimalSI
        policies={"memory": policy} if policy else {},
        consumes_counters=(),
        taints=(),
        allow_multiple_allocations=True,
        node_name="node-a",
        all_nodes=False,
        node_selector=None,
        cel_device=None,  # type: ignore[arg-type]  # capacity never reads the CEL view
    )


def asking(**requests: Fraction) -> ExactRequest:
    return ExactRequest(name="r", device_class_name="gpu", capacity_requests=requests)


def test_a_capacity_not_asked_for_consumes_the_default_else_all_of_it() -> None:
    with_default = device(80 * Gi, CapacityPolicy(default=10 * Gi, range_min=10 * Gi))
    assert consumed_for(None, with_default, "memory") == 10 * Gi
    assert consumed_for(asking(), with_default, "memory") == 10 * Gi
    assert consumed_for(None, device(80 * Gi, CapacityPolicy(range_min=Gi)), "memory") == 80 * Gi
    assert consumed_for(None, device(80 * Gi), "memory") == 80 * Gi


def test_a_request_is_rounded_up_to_the_range_or_the_next_valid_value() -> None:
    stepped = device(80 * Gi, CapacityPolicy(range_min=4 * Gi, range_step=10 * Gi))
    assert consumed_for(asking(memory=Gi), stepped, "memory") == 4 * Gi
    assert consumed_for(asking(memory=4 * Gi), stepped, "memory") == 4 * Gi
    assert consumed_for(asking(memory=5 * Gi), stepped, "memory") == 14 * Gi
    assert consumed_for(asking(memory=14 * Gi), stepped, "memory") == 14 * Gi
    unstepped = device(80 * Gi, CapacityPolicy(range_min=4 * Gi))
    assert consumed_for(asking(memory=5 * Gi), unstepped, "memory") == 5 * Gi
    valid = device(80 * Gi, CapacityPolicy(valid_values=(10 * Gi, 20 * Gi)))
    assert consumed_for(asking(memory=10 * Gi), valid, "memory") == 10 * Gi
    assert consumed_for(asking(memory=11 * Gi), valid, "memory") == 20 * Gi
    assert consumed_for(asking(memory=30 * Gi), valid, "memory") == 30 * Gi
    assert consumed_for(asking(memory=3 * Gi), device(80 * Gi), "memory") == 3 * Gi


def test_each_reason_names_the_capacity_how_it_was_counted_and_what_is_left() -> None:
    policy = CapacityPolicy(default=10 * Gi, range_min=10 * Gi, range_step=10 * Gi)
    shared = device(80 * Gi, policy)
    assert capacity_problem(asking(memory=25 * Gi), shared, {"memory": 60 * Gi}) == (
        "memory: 30Gi requested (25Gi rounded up by the requestPolicy), 20Gi left on gpu-0"
    )
    assert capacity_problem(asking(), shared, {"memory": 75 * Gi}) == (
        "memory: 10Gi requested (the requestPolicy's default), 5Gi left on gpu-0"
    )
    assert capacity_problem(asking(memory=30 * Gi), shared, {"memory": 60 * Gi}) == (
        "memory: 30Gi requested, 20Gi left on gpu-0"
    )
    # a capacity without a policy, not asked for: all of it, so any use leaves too little;
    # its amount in DecimalSI (it has no format of its own)
    two = device(80 * Gi, policy, counters=Fraction(2048))
    assert capacity_problem(asking(memory=10 * Gi), two, {"counters": Fraction(1)}) == (
        "counters: 2048 requested (all of it: not asked for, and no requestPolicy), "
        "2047 left on gpu-0"
    )
    # more in use than the device has (an over-committed device): nothing left, not less
    assert capacity_problem(asking(memory=10 * Gi), shared, {"memory": 90 * Gi}) == (
        "memory: 10Gi requested, 0 left on gpu-0"
    )
    assert capacity_problem(asking(memory=10 * Gi), shared, {"memory": 70 * Gi}) is None
    assert capacity_problem(asking(cores=Fraction(1)), shared, {}) == (
        "cores: requested, but gpu-0 has no capacity cores"
    )


def test_a_policy_the_consumed_amount_breaks_is_the_reason() -> None:
    # the whole capacity (not asked for, no default) off the range's steps: min 4Gi, step 10Gi,
    # 16Gi is 4Gi + 12Gi (and 16Gi + 4Gi is a multiple of 10Gi: the sign is what is checked)
    off_step = device(16 * Gi, CapacityPolicy(range_min=4 * Gi, range_step=10 * Gi))
    assert capacity_problem(asking(), off_step, {}) == (
        "memory: 16Gi requested (the requestPolicy's default), not the requestPolicy's minimum "
        "plus a multiple of its step on gpu-0"
    )
    on_step = device(14 * Gi, CapacityPolicy(range_min=4 * Gi, range_step=10 * Gi))
    assert capacity_problem(asking(), on_step, {}) is None
    capped = device(80 * Gi, CapacityPolicy(range_min=4 * Gi, range_max=40 * Gi))
    assert capacity_problem(asking(memory=50 * Gi), capped, {}) == (
        "memory: 50Gi requested, more than the requestPolicy's maximum 40Gi on gpu-0"
    )
    assert capacity_problem(asking(memory=40 * Gi), capped, {}) is None
    valid = device(80 * Gi, CapacityPolicy(valid_values=(10 * Gi, 20 * Gi)))
    assert capacity_problem(asking(memory=30 * Gi), valid, {}) == (
        "memory: 30Gi requested, more than the requestPolicy's largest valid value "
        "(valid: 10Gi, 20Gi) on gpu-0"
    )
    # the policy's own default is allowed even where it is not one of the valid values
    odd_default = device(80 * Gi, CapacityPolicy(default=5 * Gi, valid_values=(10 * Gi,)))
    assert capacity_problem(asking(), odd_default, {}) is None


def test_shared_capacity_adds_the_allocated_and_the_searchs_own_and_undoes_them() -> None:
    a: DeviceID = ("gpu.nvidia.com", "node-a", "gpu-0")
    b: DeviceID = ("gpu.nvidia.com", "node-a", "gpu-1")
    shared = SharedCapacity(AllocatedState(shared_capacity={a: {"memory": 10 * Gi}}))
    assert shared.in_use(a) == {"memory": 10 * Gi}
    assert shared.in_use(b) == {}
    shared.take(a, {"memory": 5 * Gi, "cores": Fraction(3)})
    shared.take(a, {"memory": 2 * Gi})
    assert shared.in_use(a) == {"memory": 17 * Gi, "cores": Fraction(3)}
    shared.take(b, {"memory": Gi})
    assert shared.in_use(b) == {"memory": Gi}
    shared.give(a, {"memory": 2 * Gi})  # the search backtracks one placement
    assert shared.in_use(a) == {"memory": 15 * Gi, "cores": Fraction(3)}
    assert a in shared.taken
    shared.give(a, {"memory": 5 * Gi, "cores": Fraction(3)})
    assert a not in shared.taken
    assert shared.in_use(a) == {"memory": 10 * Gi}
    assert shared.in_use(b) == {"memory": Gi}
