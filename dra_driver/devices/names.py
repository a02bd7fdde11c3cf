"""Device names and the counter and capacity names derived from them. Pure.

``gpu-<minor>`` for a whole GPU, ``gpu-<parentMinor>-mig-<profile>-<giProfileId>-<placementStart>``
for a MIG device (the same in static and dynamic MIG mode), as NVIDIA's driver names them
(nvidia-compat.md "Names"). A MIG device name is enough to find and clean up the device after a
crash (:func:`parse_mig_device_name`).
"""

from __future__ import annotations

import re

from dra_driver.errors import DeviceModelError
from dra_driver.gpus.info import GpuInfo, MigInstance

COUNTER_SET_SUFFIX = "-counter-set"
_MIG_NAME = re.compile(
    r"^gpu-(0|[1-9]\d*)-mig-([a-z0-9]+(?:-[a-z0-9]+)*)-(0|[1-9]\d*)-(0|[1-9]\d*)$"
)


def gpu_device_name(minor: int) -> str:
    """``gpu-<minor>``: the minor number survives GPU drains, the NVML index does not."""
    return f"gpu-{minor}"


def mig_profile_slug(profile: str) -> str:
    """A profile name as it appears in device names: ``1g.5gb+me`` -> ``1g5gb-me``.

    Dots removed, then anything outside ``[a-z0-9-]`` replaced by ``-``, as NVIDIA's driver does
    (toRFC1123Compliant), so names match between the two drivers.
    """
    slug = re.sub(r"[^a-z0-9-]", "-", profile.replace(".", "").lower())
    return slug.strip("-")


def mig_device_name(
    *, parent_minor: int, profile: str, profile_id: int, placement_start: int
) -> str:
    """``gpu-<parentMinor>-mig-<profile slug>-<giProfileId>-<placementStart>``."""
    slug = mig_profile_slug(profile)
    return f"gpu-{parent_minor}-mig-{slug}-{profile_id}-{placement_start}"


def parse_mig_device_name(name: str) -> tuple[int, int, int, str]:
    """(parent minor, GI profile id, placement start, profile slug) from a MIG device name.

    The inverse of ``mig_device_name``: enough to find and clean up a MIG device after a crash
    from its name alone. Raises DeviceModelError if ``name`` is not a MIG device name.
    """
    match = _MIG_NAME.match(name)
    if match is None:
        raise DeviceModelError(
            f"{name!r} is not a MIG device name "
            "(expected gpu-<parentMinor>-mig-<profile>-<giProfileId>-<placementStart>)"
        )
    parent, slug, profile_id, start = match.groups()
    return int(parent), int(profile_id), int(start), slug


def counter_set_name(minor: int) -> str:
    """``gpu-<minor>-counter-set``: the shared counter set of a partitionable GPU."""
    return f"{gpu_device_name(minor)}{COUNTER_SET_SUFFIX}"


def memory_slice_counter(index: int) -> str:
    """``memory-slice-<i>``: the counter (value 1) of one memory slice of a partitionable GPU."""
    return f"memory-slice-{index}"


def memory_slice_capacity(index: int) -> str:
    """``memorySlice<i>``: the capacity a static MIG device has for each memory slice it occupies.

    Named as NVIDIA's driver names it (in the driver's own domain, value 1), so selectors such as
    ``device.capacity['gpu.nvidia.com'].memorySlice0`` pick a placement. Not to be confused with
    the ``memory-slice-<i>`` counters of dynamic MIG, which are DNS labels.
    """
    return f"memorySlice{index}"


def mig_instance_name(gpu: GpuInfo, mig: MigInstance) -> str:
    """The device name of an existing MIG device (the same for static and dynamic MIG)."""
    return mig_device_name(
        parent_minor=gpu.minor,
        profile=mig.profile.name,
        profile_id=mig.profile.profile_id,
        placement_start=mig.placement.start,
    )
