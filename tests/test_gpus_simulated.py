"""Simulated GPUs: the spec language, node identities, the sysfs tree and the fake NVML library."""

from __future__ import annotations

import ctypes
import itertools
import os

import pynvml
import pytest

from dra_driver.errors import SimulationSpecError
from dra_driver.sim.nvml import (
    build_node,
    discover_simulated,
    parse_spec,
    simulated_nvml,
)
from dra_driver.sim.profiles import HARDWARE_PROFILES, hardware_profile


def test_groups_expand_to_gpus_in_spec_order() -> None:
    spec = parse_spec("a100-80gb:2, l4:1,t4")

    assert [g.hardware.key for g in spec.gpus] == ["a100-80gb", "a100-80gb", "l4", "t4"]
    assert not any(g.mig_enabled or g.fail for g in spec.gpus)


def test_aliases_and_case_are_accepted() -> None:
    spec = parse_spec("H100:1,h200")

    assert [g.hardware.key for g in spec.gpus] == ["h100-80gb", "h200-141gb"]


def test_mig_layout_is_placed_first_fit_in_the_given_order() -> None:
    (gpu,) = parse_spec("a100-40gb:1:mig=3g.20gb+2g.10gb+1g.5gb").gpus

    assert gpu.mig_enabled and gpu.mig_pending
    assert [(m.profile.name, m.start) for m in gpu.mig_instances] == [
        ("3g.20gb", 0),
        ("2g.10gb", 4),
        ("1g.5gb", 6),
    ]


def test_me_suffixes_and_repeat_counts_in_layouts() -> None:
    (gpu,) = parse_spec("h100:1:mig=1g.10gb+me+1g.10gb*6").gpus

    assert [(m.profile.name, m.start) for m in gpu.mig_instances] == [
        ("1g.10gb+me", 0),
        *[("1g.10gb", start) for start in range(1, 7)],
    ]


def test_earlier_placements_are_revisited_when_a_later_instance_needs_room() -> None:
    (gpu,) = parse_spec("a100-40gb:1:mig=3g.20gb+2g.10gb+1g.5gb*2").gpus

    assert [(m.profile.name, m.start) for m in gpu.mig_instances] == [
        ("3g.20gb", 4),
        ("2g.10gb", 0),
        ("1g.5gb", 2),
        ("1g.5gb", 3),
    ]


def test_two_memory_slice_profiles_use_their_own_placement_table() -> None:
    (gpu,) = parse_spec("a100-40gb:1:mig=1g.10gb*4").gpus
    (mixed,) = parse_spec("a100-40gb:1:mig=2g.10gb*3+1g.10gb").gpus

    assert [m.start for m in gpu.mig_instances] == [0, 2, 4, 6]
    assert [m.start for m in mixed.mig_instances] == [0, 2, 4, 6]


@pytest.mark.parametrize(
    ("layout", "reason"),
    [
        ("4g.20gb+4g.20gb", "at most 1 instance"),
        ("1g.5gb+me+1g.5gb+me", "at most 1 instance"),
        ("7g.40gb+1g.5gb", "compute slices"),
        ("2g.10gb*3+1g.10gb+1g.5gb", "compute slices"),
        ("3g.20gb+3g.20gb+1g.5gb", "no combination of possible placements"),
        ("1g.10gb*3+3g.20gb+1g.5gb", "3g.20gb {0,4}:4"),
    ],
)
def test_layouts_that_do_not_fit_are_rejected_with_the_reason(layout: str, reason: str) -> None:
    with pytest.raises(SimulationSpecError, match="does not fit") as caught:
        parse_spec(f"a100-40gb:1:mig={layout}")

    assert reason in str(caught.value)
    assert layout in str(caught.value)


def test_unknown_product_lists_the_known_ones() -> None:
    with pytest.raises(SimulationSpecError) as caught:
        parse_spec("h100:2,v100:1")

    message = str(caught.value)
    assert "'v100'" in message
    assert "group 2" in message
    for key in [*HARDWARE_PROFILES, "h100", "h200"]:
        assert key in message


def test_unknown_mig_profile_lists_the_products_profiles() -> None:
    with pytest.raises(SimulationSpecError) as caught:
        parse_spec("a100-80gb:1:mig=1g.5gb")

    message = str(caught.value)
    assert "'1g.5gb'" in message
    assert "1g.10gb, 1g.10gb+me, 1g.20gb, 2g.20gb, 3g.40gb, 4g.40gb, 7g.80gb" in message


@pytest.mark.parametrize(
    ("spec", "names"),
    [
        ("", "empty --simulate spec"),
        ("h100,,l4", "group 2 is empty"),
        ("h100:x", "unknown option 'x'"),
        ("h100:1:bogus", "unknown option 'bogus'"),
        ("h100:1:addressing=nvlink", "unknown option 'addressing=nvlink'"),
        ("h100:1:numa=-1", "unknown option 'numa=-1'"),
        ("h100:1:numa=1024", "unknown option 'numa=1024'"),
        ("h100:1:numa=", "unknown option 'numa='"),
        ("l4:1:mig", "l4 (NVIDIA L4) does not support MIG"),
        ("t4:1:mig-pending", "does not support MIG"),
        ("a100-40gb:1:mig=3g.20gb+", "empty entry"),
        ("a100-40gb:1:mig=1g.5gb*0", "bad repeat count"),
        ("a100-40gb:1:mig=1g.5gb*x", "bad repeat count"),
        ("h100:65", "more than 64 GPUs"),
    ],
)
def test_malformed_specs_name_the_bad_part(spec: str, names: str) -> None:
    with pytest.raises(SimulationSpecError) as caught:
        parse_spec(spec)

    assert names in str(caught.value)


def test_identities_are_deterministic_per_node_name() -> None:
    spec = parse_spec("h100:4:mig=1g.10gb*2")

    first = build_node(spec, node_name="node-a")
    again = build_node(spec, node_name="node-a")
    other = build_node(spec, node_name="node-b")

    assert first == again
    assert {g.uuid for g in first}.isdisjoint(g.uuid for g in other)
    mig_uuids = [m.uuid for g in first for m in g.migs]
    assert len(set(mig_uuids)) == 8
    assert {m.uuid for g in other for m in g.migs}.isdisjoint(mig_uuids)
    buses = [g.pci_bus_id for g in first]
    assert buses == sorted(buses) and len(set(buses)) == 4
    assert buses != [g.pci_bus_id for g in other]


def test_discovery_of_the_same_spec_is_identical_on_the_same_node() -> None:
    first = discover_simulated("a100-80gb:1:mig=3g.40gb,l4:2", node_name="worker-7")
    second = discover_simulated("a100-80gb:1:mig=3g.40gb,l4:2", node_name="worker-7")

    assert first == second


def test_sysfs_tree_links_each_gpu_below_its_root_complex() -> None:
    with simulated_nvml("t4:2", node_name="n1") as node:
        for gpu in node.gpus:
            link = node.sysfs_root / "bus/pci/devices" / gpu.pci_bus_id
            assert link.is_symlink()
            assert not os.readlink(link).startswith("/")  # relative, like the kernel's
            resolved = link.resolve()
            assert resolved.parent.parent.name == gpu.pcie_root
            assert (resolved / "vendor").read_text() == "0x10de\n"
            assert (resolved / "device").read_text() == "0x1eb8\n"
            assert (resolved / "numa_node").read_text() == "0\n"


@pytest.mark.parametrize(
    ("spec", "nodes"),
    [
        ("h100:1", [0]),
        ("h100:2", [0, 0]),
        ("h100:3", [0, 0, 1]),
        ("h100:4", [0, 0, 1, 1]),
        ("h100:6", [0, 0, 0, 0, 1, 1]),
        ("h100:8", [0, 0, 0, 0, 1, 1, 1, 1]),
        ("h100:4,l4:2", [0, 0, 0, 0, 1, 1]),
    ],
)
def test_the_first_half_of_the_root_complexes_is_on_numa_node_0_the_rest_on_1(
    spec: str, nodes: list[int]
) -> None:
    gpus = build_node(parse_spec(spec), node_name="n")

    assert [g.numa_node for g in gpus] == nodes
    for a, b in itertools.pairwise(gpus):
        if a.pcie_root == b.pcie_root:  # one root complex belongs to one socket
            assert a.numa_node == b.numa_node


def test_numa_option_pins_a_node_or_writes_minus_one_for_none() -> None:
    spec = parse_spec("h100:2:numa=3,l4:1:numa=none,t4:1:numa=None")
    gpus = build_node(spec, node_name="n")

    assert [g.numa_node for g in gpus] == [3, 3, -1, -1]
    with simulated_nvml("h100:1:numa=none,l4:1:numa=7", node_name="n") as node:
        files = [
            (node.sysfs_root / "bus/pci/devices" / g.pci_bus_id / "numa_node").read_text()
            for g in node.gpus
        ]
    assert files == ["-1\n", "7\n"]


def test_the_library_refuses_calls_before_nvml_init() -> None:
    with simulated_nvml("l4:1", node_name="n"), pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()


def test_symbols_the_simulation_lacks_are_function_not_found() -> None:
    with simulated_nvml("l4:1", node_name="n"):
        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            with pytest.raises(pynvml.NVMLError_FunctionNotFound):
                pynvml.nvmlDeviceGetFanSpeed(handle)
        finally:
            pynvml.nvmlShutdown()


def test_string_buffers_that_are_too_small_get_insufficient_size() -> None:
    with simulated_nvml("h100:1", node_name="n") as node:
        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            buffer = ctypes.create_string_buffer(8)
            rc = node.library.nvmlDeviceGetName(handle, buffer, ctypes.c_uint(8))
            assert rc == pynvml.NVML_ERROR_INSUFFICIENT_SIZE
            assert pynvml.nvmlDeviceGetName(handle) == "NVIDIA H100 80GB HBM3"
        finally:
            pynvml.nvmlShutdown()


def test_a_failing_gpu_answers_gpu_is_lost_through_pynvml() -> None:
    with simulated_nvml("h100:1:fail", node_name="n"):
        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            with pytest.raises(pynvml.NVMLError_GpuIsLost):
                pynvml.nvmlDeviceGetUUID(handle)
        finally:
            pynvml.nvmlShutdown()


def test_an_invalid_spec_leaves_pynvml_untouched() -> None:
    before = pynvml.nvmlLib
    with pytest.raises(SimulationSpecError), simulated_nvml("gpu9000", node_name="n"):
        pass
    assert pynvml.nvmlLib is before


def test_every_hardware_profile_is_reachable_by_its_key() -> None:
    for key, profile in HARDWARE_PROFILES.items():
        assert hardware_profile(key) is profile
        assert hardware_profile(key.upper()) is profile
    assert hardware_profile("v100") is None
