"""Every benchmark in bench/ runs in CI, in its short mode (bench/table.py: few iterations, the
table printed, no target judged): a bench that can no longer run fails here, not months later in
someone's ``make bench``. Each runs as ``make bench`` runs it (``python -m bench.<name>`` in a
fresh interpreter, from the repository root) and must exit 0 and print its table, which is
shown in the test log. A bench that needs what this machine lacks says so and is skipped
(bench_image: root, podman and a base image; bench_mps and bench_shares: root, for their tmpfs
mounts), as the tests of the same tiers are."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.__main__ import modules
from bench.table import SHORT_ENV

ROOT = Path(__file__).resolve().parents[1]
NEEDS_ROOT = {"bench_mps", "bench_shares"}  # bench/mpsnode.py mounts a tmpfs per MPS daemon
SHORT_TITLE = "[short mode: few iterations, targets not judged]"


def test_every_bench_module_is_found() -> None:
    names = {path.stem for path in modules()}
    assert {"bench_prepare", "bench_grpc_floor", "bench_publish"} <= names
    assert names == {p.stem for p in (ROOT / "bench").glob("bench_*.py")}


@pytest.mark.parametrize("name", [path.stem for path in modules()])
def test_the_bench_runs_in_its_short_mode_and_prints_its_table(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    if name in NEEDS_ROOT and os.geteuid() != 0:
        pytest.skip("mounts a tmpfs for each MPS daemon (root only)")
    run = subprocess.run(
        [sys.executable, "-m", f"bench.{name}"],
        cwd=ROOT,
        env=os.environ | {SHORT_ENV: "1"},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    output = f"{run.stdout}\n{run.stderr[-4000:]}"
    if run.returncode == 0 and run.stdout.startswith("skipped: "):
        pytest.skip(run.stdout.strip().removeprefix("skipped: "))
    assert run.returncode == 0, f"{name} failed in its short mode:\n{output}"
    assert SHORT_TITLE in run.stdout, output
    assert "measurement" in run.stdout and "verdict" in run.stdout, output
    assert "MISSED" not in run.stdout and " ok " not in run.stdout, output
    with capsys.disabled():
        print(f"\n== {name} (short mode) ==\n{run.stdout}", end="")
