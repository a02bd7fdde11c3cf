"""Run every benchmark module (bench/bench_*.py) in its own process, in name order.

Each module's ``main()`` prints one table: name, measured value, target, verdict. A module is run
in a fresh interpreter so one benchmark's memory does not skew another's RSS numbers.
``python -m bench [--short] [NAME ...]``: only the benches named (``prepare`` for
bench_prepare.py); ``--short`` runs each in its short mode (bench/table.py: few iterations, the
table printed, no target judged).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from bench.table import SHORT_ENV


def modules() -> list[Path]:
    """Every benchmark module, in name order."""
    return sorted(Path(__file__).resolve().parent.glob("bench_*.py"))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    short = "--short" in args
    only = [a for a in args if a != "--short"]
    env = os.environ | ({SHORT_ENV: "1"} if short else {})
    failed = []
    for path in modules():
        if only and path.stem.removeprefix("bench_") not in only:
            continue
        print(f"\n== {path.stem} ==", flush=True)
        rc = subprocess.call(
            [sys.executable, "-m", f"bench.{path.stem}"], cwd=path.parents[1], env=env
        )
        if rc != 0:
            failed.append(path.stem)
    if failed:
        print(f"\nfailed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
