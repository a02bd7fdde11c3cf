"""The simulated node's GPUs as values: identities, MIG devices and GPU instances, the sysfs tree.

Second step of a simulated node, after the spec (spec.py): ``build_node`` gives each GPU its
node-specific identities, and ``write_sysfs`` writes the part of /sys that discovery reads for
them. UUIDs and PCI addresses are derived from the node name with SHA-256, so the same spec on
the same node always yields the same devices, and two nodes never share UUIDs. The values here
never change; what changes at run time (MIG instances, health) lives in mig.py and health.py.
"""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass
from pathlib import Path

import pynvml

from dra_driver.sim.nvml.spec import TOTAL_SLICES, SimulatedGpuSpec, SimulationSpec
from dra_driver.sim.profiles import GpuInstanceProfile


def digest(*parts: object) -> bytes:
    """SHA-256 of the parts joined by slashes: the seed of every derived identity and reading."""
    return hashlib.sha256("/".join(str(p) for p in parts).encode()).digest()


def _uuid(node_name: str, *parts: object) -> str:
    return str(uuid.UUID(bytes=digest(node_name, *parts)[:16]))


def _bus_numbers(node_name: str, count: int) -> list[int]:
    """Distinct PCI bus numbers, ascending (NVML enumerates GPUs in PCI bus order)."""
    buses: set[int] = set()
    attempt = 0
    while len(buses) < count:
        bus = digest(node_name, "bus", attempt)[0]
        if 0x10 <= bus <= 0xFE:
            buses.add(bus)
        attempt += 1
    return sorted(buses)


@dataclass(frozen=True)
class SimulatedMig:
    """A pre-created MIG device of a simulated GPU."""

    uuid: str
    gpu_instance_id: int
    compute_instance_id: int
    profile: GpuInstanceProfile
    start: int


@dataclass(frozen=True)
class SimulatedGpu:
    """A simulated GPU with its node-specific identities.

    ``migs`` is the spec's layout, the MIG devices the GPU starts with when no state file says
    otherwise; the library's ``mig.devices(gpu)`` are the ones that exist now.
    """

    index: int
    minor: int
    uuid: str
    pci_bus_id: str  # extended BDF, lowercase: "0000:1b:00.0"
    pcie_root: str  # "pci0000:17"
    numa_node: int  # what sysfs numa_node says; NO_NUMA_NODE (-1) for none
    spec: SimulatedGpuSpec
    migs: tuple[SimulatedMig, ...] = ()


@dataclass(frozen=True)
class SimulatedGpuInstance:
    """A GPU instance of a simulated GPU; each of its compute instances is one MIG device."""

    gpu_index: int
    id: int
    profile: GpuInstanceProfile
    start: int
    compute_instances: tuple[SimulatedMig, ...] = ()

    @property
    def memory_slices(self) -> frozenset[int]:
        return frozenset(range(self.start, self.start + self.profile.placement_size))


# NVML_COMPUTE_INSTANCE_PROFILE_* of the compute profile that spans a whole GPU instance, by
# the GPU instance's compute slices; real NVML gives compute profiles ids equal to their index.
_FULL_COMPUTE_PROFILE: dict[int, int] = {
    1: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE,
    2: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE,
    3: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE,
    4: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE,
    7: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE,
}


def full_compute_profile(instance: SimulatedGpuInstance) -> int:
    """The id of the one compute profile simulated: the one spanning the whole GPU instance."""
    return _FULL_COMPUTE_PROFILE[instance.profile.slice_count]


def profile_by_index(gpu: SimulatedGpu, index: int) -> GpuInstanceProfile | None:
    """The GPU's GPU-instance profile with NVML index ``index`` (NVML_GPU_INSTANCE_PROFILE_*)."""
    return next((p for p in gpu.spec.hardware.gpu_instance_profiles if p.index == index), None)


def profile_by_id(gpu: SimulatedGpu, profile_id: int) -> GpuInstanceProfile | None:
    """The GPU's GPU-instance profile with NVML profile id ``profile_id``."""
    profiles = gpu.spec.hardware.gpu_instance_profiles
    return next((p for p in profiles if p.profile_id == profile_id), None)


def mig_uuid(node_name: str, gpu_index: int, profile: GpuInstanceProfile, start: int) -> str:
    """The UUID of the MIG device at this placement; the same whenever it is created again."""
    return "MIG-" + _uuid(node_name, "mig", gpu_index, profile.profile_id, start)


def gpu_instance_id_at(start: int, size: int) -> int:
    """A GPU-instance id for an instance at this placement on an 8-slice GPU.

    In the ranges NVIDIA's ``nvidia-smi mig -lgi`` examples show (full GPU 0, halves 1-2,
    quarters 3-6, single slices 7-13). Real NVML hands ids out in creation order, so there they
    are not a function of the placement; nothing may rely on that mapping.
    """
    if size >= TOTAL_SLICES:
        return 0
    if size == 4:
        return 1 if start == 4 else 2
    if size == 2:
        return 3 + start // 2
    return 7 + start


def _default_numa_node(index: int, count: int) -> int:
    """NUMA node 0 for the first half of the root complexes (rounded up), node 1 for the rest.

    GPUs of one root complex (pairs, see build_node) always share their NUMA node, as the root
    complex belongs to one socket.
    """
    roots = (count + 1) // 2
    return 0 if index // 2 < (roots + 1) // 2 else 1


def build_node(spec: SimulationSpec, *, node_name: str) -> tuple[SimulatedGpu, ...]:
    """Give each GPU of ``spec`` its identities on ``node_name``; deterministic."""
    buses = _bus_numbers(node_name, len(spec.gpus))
    gpus = []
    for index, (gpu, bus) in enumerate(zip(spec.gpus, buses, strict=True)):
        migs = tuple(
            SimulatedMig(
                uuid=mig_uuid(node_name, index, m.profile, m.start),
                gpu_instance_id=gpu_instance_id_at(m.start, m.profile.placement_size),
                compute_instance_id=0,
                profile=m.profile,
                start=m.start,
            )
            for m in gpu.mig_instances
        )
        # Pairs of GPUs share a PCIe root complex, as behind the PCIe switches of an HGX board.
        root_bus = buses[index - index % 2] - 4
        gpus.append(
            SimulatedGpu(
                index=index,
                minor=index,
                uuid="GPU-" + _uuid(node_name, "gpu", index),
                pci_bus_id=f"0000:{bus:02x}:00.0",
                pcie_root=f"pci0000:{root_bus:02x}",
                numa_node=(
                    _default_numa_node(index, len(spec.gpus))
                    if gpu.numa_node is None
                    else gpu.numa_node
                ),
                spec=gpu,
                migs=tuple(sorted(migs, key=lambda m: m.gpu_instance_id)),
            )
        )
    return tuple(gpus)


def write_sysfs(root: Path, gpus: tuple[SimulatedGpu, ...]) -> Path:
    """Create the parts of /sys that pcieRoot and NUMA discovery read, under ``root``; return it.

    Like the kernel's tree: ``bus/pci/devices/<bdf>`` is a relative symlink into
    ``devices/pci<domain>:<bus>/<bridge>/<bdf>``, and that directory holds ``numa_node``.
    """
    links = root / "bus" / "pci" / "devices"
    links.mkdir(parents=True, exist_ok=True)
    for gpu in gpus:
        root_bus = gpu.pcie_root.removeprefix("pci")
        device = root / "devices" / gpu.pcie_root / f"{root_bus}:01.0" / gpu.pci_bus_id
        device.mkdir(parents=True, exist_ok=True)
        (device / "vendor").write_text("0x10de\n")
        (device / "device").write_text(f"0x{gpu.spec.hardware.pci_device_id >> 16:04x}\n")
        (device / "numa_node").write_text(f"{gpu.numa_node}\n")
        (links / gpu.pci_bus_id).symlink_to(Path("../../..") / device.relative_to(root))
    return root
