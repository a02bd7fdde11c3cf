"""Simulated MIG mode: nvmlDeviceSetMigMode through pynvml and through MigManager, with the
return codes NVML gives on Ampere and Hopper, seen by discovery, kept in the state file."""

from __future__ import annotations

import ctypes
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pynvml
import pytest

from dra_driver.errors import MigFailed, SimulationSpecError
from dra_driver.gpus.migmanager import MigManager
from dra_driver.sim.nvml import SimulatedNode, simulated_nvml
from dra_driver.sim.profiles import HARDWARE_PROFILES
from tests.test_sim_nvml_mig import CI_FULL, create_ci, create_gi, discover, gpu0

H100 = HARDWARE_PROFILES["h100-80gb"]
H100_ID = {p.name: p.profile_id for p in H100.gpu_instance_profiles}


def mode(handle: Any) -> tuple[int, int]:
    current, pending = pynvml.nvmlDeviceGetMigMode(handle)
    return current, pending


def profile_info(handle: Any) -> Any:
    return pynvml.nvmlDeviceGetGpuInstanceProfileInfo(
        handle, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE
    )


def destroy_all(handle: Any, profile_id: int, slices: int) -> None:
    """Destroy every instance of the profile, compute instances first."""
    array = (pynvml.c_nvmlGpuInstance_t * 8)()
    count = ctypes.c_uint()
    pynvml.nvmlDeviceGetGpuInstances(handle, profile_id, array, ctypes.byref(count))
    for gi in array[: count.value]:
        cis = (pynvml.c_nvmlComputeInstance_t * 1)()
        ci_count = ctypes.c_uint()
        pynvml.nvmlGpuInstanceGetComputeInstances(gi, CI_FULL[slices], cis, ctypes.byref(ci_count))
        for ci in cis[: ci_count.value]:
            pynvml.nvmlComputeInstanceDestroy(ci)
        pynvml.nvmlGpuInstanceDestroy(gi)


def test_setting_mig_mode_on_a_gpu_without_mig_is_not_supported() -> None:
    with gpu0("l4:1") as (_, handle), pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceSetMigMode(handle, pynvml.NVML_DEVICE_MIG_ENABLE)


def test_a_mig_mode_other_than_enable_or_disable_is_invalid_argument() -> None:
    with gpu0("h100:1:mig") as (_, handle):
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            pynvml.nvmlDeviceSetMigMode(handle, 2)

        assert mode(handle) == (1, 1)


def test_on_hopper_mig_mode_switches_at_once_when_nothing_runs() -> None:
    with gpu0("h100:1:mig") as (_, handle):
        assert profile_info(handle).id == H100_ID["1g.10gb"]
        with pytest.raises(pynvml.NVMLError_NotSupported):  # nvml.h: not in MIG mode
            pynvml.nvmlDeviceGetUtilizationRates(handle)

        off = pynvml.nvmlDeviceSetMigMode(handle, pynvml.NVML_DEVICE_MIG_DISABLE)
        off_mode = mode(handle)
        # profiles and placements answer in either mode (nvml.h: NOT_SUPPORTED only where the
        # device has no MIG); instances need MIG mode
        off_profile = profile_info(handle)
        with pytest.raises(pynvml.NVMLError_NotSupported):
            pynvml.nvmlDeviceCreateGpuInstance(handle, H100_ID["1g.10gb"])
        with pytest.raises(pynvml.NVMLError_NotSupported):
            pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, 0)
        utilization = pynvml.nvmlDeviceGetUtilizationRates(handle)  # a plain GPU answers
        on = pynvml.nvmlDeviceSetMigMode(handle, pynvml.NVML_DEVICE_MIG_ENABLE)
        gi = pynvml.nvmlDeviceCreateGpuInstance(handle, H100_ID["1g.10gb"])

        assert (off, off_mode) == (pynvml.NVML_SUCCESS, (0, 0))
        assert off_profile.id == H100_ID["1g.10gb"]
        assert 0 <= utilization.gpu <= 100
        assert (on, mode(handle)) == (pynvml.NVML_SUCCESS, (1, 1))
        assert pynvml.nvmlGpuInstanceGetInfo(gi).profileId == H100_ID["1g.10gb"]


def test_discovery_sees_a_plain_gpu_after_mig_mode_off_and_no_instances_after_on_again() -> None:
    with gpu0("h100:1:mig") as (node, handle):
        before = discover(node).gpus[0]
        pynvml.nvmlDeviceSetMigMode(handle, pynvml.NVML_DEVICE_MIG_DISABLE)
        off = discover(node).gpus[0]
        pynvml.nvmlDeviceSetMigMode(handle, pynvml.NVML_DEVICE_MIG_ENABLE)
        on = discover(node).gpus[0]

    assert (before.mig_enabled, len(before.mig_profiles)) == (True, len(H100.gpu_instance_profiles))
    assert (off.mig_capable, off.mig_enabled, off.mig_pending) == (True, False, False)
    assert (off.mig_profiles, off.mig_instances) == (before.mig_profiles, ())
    assert (on.mig_enabled, on.mig_pending) == (True, True)
    assert on.mig_profiles == before.mig_profiles
    assert on.mig_instances == ()


@pytest.mark.parametrize("compute_instance", [True, False], ids=["mig-device", "gpu-instance"])
def test_turning_mig_mode_off_under_gpu_instances_is_in_use_and_changes_nothing(
    tmp_path: Path, compute_instance: bool
) -> None:
    state = tmp_path / "mig.json"
    with gpu0("h100:1:mig", state_path=state) as (node, handle):
        gi = pynvml.nvmlDeviceCreateGpuInstance(handle, H100_ID["3g.40gb"])
        if compute_instance:
            create_ci(gi)
        before = discover(node).gpus[0]
        written = state.read_text()

        with pytest.raises(pynvml.NVMLError_InUse):
            pynvml.nvmlDeviceSetMigMode(handle, pynvml.NVML_DEVICE_MIG_DISABLE)

        assert mode(handle) == (1, 1)
        assert discover(node).gpus[0] == before
        assert pynvml.nvmlGpuInstanceGetInfo(gi).profileId == H100_ID["3g.40gb"]
        assert state.read_text() == written


def test_on_ampere_only_the_pending_mode_changes_and_a_reset_is_required() -> None:
    with gpu0("a100-40gb:1:mig") as (node, handle):
        status = pynvml.nvmlDeviceSetMigMode(handle, pynvml.NVML_DEVICE_MIG_DISABLE)
        pending_off = mode(handle)
        still_mig = discover(node).gpus[0]
        create_gi(handle, "1g.5gb", 0)  # the current mode still is MIG mode
        back = pynvml.nvmlDeviceSetMigMode(handle, pynvml.NVML_DEVICE_MIG_ENABLE)

        assert (status, pending_off) == (pynvml.NVML_ERROR_RESET_REQUIRED, (1, 0))
        assert (still_mig.mig_enabled, still_mig.mig_pending) == (True, False)
        assert still_mig.mig_profiles
        assert (back, mode(handle)) == (pynvml.NVML_SUCCESS, (1, 1))  # the pending change undone


def test_on_ampere_turning_mig_mode_on_is_pending_until_a_reset() -> None:
    with gpu0("a100-80gb:1") as (node, handle):
        status = pynvml.nvmlDeviceSetMigMode(handle, pynvml.NVML_DEVICE_MIG_ENABLE)
        gpu = discover(node).gpus[0]

        assert (status, mode(handle)) == (pynvml.NVML_ERROR_RESET_REQUIRED, (0, 1))
        assert (gpu.mig_enabled, gpu.mig_pending, gpu.mig_instances) == (False, True, ())
        assert gpu.mig_profiles  # read whatever the mode, as NVIDIA's driver reads them


def test_on_hopper_processes_leave_the_change_pending_with_in_use() -> None:
    with gpu0("h100:1") as (node, handle):
        node.library.put_process(node.gpus[0].uuid, 4242)
        status = pynvml.nvmlDeviceSetMigMode(handle, pynvml.NVML_DEVICE_MIG_ENABLE)
        pending = mode(handle)
        plain = discover(node).gpus[0]
        node.library.end_processes(node.gpus[0].uuid)
        retried = pynvml.nvmlDeviceSetMigMode(handle, pynvml.NVML_DEVICE_MIG_ENABLE)

        assert (status, pending) == (pynvml.NVML_ERROR_IN_USE, (0, 1))
        assert (plain.mig_enabled, plain.mig_instances) == (False, ())
        assert (retried, mode(handle)) == (pynvml.NVML_SUCCESS, (1, 1))


def test_mig_mode_persists_in_the_state_file_across_two_opens(tmp_path: Path) -> None:
    state = tmp_path / "sim" / "mig.json"
    spec = "h100:1:mig=1g.10gb,a100-40gb:1:mig,l4:1"
    with simulated_nvml(spec, node_name="n", state_path=state) as node:
        pynvml.nvmlInit()
        try:
            h100, a100 = (pynvml.nvmlDeviceGetHandleByIndex(i) for i in (0, 1))
            destroy_all(h100, H100_ID["1g.10gb"], 1)
            pynvml.nvmlDeviceSetMigMode(h100, pynvml.NVML_DEVICE_MIG_DISABLE)
            pynvml.nvmlDeviceSetMigMode(a100, pynvml.NVML_DEVICE_MIG_DISABLE)
        finally:
            pynvml.nvmlShutdown()
    recorded = json.loads(state.read_text())
    with simulated_nvml(spec, node_name="n", state_path=state) as node:
        gpus = discover(node).gpus
        pynvml.nvmlInit()
        try:
            h100 = pynvml.nvmlDeviceGetHandleByIndex(0)
            pynvml.nvmlDeviceSetMigMode(h100, pynvml.NVML_DEVICE_MIG_ENABLE)
        finally:
            pynvml.nvmlShutdown()
        on_again = discover(node).gpus[0]

    h100_uuid, a100_uuid, l4_uuid = (g.uuid for g in node.gpus)
    assert recorded["mig_mode"] == {
        h100_uuid: {"current": 0, "pending": 0},
        a100_uuid: {"current": 1, "pending": 0},
    }
    assert set(recorded["gpus"]) == {a100_uuid}  # the GPUs in MIG mode now
    # Off on the H100, and the spec's 1g.10gb does not come back with the second open.
    assert (gpus[0].mig_enabled, gpus[0].mig_pending, gpus[0].mig_instances) == (False, False, ())
    assert (on_again.mig_enabled, on_again.mig_instances) == (True, ())
    assert (gpus[1].mig_enabled, gpus[1].mig_pending) == (True, False)
    assert l4_uuid not in recorded["mig_mode"] and not gpus[2].mig_capable


def test_a_state_file_without_mig_modes_keeps_the_specs_modes(tmp_path: Path) -> None:
    """Files written before the ``mig_mode`` key existed still load."""
    state = tmp_path / "mig.json"
    with gpu0("h200:1:mig-pending,h100:1:mig") as (node, _):
        pending_uuid, mig_uuid = (g.uuid for g in node.gpus)
    state.write_text(json.dumps({"version": 1, "gpus": {mig_uuid: []}}))
    with simulated_nvml("h200:1:mig-pending,h100:1:mig", node_name="n", state_path=state) as node:
        gpus = discover(node).gpus

    assert (gpus[0].uuid, gpus[0].mig_enabled, gpus[0].mig_pending) == (pending_uuid, False, True)
    assert (gpus[1].uuid, gpus[1].mig_enabled, gpus[1].mig_pending) == (mig_uuid, True, True)


@pytest.mark.parametrize(
    ("entry", "error"),
    [
        ({"mig_mode": {"L4": {"current": 0, "pending": 0}}}, "has no MIG mode"),
        ({"mig_mode": {"H100": {"current": 2, "pending": 0}}}, "is not 0 or 1"),
        ({"mig_mode": {"H100": {"current": True, "pending": 1}}}, "is not 0 or 1"),
        ({"mig_mode": {"H100": {"current": 1}}}, "pending"),
        ({"mig_mode": []}, "not an object"),
        (
            {
                "mig_mode": {"H100": {"current": 0, "pending": 0}},
                "gpus": {"H100": [{"gpu_instance_id": 0, "profile_id": 0, "start": 0}]},
            },
            "MIG mode is off",
        ),
    ],
)
def test_a_state_file_with_an_impossible_mig_mode_is_refused(
    tmp_path: Path, entry: dict[str, Any], error: str
) -> None:
    spec = "h100:1:mig,l4:1"
    with gpu0(spec) as (node, _):
        uuids = {"H100": node.gpus[0].uuid, "L4": node.gpus[1].uuid}
    state = tmp_path / "mig.json"
    content = {"version": 1, "gpus": {}, **entry}
    state.write_text(
        json.dumps(content)
        .replace('"H100"', f'"{uuids["H100"]}"')
        .replace('"L4"', f'"{uuids["L4"]}"')
    )

    with (
        pytest.raises(SimulationSpecError, match=error),
        simulated_nvml(spec, node_name="n", state_path=state),
    ):
        pass


# MigManager.set_mig_mode / mig_mode: the real pynvml calls, against the simulated library


@contextmanager
def manager(spec: str) -> Iterator[tuple[SimulatedNode, MigManager]]:
    with simulated_nvml(spec, node_name="n") as node:
        migs = MigManager()
        try:
            yield node, migs
        finally:
            migs.close()


def test_mig_manager_switches_mig_mode_off_and_on_again_on_hopper() -> None:
    with manager("h100:1:mig") as (node, migs):
        uuid = node.gpus[0].uuid
        migs.set_mig_mode(uuid, False, why="preparing gpu-0")
        off = migs.mig_mode(uuid)
        calls = len(node.library.calls)
        migs.set_mig_mode(uuid, False, why="preparing gpu-0 again")
        again = list(node.library.calls)[calls:]
        migs.set_mig_mode(uuid, True, why="unpreparing gpu-0")

        assert off == (False, False)
        assert "nvmlDeviceSetMigMode" not in again  # idempotent: nothing switched
        assert migs.mig_mode(uuid) == (True, True)


def test_mig_manager_sets_a_stale_pending_mode_back_when_the_mode_already_is_current() -> None:
    with manager("h200:1:mig-pending") as (node, migs):
        uuid = node.gpus[0].uuid
        before = migs.mig_mode(uuid)
        migs.set_mig_mode(uuid, False, why="preparing gpu-0")

        assert before == (False, True)
        assert migs.mig_mode(uuid) == (False, False)


@pytest.mark.parametrize("enabled", [False, True])
def test_mig_manager_sets_the_pending_mode_back_on_ampere_and_says_a_reset_is_needed(
    enabled: bool,
) -> None:
    with manager("a100-40gb:1" + ("" if enabled else ":mig")) as (node, migs):
        uuid = node.gpus[0].uuid

        with pytest.raises(MigFailed) as failed:
            migs.set_mig_mode(uuid, enabled, why="preparing gpu-0")

        assert migs.mig_mode(uuid) == (not enabled, not enabled)
        message = str(failed.value)
        assert uuid in message and "preparing gpu-0" in message
        assert f"MIG mode stays {'off' if enabled else 'on'}" in message
        assert "needs a GPU reset" in message


def test_mig_manager_sets_the_pending_mode_back_while_processes_run() -> None:
    with manager("h100:1") as (node, migs):
        uuid = node.gpus[0].uuid
        node.library.put_process(uuid, 4242)

        with pytest.raises(MigFailed, match=f"{uuid}.*unpreparing gpu-0.*processes run on the GPU"):
            migs.set_mig_mode(uuid, True, why="unpreparing gpu-0")
        after = migs.mig_mode(uuid)
        node.library.end_processes(uuid)
        migs.set_mig_mode(uuid, True, why="unpreparing gpu-0")

        assert after == (False, False)
        assert migs.mig_mode(uuid) == (True, True)


def test_mig_manager_cannot_turn_mig_mode_off_under_instances() -> None:
    with manager("h100:1:mig=3g.40gb") as (node, migs):
        uuid = node.gpus[0].uuid

        with pytest.raises(MigFailed, match="nvmlDeviceSetMigMode failed: in use: MIG instances"):
            migs.set_mig_mode(uuid, False, why="preparing gpu-0")
        assert migs.mig_mode(uuid) == (True, True)
        assert len(migs.instances(uuid, [H100_ID["3g.40gb"]])) == 1


def test_mig_manager_on_a_gpu_without_mig_mode() -> None:
    with manager("l4:1") as (node, migs):
        uuid = node.gpus[0].uuid
        migs.set_mig_mode(uuid, False, why="preparing gpu-0")  # off already: nothing to do

        assert migs.mig_mode(uuid) == (False, False)
        with pytest.raises(MigFailed, match="not supported: the GPU has no MIG mode"):
            migs.set_mig_mode(uuid, True, why="unpreparing gpu-0")


def test_mig_manager_reports_a_lost_gpu_as_mig_failed() -> None:
    with manager("h100:1:mig:fail") as (node, migs), pytest.raises(MigFailed, match="GPU is lost"):
        migs.set_mig_mode(node.gpus[0].uuid, False, why="preparing gpu-0")
