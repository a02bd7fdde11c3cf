"""Simulated GPUs for ``gpu-dra gpu-check``: the twins it compares each GPU with, and with
``--simulate`` the whole machine it checks.

Part of the simulated backend, given to gpucheck/ by the CLI (gpucheck/ may not import sim/).
:class:`SimulatedTwins` finds a product's profile (profiles.py) by the name NVML reports and
installs one simulated GPU of it below pynvml, as ``--simulate`` does. :func:`simulated_machine`
is a machine with simulated GPUs: the simulated NVML installed for the block, and a fake driver
tree (fakedriver.py) whose libraries and ``nvidia-smi`` are ELF stand-ins (elfdriver.py)
answering for the same GPUs, so the check's CUDA load runs its probe against them. Without a C
compiler the tree holds text stand-ins and the load fails saying so.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

from dra_driver.gpucheck.check import Machine
from dra_driver.sim.elfdriver import build_libraries, build_nvidia_smi
from dra_driver.sim.fakedriver import make_fake_driver
from dra_driver.sim.nvml import SimulatedNvmlLibrary, simulated_nvml
from dra_driver.sim.profiles import HARDWARE_PROFILES

TWIN_NODE = "gpu-check-twin"
MACHINE_NODE = "gpu-check"


class SimulatedTwins:
    """gpucheck.check.Twins on sim/profiles.py; ``libraries``: every simulated NVML it
    installed, in order (tests read their call traces)."""

    def __init__(self) -> None:
        self.libraries: list[SimulatedNvmlLibrary] = []

    def product_key(self, product_name: str) -> str | None:
        for key, profile in HARDWARE_PROFILES.items():
            if profile.product_name == product_name:
                return key
        return None

    def installed(
        self, spec: str, *, driver_version: str | None, cuda_driver_version: int | None
    ) -> AbstractContextManager[Path]:
        return self._installed(
            spec, driver_version=driver_version, cuda_driver_version=cuda_driver_version
        )

    @contextmanager
    def _installed(
        self, spec: str, *, driver_version: str | None, cuda_driver_version: int | None
    ) -> Iterator[Path]:
        with simulated_nvml(
            spec,
            node_name=TWIN_NODE,
            driver_version=driver_version,
            cuda_driver_version=cuda_driver_version,
        ) as node:
            self.libraries.append(node.library)
            yield node.sysfs_root


@contextmanager
def simulated_machine(spec: str, base: Path) -> Iterator[Machine]:
    """A machine with the GPUs of ``spec`` for the block: simulated NVML below pynvml, and
    under ``base`` (created; the caller removes it) a fake driver root with ELF stand-ins."""
    with simulated_nvml(spec, node_name=MACHINE_NODE) as node:
        base.mkdir(parents=True, exist_ok=True)
        gpus = [(g.spec.hardware.product_name, g.uuid) for g in node.gpus]
        libraries = None
        if shutil.which("cc") is not None:
            built = base / "elf"
            built.mkdir()
            libraries = build_libraries(
                built, gpus=gpus, memory_mib=[g.spec.hardware.memory_mib for g in node.gpus]
            )
        driver = make_fake_driver(
            base,
            gpu_minors=range(len(node.gpus)),
            library_bytes=None if libraries is None else libraries.__getitem__,
            gpu_uuids=[g.uuid for g in node.gpus],
        )
        if libraries is not None:
            smi = driver.root / "usr/bin/nvidia-smi"
            smi.unlink()
            smi.write_bytes(build_nvidia_smi(base / "elf"))
            smi.chmod(0o755)
        yield Machine(
            driver_roots=(driver.root,),
            sysfs_root=node.sysfs_root,
            proc_root=driver.proc_root,
            simulated=spec,
            only_given_roots=True,
        )


__all__ = ["MACHINE_NODE", "TWIN_NODE", "SimulatedTwins", "simulated_machine"]
