"""Consumable capacity: devices that allow multiple allocations
(scheduling/allocator/capacity.py)."""

from __future__ import annotations

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
