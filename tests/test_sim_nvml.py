"""Simulated GPUs: node identities, the sysfs tree, and the fake NVML library pynvml loads."""

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
