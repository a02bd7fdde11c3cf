"""What ``make demo`` prints, and how it waits: a step's heading, a poll with a deadline, and JSON
laid out to be read (one line per list entry)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def step(text: str) -> None:
    print(f"\n\033[1m==> {text}\033[0m" if sys.stdout.isatty() else f"\n==> {text}", flush=True)


def wait_for(what: str, probe: Callable[[], T | None], *, timeout_s: float = 20.0) -> T:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.05)
    raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def readable_json(value: Any, indent: str = "") -> str:
    """JSON with one line per list entry: long CDI specs stay scannable."""
    nested = (dict, list)
    if isinstance(value, dict) and any(
        isinstance(v, dict) or (isinstance(v, list) and any(isinstance(x, nested) for x in v))
        for v in value.values()
    ):
        inner = indent + "  "
        items = [f"{inner}{json.dumps(k)}: {readable_json(v, inner)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + f"\n{indent}}}"
    if isinstance(value, list) and value and any(isinstance(v, (dict, list)) for v in value):
        inner = indent + "  "
        items = [f"{inner}{readable_json(v, inner)}" for v in value]
        return "[\n" + ",\n".join(items) + f"\n{indent}]"
    return json.dumps(value)
