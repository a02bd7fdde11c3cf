"""The cases mutation testing found no test for (issue 37): shared counters summed across the
devices of one search, the search's backtracking giving counters and capacity back, and the
requestPolicy tables (validRange min/max/step, validValues, default; an exact valid value is
taken as it is). scheduling/allocator/counters.py and capacity.py."""

from __future__ import annotations

from typing import Any

import pytest

from tests.allocatordata import claim, devices_of, exactly, gpu, run, slice_

# -- shared counters ---------------------------------------------------------------------------


def drawing(name: str, amount: int, *, kind: str = "part") -> dict[str, Any]:
    """A device that draws ``amount`` of the one shared counter ``cs/mem``."""
    return {
        "name": name,
        "attributes": {"type": {"string": "mig"}, "profile": {"string": kind}},
        "capacity": {"memory": {"value": f"{amount}Gi"}},
        "consumesCounters": [{"counterSet": "cs", "counters": {"mem": {"value": str(amount)}}}],
    }


COUNTER_SET = [{"name": "cs", "counters": {"mem": {"value": "80"}}}]


def test_devices_drawing_on_one_counter_in_one_search_are_summed() -> None:
    """Three devices of 30 on a counter of 80: two fit (60), the third would make 90."""
    devices = [drawing(f"p{i}", 30) for i in range(3)]
    two = run(
        [claim(exactly(cls="mig.nvidia.com", count=2))], [slice_(devices, counters=COUNTER_SET)]
    )
    assert devices_of(two) == ["p0", "p1"]
    three = run(
        [claim(exactly(cls="mig.nvidia.com", count=3))], [slice_(devices, counters=COUNTER_SET)]
    )
    assert not three.satisfiable


def test_the_sum_counts_devices_of_different_claims_in_one_search() -> None:
    devices = [drawing(f"p{i}", 30) for i in range(3)]
    req = exactly(cls="mig.nvidia.com")
    result = run(
        [claim(req, name="a"), claim(req, name="b"), claim(req, name="c")],
        [slice_(devices, counters=COUNTER_SET)],
    )
    assert not result.satisfiable


def test_backtracking_gives_the_counters_back() -> None:
    """The first request takes ``big`` (50) first; then ``other`` (40) does not fit (90 > 80),
    so the search undoes ``big``, takes ``small`` (10), and ``other`` fits (50). Should the undo
    not give the 50 back, nothing would fit after it."""
    devices = [drawing("big", 50, kind="a"), drawing("small", 10, kind="a"),
               drawing("other", 40, kind="b")]  # fmt: skip
    first = exactly("first", cls="mig.nvidia.com",
                    selectors=("device.attributes['gpu.nvidia.com'].profile == 'a'",))  # fmt: skip
    second = exactly("second", cls="mig.nvidia.com",
                     selectors=("device.attributes['gpu.nvidia.com'].profile == 'b'",))  # fmt: skip
    result = run([claim(first, second)], [slice_(devices, counters=COUNTER_SET)])
    assert devices_of(result) == ["small", "other"]


def test_backtracking_gives_shared_capacity_back() -> None:
    """gpu-a and gpu-b (80Gi each) allow multiple allocations. The first request (60Gi, any
    GPU) takes gpu-a first; the second (40Gi) may only use gpu-a, where 20Gi are left: the
    search undoes the first and moves it to gpu-b. Should the undo not give the 60Gi back,
    the second would find gpu-a full."""
    shared = [gpu("gpu-a", product="A", allowMultipleAllocations=True),
              gpu("gpu-b", product="B", allowMultipleAllocations=True)]  # fmt: skip
    first = exactly("first", capacity={"requests": {"memory": "60Gi"}})
    only_a = "device.attributes['gpu.nvidia.com'].productName == 'A'"
    second = exactly("second", capacity={"requests": {"memory": "40Gi"}}, selectors=(only_a,))
    result = run([claim(first, second)], [slice_(shared)])
    assert [(r.request, r.device) for a in result.allocations for r in a.results] == [
        ("first", "gpu-b"),
        ("second", "gpu-a"),
    ]


# -- requestPolicy -----------------------------------------------------------------------------

RANGE = {"default": "10Gi", "validRange": {"min": "10Gi", "max": "40Gi", "step": "10Gi"}}
RANGE_NO_STEP = {"validRange": {"min": "10Gi"}}
VALUES = {"default": "20Gi", "validValues": ["10Gi", "20Gi", "40Gi"]}


def share_of(policy: dict[str, Any], requested: str | None) -> tuple[str | None, tuple[str, ...]]:
    """(memory consumed, or None when refused; the refusal's reasons) for one claim asking
    ``requested`` (None: nothing) of an 80Gi GPU that allows multiple allocations."""
    device = gpu("gpu-0", allowMultipleAllocations=True)
    device["capacity"]["memory"]["requestPolicy"] = policy
    fields = {"capacity": {"requests": {"memory": requested}}} if requested else {}
    result = run([claim(exactly(**fields))], [slice_([device])])
    if not result.satisfiable:
        return None, result.diagnoses[0].verdicts[0].reasons
    (allocation,) = result.allocations
    return allocation.results[0].consumed_capacity["memory"], ()


@pytest.mark.parametrize(
    ("policy", "requested", "consumed"),
    [
        (RANGE, None, "10Gi"),  # the default
        (RANGE, "5Gi", "10Gi"),  # below the minimum: the minimum
        (RANGE, "10Gi", "10Gi"),  # exactly the minimum
        (RANGE, "25Gi", "30Gi"),  # rounded up to the minimum plus a multiple of the step
        (RANGE, "30Gi", "30Gi"),  # on a step: as asked
        (RANGE, "40Gi", "40Gi"),  # the maximum
        (RANGE_NO_STEP, "25Gi", "25Gi"),  # no step: as asked
        (RANGE_NO_STEP, "5Gi", "10Gi"),
        (RANGE_NO_STEP, None, "80Gi"),  # no default: all of it
        (VALUES, None, "20Gi"),
        (VALUES, "5Gi", "10Gi"),  # the smallest valid value that holds it
        (VALUES, "10Gi", "10Gi"),  # an exact valid value is not rounded up to the next
        (VALUES, "15Gi", "20Gi"),
        (VALUES, "20Gi", "20Gi"),
        (VALUES, "21Gi", "40Gi"),
        (VALUES, "40Gi", "40Gi"),
    ],
)
def test_the_request_policy_table(
    policy: dict[str, Any], requested: str | None, consumed: str
) -> None:
    assert share_of(policy, requested) == (consumed, ())


@pytest.mark.parametrize(
    ("policy", "requested", "reason"),
    [
        (RANGE, "45Gi", "memory: 50Gi requested (45Gi rounded up by the requestPolicy), more "
                        "than the requestPolicy's maximum 40Gi on gpu-0"),
        (VALUES, "50Gi", "memory: 50Gi requested, more than the requestPolicy's largest valid "
                         "value (valid: 10Gi, 20Gi, 40Gi) on gpu-0"),
        (RANGE_NO_STEP, "90Gi", "memory: 90Gi requested, 80Gi left on gpu-0"),
    ],
)  # fmt: skip
def test_what_the_request_policy_refuses_is_named(
    policy: dict[str, Any], requested: str, reason: str
) -> None:
    assert share_of(policy, requested) == (None, (reason,))


def test_devices_that_use_a_counter_up_exactly_both_fit() -> None:
    """Two of 30 on a counter of 60: the sum starts at zero, so they fit exactly."""
    devices = [drawing(f"p{i}", 30) for i in range(2)]
    counters = [{"name": "cs", "counters": {"mem": {"value": "60"}}}]
    two = run([claim(exactly(cls="mig.nvidia.com", count=2))], [slice_(devices, counters=counters)])
    assert devices_of(two) == ["p0", "p1"]


def test_a_device_drawing_on_a_counter_the_pool_lacks_is_named() -> None:
    """The search stops with an error that names the device and the counter set (the verdict
    of each device says so too)."""
    device = drawing("p0", 30)
    device["consumesCounters"][0]["counterSet"] = "nope"
    result = run([claim(exactly(cls="mig.nvidia.com"))], [slice_([device], counters=COUNTER_SET)])
    assert not result.satisfiable
    assert result.error == (
        "device gpu.nvidia.com/node1/p0 consumes counter set nope, which pool node1 does not define"
    )
    assert result.diagnoses[0].verdicts[0].reasons == ("consumes unknown counter nope/mem",)


def test_a_device_drawing_on_an_unknown_counter_is_named() -> None:
    device = drawing("p0", 30)
    device["consumesCounters"][0]["counters"] = {"zz": {"value": "1"}}
    result = run([claim(exactly(cls="mig.nvidia.com"))], [slice_([device], counters=COUNTER_SET)])
    assert not result.satisfiable
    assert result.error == "device gpu.nvidia.com/node1/p0 consumes unknown counter cs/zz"
    assert result.diagnoses[0].verdicts[0].reasons == ("consumes unknown counter cs/zz",)
