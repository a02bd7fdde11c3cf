"""Every example in examples/resourceclaims/ gets the outcome its ``# expect:`` line promises.

The line format is defined in docs/explain.md:

    # expect: satisfiable [devices=NAME,NAME...] [count=N] [requests=NAME,NAME...]
    # expect: unsatisfiable

It is checked with ``gpu-dra explain`` against the demo node (``dra_driver.demo``), built by the
real simulated-GPU pipeline.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from dra_driver.demo import DEMO_NODE, DEMO_SIMULATE
from dra_driver.simulator.explain import main

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "resourceclaims"
FILES = sorted(EXAMPLES.glob("*.yaml"))
KEYS = ("devices", "count", "requests")


def expectation(path: Path) -> tuple[bool, dict[str, str]]:
    lines = [line for line in path.read_text().splitlines() if line.startswith("# expect:")]
    assert len(lines) == 1, f"{path.name}: needs exactly one '# expect:' line, has {len(lines)}"
    words = lines[0].removeprefix("# expect:").split()
    assert words and words[0] in ("satisfiable", "unsatisfiable"), f"{path.name}: {lines[0]!r}"
    options = {}
    for word in words[1:]:
        key, sep, value = word.partition("=")
        assert sep and key in KEYS and value, f"{path.name}: bad expect option {word!r}"
        options[key] = value
    assert words[0] == "satisfiable" or not options, f"{path.name}: options need 'satisfiable'"
    return words[0] == "satisfiable", options


def test_there_are_examples() -> None:
    assert FILES, f"no examples in {EXAMPLES}"


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_example_gets_its_expected_outcome_on_the_demo_node(path: Path) -> None:
    satisfiable, options = expectation(path)
    out, err = io.StringIO(), io.StringIO()
    rc = main(
        [str(path), "--simulate", DEMO_SIMULATE, "--node", DEMO_NODE, "-o", "json"],
        stdout=out,
        stderr=err,
    )
    assert rc in (0, 1), err.getvalue()
    result = json.loads(out.getvalue())
    assert result["satisfiable"] is satisfiable, json.dumps(result["nodes"], indent=1)[:4000]
    if not satisfiable:
        assert rc == 1
        return
    assert rc == 0
    results = [
        r
        for claim in result["allocation"]["claims"]
        for r in claim["allocation"]["devices"]["results"]
    ]
    if "devices" in options:
        assert [r["device"] for r in results] == options["devices"].split(",")
    if "count" in options:
        assert len(results) == int(options["count"])
    if "requests" in options:
        seen = list(dict.fromkeys(r["request"] for r in results))
        assert seen == options["requests"].split(",")
