"""Simulated MIG instance management: GPU and compute instances created and destroyed through
pynvml, with NVML's placement rules and return codes, seen by discovery, kept in a state file."""

from __future__ import annotations

import ctypes
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pynvml
import pytest

from dra_driver.gpus import nvml
from dra_driver.gpus.info import Inventory
from dra_driver.sim.nvml import SimulatedNode, discover_simulated, simulated_nvml
from dra_driver.sim.profiles import HARDWARE_PROFILES

A100 = HARDWARE_PROFILES["a100-40gb"]
ID = {p.name: p.profile_id for p in A100.gpu_instance_profiles}  # e.g. "3g.20gb" -> 9
CI_FULL = {1: 0, 2: 1, 3: 2, 4: 3, 7: 4}  # full compute profile by compute slices


@contextmanager
def gpu0(spec: str = "a100-40gb:1:mig", **kwargs: Any) -> Iterator[tuple[SimulatedNode, Any]]:
    """A simulated node with NVML initialised, and the handle of its GPU 0."""
    with simulated_nvml(spec, node_name="n", **kwargs) as node:
        pynvml.nvmlInit()
        try:
            yield node, pynvml.nvmlDeviceGetHandleByIndex(0)
        finally:
            pynvml.nvmlShutdown()


def create_gi(handle: Any, name: str, start: int) -> Any:
    placement = pynvml.c_nvmlGpuInstancePlacement_t()
    placement.start = start
    placement.size = A100.gpu_instance_profile(name).placement_size  # type: ignore[union-attr]
    return pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(
        handle, ID[name], ctypes.byref(placement)
    )


def create_ci(gpu_instance: Any) -> Any:
    info = pynvml.nvmlGpuInstanceGetInfo(gpu_instance)
    slices = next(
        p.slice_count for p in A100.gpu_instance_profiles if p.profile_id == info.profileId
    )
    profile = pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
        gpu_instance, CI_FULL[slices], pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
    )
    return pynvml.nvmlGpuInstanceCreateComputeInstance(gpu_instance, profile.id)


def gpu_instances(handle: Any, name: str) -> list[tuple[int, int]]:
    """(id, start) of the profile's GPU instances, through nvmlDeviceGetGpuInstances."""
    array = (pynvml.c_nvmlGpuInstance_t * 8)()
    count = ctypes.c_uint()
    pynvml.nvmlDeviceGetGpuInstances(handle, ID[name], array, ctypes.byref(count))
    infos = [pynvml.nvmlGpuInstanceGetInfo(array[i]) for i in range(count.value)]
    return [(info.id, info.placement.start) for info in infos]


def remaining(handle: Any) -> dict[str, int]:
    return {
        name: pynvml.nvmlDeviceGetGpuInstanceRemainingCapacity(handle, pid)
        for name, pid in ID.items()
    }


def discover(node: SimulatedNode) -> Inventory:
    return nvml.discover(driver_root=Path("/"), sysfs_root=node.sysfs_root)


@pytest.mark.parametrize("profile", A100.gpu_instance_profiles, ids=lambda p: p.name)
def test_a_gpu_instance_can_be_created_at_each_placement_of_its_profile(profile: Any) -> None:
    with gpu0() as (_, handle):
        for start in profile.placement_starts:
            gi = create_gi(handle, profile.name, start)
            info = pynvml.nvmlGpuInstanceGetInfo(gi)

            assert (info.profileId, info.placement.start) == (profile.profile_id, start)
            assert info.placement.size == profile.placement_size
            assert pynvml.nvmlDeviceGetGpuInstanceById(handle, info.id).contents is not None
            pynvml.nvmlGpuInstanceDestroy(gi)


def test_gpu_instance_ids_are_those_the_spec_layout_assigns() -> None:
    with gpu0() as (_, handle):
        for name, start in (("3g.20gb", 4), ("2g.10gb", 0), ("1g.5gb", 2), ("1g.5gb", 3)):
            create_gi(handle, name, start)
        created = {n: gpu_instances(handle, n) for n in ("3g.20gb", "2g.10gb", "1g.5gb")}
    with gpu0("a100-40gb:1:mig=3g.20gb+2g.10gb+1g.5gb*2") as (_, handle):
        laid_out = {n: gpu_instances(handle, n) for n in ("3g.20gb", "2g.10gb", "1g.5gb")}

    assert (
        created
        == laid_out
        == {"3g.20gb": [(1, 4)], "2g.10gb": [(3, 0)], "1g.5gb": [(9, 2), (10, 3)]}
    )


def test_without_a_placement_the_first_free_one_in_the_profiles_table_is_taken() -> None:
    with gpu0() as (_, handle):
        create_gi(handle, "1g.5gb", 0)
        pynvml.nvmlDeviceCreateGpuInstance(handle, ID["3g.20gb"])
        pynvml.nvmlDeviceCreateGpuInstance(handle, ID["1g.5gb"])

        assert gpu_instances(handle, "3g.20gb") == [(1, 4)]
        assert gpu_instances(handle, "1g.5gb") == [(7, 0), (8, 1)]


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (("4g.20gb", 0), ("3g.20gb", 0)),
        (("4g.20gb", 0), ("1g.5gb", 3)),
        (("3g.20gb", 4), ("2g.10gb", 4)),
        (("1g.5gb", 6), ("1g.10gb", 6)),
        (("7g.40gb", 0), ("1g.5gb", 6)),
    ],
)
def test_an_overlapping_placement_is_insufficient_resources(
    first: tuple[str, int], second: tuple[str, int]
) -> None:
    with gpu0() as (_, handle):
        create_gi(handle, *first)

        with pytest.raises(pynvml.NVMLError_InsufficientResources):
            create_gi(handle, *second)


def test_a_second_media_engine_instance_is_insufficient_resources() -> None:
    with gpu0() as (_, handle):
        create_gi(handle, "1g.5gb+me", 0)

        with pytest.raises(pynvml.NVMLError_InsufficientResources):
            create_gi(handle, "1g.5gb+me", 1)


def test_a_full_gpu_is_insufficient_resources_for_creation_without_a_placement() -> None:
    with gpu0() as (_, handle):
        for _ in range(7):
            pynvml.nvmlDeviceCreateGpuInstance(handle, ID["1g.5gb"])

        with pytest.raises(pynvml.NVMLError_InsufficientResources):
            pynvml.nvmlDeviceCreateGpuInstance(handle, ID["1g.5gb"])


@pytest.mark.parametrize(
    ("name", "start", "size"),
    [("3g.20gb", 2, 4), ("2g.10gb", 1, 2), ("1g.5gb", 7, 1), ("3g.20gb", 0, 3)],
)
def test_a_placement_outside_the_profiles_table_is_invalid_argument(
    name: str, start: int, size: int
) -> None:
    placement = pynvml.c_nvmlGpuInstancePlacement_t()
    placement.start, placement.size = start, size
    with gpu0() as (_, handle), pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(handle, ID[name], ctypes.byref(placement))


def test_an_unknown_profile_id_is_invalid_argument() -> None:
    with gpu0() as (_, handle), pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceCreateGpuInstance(handle, 1)


def test_a_gpu_instance_with_a_compute_instance_is_in_use_until_that_is_destroyed() -> None:
    with gpu0() as (_, handle):
        gi = create_gi(handle, "3g.20gb", 0)
        ci = create_ci(gi)

        with pytest.raises(pynvml.NVMLError_InUse):
            pynvml.nvmlGpuInstanceDestroy(gi)
        pynvml.nvmlComputeInstanceDestroy(ci)
        pynvml.nvmlGpuInstanceDestroy(gi)

        assert gpu_instances(handle, "3g.20gb") == []
        with pytest.raises(pynvml.NVMLError_InvalidArgument):  # the handle died with it
            pynvml.nvmlGpuInstanceGetInfo(gi)


def test_compute_instances_are_listed_and_described() -> None:
    with gpu0() as (_, handle):
        gi = create_gi(handle, "2g.10gb", 2)
        ci = create_ci(gi)
        array = (pynvml.c_nvmlComputeInstance_t * 2)()
        count = ctypes.c_uint()
        pynvml.nvmlGpuInstanceGetComputeInstances(gi, CI_FULL[2], array, ctypes.byref(count))
        info = pynvml.nvmlComputeInstanceGetInfo(array[0])
        left = pynvml.nvmlGpuInstanceGetComputeInstanceRemainingCapacity(gi, CI_FULL[2])

        assert count.value == 1
        assert ctypes.addressof(array[0].contents) == ctypes.addressof(ci.contents)
        assert (info.id, info.profileId, info.placement.start, info.placement.size) == (0, 1, 0, 2)
        assert pynvml.nvmlGpuInstanceGetInfo(info.gpuInstance).id == 4
        assert left == 0
        with pytest.raises(pynvml.NVMLError_InsufficientResources):
            pynvml.nvmlGpuInstanceCreateComputeInstance(gi, CI_FULL[2])


def test_compute_profiles_smaller_than_the_gpu_instance_are_not_supported() -> None:
    with gpu0() as (_, handle):
        gi = create_gi(handle, "3g.20gb", 0)

        with pytest.raises(pynvml.NVMLError_NotSupported):
            pynvml.nvmlGpuInstanceCreateComputeInstance(gi, CI_FULL[1])


def test_with_mig_mode_off_instance_management_is_not_supported() -> None:
    with gpu0("a100-40gb:1") as (_, handle):
        for call in (
            lambda: pynvml.nvmlDeviceCreateGpuInstance(handle, ID["1g.5gb"]),
            lambda: create_gi(handle, "1g.5gb", 0),
            lambda: gpu_instances(handle, "1g.5gb"),
        ):
            with pytest.raises(pynvml.NVMLError_NotSupported):
                call()


def test_with_mig_mode_off_the_remaining_capacity_is_every_profiles_full_count() -> None:
    # as a real H200 with MIG off answered (tests/data/real/nvidia-h200.json)
    with gpu0("a100-40gb:1") as (_, handle):
        counts = remaining(handle)
    assert counts == {p.name: p.instance_count for p in A100.gpu_instance_profiles}


def test_a_gpu_without_mig_has_no_remaining_capacity() -> None:
    with gpu0("l4:1") as (_, handle), pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetGpuInstanceRemainingCapacity(handle, ID["1g.5gb"])


def test_remaining_capacity_counts_what_still_fits() -> None:
    with gpu0() as (_, handle):
        empty = remaining(handle)
        create_gi(handle, "3g.20gb", 4)
        with_3g = remaining(handle)
        create_gi(handle, "1g.5gb", 0)
        with_1g = remaining(handle)
        create_gi(handle, "2g.10gb", 2)
        full = remaining(handle)

    assert empty == {
        "1g.5gb": 7,
        "1g.5gb+me": 1,
        "1g.10gb": 4,
        "2g.10gb": 3,
        "3g.20gb": 2,
        "4g.20gb": 1,
        "7g.40gb": 1,
    }
    assert with_3g == {**empty, "1g.5gb": 4, "1g.10gb": 2, "2g.10gb": 2, "3g.20gb": 1, "7g.40gb": 0}
    assert with_1g == {
        **with_3g,
        "1g.5gb": 3,
        "1g.10gb": 1,
        "2g.10gb": 1,
        "3g.20gb": 0,
        "4g.20gb": 0,
    }
    assert full == {
        **with_1g,
        "1g.5gb": 1,
        "1g.5gb+me": 1,
        "1g.10gb": 0,
        "2g.10gb": 0,
        "3g.20gb": 0,
    }


def test_discovery_sees_a_created_mig_device_as_if_the_spec_had_laid_it_out() -> None:
    laid_out = discover_simulated("a100-40gb:1:mig=3g.20gb+1g.5gb", node_name="n")
    with gpu0() as (node, handle):
        gi_only = create_gi(handle, "1g.5gb", 4)
        before_ci = discover(node)
        create_ci(gi_only)
        create_ci(create_gi(handle, "3g.20gb", 0))
        created = discover(node)

    assert before_ci.gpus[0].mig_instances == ()  # a GPU instance alone is no MIG device
    assert created.gpus[0].mig_instances == laid_out.gpus[0].mig_instances
    (three_g, one_g) = created.gpus[0].mig_instances
    assert (three_g.profile.name, three_g.placement.start, three_g.gpu_instance_id) == (
        "3g.20gb",
        0,
        2,
    )
    assert (one_g.profile.name, one_g.placement.start, one_g.memory_bytes) == (
        "1g.5gb",
        4,
        4864 << 20,
    )


def test_a_destroyed_mig_device_is_gone_from_discovery_and_its_handle_invalid() -> None:
    with gpu0("a100-40gb:1:mig=3g.20gb+2g.10gb") as (node, handle):
        before = [m.uuid for m in discover(node).gpus[0].mig_instances]
        first = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, 0)  # the 3g (id 2)
        gi = pynvml.nvmlDeviceGetGpuInstanceById(handle, 2)
        array = (pynvml.c_nvmlComputeInstance_t * 1)()
        count = ctypes.c_uint()
        pynvml.nvmlGpuInstanceGetComputeInstances(gi, CI_FULL[3], array, ctypes.byref(count))
        pynvml.nvmlComputeInstanceDestroy(array[0])
        pynvml.nvmlGpuInstanceDestroy(gi)
        after = [m.uuid for m in discover(node).gpus[0].mig_instances]
        remaining_handle = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, 0)

        assert after == before[1:]
        assert pynvml.nvmlDeviceGetUUID(remaining_handle) == before[1]
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            pynvml.nvmlDeviceGetUUID(first)
        with pytest.raises(pynvml.NVMLError_NotFound):
            pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, 1)


def test_instances_persist_in_the_state_file_across_two_opens(tmp_path: Path) -> None:
    state = tmp_path / "sim" / "mig.json"
    with gpu0("a100-40gb:1:mig=7g.40gb", state_path=state) as (node, handle):
        assert not state.exists()  # the spec's layout until something changes
        gi = pynvml.nvmlDeviceGetGpuInstanceById(handle, 0)
        array = (pynvml.c_nvmlComputeInstance_t * 1)()
        count = ctypes.c_uint()
        pynvml.nvmlGpuInstanceGetComputeInstances(gi, CI_FULL[7], array, ctypes.byref(count))
        pynvml.nvmlComputeInstanceDestroy(array[0])
        pynvml.nvmlGpuInstanceDestroy(gi)
        create_ci(create_gi(handle, "2g.10gb", 4))
        create_gi(handle, "1g.5gb", 0)
        first = discover(node).gpus[0].mig_instances

    with gpu0("a100-40gb:1:mig=7g.40gb", state_path=state) as (node, handle):
        second = discover(node).gpus[0].mig_instances
        one_g = gpu_instances(handle, "1g.5gb")

    assert [(m.profile.name, m.placement.start) for m in second] == [("2g.10gb", 4)]
    assert second == first
    assert one_g == [(7, 0)]  # the GPU instance without a compute instance too
    recorded = json.loads(state.read_text())
    assert recorded["version"] == 1
    assert sorted(
        (gi["profile_id"], gi["start"], len(gi["compute_instances"]))
        for gi in recorded["gpus"][node.gpus[0].uuid]
    ) == [(14, 4, 1), (19, 0, 0)]
    assert [p.name for p in state.parent.iterdir()] == ["mig.json"]  # no temporary files left


def test_concurrent_creations_never_share_a_placement() -> None:
    results: list[int] = []
    with gpu0() as (_, handle):

        def create() -> None:
            try:
                gi = pynvml.nvmlDeviceCreateGpuInstance(handle, ID["1g.5gb"])
                results.append(pynvml.nvmlGpuInstanceGetInfo(gi).placement.start)
            except pynvml.NVMLError_InsufficientResources:
                results.append(-1)

        threads = [threading.Thread(target=create) for _ in range(10)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    assert sorted(results) == [-1, -1, -1, 0, 1, 2, 3, 4, 5, 6]
