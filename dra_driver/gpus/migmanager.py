"""Creating and destroying MIG instances through NVML: the NVML boundary of dynamic MIG.

Place in the flow: beside discovery (gpus/nvml.py); mig/dynamic.py calls it for prepare (create
a dynamic MIG device's GPU instance at its placement and a compute instance of the full compute
profile on it), unprepare and recovery (find and destroy), and asks it which processes run.
Every NVML error becomes a MigFailed naming the device, the call and what NVML's code means, so
a claim's error says why (insufficient resources, in use, not supported). pynvml must already
hold a library (a real one loaded by discovery, or simulated GPUs): this module loads none.

It also switches a GPU's MIG mode (set_mig_mode, for the whole GPU of a MIG-mode GPU in dynamic
MIG mode): NVML changes the mode at once only where no GPU reset is needed and nothing runs on
the GPU; otherwise the change stays pending, and set_mig_mode takes it back and says why.

Instances are found by what the driver knows of them, the GPU, the GPU-instance profile and the
placement start (exactly what a dynamic device's name encodes), never by ids remembered across
a crash: after a kill -9 at any step the next start finds the half-made instance (a GPU instance
without its compute instance included) from the device name alone.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

import pynvml

from dra_driver.errors import MigFailed

# NVML_COMPUTE_INSTANCE_PROFILE_* of the compute profile that spans a whole GPU instance, by the
# GPU instance's compute slices (NVIDIA's mig-parted picks the compute profile the same way).
_FULL_COMPUTE_PROFILE = {
    1: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE,
    2: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE,
    3: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE,
    4: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE,
    6: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_6_SLICE,
    7: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE,
    8: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_8_SLICE,
}
# What NVML's codes mean for an instance being created or destroyed (nvml.h).
_MEANINGS = {
    pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES: "insufficient resources: another instance "
    "overlaps the placement, or the GPU has no room for another instance of the profile",
    pynvml.NVML_ERROR_IN_USE: "in use: processes run on the instance",
    pynvml.NVML_ERROR_NOT_SUPPORTED: "not supported: the GPU is not in MIG mode, or does not "
    "support the profile",
    pynvml.NVML_ERROR_INVALID_ARGUMENT: "invalid argument: the profile has no such placement",
    pynvml.NVML_ERROR_NO_PERMISSION: "no permission: the agent needs CAP_SYS_ADMIN for MIG "
    "management",
    pynvml.NVML_ERROR_GPU_IS_LOST: "the GPU is lost",
}
# What nvmlDeviceSetMigMode's own return codes mean (nvml.h: NOT_SUPPORTED for a GPU without MIG
# mode; IN_USE is how simulated GPUs refuse MIG mode off while GPU instances exist, a case nvml.h
# does not document).
_MODE_MEANINGS = {
    pynvml.NVML_ERROR_IN_USE: "in use: MIG instances exist on the GPU",
    pynvml.NVML_ERROR_NOT_SUPPORTED: "not supported: the GPU has no MIG mode",
}
# Why a mode change did not become current, by its activation status (nvml.h: RESET_REQUIRED
# where the change needs a reset, IN_USE when the GPU is not idle).
_ACTIVATION = {
    pynvml.NVML_ERROR_RESET_REQUIRED: "it needs a GPU reset (Ampere GPUs such as the A100 and "
    "A30 change MIG mode only through one, and this driver never resets a GPU)",
    pynvml.NVML_ERROR_IN_USE: "processes run on the GPU (NVML changes MIG mode only on an idle "
    "GPU)",
}
_NO_INSTANCE = 0xFFFFFFFF  # a process's gpuInstanceId outside any MIG instance
_MAX_INSTANCES = 16  # more than any profile's instanceCount (nvmlDeviceGetGpuInstances sizing)


@dataclass(frozen=True)
class MigSlot:
    """A GPU instance that exists on a GPU, and its compute instance if it has one."""

    profile_id: int
    start: int
    gpu_instance_id: int
    compute_instance_id: int | None  # None: a GPU instance without its compute instance
    uuid: str | None  # the MIG device's "MIG-..." UUID; None without a compute instance


def nvml_problem(exc: pynvml.NVMLError) -> str:
    """What an NVML error means here, in words."""
    return _MEANINGS.get(exc.value, str(exc))


class MigManager:
    """Creates, finds and destroys MIG instances with NVML; safe to call from many threads.

    Changes to one GPU are serialised (a per-GPU lock), so "find, else create" is one step for
    the threads of this process. NVML is initialised on first use and shut down by close().
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._gpu_locks: dict[str, threading.Lock] = {}
        self._initialised = False

    def close(self) -> None:
        with self._lock:
            if self._initialised:
                self._initialised = False
                with suppress(pynvml.NVMLError):  # shutting down: nothing left to do about it
                    pynvml.nvmlShutdown()

    @contextmanager
    def _gpu(self, gpu_uuid: str, what: str) -> Iterator[Any]:
        """The GPU's handle, its lock held; NVML errors become MigFailed naming ``what``."""
        with self._lock:
            if not self._initialised:
                try:
                    pynvml.nvmlInit()
                except pynvml.NVMLError as exc:
                    raise MigFailed(f"{what}: NVML cannot be initialised: {exc}") from exc
                self._initialised = True
            lock = self._gpu_locks.setdefault(gpu_uuid, threading.Lock())
        with lock:
            try:
                yield pynvml.nvmlDeviceGetHandleByUUID(gpu_uuid.encode())
            except pynvml.NVMLError as exc:
                raise MigFailed(f"{what}: {nvml_problem(exc)}") from exc

    def instances(self, gpu_uuid: str, profile_ids: Iterable[int]) -> tuple[MigSlot, ...]:
        """Every GPU instance of those profiles on the GPU, each with its compute instance."""
        with self._gpu(gpu_uuid, f"listing the MIG instances of GPU {gpu_uuid}") as handle:
            return tuple(
                slot for pid in sorted(set(profile_ids)) for slot in _slots(handle, pid, None)
            )

    def create(
        self, gpu_uuid: str, *, profile_id: int, start: int, size: int, slices: int, name: str
    ) -> tuple[MigSlot, bool]:
        """The instance of profile ``profile_id`` at placement ``start`` (``size`` memory
        slices, ``slices`` compute slices) with its compute instance: created, completed (a GPU
        instance without its compute instance gets one), or found complete. Idempotent. Returns
        it and whether anything was created. ``name`` (the device's) is for errors."""
        with self._gpu(gpu_uuid, f"creating MIG device {name}") as handle:
            found = _slots(handle, profile_id, start)
            created = False
            if found:
                gi = found[0]
                gpu_instance = pynvml.nvmlDeviceGetGpuInstanceById(handle, gi.gpu_instance_id)
            else:
                placement = pynvml.c_nvmlGpuInstancePlacement_t()
                placement.start = start
                placement.size = size
                try:
                    gpu_instance = pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(
                        handle, profile_id, ctypes.byref(placement)
                    )
                except pynvml.NVMLError as exc:
                    raise MigFailed(
                        f"creating MIG device {name}: nvmlDeviceCreateGpuInstanceWithPlacement "
                        f"failed: {nvml_problem(exc)}"
                    ) from exc
                created = True
            if not found or found[0].compute_instance_id is None:
                try:
                    pynvml.nvmlGpuInstanceCreateComputeInstance(
                        gpu_instance, _full_compute_profile(slices)
                    )
                except pynvml.NVMLError as exc:
                    raise MigFailed(
                        f"creating MIG device {name}: nvmlGpuInstanceCreateComputeInstance "
                        f"failed: {nvml_problem(exc)}"
                    ) from exc
                created = True
            (slot,) = _slots(handle, profile_id, start)
            return slot, created

    def destroy(self, gpu_uuid: str, *, profile_id: int, start: int, name: str) -> bool:
        """Destroy the instance of ``profile_id`` at ``start`` (its compute instances first).
        Idempotent: False when there was none. MigFailed (in use) while processes run on it."""
        with self._gpu(gpu_uuid, f"destroying MIG device {name}") as handle:
            found = _slots(handle, profile_id, start)
            if not found:
                return False
            gi = found[0]
            gpu_instance = pynvml.nvmlDeviceGetGpuInstanceById(handle, gi.gpu_instance_id)
            for compute_instance in _compute_instances(gpu_instance):
                try:
                    pynvml.nvmlComputeInstanceDestroy(compute_instance)
                except pynvml.NVMLError as exc:
                    raise MigFailed(
                        f"destroying MIG device {name}: nvmlComputeInstanceDestroy failed: "
                        f"{nvml_problem(exc)}"
                    ) from exc
            try:
                pynvml.nvmlGpuInstanceDestroy(gpu_instance)
            except pynvml.NVMLError as exc:
                raise MigFailed(
                    f"destroying MIG device {name}: nvmlGpuInstanceDestroy failed: "
                    f"{nvml_problem(exc)}"
                ) from exc
            return True

    def mig_mode(self, gpu_uuid: str) -> tuple[bool, bool]:
        """The GPU's MIG mode: (current, pending). A GPU without MIG mode: (False, False)."""
        with self._gpu(gpu_uuid, f"reading the MIG mode of GPU {gpu_uuid}") as handle:
            return _mig_mode(handle)

    def set_mig_mode(self, gpu_uuid: str, enabled: bool, *, why: str) -> None:
        """Make ``enabled`` the GPU's current MIG mode, or raise MigFailed saying why not.

        Idempotent: nothing is switched when the current mode already is ``enabled``; a pending
        mode that differs from it is then set back to it. When NVML leaves the change pending
        (an Ampere GPU needs a reset; processes run on the GPU), the pending mode is set back to
        the current one before MigFailed is raised, so that a later GPU reset or reboot does not
        switch the mode behind the driver's back. ``why`` (what the switch is for) goes into the
        error. NVML errors are MigFailed too. Serialised with this GPU's other MIG changes.
        """
        what = f"turning MIG mode {_on(enabled)} on GPU {gpu_uuid} ({why})"
        with self._gpu(gpu_uuid, what) as handle:
            current, pending = _mig_mode(handle)
            if current == enabled:
                if pending != current:
                    _set_mig_mode(handle, current, what)
                return
            status = _set_mig_mode(handle, enabled, what)
            current, pending = _mig_mode(handle)
            if current == enabled:
                return
            reverted = ""
            if pending != current:
                try:
                    _set_mig_mode(handle, current, what)
                except MigFailed as exc:
                    reverted = f"; setting the pending mode back to {_on(current)} failed: {exc}"
            reason = _ACTIVATION.get(status) or (
                "NVML reported success, yet the mode did not change"
                if status == pynvml.NVML_SUCCESS
                else str(pynvml.NVMLError(status))
            )
            raise MigFailed(f"{what}: MIG mode stays {_on(current)}: {reason}{reverted}")

    def processes(self, gpu_uuid: str, *, gpu_instance_id: int | None) -> tuple[int, ...]:
        """PIDs of the compute processes NVML lists on the GPU: those inside GPU instance
        ``gpu_instance_id``, or (None) those outside every MIG instance (on the full GPU)."""
        wanted = _NO_INSTANCE if gpu_instance_id is None else gpu_instance_id
        with self._gpu(gpu_uuid, f"listing the processes of GPU {gpu_uuid}") as handle:
            return tuple(
                int(p.pid)
                for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
                if int(p.gpuInstanceId) == wanted
            )


def _on(enabled: bool) -> str:
    return "on" if enabled else "off"


def _mig_mode(handle: Any) -> tuple[bool, bool]:
    try:
        current, pending = pynvml.nvmlDeviceGetMigMode(handle)
    except pynvml.NVMLError_NotSupported:
        return False, False  # nvml.h: NOT_SUPPORTED for a GPU without MIG mode
    return current == pynvml.NVML_DEVICE_MIG_ENABLE, pending == pynvml.NVML_DEVICE_MIG_ENABLE


def _set_mig_mode(handle: Any, enabled: bool, what: str) -> int:
    """nvmlDeviceSetMigMode; its activation status (SUCCESS: the mode is current now)."""
    mode = pynvml.NVML_DEVICE_MIG_ENABLE if enabled else pynvml.NVML_DEVICE_MIG_DISABLE
    try:
        return int(pynvml.nvmlDeviceSetMigMode(handle, mode))
    except pynvml.NVMLError as exc:
        meaning = _MODE_MEANINGS.get(exc.value) or nvml_problem(exc)
        raise MigFailed(f"{what}: nvmlDeviceSetMigMode failed: {meaning}") from exc


def _full_compute_profile(slices: int) -> int:
    try:
        return int(_FULL_COMPUTE_PROFILE[slices])
    except KeyError:
        raise MigFailed(f"no compute profile spans {slices} compute slices") from None


def _slots(handle: Any, profile_id: int, start: int | None) -> list[MigSlot]:
    """The GPU instances of ``profile_id`` (at ``start`` only, unless None)."""
    array = (pynvml.c_nvmlGpuInstance_t * _MAX_INSTANCES)()
    count = ctypes.c_uint(_MAX_INSTANCES)
    try:
        pynvml.nvmlDeviceGetGpuInstances(handle, profile_id, array, ctypes.byref(count))
    except pynvml.NVMLError_InvalidArgument:
        return []  # a profile this GPU does not have: no instances of it
    slots = []
    for gpu_instance in array[: count.value]:
        info = pynvml.nvmlGpuInstanceGetInfo(gpu_instance)
        if start is not None and int(info.placement.start) != start:
            continue
        compute = _compute_instances(gpu_instance)
        ci_id = uuid = None
        if compute:
            ci_id = int(pynvml.nvmlComputeInstanceGetInfo(compute[0]).id)
            uuid = _mig_uuid(handle, int(info.id), ci_id)
        slots.append(
            MigSlot(
                profile_id=profile_id,
                start=int(info.placement.start),
                gpu_instance_id=int(info.id),
                compute_instance_id=ci_id,
                uuid=uuid,
            )
        )
    return slots


def _compute_instances(gpu_instance: Any) -> list[Any]:
    """Every compute instance of the GPU instance, whatever its compute profile."""
    found: list[Any] = []
    for profile_id in range(pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
        array = (pynvml.c_nvmlComputeInstance_t * 8)()
        count = ctypes.c_uint(8)
        try:
            pynvml.nvmlGpuInstanceGetComputeInstances(
                gpu_instance, profile_id, array, ctypes.byref(count)
            )
        except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_InvalidArgument):
            continue  # a compute profile this GPU instance does not have
        found.extend(array[: count.value])
    return found


def _mig_uuid(handle: Any, gpu_instance_id: int, compute_instance_id: int) -> str | None:
    """The UUID of the MIG device with those ids (None while NVML does not list it)."""
    for index in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
        try:
            mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, index)
        except pynvml.NVMLError_NotFound:
            continue
        if (
            pynvml.nvmlDeviceGetGpuInstanceId(mig) == gpu_instance_id
            and pynvml.nvmlDeviceGetComputeInstanceId(mig) == compute_instance_id
        ):
            uuid = pynvml.nvmlDeviceGetUUID(mig)
            return uuid.decode() if isinstance(uuid, bytes) else str(uuid)
    return None
