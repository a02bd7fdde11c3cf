"""The selector environment per Kubernetes minor (scheduling/environment.py); the cost estimate and
limits are in test_scheduling_cel_cost.py."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from dra_driver.devices.classes import default_device_classes
from dra_driver.errors import CelCompileError
from dra_driver.scheduling import environment
from dra_driver.scheduling.cel import compile_selector
from dra_driver.scheduling.environment import (
    COST_LIMIT,
    LIST_TYPE_ATTRIBUTES_GATE,
    NEWEST_VERSION,
    SUPPORTED_VERSIONS,
)

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "resourceclaims"
LISTS_V3 = {
    "[3, 1].reverse() == [1, 3]": "reverse",
    "[3, 1].sort() == [1, 3]": "sort",
    "[1, 1].distinct() == [1]": "distinct",
    "[[1], [2]].flatten() == [1, 2]": "flatten",
    "[1, 2, 3].slice(0, 1) == [1]": "slice",
    "[2, 1].sortBy(x, x) == [1, 2]": "sortBy",
    "lists.range(2) == [0, 1]": "lists.range",
}
GATES = frozenset({LIST_TYPE_ATTRIBUTES_GATE})
INCLUDES = "device.attributes['gpu.nvidia.com'].productName.includes('NVIDIA H100')"


# ---------------------------------------------------------------------------------------------
# The version table


def test_the_supported_versions_are_1_34_to_1_37_and_the_newest_is_the_default() -> None:
    assert SUPPORTED_VERSIONS == ("1.34", "1.35", "1.36", "1.37")
    assert NEWEST_VERSION == "1.37"
    assert environment.environment().k8s_version == "1.37"


def test_new_expressions_compile_at_the_previous_minor() -> None:
    for v in SUPPORTED_VERSIONS:
        minor = int(v.split(".")[1])
        assert environment.environment(v).compatibility_version == (1, minor - 1)


@pytest.mark.parametrize("expression", sorted(LISTS_V3))
def test_an_ext_lists_v3_function_is_refused_by_1_34_and_accepted_from_1_35(
    expression: str,
) -> None:
    name = LISTS_V3[expression]
    with pytest.raises(CelCompileError, match=re.escape(f"undeclared reference to '{name}'")):
        compile_selector(expression, "1.34")
    for v in ("1.35", "1.36", "1.37"):
        assert compile_selector(expression, v).evaluate({}) is True


def test_kubernetes_lists_v0_stays_in_every_version_for_new_expressions() -> None:
    # Removed at compatibility 1.37, i.e. from a 1.38 server's new expressions on.
    for v in SUPPORTED_VERSIONS:
        assert "Kubernetes Lists v0" in environment.environment(v).libraries
        assert compile_selector("[1, 2].sum() == 3 && [1, 2].isSorted()", v).evaluate({}) is True
        assert compile_selector("'abc'.indexOf('b') == 1", v).evaluate({}) is True


def test_includes_is_refused_unless_the_list_type_attributes_gate_is_on() -> None:
    for v in SUPPORTED_VERSIONS:
        with pytest.raises(CelCompileError, match="undeclared reference to 'includes'"):
            compile_selector(INCLUDES, v)
    with pytest.raises(CelCompileError, match="undeclared reference to 'includes'"):
        compile_selector(INCLUDES, "1.35", GATES)
    for v in ("1.36", "1.37"):
        assert compile_selector(INCLUDES, v, GATES).estimated_cost > 0


def test_an_unsupported_version_is_refused() -> None:
    with pytest.raises(ValueError, match=re.escape("supported: 1.34, 1.35, 1.36, 1.37")):
        environment.environment("1.33")
    with pytest.raises(ValueError, match=re.escape("MAJOR.MINOR")):
        environment.environment("latest")
    assert environment.parse_version("v1.35.2") == (1, 35)


def test_the_compile_error_carries_line_and_column_as_cel_go_reports_it() -> None:
    with pytest.raises(CelCompileError) as info:
        compile_selector("device.driver == 'x' &&\n  [1, 2].reverse() == [2, 1]", "1.34")
    assert str(info.value).startswith(
        "line 2, column 9: undeclared reference to 'reverse' (in container '')"
    )
    with pytest.raises(CelCompileError) as info:
        compile_selector("lists.range(3).size() == 3", "1.34")
    assert str(info.value).startswith("line 1, column 1: undeclared reference to 'lists.range'")


def test_the_compiled_program_cache_is_per_version() -> None:
    expression = "[2, 1].reverse() == [1, 2]"
    assert compile_selector(expression, "1.35") is compile_selector(expression, "1.35")
    with pytest.raises(CelCompileError):
        compile_selector(expression, "1.34")
    assert compile_selector(expression).evaluate({}) is True


def selectors_in(obj: Any) -> Iterator[str]:
    if isinstance(obj, dict):
        cel = obj.get("cel")
        if isinstance(cel, dict) and isinstance(cel.get("expression"), str):
            yield cel["expression"]
        for value in obj.values():
            yield from selectors_in(value)
    elif isinstance(obj, list):
        for value in obj:
            yield from selectors_in(value)


def example_selectors() -> list[tuple[str, str]]:
    out = []
    for path in sorted(EXAMPLES.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            out.extend((path.name, s) for s in selectors_in(doc))
    out.extend(("DeviceClass", s) for s in selectors_in(default_device_classes()))
    return out


REPO = Path(__file__).resolve().parent.parent
_INLINE = re.compile(r"`([^`\n]*\bdevice\.(?:attributes|capacity|driver)[^`\n]*)`")


def docs_selectors() -> list[tuple[str, str]]:
    """Selectors written out in the README and docs (inline code that is a whole boolean
    expression over ``device``; prose placeholders like ``device.attributes[domain][name]``
    and bare field names are not selectors)."""
    out = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for m in _INLINE.finditer(path.read_text()):
            text = m.group(1)
            if "..." in text or "[domain]" in text or not re.search(r"==|>=|<=|has\(", text):
                continue
            out.append((path.name, text))
    return out


@pytest.mark.parametrize("version", SUPPORTED_VERSIONS)
def test_every_selector_the_docs_show_compiles_in_every_version(version: str) -> None:
    found = docs_selectors()
    assert len(found) >= 2
    for where, expression in found:
        try:
            compile_selector(expression, version)
        except CelCompileError as exc:  # pragma: no cover - the failure message
            pytest.fail(f"{where}: {expression!r} does not compile in {version}: {exc}")


def test_there_are_example_and_class_selectors() -> None:
    sources = {where for where, _ in example_selectors()}
    assert "DeviceClass" in sources and len(sources) > 1


@pytest.mark.parametrize("version", SUPPORTED_VERSIONS)
def test_every_example_and_device_class_selector_compiles_in_every_version(version: str) -> None:
    for where, expression in example_selectors():
        try:
            program = compile_selector(expression, version)
        except CelCompileError as exc:  # pragma: no cover - the failure message
            pytest.fail(f"{where}: {expression!r} does not compile in {version}: {exc}")
        assert program.estimated_cost < COST_LIMIT // 100, (where, expression)
