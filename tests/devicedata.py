"""GPU facts for the device model tests: an H100, and the same H100 in MIG mode."""

from __future__ import annotations

import dataclasses

from dra_driver.gpus.info import GpuInfo, MigInstance, MigPlacement, MigProfile

DRIVER = "gpu.nvidia.com"
MIB = 1024 * 1024

H100 = GpuInfo(
    index=0,
    minor=3,
    uuid="GPU-8f2c1d7e-0b1a-4c55-9e3d-2a6f0c9b7d41",
    product_name="NVIDIA H100 80GB HBM3",
    brand="Nvidia",
    architecture="Hopper",
    cuda_compute_capability=(9, 0),
    memory_bytes=81559 * MIB,
    pci_bus_id="0000:1b:00.0",
    pcie_root="pci0000:15",
    driver_version="570.124.06",
    cuda_driver_version=12080,
    mig_capable=True,
    mig_enabled=False,
    mig_pending=False,
    numa_node=1,
)

PROFILE_1G_ME = MigProfile(
    profile_id=20,
    name="1g.10gb+me",
    slice_count=1,
    memory_bytes=9984 * MIB,
    multiprocessors=16,
    copy_engines=1,
    decoders=1,
    encoders=0,
    jpeg_engines=1,
    ofa_engines=1,
    instance_count=1,
    placements=tuple(MigPlacement(start=s, size=1) for s in range(7)),
)
PROFILE_3G = MigProfile(
    profile_id=9,
    name="3g.40gb",
    slice_count=3,
    memory_bytes=40448 * MIB,
    multiprocessors=60,
    copy_engines=3,
    decoders=3,
    encoders=0,
    jpeg_engines=3,
    ofa_engines=0,
    instance_count=2,
    placements=(MigPlacement(start=0, size=4), MigPlacement(start=4, size=4)),
)


def mig_instance(profile: MigProfile, start: int, gi: int) -> MigInstance:
    return MigInstance(
        uuid=f"MIG-00000000-0000-4000-8000-0000000000{gi:02d}",
        gpu_instance_id=gi,
        compute_instance_id=0,
        profile=profile,
        placement=MigPlacement(start=start, size=profile.placements[0].size),
        memory_bytes=profile.memory_bytes,
        multiprocessors=profile.multiprocessors,
    )


H100_MIG = dataclasses.replace(
    H100,
    minor=1,
    mig_enabled=True,
    mig_pending=True,
    mig_profiles=(PROFILE_1G_ME, PROFILE_3G),
    mig_instances=(mig_instance(PROFILE_3G, 4, 1), mig_instance(PROFILE_1G_ME, 0, 7)),
)
