"""Shared counters of partitionable devices (scheduling/allocator/counters.py)."""

from __future__ import annotations

from tests.allocatordata import (
    allocated_claim,
    claim,
    devices_of,
    exactly,
    mig,
    run,
    slice_,
)


def test_overlapping_partitions_cannot_both_be_allocated() -> None:
    counters = [
        {"name": "gpu-0-cs", "counters": {f"memory-slice-{i}": {"value": "1"} for i in range(8)}}
    ]
    devices = [
        mig("big", start=0, size=4),
        mig("overlap", start=2, size=2),
        mig("free", start=4, size=2),
    ]
    result = run(
        [claim(exactly(cls="mig.nvidia.com", count=2))], [slice_(devices, counters=counters)]
    )
    assert devices_of(result) == ["big", "free"]
    result = run(
        [claim(exactly(cls="mig.nvidia.com", count=3))], [slice_(devices, counters=counters)]
    )
    assert not result.satisfiable


def test_counters_used_by_allocated_devices_are_not_available() -> None:
    counters = [
        {"name": "gpu-0-cs", "counters": {f"memory-slice-{i}": {"value": "1"} for i in range(8)}}
    ]
    devices = [mig("big", start=0, size=4), mig("overlap", start=2, size=2)]
    result = run(
        [
            claim(
                exactly(
                    cls="mig.nvidia.com",
                    selectors=("device.attributes['gpu.nvidia.com'].profile == '2g'",),
                )
            )
        ],
        [slice_(devices, counters=counters)],
        allocated=[allocated_claim("big")],
    )
    assert not result.satisfiable
    reasons = {v.device: v.reasons for v in result.diagnoses[0].verdicts}
    assert reasons["overlap"] == (
        "2g at placement 2 needs memory-slice-2..3 of gpu-0-cs; "
        "memory-slice-2..3 are used by big of claim ns/other",
    )
    assert result.diagnoses[0].summary == (
        "the one matching device is taken by allocated claims: overlap (ns/other)"
    )
