"""The estimated cost of a selector and the runtime cost limit (scheduling/cel/cost.py,
scheduling/cel/comprehensions.py; the limit is environment.COST_LIMIT)."""

from __future__ import annotations

import pytest

from dra_driver.errors import CelCompileError, CelRuntimeError
from dra_driver.scheduling.cel import compile_expression, compile_selector
from dra_driver.scheduling.environment import COST_LIMIT

ORDINARY = {
    "class": "device.driver == 'gpu.nvidia.com' && "
    "device.attributes['gpu.nvidia.com'].type == 'gpu'",
    "memory": "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('40Gi')) >= 0",
    "product": "device.attributes['gpu.nvidia.com'].productName.startsWith('NVIDIA H100')",
    "bind": "cel.bind(g, device.attributes['gpu.nvidia.com'], g.type == 'gpu' && "
    "g.architecture == 'Hopper')",
    "regex": "device.attributes['gpu.nvidia.com'].productName.matches('^NVIDIA (H|A)100')",
    "exists": "device.attributes['gpu.nvidia.com'].exists(k, k.startsWith('mig'))",
}


def test_ordinary_selectors_are_far_below_the_cost_limit() -> None:
    estimates = {name: compile_selector(e).estimated_cost for name, e in ORDINARY.items()}
    # Our estimates (cel-go's may differ slightly; see cel/cost.py): reported here.
    assert estimates == {
        "class": 9,
        "memory": 6,
        "product": 6,
        "bind": 10,
        "regex": 32,
        "exists": 163,
    }
    assert max(estimates.values()) < COST_LIMIT // 1000


def test_nested_comprehensions_over_attribute_maps_exceed_the_estimated_cost_limit() -> None:
    two = "device.attributes.all(d, device.attributes[d].all(k, device.attributes[d][k] == 'x'))"
    assert compile_selector(two).estimated_cost < COST_LIMIT
    four = (
        "device.attributes.all(d, device.attributes[d].all(k, "
        "device.attributes.all(e, device.attributes[e].all(j, "
        "device.attributes[e][j] == device.attributes[d][k]))))"
    )
    with pytest.raises(CelCompileError) as info:
        compile_selector(four)
    message = str(info.value)
    assert message.startswith("too complex, exceeds cost limit: estimated cost ")
    assert f"exceeds the limit of {COST_LIMIT}" in message
    estimate = int(message.split("estimated cost ")[1].split(maxsplit=1)[0])
    assert estimate > COST_LIMIT


def test_a_comprehension_that_runs_too_long_is_cancelled_at_runtime() -> None:
    # Not a selector (its estimate would refuse it): the runtime limit alone stops it.
    program = compile_expression(
        "lists.range(2000).all(i, lists.range(2000).all(j, i + j >= 0))", {}
    )
    with pytest.raises(CelRuntimeError, match="operation cancelled: actual cost limit exceeded"):
        program.evaluate({})
    small = compile_expression("lists.range(100).all(i, lists.range(100).all(j, i + j >= 0))", {})
    assert small.evaluate({}) is True
    assert small.evaluate({}) is True  # the counter is per evaluation


def test_the_runtime_cost_is_shared_by_sibling_comprehensions() -> None:
    half = "lists.range(1000).all(i, lists.range(300).all(j, j >= 0))"
    assert compile_expression(half, {}).evaluate({}) is True
    with pytest.raises(CelRuntimeError, match="actual cost limit exceeded"):
        compile_expression(f"{half} && {half} && {half}", {}).evaluate({})
