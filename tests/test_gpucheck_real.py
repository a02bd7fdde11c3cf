"""The simulation cannot drift from hardware we have seen: every report of a real run committed
under tests/data/real/ (docs/gpu-check.md "Committing a real run") holds the simulated profile of
its product to every field the hardware answered, through the same comparison the check runs.

The first is an H200's (driver 580.159.04, MIG off, no NUMA): its twin runs on that node's driver
and CUDA versions and NUMA node, so only UUIDs, PCI addresses, counts and readings are compared
by presence. A report made from a simulated run in a temp dir shows the comparison also passes
on a GPU in MIG mode, and fails on any changed field."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from dra_driver.gpucheck import report
from dra_driver.gpucheck.check import Options, compare_with_twin, run_check
from dra_driver.sim.checkmachine import SimulatedTwins, simulated_machine

REAL = Path(__file__).parent / "data" / "real"
REPORTS = sorted(REAL.glob("*.json")) or [
    pytest.param(
        None,
        marks=pytest.mark.skip(
            reason="no real run's report in tests/data/real yet: no GPU has been lent "
            "(docs/gpu-check.md, Committing a real run)"
        ),
    )
]


def recorded_gpus(path: Path) -> list[dict[str, Any]]:
    return list(json.loads(path.read_text())["gpus"])


def mismatches(gpu: dict[str, Any]) -> list[dict[str, Any]]:
    twin = compare_with_twin(gpu["facts"], twins=SimulatedTwins(), driver_name="gpu.nvidia.com")
    assert "error" not in twin, twin
    return list(twin["differences"])


@pytest.mark.parametrize("path", REPORTS, ids=lambda p: getattr(p, "name", "none"))
def test_the_simulated_profile_answers_as_the_recorded_hardware_did(path: Path) -> None:
    assert path.name == report.product_file_name(recorded_gpus(path)[0]["product_name"])
    for gpu in recorded_gpus(path):
        assert mismatches(gpu) == [], f"sim/profiles.py differs from the GPU {path.name} recorded"


@pytest.fixture(scope="module")
def simulated_report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A report as a real run writes it, made on simulated GPUs (A100 40GB in MIG mode)."""
    base = tmp_path_factory.mktemp("report")
    (base / "work").mkdir()
    with simulated_machine("a100-40gb:1:mig=3g.20gb+2g.10gb", base / "machine") as machine:
        body = run_check(machine, twins=SimulatedTwins(), options=Options(), work=base / "work")
    path, _ = report.write(body, base / "out")
    return path


def test_a_report_read_back_from_disk_matches_its_simulated_profile(simulated_report: Path) -> None:
    for gpu in recorded_gpus(simulated_report):
        assert mismatches(gpu) == []


@pytest.mark.parametrize(
    ("where", "path"),
    [
        (("discovery", "memory_bytes"), "discovery.memory_bytes"),
        (("mig", "profiles", "0", "info", "value", "memorySizeMB"),
         "mig.profiles.0.info.value.memorySizeMB"),
        (("mig", "profiles", "4", "placements", "value", 0, "size"),
         "mig.profiles.4.placements.value.0.size"),
        (("health", "supported_event_types", "value"), "health.supported_event_types.value"),
    ],
)  # fmt: skip
def test_a_changed_field_in_a_report_is_a_difference_at_its_path(
    simulated_report: Path, where: tuple[Any, ...], path: str
) -> None:
    (gpu,) = recorded_gpus(simulated_report)
    changed = copy.deepcopy(gpu)
    node: Any = changed["facts"]
    for key in where[:-1]:
        node = node[key]
    node[where[-1]] = node[where[-1]] + 1
    assert [d["path"] for d in mismatches(changed)] == [path]


def test_an_answer_the_hardware_refused_is_a_difference_too(simulated_report: Path) -> None:
    (gpu,) = recorded_gpus(simulated_report)
    changed = copy.deepcopy(gpu)
    changed["facts"]["health"]["remapped_rows"] = {"error": "NOT_SUPPORTED", "rc": 3}
    paths = {d["path"] for d in mismatches(changed)}
    assert "health.remapped_rows.error" in paths


@pytest.mark.parametrize(
    "path",
    [
        "devices.static.0.attributes.driverVersion.version",
        "devices.static.0.attributes.cudaDriverVersion.version",
    ],
)
def test_the_nodes_driver_version_is_compared_by_value_not_hidden(path: str) -> None:
    (gpu,) = recorded_gpus(REAL / "nvidia-h200.json")
    changed = copy.deepcopy(gpu)
    node: Any = changed["facts"]
    *parents, leaf = path.split(".")
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    node[leaf] = "570.124.6"
    assert [d["path"] for d in mismatches(changed)] == [path]
