"""MIG in the simulated library: GPU and compute instances created and destroyed, and the MIG mode.

The MIG-management side of the simulated library (library.py collects the table):
nvmlDeviceCreateGpuInstance(WithPlacement), nvmlGpuInstanceDestroy, nvmlDeviceGetGpuInstances,
nvmlDeviceGetGpuInstanceRemainingCapacity and their compute-instance counterparts, and
nvmlDeviceSetMigMode, with the return codes nvml.h documents for them. The instances that exist
are one immutable view, replaced under one lock on every change (after the state file,
migstate.py, when there is one, has been written), so discovery, telemetry and the health watch
read a consistent set without locking. The spec's layout is the state a node starts from.

Modelled: the profiles' placement tables on the 8 memory slices, the per-profile instance
counts (which is what makes a ``+me`` profile exclusive: one instance of it per GPU), the 7
compute slices, the full-GPU-instance compute profile, and processes holding a compute
instance (SimulatedNvmlLibrary.processes: IN_USE), and each GPU's MIG mode, current and
pending, switched with nvmlDeviceSetMigMode (see _set_mig_mode for what real NVML does there).
Not modelled: compute profiles smaller than their GPU instance, and permissions.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable
from dataclasses import replace as _replace
from pathlib import Path
from typing import Any

import pynvml

from dra_driver.sim.nvml.abi import (
    GPU_IS_LOST,
    IN_USE,
    INSUFFICIENT_RESOURCES,
    INVALID_ARGUMENT,
    NOT_SUPPORTED,
    RESET_REQUIRED,
    SUCCESS,
    UNKNOWN,
    VERSION_MISMATCH,
    address_of,
    as_int,
    placement_arg,
    pointee,
    set_pointer,
)
from dra_driver.sim.nvml.migstate import read_state, write_state
from dra_driver.sim.nvml.node import (
    SimulatedGpu,
    SimulatedGpuInstance,
    SimulatedMig,
    full_compute_profile,
    gpu_instance_id_at,
    mig_uuid,
    profile_by_id,
)
from dra_driver.sim.nvml.parts import Library, MigView
from dra_driver.sim.nvml.spec import TOTAL_COMPUTE_SLICES
from dra_driver.sim.profiles import GpuInstanceProfile

_log = logging.getLogger("dra_driver.sim.nvml")  # one logger for the whole simulated library

# Handle addresses inside a GPU's 0x1000 (see abi.Handles), by GPU-instance id (0-13) and
# compute-instance id (0-7).
_MIG_DEVICE_OFFSET = 0x100
_COMPUTE_INSTANCE_OFFSET = 0x400
_GPU_INSTANCE_OFFSET = 0x800


class SimulatedMigInstances:
    """The GPU and compute instances of a simulated node, and the NVML functions that manage them.

    It also holds each GPU's MIG mode (current, pending), starting from the spec's
    (``mig``/``mig=``: on, on; ``mig-pending``: off, on) and changed by ``nvmlDeviceSetMigMode``.

    ``state_path``: a JSON file this node owns; read at start when it exists (it then replaces
    the spec's layout and modes for the GPUs it names), rewritten atomically (temporary file,
    rename; not synced: it must outlive the agent process, and real instances do not outlive a
    reboot) on every change, under the lock, before the change becomes visible. migstate.py
    has its format; a file that cannot be read, or names impossible instances or modes, is a
    SimulationSpecError at start.
    """

    def __init__(self, library: Library, *, node_name: str, state_path: Path | None) -> None:
        self._library = library
        self._gpus = library.gpus
        self._node_name = node_name
        self.state_path = state_path
        self._lock = threading.Lock()
        instances = {
            gpu.index: tuple(
                SimulatedGpuInstance(
                    gpu_index=gpu.index,
                    id=mig.gpu_instance_id,
                    profile=mig.profile,
                    start=mig.start,
                    compute_instances=(mig,),
                )
                for mig in gpu.migs
            )
            for gpu in self._gpus
        }
        modes = {gpu.index: (gpu.spec.mig_enabled, gpu.spec.mig_pending) for gpu in self._gpus}
        if state_path is not None and state_path.exists():
            read_state(
                state_path, gpus=self._gpus, node_name=node_name, instances=instances, modes=modes
            )
        self.view = self._build_view(instances, modes)

    def mode(self, gpu: SimulatedGpu) -> tuple[bool, bool]:
        """The GPU's MIG mode now: (current, pending)."""
        return self.view.modes[gpu.index]

    def enabled(self, gpu: SimulatedGpu) -> bool:
        """Whether the GPU is in MIG mode now (its current mode)."""
        return self.view.modes[gpu.index][0]

    # --- the view and handles ------------------------------------------------------------------

    def devices(self, gpu: SimulatedGpu) -> tuple[SimulatedMig, ...]:
        """The MIG devices of ``gpu`` now, by GPU-instance id then compute-instance id."""
        return self.view.devices[gpu.index]

    def _base(self, gpu_index: int) -> int:
        return self._library.handles.gpu_address[gpu_index]

    def mig_address(self, gpu: SimulatedGpu, mig: SimulatedMig) -> int:
        offset = _MIG_DEVICE_OFFSET + 0x10 * mig.gpu_instance_id + mig.compute_instance_id
        return self._base(gpu.index) + offset

    def gpu_instance_address(self, instance: SimulatedGpuInstance) -> int:
        return self._base(instance.gpu_index) + _GPU_INSTANCE_OFFSET + 0x10 * instance.id

    def _compute_instance_address(self, instance: SimulatedGpuInstance, ci: SimulatedMig) -> int:
        offset = _COMPUTE_INSTANCE_OFFSET + 0x10 * instance.id + ci.compute_instance_id
        return self._base(instance.gpu_index) + offset

    def _build_view(
        self,
        instances: dict[int, tuple[SimulatedGpuInstance, ...]],
        modes: dict[int, tuple[bool, bool]],
    ) -> MigView:
        by_id = {i: tuple(sorted(found, key=lambda g: g.id)) for i, found in instances.items()}
        view = MigView(
            instances=by_id,
            modes=dict(modes),
            devices={
                i: tuple(ci for gi in found for ci in gi.compute_instances)
                for i, found in by_id.items()
            },
            mig_devices={},
            gpu_instances={},
            compute_instances={},
        )
        for gpu in self._gpus:
            for gi in by_id[gpu.index]:
                view.gpu_instances[self.gpu_instance_address(gi)] = gi
                for ci in gi.compute_instances:
                    view.mig_devices[self.mig_address(gpu, ci)] = (gpu, ci)
                    view.compute_instances[self._compute_instance_address(gi, ci)] = (gi, ci)
        return view

    def _answers(self, gpu_index: int) -> bool:
        gpu = self._gpus[gpu_index]
        return not gpu.spec.fail and self._library.health.answers(gpu)

    def gpu_instance(self, handle: Any) -> tuple[SimulatedGpuInstance | None, int]:
        """(instance, rc) for a GPU-instance handle; INVALID_ARGUMENT once it is destroyed."""
        found = self.view.gpu_instances.get(address_of(handle))
        if found is None:
            return None, INVALID_ARGUMENT
        if not self._answers(found.gpu_index):
            return None, GPU_IS_LOST
        return found, SUCCESS

    def _mig_gpu(self, handle: Any) -> tuple[SimulatedGpu | None, int]:
        """A full-GPU handle of a GPU in MIG mode (nvml.h: NOT_SUPPORTED when it is off)."""
        gpu, rc = self._library.full_gpu(handle)
        if gpu is None or rc != SUCCESS:
            return None, rc
        if not self.enabled(gpu):
            return None, NOT_SUPPORTED
        return gpu, SUCCESS

    # --- state changes ---------------------------------------------------------------------------

    def _commit(
        self,
        gpu_index: int,
        instances: tuple[SimulatedGpuInstance, ...] | None = None,
        *,
        mode: tuple[bool, bool] | None = None,
    ) -> int:
        """Make ``instances`` the GPU's instances and ``mode`` its MIG mode (None: unchanged):
        state file first, then the view (lock held)."""
        changed = dict(self.view.instances)
        modes = dict(self.view.modes)
        if instances is not None:
            changed[gpu_index] = instances
        if mode is not None:
            modes[gpu_index] = mode
        if self.state_path is not None:
            try:
                write_state(self.state_path, gpus=self._gpus, instances=changed, modes=modes)
            except OSError as exc:
                _log.error("simulated GPUs: cannot write MIG state %s: %s", self.state_path, exc)
                return UNKNOWN
        self.view = self._build_view(changed, modes)
        return SUCCESS

    def _refusal(self, gpu: SimulatedGpu, profile: GpuInstanceProfile, start: int) -> int:
        """Why a ``profile`` instance at ``start`` cannot be created now; SUCCESS if it can."""
        if start not in profile.placement_starts:
            return INVALID_ARGUMENT
        existing = self.view.instances[gpu.index]
        span = frozenset(range(start, start + profile.placement_size))
        compute = sum(i.profile.slice_count for i in existing) + profile.slice_count
        same = sum(1 for i in existing if i.profile.profile_id == profile.profile_id)
        if (
            same >= profile.instance_count
            or compute > TOTAL_COMPUTE_SLICES
            or any(span & i.memory_slices for i in existing)
        ):
            return INSUFFICIENT_RESOURCES
        return SUCCESS

    def _create_gpu_instance(
        self, gpu: SimulatedGpu, profile: GpuInstanceProfile, start: int | None, ref: Any
    ) -> int:
        with self._lock:
            if start is None:  # the first placement that fits, in the profile's table order
                start = next(
                    (
                        s
                        for s in profile.placement_starts
                        if self._refusal(gpu, profile, s) == SUCCESS
                    ),
                    None,
                )
                if start is None:
                    return INSUFFICIENT_RESOURCES
            rc = self._refusal(gpu, profile, start)
            if rc != SUCCESS:
                return rc
            created = SimulatedGpuInstance(
                gpu_index=gpu.index,
                id=gpu_instance_id_at(start, profile.placement_size),
                profile=profile,
                start=start,
            )
            rc = self._commit(gpu.index, (*self.view.instances[gpu.index], created))
            if rc == SUCCESS:
                set_pointer(ref, self.gpu_instance_address(created))
            return rc

    def _destroy_gpu_instance(self, handle: Any) -> int:
        with self._lock:
            instance, rc = self.gpu_instance(handle)
            if instance is None:
                return rc
            if instance.compute_instances:  # nvml.h: IN_USE while compute instances exist
                return IN_USE
            left = tuple(i for i in self.view.instances[instance.gpu_index] if i is not instance)
            return self._commit(instance.gpu_index, left)

    def _create_compute_instance(self, handle: Any, profile_id: int, ref: Any) -> int:
        with self._lock:
            instance, rc = self.gpu_instance(handle)
            if instance is None:
                return rc
            rc = self._compute_profile_refusal(instance, profile_id)
            if rc != SUCCESS:
                return rc
            if instance.compute_instances:
                return INSUFFICIENT_RESOURCES  # the full compute profile leaves no room
            ci = SimulatedMig(
                uuid=mig_uuid(
                    self._node_name, instance.gpu_index, instance.profile, instance.start
                ),
                gpu_instance_id=instance.id,
                compute_instance_id=0,
                profile=instance.profile,
                start=instance.start,
            )
            grown = _replace(instance, compute_instances=(ci,))
            others = (i for i in self.view.instances[instance.gpu_index] if i is not instance)
            rc = self._commit(instance.gpu_index, (*others, grown))
            if rc == SUCCESS:
                set_pointer(ref, self._compute_instance_address(grown, ci))
            return rc

    def _compute_profile_refusal(self, instance: SimulatedGpuInstance, profile_id: int) -> int:
        if profile_id >= pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT:
            return INVALID_ARGUMENT
        if profile_id != full_compute_profile(instance):
            return NOT_SUPPORTED  # smaller compute profiles are not simulated
        return SUCCESS

    def _set_mig_mode(self, handle: Any, mode: Any, status_ref: Any) -> int:
        """nvmlDeviceSetMigMode: set the pending MIG mode and try to activate it.

        nvml.h (quoted in NVIDIA's cuda-python docs of ``device_set_mig_mode``): the return code
        is NOT_SUPPORTED when the device does not support MIG mode and INVALID_ARGUMENT for a bad
        device, mode or activation-status pointer; otherwise SUCCESS, and *activationStatus*
        says whether the mode became current. Activation "may unbind or reset the device"; where
        a reset is needed and cannot happen it is RESET_REQUIRED, and "if device unbind fails
        because the device isn't idle, NVML_ERROR_IN_USE would be returned. The caller of this
        API is expected to idle the device and retry". The pending mode is "the target mode
        following the next activation trigger" (nvmlDeviceGetMigMode).

        Which GPUs need the reset: NVIDIA's MIG user guide ("Deployment Considerations"):
        "Setting MIG mode on the A100/A30 requires a GPU reset"; kubernetes-sigs/
        dra-driver-nvidia-gpu (``supportsMIGModeToggle``) toggles it without a reset on Hopper
        and newer only. So an Ampere GPU here only changes its pending mode (RESET_REQUIRED),
        and a Hopper or newer one switches unless compute processes run on it (IN_USE, pending
        changed). Disabling while GPU instances exist is refused with IN_USE as the return code,
        nothing changed: nvml.h does not document that case; the upstream driver never tries it
        (it disables MIG mode only once no MIG device is left), and instances cannot outlive the
        mode they need.
        """
        gpu, rc = self._library.full_gpu(handle)
        if gpu is None or rc != SUCCESS:
            return rc
        if not gpu.spec.hardware.mig_capable:
            return NOT_SUPPORTED
        wanted = as_int(mode)
        if wanted not in (pynvml.NVML_DEVICE_MIG_DISABLE, pynvml.NVML_DEVICE_MIG_ENABLE):
            return INVALID_ARGUMENT
        if status_ref is None:
            return INVALID_ARGUMENT
        enable = wanted == pynvml.NVML_DEVICE_MIG_ENABLE
        with self._lock:
            current, _ = self.view.modes[gpu.index]
            if not enable and self.view.instances[gpu.index]:
                return IN_USE
            if enable == current:
                status, changed = SUCCESS, (current, enable)  # cancels a pending change
            elif gpu.spec.hardware.architecture < pynvml.NVML_DEVICE_ARCH_HOPPER:
                status, changed = RESET_REQUIRED, (current, enable)
            elif self._library.processes.get(gpu.uuid):  # (those in MIG devices: refused above)
                status, changed = IN_USE, (current, enable)
            else:
                status, changed = SUCCESS, (enable, enable)
            rc = self._commit(gpu.index, mode=changed)
            if rc == SUCCESS:
                pointee(status_ref).value = status
            return rc

    # --- the NVML functions ----------------------------------------------------------------------

    def functions(self) -> dict[str, Callable[..., Any]]:
        return {
            "nvmlDeviceCreateGpuInstance": self._nvml_create_gi,
            "nvmlDeviceCreateGpuInstanceWithPlacement": self._nvml_create_gi_with_placement,
            "nvmlGpuInstanceDestroy": self._destroy_gpu_instance,
            "nvmlDeviceGetGpuInstances": self._nvml_gpu_instances,
            "nvmlDeviceGetGpuInstanceRemainingCapacity": self._nvml_gi_remaining,
            "nvmlGpuInstanceGetComputeInstanceProfileInfoV": self._nvml_ci_profile_info,
            "nvmlGpuInstanceGetComputeInstancePossiblePlacements": self._nvml_ci_placements,
            "nvmlGpuInstanceCreateComputeInstance": self._nvml_create_ci,
            "nvmlGpuInstanceCreateComputeInstanceWithPlacement": self._nvml_create_ci_placed,
            "nvmlComputeInstanceDestroy": self._nvml_destroy_ci,
            "nvmlGpuInstanceGetComputeInstances": self._nvml_compute_instances,
            "nvmlGpuInstanceGetComputeInstanceRemainingCapacity": self._nvml_ci_remaining,
            "nvmlComputeInstanceGetInfo_v2": self._nvml_ci_info,
            "nvmlDeviceSetMigMode": self._set_mig_mode,
        }

    def _gpu_and_profile(
        self, handle: Any, profile_id: Any
    ) -> tuple[SimulatedGpu | None, GpuInstanceProfile | None, int]:
        gpu, rc = self._mig_gpu(handle)
        if gpu is None:
            return None, None, rc
        profile = profile_by_id(gpu, as_int(profile_id))
        if profile is None:  # nvml.h: INVALID_ARGUMENT "if ... profileId ... are invalid"
            return None, None, INVALID_ARGUMENT
        return gpu, profile, SUCCESS

    def _nvml_create_gi(self, handle: Any, profile_id: Any, ref: Any) -> int:
        gpu, profile, rc = self._gpu_and_profile(handle, profile_id)
        if gpu is None or profile is None:
            return rc
        return self._create_gpu_instance(gpu, profile, None, ref)

    def _nvml_create_gi_with_placement(
        self, handle: Any, profile_id: Any, placement: Any, ref: Any
    ) -> int:
        gpu, profile, rc = self._gpu_and_profile(handle, profile_id)
        if gpu is None or profile is None:
            return rc
        if placement is None:
            return INVALID_ARGUMENT
        wanted = placement_arg(placement)
        if wanted.size != profile.placement_size:
            return INVALID_ARGUMENT
        return self._create_gpu_instance(gpu, profile, int(wanted.start), ref)

    def _nvml_gpu_instances(self, handle: Any, profile_id: Any, array: Any, count: Any) -> int:
        gpu, profile, rc = self._gpu_and_profile(handle, profile_id)
        if gpu is None or profile is None:
            return rc
        if array is None:
            return INVALID_ARGUMENT
        found = [i for i in self.view.instances[gpu.index] if i.profile is profile]
        # nvml.h: the caller sizes the array for the profile's instanceCount.
        handles = ctypes.cast(array, ctypes.POINTER(ctypes.c_void_p))
        for n, instance in enumerate(found):
            handles[n] = self.gpu_instance_address(instance)
        pointee(count).value = len(found)
        return SUCCESS

    def _nvml_gi_remaining(self, handle: Any, profile_id: Any, ref: Any) -> int:
        # Answered with MIG mode off too (as a real H200 did: every profile's full count), on
        # the instances that exist (none then).
        gpu, rc = self._library.full_gpu(handle)
        if gpu is None or rc != SUCCESS:
            return rc
        if not gpu.spec.hardware.mig_capable:
            return NOT_SUPPORTED
        profile = profile_by_id(gpu, as_int(profile_id))
        if profile is None:
            return INVALID_ARGUMENT
        existing = self.view.instances[gpu.index]
        used = frozenset().union(*(i.memory_slices for i in existing))
        compute_left = TOTAL_COMPUTE_SLICES - sum(i.profile.slice_count for i in existing)
        same = sum(1 for i in existing if i.profile is profile)
        # Placements of one profile are aligned to their size, so taking free ones in table
        # order finds the most that fit together.
        fit = 0
        for start in profile.placement_starts:
            span = frozenset(range(start, start + profile.placement_size))
            if not span & used:
                used |= span
                fit += 1
        pointee(ref).value = max(
            0, min(fit, profile.instance_count - same, compute_left // profile.slice_count)
        )
        return SUCCESS

    def _nvml_ci_profile_info(self, handle: Any, profile: Any, engine: Any, ref: Any) -> int:
        instance, rc = self.gpu_instance(handle)
        if instance is None:
            return rc
        info = pointee(ref)
        if info.version != pynvml.nvmlComputeInstanceProfileInfo_v2:
            return VERSION_MISMATCH
        if as_int(engine) >= pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_COUNT:
            return INVALID_ARGUMENT
        rc = self._compute_profile_refusal(instance, as_int(profile))
        if rc != SUCCESS:
            return rc
        gi = instance.profile
        info.id = full_compute_profile(instance)
        info.sliceCount = gi.slice_count
        info.instanceCount = 1
        info.multiprocessorCount = gi.multiprocessors
        info.sharedCopyEngineCount = gi.copy_engines
        info.sharedDecoderCount = gi.decoders
        info.sharedEncoderCount = gi.encoders
        info.sharedJpegCount = gi.jpeg_engines
        info.sharedOfaCount = gi.ofa_engines
        info.name = f"MIG {gi.name}".encode()  # nvidia-smi names the full compute profile so
        return SUCCESS

    def _nvml_ci_placements(self, handle: Any, profile_id: Any, placements: Any, count: Any) -> int:
        instance, rc = self.gpu_instance(handle)
        if instance is None:
            return rc
        rc = self._compute_profile_refusal(instance, as_int(profile_id))
        if rc != SUCCESS:
            return rc
        if placements is not None:  # nvml.h: with placements == NULL only the count is returned
            array = ctypes.cast(placements, ctypes.POINTER(pynvml.c_nvmlComputeInstancePlacement_t))
            array[0].start = 0
            array[0].size = instance.profile.slice_count
        pointee(count).value = 1
        return SUCCESS

    def _nvml_create_ci(self, handle: Any, profile_id: Any, ref: Any) -> int:
        return self._create_compute_instance(handle, as_int(profile_id), ref)

    def _nvml_create_ci_placed(self, handle: Any, profile_id: Any, placement: Any, ref: Any) -> int:
        instance, rc = self.gpu_instance(handle)
        if instance is None:
            return rc
        if placement is None:
            return INVALID_ARGUMENT
        wanted = placement_arg(placement)
        if (wanted.start, wanted.size) != (0, instance.profile.slice_count):
            return INVALID_ARGUMENT
        return self._create_compute_instance(handle, as_int(profile_id), ref)

    def _nvml_destroy_ci(self, handle: Any) -> int:
        with self._lock:
            found = self.view.compute_instances.get(address_of(handle))
            if found is None:
                return INVALID_ARGUMENT
            instance, ci = found
            if not self._answers(instance.gpu_index):
                return GPU_IS_LOST
            if self._library.processes.get(ci.uuid):  # nvml.h: IN_USE while processes run
                return IN_USE
            shrunk = _replace(
                instance,
                compute_instances=tuple(c for c in instance.compute_instances if c is not ci),
            )
            others = (i for i in self.view.instances[instance.gpu_index] if i is not instance)
            return self._commit(instance.gpu_index, (*others, shrunk))

    def _nvml_compute_instances(self, handle: Any, profile_id: Any, array: Any, count: Any) -> int:
        instance, rc = self.gpu_instance(handle)
        if instance is None:
            return rc
        if as_int(profile_id) >= pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT or array is None:
            return INVALID_ARGUMENT
        found = [
            ci
            for ci in instance.compute_instances
            if as_int(profile_id) == full_compute_profile(instance)
        ]
        handles = ctypes.cast(array, ctypes.POINTER(ctypes.c_void_p))
        for n, ci in enumerate(found):
            handles[n] = self._compute_instance_address(instance, ci)
        pointee(count).value = len(found)
        return SUCCESS

    def _nvml_ci_remaining(self, handle: Any, profile_id: Any, ref: Any) -> int:
        instance, rc = self.gpu_instance(handle)
        if instance is None:
            return rc
        rc = self._compute_profile_refusal(instance, as_int(profile_id))
        if rc != SUCCESS:
            return rc
        pointee(ref).value = 0 if instance.compute_instances else 1
        return SUCCESS

    def _nvml_ci_info(self, handle: Any, ref: Any) -> int:
        found = self.view.compute_instances.get(address_of(handle))
        if found is None:
            return INVALID_ARGUMENT
        instance, ci = found
        if not self._answers(instance.gpu_index):
            return GPU_IS_LOST
        info = pointee(ref)
        info.device = ctypes.cast(
            ctypes.c_void_p(self._base(instance.gpu_index)), pynvml.c_nvmlDevice_t
        )
        info.gpuInstance = ctypes.cast(
            ctypes.c_void_p(self.gpu_instance_address(instance)), pynvml.c_nvmlGpuInstance_t
        )
        info.id = ci.compute_instance_id
        info.profileId = full_compute_profile(instance)
        info.placement.start = 0
        info.placement.size = instance.profile.slice_count
        return SUCCESS
