"""``gpu-dra explain`` on dynamic MIG slices: partitionable devices are allocated as the scheduler
allocates them (shared counters consumed across the claims already allocated), and a refusal
names the memory slices a placement needs and who holds them.

The slices are what the agent publishes for simulated H100s with ``--mig-mode dynamic``.
"""

from __future__ import annotations

import io
import json
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import yaml

from dra_driver.cli import explain_main as main
from dra_driver.devices import MigMode
from dra_driver.devices.classes import default_device_classes
from dra_driver.quantity import parse_quantity
from dra_driver.scheduling.explain import allocate, result_json
from tests.simulatedslices import simulated_slices

NODE = "node1"
DRIVER = "gpu.nvidia.com"
NS = "team-a"


def slices(spec: str = "h100:1:mig", mig_mode: MigMode = "dynamic") -> list[dict[str, Any]]:
    return simulated_slices(spec, node_name=NODE, mig_mode=mig_mode)


def mig_claim(name: str, selector: str, *, count: int = 1) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NS, "uid": f"uid-{name}"},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "mig",
                        "exactly": {
                            "deviceClassName": "mig.nvidia.com",
                            "count": count,
                            "selectors": [{"cel": {"expression": selector}}],
                        },
                    }
                ]
            }
        },
    }


def gpu_claim(name: str) -> dict[str, Any]:
    claim = mig_claim(name, "true")
    claim["spec"]["devices"]["requests"] = [
        {"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}
    ]
    return claim


def profile_is(profile: str) -> str:
    return f"device.attributes['{DRIVER}'].profile == '{profile}'"


def held(claim: dict[str, Any], *devices: str) -> dict[str, Any]:
    """``claim`` as the scheduler leaves it: allocated ``devices`` on the node."""
    request = claim["spec"]["devices"]["requests"][0]["name"]
    return {
        **claim,
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {"request": request, "driver": DRIVER, "pool": NODE, "device": d}
                        for d in devices
                    ]
                },
                "nodeSelector": {
                    "nodeSelectorTerms": [
                        {
                            "matchFields": [
                                {"key": "metadata.name", "operator": "In", "values": [NODE]}
                            ]
                        }
                    ]
                },
            }
        },
    }


def run(
    claim: dict[str, Any],
    *allocated: dict[str, Any],
    spec: str = "h100:1:mig",
    mig_mode: MigMode = "dynamic",
) -> Any:
    classes = default_device_classes(DRIVER)
    return allocate(claim, classes, slices(spec, mig_mode), allocated=allocated)


def devices_of(result: Any) -> list[str]:
    (claim,) = result_json(result)["allocation"]["claims"]
    return [r["device"] for r in claim["allocation"]["devices"]["results"]]


def test_a_3g40gb_claim_gets_the_first_free_placement() -> None:
    claim = mig_claim("c", profile_is("3g.40gb"))
    assert devices_of(run(claim)) == ["gpu-0-mig-3g40gb-9-0"]
    first = held(mig_claim("a", profile_is("3g.40gb")), "gpu-0-mig-3g40gb-9-0")
    assert devices_of(run(claim, first)) == ["gpu-0-mig-3g40gb-9-4"]


def test_a_refused_placement_names_the_memory_slice_in_use_and_its_holder() -> None:
    small = held(mig_claim("small", profile_is("1g.10gb")), "gpu-0-mig-1g10gb-19-6")
    big = held(mig_claim("big", profile_is("3g.40gb")), "gpu-0-mig-3g40gb-9-0")

    result = run(mig_claim("c", profile_is("3g.40gb")), small, big)

    assert not result.satisfiable
    (diagnosis,) = result.nodes[0].diagnoses
    reasons = {v.device: v.reasons for v in diagnosis.verdicts}
    assert reasons["gpu-0-mig-3g40gb-9-4"][0] == (
        "3g.40gb at placement 4 needs memory-slice-4..7 of gpu-0-counter-set; "
        f"memory-slice-6 is used by gpu-0-mig-1g10gb-19-6 of claim {NS}/small"
    )
    assert reasons["gpu-0-mig-3g40gb-9-0"][0] == f"in use by {NS}/big"


def test_the_full_size_placement_consumes_every_memory_slice() -> None:
    one_slice = held(mig_claim("small", profile_is("1g.10gb")), "gpu-0-mig-1g10gb-19-0")
    # a single MIG device keeps the 7g.80gb placement of that GPU from being allocated
    full = mig_claim("full", profile_is("7g.80gb"))
    assert devices_of(run(full, one_slice, spec="h100:2:mig")) == ["gpu-1-mig-7g80gb-0-0"]
    refused = run(full, one_slice)
    assert not refused.satisfiable
    (diagnosis,) = refused.nodes[0].diagnoses
    (verdict,) = [v for v in diagnosis.verdicts if v.device == "gpu-0-mig-7g80gb-0-0"]
    assert (
        "7g.80gb at placement 0 needs memory-slice-0..7 of gpu-0-counter-set; memory-slice-0 is "
        f"used by gpu-0-mig-1g10gb-19-0 of claim {NS}/small" in verdict.reasons
    )
    # and the 7g.80gb, allocated, leaves no placement
    taken = held(mig_claim("full", profile_is("7g.80gb")), "gpu-0-mig-7g80gb-0-0")
    assert not run(mig_claim("c", profile_is("1g.10gb")), taken).satisfiable


def test_the_whole_gpu_consumes_every_counter_of_its_gpu() -> None:
    # free GPU: the whole GPU is offered (prepare takes it out of MIG mode)
    assert devices_of(run(gpu_claim("whole"))) == ["gpu-0"]
    # one MIG device on gpu-0: the whole gpu-0 no longer fits, gpu-1 does
    one_slice = held(mig_claim("small", profile_is("1g.10gb")), "gpu-0-mig-1g10gb-19-3")
    assert devices_of(run(gpu_claim("whole"), one_slice, spec="h100:2:mig")) == ["gpu-1"]
    refused = run(gpu_claim("whole"), one_slice)
    assert not refused.satisfiable
    (diagnosis,) = refused.nodes[0].diagnoses
    (verdict,) = [v for v in diagnosis.verdicts if v.device == "gpu-0"]
    assert any(
        "memory-slice-3" in reason and f"gpu-0-mig-1g10gb-19-3 of claim {NS}/small" in reason
        for reason in verdict.reasons
    ), verdict.reasons
    # the whole GPU allocated: no placement of it is left
    whole = held(gpu_claim("whole"), "gpu-0")
    assert not run(mig_claim("c", profile_is("1g.10gb")), whole).satisfiable
    assert devices_of(run(mig_claim("c", profile_is("1g.10gb")), whole, spec="h100:2:mig")) == [
        "gpu-1-mig-1g10gb-19-0"
    ]


def test_an_ampere_gpu_in_dynamic_mig_mode_is_not_offered_whole() -> None:
    assert not run(gpu_claim("whole"), spec="a100-80gb:1:mig").satisfiable
    assert run(mig_claim("c", profile_is("1g.10gb")), spec="a100-80gb:1:mig").satisfiable


def test_two_media_extension_placements_never_share_a_gpu() -> None:
    assert run(mig_claim("c", profile_is("1g.10gb+me"))).satisfiable
    assert not run(mig_claim("c", profile_is("1g.10gb+me"), count=2)).satisfiable
    assert run(mig_claim("c", profile_is("1g.10gb"), count=7)).satisfiable
    assert not run(mig_claim("c", profile_is("1g.10gb"), count=8)).satisfiable


@pytest.mark.parametrize(
    ("memory", "expected"),
    [
        # 1g.20gb and 2g.20gb have 19.6Gi: the smallest with 20Gi is 3g.40gb, two per GPU
        ("20Gi", [f"gpu-{g}-mig-3g40gb-9-{s}" for g in (0, 1) for s in (0, 4)]),
        # the smallest first: seven 1g.10gb per GPU, then no placement is left free
        ("9Gi", [f"gpu-{g}-mig-1g10gb-19-{s}" for g in (0, 1) for s in range(7)]),
    ],
)
def test_claims_allocated_one_after_another_never_overlap_nor_exceed_the_counters(
    memory: str, expected: list[str]
) -> None:
    """Allocate "any MIG device with at least <memory>" until the node is full, each time with
    every earlier claim allocated: placements never overlap and no counter is exceeded."""
    published = slices("h100:2:mig")
    counter_sets = {
        cs["name"]: cs["counters"] for s in published for cs in s["spec"].get("sharedCounters", ())
    }
    consumes = {
        d["name"]: d["consumesCounters"][0] for s in published for d in s["spec"].get("devices", ())
    }
    selector = f"device.capacity['{DRIVER}'].memory.compareTo(quantity('{memory}')) >= 0"
    allocated: list[dict[str, Any]] = []
    for i in range(20):
        claim = mig_claim(f"c{i}", selector)
        result = allocate(claim, default_device_classes(DRIVER), published, allocated=allocated)
        if not result.satisfiable:
            break
        allocated.append(held(claim, *devices_of(result)))
    names = [
        r["device"] for c in allocated for r in c["status"]["allocation"]["devices"]["results"]
    ]
    assert names == expected
    used: dict[tuple[str, str], Fraction] = {}
    for name in names:
        consumption = consumes[name]
        for counter, value in consumption["counters"].items():
            key = (consumption["counterSet"], counter)
            used[key] = used.get(key, Fraction(0)) + parse_quantity(value["value"]).value
    for (cs, counter), total in used.items():
        assert total <= parse_quantity(counter_sets[cs][counter]["value"]).value, (cs, counter)


def test_the_command_line_takes_mig_mode_with_simulate_only(tmp_path: Path) -> None:
    path = tmp_path / "claim.yaml"
    path.write_text(yaml.safe_dump(mig_claim("c", profile_is("3g.40gb"))))
    out, err = io.StringIO(), io.StringIO()
    argv = [str(path), "--simulate", "h100:1:mig", "--mig-mode", "dynamic", "-o", "json"]
    assert main(argv, stdout=out, stderr=err) == 0, err.getvalue()
    assert devices_of_json(json.loads(out.getvalue())) == ["gpu-0-mig-3g40gb-9-0"]
    # static mode: a GPU in MIG mode without MIG devices offers nothing
    assert main([*argv[:3], "-o", "json"], stdout=io.StringIO(), stderr=err) == 1
    slices_file = tmp_path / "slices.yaml"
    slices_file.write_text(yaml.safe_dump_all(slices()))
    err = io.StringIO()
    argv = [str(path), "--slices", str(slices_file), "--mig-mode", "dynamic"]
    assert main(argv, stdout=io.StringIO(), stderr=err) == 2
    assert "--mig-mode applies to --simulate only" in err.getvalue()


def devices_of_json(result: dict[str, Any]) -> list[str]:
    (claim,) = result["allocation"]["claims"]
    return [r["device"] for r in claim["allocation"]["devices"]["results"]]


def gpu_claim_selecting(name: str, selector: str) -> dict[str, Any]:
    claim = gpu_claim(name)
    claim["spec"]["devices"]["requests"][0]["exactly"]["selectors"] = [
        {"cel": {"expression": selector}}
    ]
    return claim


def test_the_whole_gpu_is_selected_by_its_multiprocessors_as_with_nvidias_driver(
    tmp_path: Path,
) -> None:
    selector = f"device.capacity['{DRIVER}'].multiprocessors.compareTo(quantity('132')) >= 0"
    path = tmp_path / "claim.yaml"
    path.write_text(yaml.safe_dump(gpu_claim_selecting("c", selector)))
    out, err = io.StringIO(), io.StringIO()
    argv = [str(path), "--simulate", "h100:1:mig", "--mig-mode", "dynamic", "--node", NODE]
    assert main(argv, stdout=out, stderr=err) == 0, err.getvalue() + out.getvalue()
    assert "gpu-0" in out.getvalue() and "NOT satisfiable" not in out.getvalue()
    # a GPU not in MIG mode has memory only, in NVIDIA's driver too: the selector's CEL error
    out, err = io.StringIO(), io.StringIO()
    assert main([str(path), "--simulate", "h100:1"], stdout=out, stderr=err) == 1
    assert "capacity gpu.nvidia.com/multiprocessors missing" in out.getvalue()


@pytest.mark.parametrize(
    ("threshold", "partitionable", "plain"),
    [
        ("81152Mi", True, True),  # the 7g.80gb profile's memory: both
        ("81200Mi", False, True),  # between the two: only a GPU not in MIG mode (81559Mi)
        ("81560Mi", False, False),
    ],
)
def test_a_memory_threshold_between_the_largest_profile_and_nvml_splits_as_nvidias(
    threshold: str, partitionable: bool, plain: bool
) -> None:
    selector = f"device.capacity['{DRIVER}'].memory.compareTo(quantity('{threshold}')) >= 0"
    claim = gpu_claim_selecting("c", selector)
    dynamic_result = run(claim, spec="h100:1:mig")
    assert dynamic_result.satisfiable is partitionable
    # a GPU not in MIG mode in static mode (in dynamic mode a Hopper is partitionable either way)
    assert run(claim, spec="h100:1", mig_mode="static").satisfiable is plain
    if partitionable:
        assert devices_of(dynamic_result) == ["gpu-0"]
    else:
        (diagnosis,) = dynamic_result.nodes[0].diagnoses
        (verdict,) = [v for v in diagnosis.verdicts if v.device == "gpu-0"]
        assert f"memory 81152Mi is less than {threshold}" in " ".join(verdict.reasons)


def test_a_multiprocessors_selector_on_a_mixed_node_fails_on_the_gpu_without_them() -> None:
    # gpu-1 (an L4, never partitionable) comes first and has memory only: a CEL runtime error,
    # which gives up the node as in the scheduler, and the summary says so rather than blaming
    # the counters
    selector = f"device.capacity['{DRIVER}'].multiprocessors.compareTo(quantity('132')) >= 0"
    result = run(gpu_claim_selecting("c", selector), spec="h100:1:mig,l4:1")
    assert not result.satisfiable
    (node,) = result.nodes
    assert node.error is not None and "gpu-1: CEL runtime error" in node.error
    (diagnosis,) = node.diagnoses
    assert diagnosis.summary == (
        "1 devices usable (gpu-0), but the attempt was given up on the error above"
    )
    guarded = f"has(device.capacity['{DRIVER}'].multiprocessors) && {selector}"
    assert devices_of(run(gpu_claim_selecting("c", guarded), spec="h100:1:mig,l4:1")) == ["gpu-0"]
