"""What discovery asks NVML about each device: identity, memory, PCI, modes, MIG devices, processes.

The device-query side of the simulated library (library.py collects the table): names, UUIDs,
brand and architecture, memory, PCI info, minor numbers, addressing and compute modes, the MIG
queries discovery makes (GPU-instance profiles and placements, MIG device handles, their ids and
attributes, GPU instances by id) and the compute processes running on a device. Each answer is
read from the node's values (node.py) and the instances that exist now (mig.py), with the
return codes nvml.h documents.
"""

from __future__ import annotations

import ctypes
import json
from collections.abc import Callable
from typing import Any

import pynvml

from dra_driver.sim.nvml.abi import (
    INSUFFICIENT_SIZE,
    INVALID_ARGUMENT,
    NO_INSTANCE,
    NOT_FOUND,
    NOT_SUPPORTED,
    SUCCESS,
    VERSION_MISMATCH,
    as_int,
    nvml_bus_id,
    pointee,
    set_pointer,
    write_string,
)
from dra_driver.sim.nvml.node import profile_by_id, profile_by_index
from dra_driver.sim.nvml.parts import Library
from dra_driver.sim.nvml.spec import TOTAL_COMPUTE_SLICES

DRIVER_GPU_INSTANCE_PROFILE_COUNT = 0x11
"""The GPU-instance profile indices the simulated driver knows (R580's nvml.h: 0 to 0x10). A
real H200 on 580.159.04 answers INVALID_ARGUMENT for index 0x11, which pynvml 13 already names
(``NVML_GPU_INSTANCE_PROFILE_3_SLICE_GFX``), and NOT_SUPPORTED for known ones it lacks."""

_COMPUTE_MODES: dict[str, int] = {
    "DEFAULT": pynvml.NVML_COMPUTEMODE_DEFAULT,
    "EXCLUSIVE_THREAD": pynvml.NVML_COMPUTEMODE_EXCLUSIVE_THREAD,
    "PROHIBITED": pynvml.NVML_COMPUTEMODE_PROHIBITED,
    "EXCLUSIVE_PROCESS": pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS,
}


class DeviceQueries:
    """The device query functions of one simulated library; stateless (the library holds it)."""

    def __init__(self, library: Library) -> None:
        self._library = library

    def functions(self) -> dict[str, Callable[..., Any]]:
        return {
            "nvmlDeviceGetName": self._name,
            "nvmlDeviceGetUUID": self._uuid,
            "nvmlDeviceGetBrand": self._brand,
            "nvmlDeviceGetArchitecture": self._architecture,
            "nvmlDeviceGetCudaComputeCapability": self._compute_capability,
            "nvmlDeviceGetMemoryInfo": self._memory_info,
            "nvmlDeviceGetMemoryInfo_v2": self._memory_info_v2,
            "nvmlDeviceGetPciInfo_v3": self._pci_info,
            "nvmlDeviceGetMinorNumber": self._minor,
            "nvmlDeviceGetAddressingMode": self._addressing_mode,
            "nvmlDeviceGetMigMode": self._mig_mode,
            "nvmlDeviceGetComputeMode": self._compute_mode,
            "nvmlDeviceGetGpuInstanceProfileInfoV": self._gi_profile_info,
            "nvmlDeviceGetGpuInstancePossiblePlacements_v2": self._gi_placements,
            "nvmlDeviceGetMaxMigDeviceCount": self._max_mig_count,
            "nvmlDeviceGetMigDeviceHandleByIndex": self._mig_handle_by_index,
            "nvmlDeviceIsMigDeviceHandle": self._is_mig_handle,
            "nvmlDeviceGetGpuInstanceId": self._gpu_instance_id,
            "nvmlDeviceGetComputeInstanceId": self._compute_instance_id,
            "nvmlDeviceGetAttributes_v2": self._attributes,
            "nvmlDeviceGetGpuInstanceById": self._gpu_instance_by_id,
            "nvmlGpuInstanceGetInfo": self._gpu_instance_info,
            "nvmlDeviceGetComputeRunningProcesses_v3": self._running_processes,
        }

    def _name(self, handle: Any, buffer: Any, length: Any) -> int:
        gpu, mig, rc = self._library.device(handle)
        if gpu is None or rc != SUCCESS:
            return rc
        name = gpu.spec.hardware.product_name
        return write_string(buffer, length, f"{name} MIG {mig.profile.name}" if mig else name)

    def _uuid(self, handle: Any, buffer: Any, length: Any) -> int:
        gpu, mig, rc = self._library.device(handle)
        if gpu is None or rc != SUCCESS:
            return rc
        return write_string(buffer, length, mig.uuid if mig else gpu.uuid)

    def _brand(self, handle: Any, ref: Any) -> int:
        gpu, _, rc = self._library.device(handle)
        if gpu is not None and rc == SUCCESS:
            pointee(ref).value = gpu.spec.hardware.brand
        return rc

    def _architecture(self, handle: Any, ref: Any) -> int:
        gpu, _, rc = self._library.device(handle)
        if gpu is not None and rc == SUCCESS:
            pointee(ref).value = gpu.spec.hardware.architecture
        return rc

    def _compute_capability(self, handle: Any, major: Any, minor: Any) -> int:
        gpu, _, rc = self._library.device(handle)
        if gpu is not None and rc == SUCCESS:
            pointee(major).value, pointee(minor).value = gpu.spec.hardware.cuda_compute_capability
        return rc

    def _memory_info(self, handle: Any, ref: Any) -> int:
        """nvmlDeviceGetMemoryInfo (v1): the driver's reserved memory counted as used."""
        gpu, mig, rc = self._library.device(handle)
        if gpu is None or rc != SUCCESS:
            return rc
        info = self._library.readings.memory(gpu, mig)
        memory = pointee(ref)
        memory.total = info.total
        memory.used = info.used + info.reserved
        memory.free = info.free
        return SUCCESS

    def _memory_info_v2(self, handle: Any, ref: Any) -> int:
        """nvmlDeviceGetMemoryInfo_v2: reserved apart, used without it (what nvidia-smi shows)."""
        gpu, mig, rc = self._library.device(handle)
        if gpu is None or rc != SUCCESS:
            return rc
        memory = pointee(ref)
        if memory.version != pynvml.nvmlMemory_v2:
            return VERSION_MISMATCH
        info = self._library.readings.memory(gpu, mig)
        memory.total, memory.reserved = info.total, info.reserved
        memory.used, memory.free = info.used, info.free
        return SUCCESS

    def _pci_info(self, handle: Any, ref: Any) -> int:
        gpu, _, rc = self._library.device(handle)
        if gpu is None or rc != SUCCESS:
            return rc
        info = pointee(ref)
        domain, bus, device_function = gpu.pci_bus_id.split(":")
        info.busId = nvml_bus_id(gpu.pci_bus_id).encode()
        info.busIdLegacy = nvml_bus_id(gpu.pci_bus_id)[4:].encode()
        info.domain = int(domain, 16)
        info.bus = int(bus, 16)
        info.device = int(device_function.split(".")[0], 16)
        info.pciDeviceId = gpu.spec.hardware.pci_device_id
        return SUCCESS

    def _minor(self, handle: Any, ref: Any) -> int:
        gpu, rc = self._library.full_gpu(handle)
        if gpu is not None and rc == SUCCESS:
            pointee(ref).value = gpu.minor
        return rc

    def _addressing_mode(self, handle: Any, ref: Any) -> int:
        gpu, _, rc = self._library.device(handle)
        if gpu is None or rc != SUCCESS:
            return rc
        mode = pointee(ref)
        if mode.version != pynvml.nvmlDeviceAddressingMode_v1:
            return VERSION_MISMATCH
        if gpu.spec.addressing_mode is None:
            return NOT_SUPPORTED
        mode.value = gpu.spec.addressing_mode
        return SUCCESS

    def _mig_mode(self, handle: Any, current: Any, pending: Any) -> int:
        gpu, rc = self._library.full_gpu(handle)
        if gpu is None or rc != SUCCESS:
            return rc
        if not gpu.spec.hardware.mig_capable:
            return NOT_SUPPORTED
        current_mode, pending_mode = self._library.mig.mode(gpu)
        pointee(current).value = int(current_mode)
        pointee(pending).value = int(pending_mode)
        return SUCCESS

    def _compute_mode(self, handle: Any, mode: Any) -> int:
        gpu, mig, rc = self._library.device(handle)
        if gpu is None or rc != SUCCESS:
            return rc
        if mig is not None:  # a property of the whole GPU
            return NOT_SUPPORTED
        modes: dict[str, Any] = {}
        if self._library.compute_modes is not None:
            try:
                modes = json.loads(self._library.compute_modes.read_text())
            except (OSError, ValueError):
                modes = {}
        pointee(mode).value = _COMPUTE_MODES.get(str(modes.get(gpu.uuid, "DEFAULT")), 0)
        return SUCCESS

    def _gi_profile_info(self, handle: Any, index: Any, ref: Any) -> int:
        gpu, rc = self._library.full_gpu(handle)
        if gpu is None or rc != SUCCESS:
            return rc
        info = pointee(ref)
        if info.version != pynvml.nvmlGpuInstanceProfileInfo_v2:
            return VERSION_MISMATCH
        if as_int(index) >= DRIVER_GPU_INSTANCE_PROFILE_COUNT:
            return INVALID_ARGUMENT
        # nvml.h: NOT_SUPPORTED "if device doesn't support MIG or profile isn't supported".
        # Answered in MIG mode or not: NVIDIA's driver reads every MIG-capable GPU's profiles
        # and placements whatever its MIG mode (dra-driver-nvidia-gpu nvlib.go getGpuInfo,
        # inspectMigProfilesAndPlacements) and publishes a Hopper not in MIG mode from them.
        profile = profile_by_index(gpu, as_int(index))
        if profile is None or not gpu.spec.hardware.mig_capable:
            return NOT_SUPPORTED
        info.id = profile.profile_id
        info.isP2pSupported = 0
        info.sliceCount = profile.slice_count
        info.instanceCount = profile.instance_count
        info.multiprocessorCount = profile.multiprocessors
        info.copyEngineCount = profile.copy_engines
        info.decoderCount = profile.decoders
        info.encoderCount = profile.encoders
        info.jpegCount = profile.jpeg_engines
        info.ofaCount = profile.ofa_engines
        info.memorySizeMB = profile.memory_mib
        info.name = f"MIG {profile.name}".encode()
        info.version = 0  # the real library hands the whole structure back, version zeroed
        return SUCCESS

    def _gi_placements(self, handle: Any, profile_id: Any, placements: Any, count: Any) -> int:
        gpu, rc = self._library.full_gpu(handle)
        if gpu is None or rc != SUCCESS:
            return rc
        profile = profile_by_id(gpu, as_int(profile_id))
        if profile is None or not gpu.spec.hardware.mig_capable:
            return NOT_SUPPORTED  # every possible placement, in MIG mode or not (as above)
        # nvml.h: with placements == NULL only the count is returned.
        if placements is not None:
            array = ctypes.cast(placements, ctypes.POINTER(pynvml.c_nvmlGpuInstancePlacement_t))
            for i, start in enumerate(profile.placement_starts):
                array[i].start = start
                array[i].size = profile.placement_size
        pointee(count).value = len(profile.placement_starts)
        return SUCCESS

    def _max_mig_count(self, handle: Any, ref: Any) -> int:
        gpu, rc = self._library.full_gpu(handle)
        if gpu is None or rc != SUCCESS:
            return rc
        if not gpu.spec.hardware.mig_capable:
            return NOT_SUPPORTED
        pointee(ref).value = TOTAL_COMPUTE_SLICES
        return SUCCESS

    def _mig_handle_by_index(self, handle: Any, index: Any, ref: Any) -> int:
        gpu, rc = self._library.full_gpu(handle)
        if gpu is None or rc != SUCCESS:
            return rc
        if not self._library.mig.enabled(gpu):
            return NOT_SUPPORTED
        i = as_int(index)
        if i >= TOTAL_COMPUTE_SLICES:
            return INVALID_ARGUMENT
        migs = self._library.mig.devices(gpu)
        if i >= len(migs):
            return NOT_FOUND
        set_pointer(ref, self._library.mig.mig_address(gpu, migs[i]))
        return SUCCESS

    def _is_mig_handle(self, handle: Any, ref: Any) -> int:
        gpu, mig, rc = self._library.device(handle)
        if gpu is not None and rc == SUCCESS:
            pointee(ref).value = int(mig is not None)
        return rc

    def _gpu_instance_id(self, handle: Any, ref: Any) -> int:
        gpu, mig, rc = self._library.device(handle)
        if gpu is None or rc != SUCCESS:
            return rc
        if mig is None:
            return INVALID_ARGUMENT
        pointee(ref).value = mig.gpu_instance_id
        return SUCCESS

    def _compute_instance_id(self, handle: Any, ref: Any) -> int:
        gpu, mig, rc = self._library.device(handle)
        if gpu is None or rc != SUCCESS:
            return rc
        if mig is None:
            return INVALID_ARGUMENT
        pointee(ref).value = mig.compute_instance_id
        return SUCCESS

    def _attributes(self, handle: Any, ref: Any) -> int:
        gpu, mig, rc = self._library.device(handle)
        if gpu is None or rc != SUCCESS:
            return rc
        if mig is None:
            return NOT_SUPPORTED  # nvml.h: only MIG device handles are supported
        attributes = pointee(ref)
        profile = mig.profile
        attributes.multiprocessorCount = profile.multiprocessors
        attributes.sharedCopyEngineCount = profile.copy_engines
        attributes.sharedDecoderCount = profile.decoders
        attributes.sharedEncoderCount = profile.encoders
        attributes.sharedJpegCount = profile.jpeg_engines
        attributes.sharedOfaCount = profile.ofa_engines
        attributes.gpuInstanceSliceCount = profile.slice_count
        attributes.computeInstanceSliceCount = profile.slice_count
        attributes.memorySizeMB = profile.memory_mib
        return SUCCESS

    def _gpu_instance_by_id(self, handle: Any, gpu_instance_id: Any, ref: Any) -> int:
        gpu, rc = self._library.full_gpu(handle)
        if gpu is None or rc != SUCCESS:
            return rc
        if not self._library.mig.enabled(gpu):
            return NOT_SUPPORTED
        instances = self._library.mig.view.instances[gpu.index]
        found = next((i for i in instances if i.id == as_int(gpu_instance_id)), None)
        if found is None:
            return NOT_FOUND
        set_pointer(ref, self._library.mig.gpu_instance_address(found))
        return SUCCESS

    def _gpu_instance_info(self, gpu_instance: Any, ref: Any) -> int:
        found, rc = self._library.mig.gpu_instance(gpu_instance)
        if found is None:
            return rc
        info = pointee(ref)
        info.device = ctypes.cast(
            ctypes.c_void_p(self._library.handles.gpu_address[found.gpu_index]),
            pynvml.c_nvmlDevice_t,
        )
        info.id = found.id
        info.profileId = found.profile.profile_id
        info.placement.start = found.start
        info.placement.size = found.profile.placement_size
        return SUCCESS

    def _running_processes(self, handle: Any, count: Any, array: Any) -> int:
        """nvml.h: a MIG device's handle lists its processes; a GPU's lists its own and, in MIG
        mode, those of its MIG devices (with their GPU/compute instance ids)."""
        gpu, mig, rc = self._library.device(handle)
        if gpu is None or rc != SUCCESS:
            return rc
        devices = [mig] if mig is not None else list(self._library.mig.devices(gpu))
        found = (
            []
            if mig is not None
            else [(p, NO_INSTANCE, NO_INSTANCE) for p in self._library.processes.get(gpu.uuid, ())]
        )
        for device in devices:
            assert device is not None
            found.extend(
                (p, device.gpu_instance_id, device.compute_instance_id)
                for p in self._library.processes.get(device.uuid, ())
            )
        size = pointee(count)
        if array is None or size.value < len(found):
            size.value = len(found)
            return INSUFFICIENT_SIZE if found else SUCCESS
        entries = ctypes.cast(array, ctypes.POINTER(pynvml.c_nvmlProcessInfo_v3_t))
        for n, (pid, gi, ci) in enumerate(found):
            entries[n].pid = pid
            entries[n].usedGpuMemory = 0
            entries[n].gpuInstanceId = gi
            entries[n].computeInstanceId = ci
        size.value = len(found)
        return SUCCESS
