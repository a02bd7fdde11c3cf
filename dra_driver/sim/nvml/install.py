"""Installing the simulated library where pynvml loads NVML, for the duration of a block.

The entry point of simulated GPUs (the agent's ``--simulate``, the demo, tests, ``gpu-dra
explain``): ``simulated_nvml(spec, node_name=...)`` parses the spec (spec.py), builds the node
(node.py), writes its sysfs tree, and puts a ``SimulatedNvmlLibrary`` (library.py) where pynvml
keeps its ``CDLL`` handle (``pynvml.nvmlLib``), so ``gpus.nvml.discover`` runs its normal pynvml
call sequence, including pynvml's own argument marshalling and return-code checks, against
simulated hardware. There is no second discovery path.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pynvml

from dra_driver.gpus import nvml
from dra_driver.gpus.info import Inventory
from dra_driver.sim.nvml.library import SimulatedNvmlLibrary
from dra_driver.sim.nvml.node import SimulatedGpu, build_node, write_sysfs
from dra_driver.sim.nvml.spec import parse_spec


@dataclass(frozen=True)
class SimulatedNode:
    """What ``simulated_nvml`` yields: the GPUs it serves and the sysfs tree to read."""

    node_name: str
    gpus: tuple[SimulatedGpu, ...]
    sysfs_root: Path
    library: SimulatedNvmlLibrary


@contextmanager
def simulated_nvml(
    spec: str,
    *,
    node_name: str,
    inbox: Path | None = None,
    state_path: Path | None = None,
    compute_modes: Path | None = None,
    driver_version: str | None = None,
    cuda_driver_version: int | None = None,
) -> Iterator[SimulatedNode]:
    """Install simulated GPUs as pynvml's NVML library for the duration of the block.

    Parses ``spec`` first (SimulationSpecError before anything changes), writes a sysfs tree to a
    temporary directory (``gpu-dra-sysfs-*`` in ``TMPDIR``, removed when the block ends, on an
    exception too, but not by a process killed with SIGKILL; pass ``node.sysfs_root`` to
    discovery), and restores pynvml's previous library, symbol cache and reference count on
    exit, so blocks may be used one after another or nested in one process (the installing and
    restoring are not for concurrent use; the library itself may be called from several
    threads). ``inbox``: a file
    other processes append faults to (sim/faults.py); lines already in it are skipped.
    ``state_path``: the file the node keeps its MIG instances in (see SimulatedMigInstances),
    read here when it exists, so a second block on the same file sees the instances the first
    created; None keeps them in memory, starting from the spec's layout. ``compute_modes``,
    ``driver_version``, ``cuda_driver_version`` (None: the simulated driver's): see
    SimulatedNvmlLibrary.
    """
    gpus = build_node(parse_spec(spec), node_name=node_name)
    versions: dict[str, Any] = {}
    if driver_version is not None:
        versions["driver_version"] = driver_version
    if cuda_driver_version is not None:
        versions["cuda_driver_version"] = cuda_driver_version
    library = SimulatedNvmlLibrary(
        gpus,
        node_name=node_name,
        inbox=inbox,
        state_path=state_path,
        compute_modes=compute_modes,
        **versions,
    )
    with tempfile.TemporaryDirectory(prefix="gpu-dra-sysfs-") as tmp:
        sysfs_root = write_sysfs(Path(tmp), gpus)
        with pynvml.libLoadLock:
            saved = (
                pynvml.nvmlLib,
                dict(pynvml._nvmlGetFunctionPointer_cache),
                pynvml._nvmlLib_refcount,
            )
            pynvml.nvmlLib = library
            # pynvml caches function pointers by name; stale entries would call the old library.
            pynvml._nvmlGetFunctionPointer_cache.clear()
            pynvml._nvmlLib_refcount = 0
        try:
            yield SimulatedNode(
                node_name=node_name, gpus=gpus, sysfs_root=sysfs_root, library=library
            )
        finally:
            with pynvml.libLoadLock:
                pynvml.nvmlLib, cache, pynvml._nvmlLib_refcount = saved
                pynvml._nvmlGetFunctionPointer_cache.clear()
                pynvml._nvmlGetFunctionPointer_cache.update(cache)


def discover_simulated(spec: str, *, node_name: str) -> Inventory:
    """Run ``nvml.discover`` once against simulated GPUs (what ``--simulate`` does at start)."""
    with simulated_nvml(spec, node_name=node_name) as node:
        # The driver root is never read: pynvml already holds the simulated library.
        return nvml.discover(driver_root=Path("/"), sysfs_root=node.sysfs_root)
