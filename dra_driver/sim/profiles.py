"""Hardware profiles of real NVIDIA GPUs, as NVML reports them: the data simulated GPUs serve.

Pure data, read by sim/nvml (which answers NVML calls from it) and by tests. Every number
is what the NVML C library returns on that product: ``nvmlDeviceGetName``, total memory in MiB
(``nvmlDeviceGetMemoryInfo``), and per GPU-instance profile the fields of
``nvmlGpuInstanceProfileInfo_v2`` plus ``nvmlDeviceGetGpuInstancePossiblePlacements``.

Sources (read 2026-05; no code copied):

* NVIDIA Multi-Instance GPU User Guide, "Supported MIG Profiles"
  (docs.nvidia.com/datacenter/tesla/mig-user-guide/supported-mig-profiles.html): profile names,
  instance counts, copy engines, NVDEC/JPEG/OFA per profile for A100, H100 80GB, H200 141GB.
* Same guide, "Getting Started with MIG": ``nvidia-smi mig -lgipp`` placement tables
  ({0..6}:1 for ids 19/20, {0,2,4,6}:2 for 15, {0,2,4}:2 for 14, {0,4}:4 for 9, {0}:4 for 5,
  {0}:8 for 0) and ``-lgi`` outputs showing which GPU-instance ids NVML hands out per placement.
* ``nvidia-smi mig -lgip`` outputs (memory in GiB with two decimals, SM/CE/DEC/ENC/JPEG/OFA):
  H100 80GB HBM3 SXM5 (several public write-ups, e.g. jbarrow.ai field notes on MIG, 132 SMs);
  H200 141GB in github.com/NVIDIA/mig-parted issue 120 (its memory 256 MiB short for five
  profiles: corrected from the real run below); A100 80GB in public MIG tutorials
  (driver 515; the 1g.20gb row, added in R525, from a second write-up); A100-SXM4-40GB figures
  from the MIG user guide table plus an ``nvidia-smi`` MIG device listing (2g.10gb = 9856 MiB,
  28 SMs, 2 CE, 1 DEC).
* ``nvidia-smi`` / ``nvidia-smi -q`` outputs for total memory and names: A100-SXM4-40GB 40960 MiB,
  A100-SXM4-80GB 81920 MiB, H100 80GB HBM3 81559 MiB, H200 143771 MiB, L4 23034 MiB, Tesla T4
  15360 MiB (Product Brand "NVIDIA", architecture Turing).
* A real ``gpu-dra gpu-check`` run on an NVIDIA H200 (driver 580.159.04, MIG off), committed as
  tests/data/real/nvidia-h200.json: every H200 figure here is what that GPU answered, and
  tests/test_gpucheck_real.py holds the profile to it.
* go-nvml's mock GPUs (github.com/NVIDIA/go-nvml pkg/nvml/mock) for the PCI device ids and the
  brand/architecture constants used for datacenter parts.

NVML reports memory in MiB; ``nvidia-smi`` prints GiB rounded to two decimals, so 9.62 GiB is
9856 MiB and 19.62 GiB is 20096 MiB. Profile names follow from memory exactly as NVIDIA's go-nvlib
derives them (checked by the tests), so a wrong memory figure shows up as a wrong name.
"""

from __future__ import annotations

from dataclasses import dataclass

# NVML constants (nvml.h); spelled out here so this module stays pure data.
BRAND_NVIDIA = 14
ARCH_PASCAL = 4
ARCH_TURING = 6
ARCH_AMPERE = 7
ARCH_ADA = 8
ARCH_HOPPER = 9

# NVML_GPU_INSTANCE_PROFILE_* indices (what nvmlDeviceGetGpuInstanceProfileInfoV takes), as
# opposed to the profile *ids* (19, 20, 15, ...) that the returned info carries.
PROFILE_1_SLICE = 0x0
PROFILE_2_SLICE = 0x1
PROFILE_3_SLICE = 0x2
PROFILE_4_SLICE = 0x3
PROFILE_7_SLICE = 0x4
PROFILE_1_SLICE_REV1 = 0x7  # 1g with media extensions (+me)
PROFILE_1_SLICE_REV2 = 0x9  # 1g with two memory slices (1g.10gb on A100-40GB)


@dataclass(frozen=True)
class GpuInstanceProfile:
    """One GPU-instance profile of a product: nvmlGpuInstanceProfileInfo_v2 and its placements."""

    index: int  # NVML_GPU_INSTANCE_PROFILE_* constant
    profile_id: int
    name: str  # as nvidia-smi prints it, without the "MIG " prefix
    slice_count: int  # compute slices
    instance_count: int
    multiprocessors: int
    copy_engines: int
    decoders: int
    encoders: int
    jpeg_engines: int
    ofa_engines: int
    memory_mib: int
    placement_starts: tuple[int, ...]
    placement_size: int  # memory slices one instance covers


@dataclass(frozen=True)
class HardwareProfile:
    """One GPU product as NVML describes it."""

    key: str  # the name used in --simulate specs
    product_name: str
    brand: int  # NVML_BRAND_*
    architecture: int  # NVML_DEVICE_ARCH_*
    cuda_compute_capability: tuple[int, int]
    memory_mib: int
    pci_device_id: int  # nvmlPciInfo_t.pciDeviceId: device id << 16 | vendor 0x10de
    gpu_instance_profiles: tuple[GpuInstanceProfile, ...] = ()

    @property
    def mig_capable(self) -> bool:
        return bool(self.gpu_instance_profiles)

    def gpu_instance_profile(self, name: str) -> GpuInstanceProfile | None:
        for profile in self.gpu_instance_profiles:
            if profile.name == name:
                return profile
        return None


_ALL_1G = (0, 1, 2, 3, 4, 5, 6)


def _table(
    rows: tuple[tuple[int, int, str, int, int, int, int, int, int, int, int, int], ...],
) -> tuple[GpuInstanceProfile, ...]:
    """Build profiles from (index, id, name, slices, instances, SMs, CE, DEC, ENC, JPEG, OFA, MiB).

    Placements are the same on A100, H100 and H200 (the 8-slice memory layout), so they are
    derived from the profile id rather than repeated per product.
    """
    placements = {
        19: (_ALL_1G, 1),
        20: (_ALL_1G, 1),
        15: ((0, 2, 4, 6), 2),
        14: ((0, 2, 4), 2),
        9: ((0, 4), 4),
        5: ((0,), 4),
        0: ((0,), 8),
    }
    profiles = []
    for index, pid, name, slices, count, sms, ce, dec, enc, jpeg, ofa, mib in rows:
        starts, size = placements[pid]
        profiles.append(
            GpuInstanceProfile(
                index=index,
                profile_id=pid,
                name=name,
                slice_count=slices,
                instance_count=count,
                multiprocessors=sms,
                copy_engines=ce,
                decoders=dec,
                encoders=enc,
                jpeg_engines=jpeg,
                ofa_engines=ofa,
                memory_mib=mib,
                placement_starts=starts,
                placement_size=size,
            )
        )
    return tuple(profiles)


A100_SXM4_40GB = HardwareProfile(
    key="a100-40gb",
    product_name="NVIDIA A100-SXM4-40GB",
    brand=BRAND_NVIDIA,
    architecture=ARCH_AMPERE,
    cuda_compute_capability=(8, 0),
    memory_mib=40960,
    pci_device_id=0x20B010DE,
    gpu_instance_profiles=_table(
        (
            (PROFILE_1_SLICE, 19, "1g.5gb", 1, 7, 14, 1, 0, 0, 0, 0, 4864),
            (PROFILE_1_SLICE_REV1, 20, "1g.5gb+me", 1, 1, 14, 1, 1, 0, 1, 1, 4864),
            (PROFILE_1_SLICE_REV2, 15, "1g.10gb", 1, 4, 14, 1, 1, 0, 0, 0, 9856),
            (PROFILE_2_SLICE, 14, "2g.10gb", 2, 3, 28, 2, 1, 0, 0, 0, 9856),
            (PROFILE_3_SLICE, 9, "3g.20gb", 3, 2, 42, 3, 2, 0, 0, 0, 19968),
            (PROFILE_4_SLICE, 5, "4g.20gb", 4, 1, 56, 4, 2, 0, 0, 0, 19968),
            (PROFILE_7_SLICE, 0, "7g.40gb", 7, 1, 98, 7, 5, 0, 1, 1, 40192),
        )
    ),
)

A100_SXM4_80GB = HardwareProfile(
    key="a100-80gb",
    product_name="NVIDIA A100-SXM4-80GB",
    brand=BRAND_NVIDIA,
    architecture=ARCH_AMPERE,
    cuda_compute_capability=(8, 0),
    memory_mib=81920,
    pci_device_id=0x20B210DE,
    gpu_instance_profiles=_table(
        (
            (PROFILE_1_SLICE, 19, "1g.10gb", 1, 7, 14, 1, 0, 0, 0, 0, 9728),
            (PROFILE_1_SLICE_REV1, 20, "1g.10gb+me", 1, 1, 14, 1, 1, 0, 1, 1, 9728),
            (PROFILE_1_SLICE_REV2, 15, "1g.20gb", 1, 4, 14, 1, 1, 0, 0, 0, 19968),
            (PROFILE_2_SLICE, 14, "2g.20gb", 2, 3, 28, 2, 1, 0, 0, 0, 19968),
            (PROFILE_3_SLICE, 9, "3g.40gb", 3, 2, 42, 3, 2, 0, 0, 0, 40192),
            (PROFILE_4_SLICE, 5, "4g.40gb", 4, 1, 56, 4, 2, 0, 0, 0, 40192),
            (PROFILE_7_SLICE, 0, "7g.80gb", 7, 1, 98, 7, 5, 0, 1, 1, 80896),
        )
    ),
)

H100_80GB_HBM3 = HardwareProfile(
    key="h100-80gb",
    product_name="NVIDIA H100 80GB HBM3",
    brand=BRAND_NVIDIA,
    architecture=ARCH_HOPPER,
    cuda_compute_capability=(9, 0),
    memory_mib=81559,
    pci_device_id=0x233010DE,
    gpu_instance_profiles=_table(
        (
            (PROFILE_1_SLICE, 19, "1g.10gb", 1, 7, 16, 1, 1, 0, 1, 0, 9984),
            (PROFILE_1_SLICE_REV1, 20, "1g.10gb+me", 1, 1, 16, 1, 1, 0, 1, 1, 9984),
            (PROFILE_1_SLICE_REV2, 15, "1g.20gb", 1, 4, 26, 1, 1, 0, 1, 0, 20096),
            (PROFILE_2_SLICE, 14, "2g.20gb", 2, 3, 32, 2, 2, 0, 2, 0, 20096),
            (PROFILE_3_SLICE, 9, "3g.40gb", 3, 2, 60, 3, 3, 0, 3, 0, 40448),
            (PROFILE_4_SLICE, 5, "4g.40gb", 4, 1, 64, 4, 4, 0, 4, 0, 40448),
            (PROFILE_7_SLICE, 0, "7g.80gb", 7, 1, 132, 8, 7, 0, 7, 1, 81152),
        )
    ),
)

H200_141GB = HardwareProfile(
    key="h200-141gb",
    product_name="NVIDIA H200",
    brand=BRAND_NVIDIA,
    architecture=ARCH_HOPPER,
    cuda_compute_capability=(9, 0),
    memory_mib=143771,
    pci_device_id=0x233510DE,
    gpu_instance_profiles=_table(
        (
            (PROFILE_1_SLICE, 19, "1g.18gb", 1, 7, 16, 1, 1, 0, 1, 0, 16384),
            (PROFILE_1_SLICE_REV1, 20, "1g.18gb+me", 1, 1, 16, 1, 1, 0, 1, 1, 16384),
            (PROFILE_1_SLICE_REV2, 15, "1g.35gb", 1, 4, 26, 1, 1, 0, 1, 0, 33280),
            (PROFILE_2_SLICE, 14, "2g.35gb", 2, 3, 32, 2, 2, 0, 2, 0, 33280),
            (PROFILE_3_SLICE, 9, "3g.71gb", 3, 2, 60, 3, 3, 0, 3, 0, 71424),
            (PROFILE_4_SLICE, 5, "4g.71gb", 4, 1, 64, 4, 4, 0, 4, 0, 71424),
            (PROFILE_7_SLICE, 0, "7g.141gb", 7, 1, 132, 8, 7, 0, 7, 1, 143360),
        )
    ),
)

L4 = HardwareProfile(
    key="l4",
    product_name="NVIDIA L4",
    brand=BRAND_NVIDIA,
    architecture=ARCH_ADA,
    cuda_compute_capability=(8, 9),
    memory_mib=23034,
    pci_device_id=0x27B810DE,
)

T4 = HardwareProfile(
    key="t4",
    product_name="Tesla T4",
    brand=BRAND_NVIDIA,
    architecture=ARCH_TURING,
    cuda_compute_capability=(7, 5),
    memory_mib=15360,
    pci_device_id=0x1EB810DE,
)

# A pre-Volta GPU (compute capability 6.0): what MPS multi-user mode refuses.
P100 = HardwareProfile(
    key="p100",
    product_name="Tesla P100-PCIE-16GB",
    brand=BRAND_NVIDIA,
    architecture=ARCH_PASCAL,
    cuda_compute_capability=(6, 0),
    memory_mib=16280,
    pci_device_id=0x15F810DE,
)

HARDWARE_PROFILES: dict[str, HardwareProfile] = {
    p.key: p for p in (A100_SXM4_40GB, A100_SXM4_80GB, H100_80GB_HBM3, H200_141GB, L4, T4, P100)
}
"""Every simulated product by spec key."""

ALIASES: dict[str, str] = {"h100": "h100-80gb", "h200": "h200-141gb"}
"""Short spec names; A100 has none because its two memory sizes have different MIG profiles."""

MEMORY_RESERVED_MIB = 614
"""Device memory the driver reserves on a whole GPU (``nvmlMemory_v2_t.reserved``): what a real
H200 showed (with 20 GB allocated, ``nvmlDeviceGetMemoryInfo`` counted 20699 MiB used, nvidia-smi
on ``nvmlDeviceGetMemoryInfo_v2`` 20085 MiB). The other products are not measured and reuse it."""

DRIVER_VERSION = "570.124.06"
"""What nvmlSystemGetDriverVersion returns on simulated nodes (an R570 production driver)."""

CUDA_DRIVER_VERSION = 12080
"""What nvmlSystemGetCudaDriverVersion returns with that driver (CUDA 12.8)."""


def hardware_profile(key: str) -> HardwareProfile | None:
    """The profile for a spec key or alias (case-insensitive), or None if unknown."""
    key = key.lower()
    return HARDWARE_PROFILES.get(ALIASES.get(key, key))


def known_keys() -> list[str]:
    """Spec keys and aliases, for error messages."""
    return sorted([*HARDWARE_PROFILES, *ALIASES])
