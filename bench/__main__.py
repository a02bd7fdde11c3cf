"""Run every benchmark module (bench/bench_*.py) in its own process, in name order.

Each module's ``main()`` prints one table: name, measured value, target, verdict. A module is run
in a fresh interpreter so one benchmark's memory does not skew another's RSS numbers.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def main() -> int:
    here = Path(__file__).resolve().parent
    only = sys.argv[1:]
    failed = 0
    for path in sorted(here.glob("bench_*.py")):
        if only and path.stem.removeprefix("bench_") not in only:
            continue
        print(f"\n== {path.stem} ==", flush=True)
        rc = subprocess.call([sys.executable, "-m", f"bench.{path.stem}"], cwd=here.parent)
        failed += rc != 0
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
