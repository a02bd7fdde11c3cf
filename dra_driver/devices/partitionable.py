"""Dynamic MIG: a GPU in MIG mode as partitionable devices (KEP-4815). Pure.

Place in the flow: in ``--mig-mode=dynamic`` pool.py publishes a GPU in MIG mode whose MIG
devices were all created by this driver (:func:`is_partitionable`) as one counter set
``gpu-<minor>-counter-set`` and one device per GPU-instance profile and placement
(:func:`partitionable_gpu`; nvidia-compat.md "Dynamic MIG"); the scheduler's counters keep the
placements it allocates from overlapping, and mig/ creates the MIG device at prepare.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from dra_driver.devices.gpu import common_attributes, gpu_device
from dra_driver.devices.model import CounterConsumption, CounterSet, Device
from dra_driver.devices.names import (
    counter_set_name,
    gpu_device_name,
    memory_slice_capacity,
    memory_slice_counter,
    mig_device_name,
    mig_instance_name,
)
from dra_driver.errors import DeviceModelError
from dra_driver.gpus.info import GpuInfo, MigProfile
from dra_driver.quantity import binary, decimal


def unmanaged_mig_devices(gpu: GpuInfo, *, managed_mig: frozenset[str]) -> tuple[str, ...]:
    """Names of ``gpu``'s existing MIG devices that are not in ``managed_mig``, sorted."""
    return tuple(
        sorted(
            name
            for name in (mig_instance_name(gpu, m) for m in gpu.mig_instances)
            if name not in managed_mig
        )
    )


def is_partitionable(gpu: GpuInfo, *, managed_mig: frozenset[str]) -> bool:
    """Whether dynamic MIG mode publishes ``gpu`` as partitionable: it is in MIG mode, or not
    in MIG mode and able to enter it without a reset (:func:`toggles_mig_mode`: prepare of a
    placement turns MIG mode on), reports its GPU-instance profiles, and every MIG device on it
    is one this driver created. An Ampere GPU not in MIG mode stays a plain GPU."""
    return (
        (gpu.mig_enabled or toggles_mig_mode(gpu))
        and bool(gpu.mig_profiles)
        and not unmanaged_mig_devices(gpu, managed_mig=managed_mig)
    )


# MIG capacities and the counters that stand for them, named as NVIDIA's driver names them
# (camelToDNSName of the capacity name).
_COUNTER_OF_CAPACITY = {
    "multiprocessors": "multiprocessors",
    "copyEngines": "copy-engines",
    "decoders": "decoders",
    "encoders": "encoders",
    "jpegEngines": "jpeg-engines",
    "ofaEngines": "ofa-engines",
    "memory": "memory",
}


def _profile_capacities(profile: MigProfile) -> dict[str, int]:
    return {
        "multiprocessors": profile.multiprocessors,
        "copyEngines": profile.copy_engines,
        "decoders": profile.decoders,
        "encoders": profile.encoders,
        "jpegEngines": profile.jpeg_engines,
        "ofaEngines": profile.ofa_engines,
        "memory": profile.memory_bytes,
    }


def _capacity_json(capacities: Mapping[str, int]) -> dict[str, str]:
    return {
        name: binary(value) if name == "memory" else decimal(value)
        for name, value in capacities.items()
    }


_ONE = decimal(1)


def _counters(capacity: Mapping[str, str], *, start: int, size: int) -> dict[str, str]:
    """The counters standing for ``capacity`` (canonical quantities) and memory slices
    ``start`` .. ``start + size - 1``."""
    counters = {_COUNTER_OF_CAPACITY[n]: v for n, v in capacity.items()}
    counters.update({memory_slice_counter(i): _ONE for i in range(start, start + size)})
    return counters


# Architectures that leave and enter MIG mode without a GPU reset (when nothing runs on the GPU):
# NVIDIA's driver toggles MIG mode at allocation time on Hopper and newer only (A100 and A30 need
# a reset, so their MIG mode stays as the administrator set it).
MIG_TOGGLE_ARCHITECTURES = frozenset({"Hopper", "Blackwell"})


def toggles_mig_mode(gpu: GpuInfo) -> bool:
    """Whether the driver may change ``gpu``'s MIG mode (dynamic MIG): it reports MIG support
    and is Hopper or newer (architecture Hopper or Blackwell, or CUDA compute capability 9 or
    more for one NVML names no architecture we know), as NVIDIA's driver decides
    (``supportsMIGModeToggle``: architecture >= NVML_DEVICE_ARCH_HOPPER)."""
    return gpu.mig_capable and (
        gpu.architecture in MIG_TOGGLE_ARCHITECTURES or gpu.cuda_compute_capability[0] >= 9
    )


def whole_gpu_offered(gpu: GpuInfo) -> bool:
    """Whether a partitionable GPU also offers itself whole (dynamic MIG): it changes MIG mode
    without a GPU reset (:func:`toggles_mig_mode`)."""
    return toggles_mig_mode(gpu)


def partitionable_gpu(gpu: GpuInfo) -> tuple[CounterSet, tuple[Device, ...]]:
    """The counter set and devices of a GPU in dynamic MIG mode (nvidia-compat.md "Dynamic MIG").

    Counters: per capacity the largest value any of its GPU-instance profiles has, and one
    ``memory-slice-<i>`` per memory slice, up to the end of the furthest placement (NVIDIA's
    driver takes the largest placement size; both are 8 on A100, H100 and H200). Devices: every
    profile's every placement, smallest memory first, so that first fit picks the smallest
    partition that satisfies a selector. A placement device has no ``uuid`` (the MIG device
    does not exist until a claim gets it) and carries the static MIG device's ``memorySlice<i>``
    capacities too, so placement selectors work in both modes. The whole GPU comes first (the
    attributes of a GPU not in MIG mode, with its ``uuid``), consuming every counter, where
    :func:`whole_gpu_offered` says so: preparing it takes the GPU out of MIG mode, which GPUs
    before Hopper cannot do without a reset (NVIDIA's driver does not toggle them either). Its
    capacities are the counters' largest values, as NVIDIA's driver publishes them (its
    ``PartCapacities``): ``multiprocessors`` .. ``memory`` of the largest profile, so an H100's
    whole GPU has ``memory: 81152Mi`` here where a GPU not in MIG mode has ``81559Mi``.
    """
    if not gpu.mig_profiles:
        raise DeviceModelError(f"GPU {gpu_device_name(gpu.minor)} reports no MIG profiles")
    largest: dict[str, int] = {}
    slices = 0
    for profile in gpu.mig_profiles:
        for name, value in _profile_capacities(profile).items():
            largest[name] = max(largest.get(name, 0), value)
        for placement in profile.placements:
            slices = max(slices, placement.start + placement.size)
    cs_name = counter_set_name(gpu.minor)
    every = _counters(_capacity_json(largest), start=0, size=slices)
    common = common_attributes(gpu)
    devices: list[Device] = []
    if whole_gpu_offered(gpu):
        devices.append(
            replace(
                gpu_device(gpu),
                capacity=_capacity_json(largest),
                consumes_counters=(CounterConsumption(counter_set=cs_name, counters=every),),
            )
        )
    placements = sorted(
        ((profile, placement) for profile in gpu.mig_profiles for placement in profile.placements),
        key=lambda pp: (pp[0].memory_bytes, pp[0].slice_count, pp[0].profile_id, pp[1].start),
    )
    capacity_of = {id(p): _capacity_json(_profile_capacities(p)) for p in gpu.mig_profiles}
    for profile, placement in placements:
        capacity = capacity_of[id(profile)]
        devices.append(
            Device(
                name=mig_device_name(
                    parent_minor=gpu.minor,
                    profile=profile.name,
                    profile_id=profile.profile_id,
                    placement_start=placement.start,
                ),
                attributes={
                    "type": "mig",
                    "parentUUID": gpu.uuid,
                    "profile": profile.name,
                    **common,
                },
                capacity={
                    **capacity,
                    **{
                        memory_slice_capacity(i): _ONE
                        for i in range(placement.start, placement.start + placement.size)
                    },
                },
                consumes_counters=(
                    CounterConsumption(
                        counter_set=cs_name,
                        counters=_counters(capacity, start=placement.start, size=placement.size),
                    ),
                ),
            )
        )
    return CounterSet(name=cs_name, counters=every), tuple(devices)
