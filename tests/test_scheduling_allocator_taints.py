"""Taints, tolerations and DeviceTaintRules (scheduling/allocator/taints.py)."""

from __future__ import annotations

from typing import Any

from dra_driver.scheduling.allocator import (
    allocate,
    apply_taint_rules,
    parse_claim,
    parse_device_taint_rule,
    parse_slice,
)
from tests.allocatordata import (
    CLASSES,
    NODE,
    claim,
    devices_of,
    exactly,
    gpu,
    mig,
    run,
    slice_,
)


def test_taints_block_unless_tolerated() -> None:
    tainted = gpu(
        "gpu-0", taints=[{"key": "gpu.nvidia.com/xid", "value": "48", "effect": "NoSchedule"}]
    )
    result = run([claim(exactly())], [slice_([tainted])])
    assert not result.satisfiable
    assert result.diagnoses[0].verdicts[0].reasons == (
        "taint gpu.nvidia.com/xid=48:NoSchedule is not tolerated",
    )
    tolerant = exactly(tolerations=[{"key": "gpu.nvidia.com/xid", "operator": "Exists"}])
    assert devices_of(run([claim(tolerant)], [slice_([tainted])])) == ["gpu-0"]
    none_effect = gpu("gpu-0", taints=[{"key": "k", "effect": "None"}])
    assert devices_of(run([claim(exactly())], [slice_([none_effect])])) == ["gpu-0"]


def taint_rule(name: str, selector: dict[str, Any] | None, effect: str = "NoSchedule") -> Any:
    spec: dict[str, Any] = {"taint": {"key": "example.com/broken", "effect": effect}}
    if selector is not None:
        spec["deviceSelector"] = selector
    return parse_device_taint_rule(
        {"kind": "DeviceTaintRule", "metadata": {"name": name}, "spec": spec}
    )


def test_device_taint_rules_taint_what_their_selector_picks() -> None:
    counters = [
        {"name": "gpu-0-cs", "counters": {f"memory-slice-{i}": {"value": "1"} for i in range(8)}}
    ]
    slices = [
        parse_slice(
            slice_([gpu("gpu-0"), gpu("gpu-1"), mig("mig-a", start=0, size=1)], counters=counters)
        )
    ]

    def tainted(*rules: Any) -> dict[str, list[str]]:
        out = apply_taint_rules(slices, rules, classes=CLASSES)
        return {d.name: [t.rule for t in d.taints] for s in out for d in s.devices if d.taints}

    assert tainted(taint_rule("one", {"device": "gpu-1", "pool": "node1"})) == {"gpu-1": ["one"]}
    assert tainted(taint_rule("other-driver", {"driver": "x.example.com"})) == {}
    assert tainted(taint_rule("no-selector", None)) == {}
    assert tainted(taint_rule("all", {})) == {"gpu-0": ["all"], "gpu-1": ["all"], "mig-a": ["all"]}
    # v1alpha3 before 1.35: a class and CEL selectors narrow the rule
    assert tainted(taint_rule("migs", {"deviceClassName": "mig.nvidia.com"})) == {"mig-a": ["migs"]}
    assert tainted(taint_rule("missing-class", {"deviceClassName": "nope"})) == {}

    rules = [taint_rule("one", {"device": "gpu-0"})]
    result = allocate(
        [parse_claim(claim(exactly(count=2)))],
        classes=CLASSES,
        slices=apply_taint_rules(slices, rules, classes=CLASSES),
        node=NODE,
    )
    assert not result.satisfiable
    reasons = {v.device: v.reasons for v in result.diagnoses[0].verdicts}
    assert reasons["gpu-0"] == (
        "taint example.com/broken:NoSchedule is not tolerated (from DeviceTaintRule one)",
    )
    tolerant = exactly(count=2, tolerations=[{"key": "example.com/broken", "operator": "Exists"}])
    result = allocate(
        [parse_claim(claim(tolerant))],
        classes=CLASSES,
        slices=apply_taint_rules(slices, rules, classes=CLASSES),
        node=NODE,
    )
    assert devices_of(result) == ["gpu-0", "gpu-1"]


def test_no_taint_rules_leave_the_slices_as_they_are() -> None:
    slices = [parse_slice(slice_([gpu("gpu-0")]))]
    assert apply_taint_rules(slices, [], classes=CLASSES) == slices  # the same objects


def test_a_rule_selector_that_fails_at_runtime_selects_nothing() -> None:
    slices = [parse_slice(slice_([gpu("gpu-0")]))]
    broken = taint_rule(
        "broken",
        {"selectors": [{"cel": {"expression": "device.attributes['gpu.nvidia.com'].x == 1"}}]},
    )
    (out,) = apply_taint_rules(slices, [broken], classes=CLASSES)
    assert out.devices[0].taints == ()


def test_no_execute_blocks_like_no_schedule() -> None:
    tainted = gpu("gpu-0", taints=[{"key": "k", "value": "v", "effect": "NoExecute"}])
    result = run([claim(exactly())], [slice_([tainted])])
    assert not result.satisfiable
    assert result.diagnoses[0].verdicts[0].reasons == ("taint k=v:NoExecute is not tolerated",)
