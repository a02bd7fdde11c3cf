"""Simulated GPUs: a stand-in for the NVML C library that pynvml loads, plus a matching sysfs tree.

The first step of the flow for nodes without GPUs (the demo, tests, users trying the driver):
``simulated_nvml(spec, node_name=...)`` puts a fake library object where pynvml keeps its
``CDLL`` handle, so ``gpus.nvml.discover`` runs its normal pynvml call sequence against
simulated hardware. The seam is the C library: pynvml's own marshalling and return-code checks
run too. By NVML area:

    spec.py       the ``--simulate`` spec (syntax in its docstring and docs/simulate.md)
    node.py       the node's GPUs as values: identities, MIG devices, GPU instances, sysfs tree
    abi.py        the C side pynvml sees: return codes, exported symbols, pointers, handles
    library.py    the library object pynvml loads: its symbol table, init, handle lookups
    devices.py    device queries (identity, memory, PCI, modes, MIG devices, processes)
    readings.py   telemetry readings that move with time and load
    health.py     NVML events and XIDs, health queries, injected faults and their inbox
    inboxwatch.py waiting on the inbox file without polling it (inotify)
    mig.py        GPU and compute instances, the MIG mode; migstate.py their state file
    install.py    ``simulated_nvml``: installs the library for a block, and the sysfs tree

Hardware facts come from sim/profiles.py; faults from sim/faults.py.
"""

from dra_driver.sim.nvml.abi import CFunction
from dra_driver.sim.nvml.health import (
    IDLE_C,
    SHUTDOWN_C,
    SLOWDOWN_C,
    SUPPORTED_EVENT_TYPES,
    XID_DOUBLE_BIT_ECC,
    XID_GPU_LOST,
    SimulatedHealth,
)
from dra_driver.sim.nvml.install import SimulatedNode, discover_simulated, simulated_nvml
from dra_driver.sim.nvml.library import SimulatedNvmlLibrary
from dra_driver.sim.nvml.mig import SimulatedMigInstances
from dra_driver.sim.nvml.node import (
    SimulatedGpu,
    SimulatedGpuInstance,
    SimulatedMig,
    build_node,
    write_sysfs,
)
from dra_driver.sim.nvml.readings import simulated_load
from dra_driver.sim.nvml.spec import (
    MAX_GPUS,
    NO_NUMA_NODE,
    TOTAL_COMPUTE_SLICES,
    TOTAL_SLICES,
    MigPlacementSpec,
    SimulatedGpuSpec,
    SimulationSpec,
    parse_spec,
)

_CFunction = CFunction  # the name tests/plugin_process.py wraps a symbol with (die_at)

__all__ = [
    "IDLE_C",
    "MAX_GPUS",
    "NO_NUMA_NODE",
    "SHUTDOWN_C",
    "SLOWDOWN_C",
    "SUPPORTED_EVENT_TYPES",
    "TOTAL_COMPUTE_SLICES",
    "TOTAL_SLICES",
    "XID_DOUBLE_BIT_ECC",
    "XID_GPU_LOST",
    "CFunction",
    "MigPlacementSpec",
    "SimulatedGpu",
    "SimulatedGpuInstance",
    "SimulatedGpuSpec",
    "SimulatedHealth",
    "SimulatedMig",
    "SimulatedMigInstances",
    "SimulatedNode",
    "SimulatedNvmlLibrary",
    "SimulationSpec",
    "_CFunction",
    "build_node",
    "discover_simulated",
    "parse_spec",
    "simulated_load",
    "simulated_nvml",
    "write_sysfs",
]
