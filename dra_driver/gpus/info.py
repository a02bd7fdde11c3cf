"""What discovery reports about the node's GPUs: plain frozen values, no NVML types.

These are the facts devices/ turns into DRA devices and prepare/cdi.py use to build container
edits. Memory is in bytes, versions are as NVML reports them (normalised later, in devices/).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MigPlacement:
    """Where a GPU instance sits: its first memory slice and how many slices it spans."""

    start: int
    size: int


@dataclass(frozen=True)
class MigProfile:
    """A GPU-instance profile as NVML describes it (nvmlGpuInstanceProfileInfo_v2/v3)."""

    profile_id: int  # NVML GPU-instance profile id (nvmlGpuInstanceProfileInfo.id), e.g. 19
    name: str  # e.g. "1g.10gb", "1g.10gb+me", "3g.40gb"
    slice_count: int
    memory_bytes: int
    multiprocessors: int
    copy_engines: int
    decoders: int
    encoders: int
    jpeg_engines: int
    ofa_engines: int
    instance_count: int  # how many of this profile fit on the GPU at once
    placements: tuple[
        MigPlacement, ...
    ]  # every possible placement (nvmlDeviceGetGpuInstancePossiblePlacements)


@dataclass(frozen=True)
class MigInstance:
    """A MIG device that exists now (a GPU instance with its compute instance)."""

    uuid: str  # "MIG-..."
    gpu_instance_id: int
    compute_instance_id: int
    profile: MigProfile
    placement: MigPlacement
    memory_bytes: int
    multiprocessors: int


@dataclass(frozen=True)
class GpuInfo:
    """One physical GPU."""

    index: int  # NVML index (not stable across drains; never published)
    minor: int  # /dev/nvidia<minor>; names the device (gpu-<minor>)
    uuid: str  # "GPU-..."
    product_name: str  # nvmlDeviceGetName, e.g. "NVIDIA H100 80GB HBM3"
    brand: str  # spelled as NVIDIA's driver spells the NVML brand, e.g. "Nvidia", "Tesla"
    architecture: str  # e.g. "Ampere", "Hopper"
    cuda_compute_capability: tuple[int, int]  # (major, minor)
    memory_bytes: int
    pci_bus_id: str  # extended BDF, lowercase: "0000:1b:00.0"
    pcie_root: str | None  # "pci0000:00" from sysfs, None when unknown
    driver_version: str  # raw NVML string, e.g. "570.124.06"
    cuda_driver_version: int  # raw NVML int, e.g. 12080
    mig_capable: bool
    mig_enabled: bool  # current MIG mode
    mig_pending: bool  # pending MIG mode (applies after a GPU reset)
    mig_profiles: tuple[MigProfile, ...] = ()  # GPU-instance profiles this GPU supports
    mig_instances: tuple[MigInstance, ...] = ()  # MIG devices that exist now
    addressing_mode: str | None = None  # "HMM" or "ATS" on coherent-memory platforms
    numa_node: int | None = None  # sysfs numa_node of the PCI device; None when there is none


@dataclass(frozen=True)
class GpuFailure:
    """A GPU that NVML lists but that could not be queried; logged, not published."""

    index: int
    error: str


@dataclass(frozen=True)
class Inventory:
    """The result of one discovery pass over the node."""

    gpus: tuple[GpuInfo, ...]
    failures: tuple[GpuFailure, ...] = ()
