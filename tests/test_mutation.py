"""The mutation tier: mutmut mutates one pure core per run and its tests must kill the mutants
(issue 37 item 6).

Each run takes one module of ``CORES`` in turn (the day of the year picks it, so every core
comes round in turn; ``MUTATION_CORE=<module>`` picks one, ``MUTATION_CORE=all`` runs
them all), copies the package and the tests into the test's directory, runs ``mutmut run``
there against the module's own test files, and fails when the share of mutants killed falls
below the module's floor (the score measured when the floor was set: docs/development.md
"Mutation testing" has them). Bounded in time: a core takes a few seconds to three and a half
minutes on two shared CPUs; ``mutmut`` gets
``LIMIT_S`` and the test fails if it runs out.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).parents[1]
MUTMUT = Path(sys.executable).parent / "mutmut"
LIMIT_S = 230


@dataclass(frozen=True)
class Core:
    tests: tuple[str, ...]
    floor: float  # the share of mutants killed, as measured (docs/development.md)


CORES = {
    "dra_driver/scheduling/allocator/counters.py": Core(
        ("test_scheduling_allocator_counters.py", "test_scheduling_allocator_policies.py"), 0.92
    ),
    "dra_driver/scheduling/allocator/capacity.py": Core(
        ("test_scheduling_allocator_capacity.py", "test_scheduling_allocator_policies.py"), 0.96
    ),
    "dra_driver/scheduling/allocator/search.py": Core(
        ("test_scheduling_allocator_search.py",), 0.95
    ),
    "dra_driver/scheduling/allocator/constraints.py": Core(
        ("test_scheduling_allocator_constraints.py",), 0.97
    ),
    "dra_driver/scheduling/allocator/model.py": Core(("test_scheduling_allocator_model.py",), 0.96),
    "dra_driver/scheduling/allocator/taints.py": Core(
        ("test_scheduling_allocator_taints.py",), 0.92
    ),
    "dra_driver/publish/syncplan.py": Core(("test_syncplan.py",), 0.95),
    "dra_driver/sharing/shares.py": Core(("test_shares.py",), 0.99),
    "dra_driver/prepare/plan.py": Core(("test_prepare_plan.py",), 0.97),
    "dra_driver/devices/partitionable.py": Core(("test_devices_partitionable.py",), 1.00),
    "dra_driver/devices/validation.py": Core(("test_devices_validation.py",), 1.00),
    "dra_driver/devices/gpu.py": Core(("test_devices_gpu.py",), 1.00),
    "dra_driver/devices/names.py": Core(("test_devices_names.py",), 0.97),
    "dra_driver/devices/model.py": Core(("test_devices_model.py",), 0.91),
    "dra_driver/devices/pool.py": Core(("test_devices_pool.py",), 1.00),
    "dra_driver/devices/table.py": Core(("test_devices_table.py",), 0.96),
    "dra_driver/devices/classes.py": Core(("test_devices_classes.py",), 1.00),
    "dra_driver/scheduling/allocator/candidates.py": Core(
        ("test_scheduling_allocator_candidates.py",), 0.98
    ),
    "dra_driver/scheduling/allocator/allocation.py": Core(
        ("test_scheduling_allocator.py", "test_scheduling_allocator_binding.py"), 0.95
    ),
    "dra_driver/scheduling/allocator/reasons.py": Core(
        ("test_scheduling_allocator_reasons.py",), 0.99
    ),
    "dra_driver/scheduling/allocator/parse.py": Core(("test_scheduling_allocator_parse.py",), 0.99),
}


def chosen() -> list[str]:
    wanted = os.environ.get("MUTATION_CORE", "")
    if wanted == "all":
        return list(CORES)
    if wanted:
        return [wanted]
    cores = list(CORES)
    return [cores[datetime.date.today().toordinal() % len(cores)]]


def killed_share(workdir: Path, module: str) -> tuple[int, int]:
    """(killed, mutants) from mutmut's record of the module's mutants: exit status 1 is a
    failed test run (killed); 0 survived; anything else (a timeout, a crash) is not a kill."""
    meta = json.loads((workdir / "mutants" / f"{module}.meta").read_text())
    codes = list(meta["exit_code_by_key"].values())
    return sum(1 for c in codes if c == 1), len(codes)


@pytest.mark.skipif(not MUTMUT.exists(), reason="needs mutmut (pip install -e '.[dev]')")
@pytest.mark.parametrize("module", chosen())
def test_the_tests_of_a_pure_core_kill_its_mutants(tmp_path: Path, module: str) -> None:
    core = CORES[module]
    shutil.copytree(REPO / "dra_driver", tmp_path / "dra_driver",
                    ignore=shutil.ignore_patterns("__pycache__", "gpu-dra-cdi-hook"))  # fmt: skip
    shutil.copytree(REPO / "tests", tmp_path / "tests",
                    ignore=shutil.ignore_patterns("__pycache__", "data", "celspec"))  # fmt: skip
    selection = [f"tests/{t}" for t in core.tests]
    (tmp_path / "pyproject.toml").write_text(
        "[tool.mutmut]\n"
        f"source_paths = [{json.dumps(module)}]\n"
        f"pytest_add_cli_args_test_selection = {json.dumps(selection)}\n"
        'pytest_add_cli_args = ["-p", "no:randomly", "-p", "no:cacheprovider", "--noconftest"]\n'
        'also_copy = ["dra_driver", "tests"]\n'
    )
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    result = subprocess.run(
        [str(MUTMUT), "run", "--max-children", "2"],
        cwd=tmp_path, capture_output=True, text=True, timeout=LIMIT_S, check=False, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    killed, mutants = killed_share(tmp_path, module)
    survivors = subprocess.run(
        [str(MUTMUT), "results"], cwd=tmp_path, capture_output=True, text=True, timeout=60,
        check=False,
    ).stdout  # fmt: skip
    print(f"{module}: {killed}/{mutants} mutants killed ({killed / mutants:.0%})")
    assert mutants > 0
    assert killed / mutants >= core.floor, f"{killed}/{mutants} killed; survivors:\n{survivors}"
