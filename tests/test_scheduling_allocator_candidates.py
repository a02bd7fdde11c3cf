"""Which devices a request may take (scheduling/allocator/candidates.py): selectors, pool
generations, incomplete pools, slice order."""

from __future__ import annotations

from tests.allocatordata import (
    claim,
    devices_of,
    exactly,
    gpu,
    mig,
    run,
    slice_,
)


def test_class_selector_filters_by_type() -> None:
    result = run(
        [claim(exactly(cls="mig.nvidia.com"))],
        [
            slice_(
                [gpu("gpu-0"), mig("gpu-0-mig-1", start=0, size=1)],
                counters=[
                    {
                        "name": "gpu-0-cs",
                        "counters": {f"memory-slice-{i}": {"value": "1"} for i in range(8)},
                    }
                ],
            )
        ],
    )
    assert devices_of(result) == ["gpu-0-mig-1"]


def test_request_selector_and_unsatisfiable_reason() -> None:
    sel = "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('80Gi')) >= 0"
    result = run([claim(exactly(selectors=(sel,)))], [slice_([gpu("gpu-0", memory="40Gi")])])
    assert not result.satisfiable
    (diag,) = result.diagnoses
    assert diag.verdicts[0].reasons == ("request selector #0: memory 40Gi is less than 80Gi",)
    assert diag.summary == "needs 1, 0 of 1 devices usable"


def test_only_the_highest_generation_counts() -> None:
    old = slice_([gpu("old")], name="a", generation=1)
    new = slice_([gpu("new")], name="b", generation=2)
    assert devices_of(run([claim(exactly())], [old, new])) == ["new"]


def test_an_incomplete_pool_is_skipped() -> None:
    result = run([claim(exactly())], [slice_([gpu("gpu-0")], count=2)])
    assert not result.satisfiable
    assert any("incomplete" in n for n in result.notes)
    result = run([claim(exactly(allocationMode="All"))], [slice_([gpu("gpu-0")], count=2)])
    assert result.error is not None and "being updated" in result.error


def test_slices_are_tried_in_name_order() -> None:
    result = run(
        [claim(exactly())],
        [slice_([gpu("b-dev")], name="z", count=2), slice_([gpu("a-dev")], name="a", count=2)],
    )
    assert devices_of(result) == ["a-dev"]
