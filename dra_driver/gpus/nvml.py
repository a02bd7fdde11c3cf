"""GPU discovery through NVML (pynvml): the first step of the node flow.

``discover`` loads ``libnvidia-ml.so.1`` from the NVIDIA driver root, asks NVML about every GPU
and returns plain ``gpus.info`` values that devices.py turns into DRA devices. This module is the
NVML boundary: pynvml's exceptions become ``errors.DiscoveryError`` subclasses here and nowhere
else. With ``--simulate`` the library pynvml calls is sim/nvml/'s stand-in; the code
below does not know the difference.

Strings that users match in CEL selectors (brand, architecture, MIG profile names) are spelled
exactly as NVIDIA's Go driver spells them (go-nvlib ``GetBrandAsString``,
``GetArchitectureAsString``, ``MigProfileInfo.String``), so selectors written for it keep working.

Two facts come from sysfs rather than NVML, read under ``sysfs_root`` as Kubernetes'
``deviceattribute`` helpers read them for NVIDIA's driver: the PCIe root (``pcie_root``) and the
NUMA node (``numa_node``) of each GPU's PCI device.

GPU-instance profiles and their possible placements are read from every MIG-capable GPU, in MIG
mode or not, as NVIDIA's driver reads them (kubernetes-sigs/dra-driver-nvidia-gpu,
``cmd/gpu-kubelet-plugin/nvlib.go`` ``getGpuInfo`` and ``inspectMigProfilesAndPlacements``: every
profile index is asked whatever the MIG mode, ``NOT_SUPPORTED`` and ``INVALID_ARGUMENT`` skip a
profile, any other error fails the GPU; nvml.h documents ``NOT_SUPPORTED`` as "device doesn't
support MIG or profile isn't supported"). Dynamic MIG publishes a Hopper GPU that is not in MIG
mode from them (mig/ondemand_step.py turns MIG mode on when a placement is prepared). MIG
devices exist only in MIG mode, so ``mig_instances`` is empty for a GPU not in MIG mode.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pynvml

from dra_driver.errors import DiscoveryError, GpuError, NoGpusFound, NvmlLibraryNotFound
from dra_driver.gpus.info import (
    GpuFailure,
    GpuInfo,
    Inventory,
    MigInstance,
    MigPlacement,
    MigProfile,
)

logger = logging.getLogger(__name__)

LIBRARY_NAME = "libnvidia-ml.so.1"
LIBRARY_DIRS = (
    "usr/lib64",
    "usr/lib/x86_64-linux-gnu",
    "usr/lib/aarch64-linux-gnu",
    "usr/lib",
    "lib64",
    "lib/x86_64-linux-gnu",
    "lib/aarch64-linux-gnu",
    "lib",
)
"""Where driver installs put the library, relative to the driver root (host or GPU Operator)."""

DEFAULT_SYSFS_ROOT = Path("/sys")

# go-nvlib's spellings (pkg/nvlib/device/device.go); values missing there read "Unknown".
BRANDS = {
    pynvml.NVML_BRAND_UNKNOWN: "Unknown",
    pynvml.NVML_BRAND_QUADRO: "Quadro",
    pynvml.NVML_BRAND_TESLA: "Tesla",
    pynvml.NVML_BRAND_NVS: "NVS",
    pynvml.NVML_BRAND_GRID: "Grid",
    pynvml.NVML_BRAND_GEFORCE: "GeForce",
    pynvml.NVML_BRAND_TITAN: "Titan",
    pynvml.NVML_BRAND_NVIDIA_VAPPS: "NvidiaVApps",
    pynvml.NVML_BRAND_NVIDIA_VPC: "NvidiaVPC",
    pynvml.NVML_BRAND_NVIDIA_VCS: "NvidiaVCS",
    pynvml.NVML_BRAND_NVIDIA_VWS: "NvidiaVWS",
    pynvml.NVML_BRAND_NVIDIA_CLOUD_GAMING: "NvidiaCloudGaming",
    pynvml.NVML_BRAND_QUADRO_RTX: "QuadroRTX",
    pynvml.NVML_BRAND_NVIDIA_RTX: "NvidiaRTX",
    pynvml.NVML_BRAND_NVIDIA: "Nvidia",
    pynvml.NVML_BRAND_GEFORCE_RTX: "GeForceRTX",
    pynvml.NVML_BRAND_TITAN_RTX: "TitanRTX",
}
ARCHITECTURES = {
    pynvml.NVML_DEVICE_ARCH_KEPLER: "Kepler",
    pynvml.NVML_DEVICE_ARCH_MAXWELL: "Maxwell",
    pynvml.NVML_DEVICE_ARCH_PASCAL: "Pascal",
    pynvml.NVML_DEVICE_ARCH_VOLTA: "Volta",
    pynvml.NVML_DEVICE_ARCH_TURING: "Turing",
    pynvml.NVML_DEVICE_ARCH_AMPERE: "Ampere",
    pynvml.NVML_DEVICE_ARCH_ADA: "Ada Lovelace",
    pynvml.NVML_DEVICE_ARCH_HOPPER: "Hopper",
    pynvml.NVML_DEVICE_ARCH_BLACKWELL: "Blackwell",
    pynvml.NVML_DEVICE_ARCH_UNKNOWN: "Unknown",
}
ADDRESSING_MODES = {
    pynvml.NVML_DEVICE_ADDRESSING_MODE_HMM: "HMM",
    pynvml.NVML_DEVICE_ADDRESSING_MODE_ATS: "ATS",
}

# GPU-instance profile index -> compute slices, and the name suffix go-nvlib adds for it.
_P = pynvml
_PROFILE_SLICES = {
    _P.NVML_GPU_INSTANCE_PROFILE_1_SLICE: 1,
    _P.NVML_GPU_INSTANCE_PROFILE_2_SLICE: 2,
    _P.NVML_GPU_INSTANCE_PROFILE_3_SLICE: 3,
    _P.NVML_GPU_INSTANCE_PROFILE_4_SLICE: 4,
    _P.NVML_GPU_INSTANCE_PROFILE_7_SLICE: 7,
    _P.NVML_GPU_INSTANCE_PROFILE_8_SLICE: 8,
    _P.NVML_GPU_INSTANCE_PROFILE_6_SLICE: 6,
    _P.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1: 1,
    _P.NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1: 2,
    _P.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2: 1,
    _P.NVML_GPU_INSTANCE_PROFILE_1_SLICE_GFX: 1,
    _P.NVML_GPU_INSTANCE_PROFILE_2_SLICE_GFX: 2,
    _P.NVML_GPU_INSTANCE_PROFILE_4_SLICE_GFX: 4,
    _P.NVML_GPU_INSTANCE_PROFILE_1_SLICE_NO_ME: 1,
    _P.NVML_GPU_INSTANCE_PROFILE_2_SLICE_NO_ME: 2,
    _P.NVML_GPU_INSTANCE_PROFILE_1_SLICE_ALL_ME: 1,
    _P.NVML_GPU_INSTANCE_PROFILE_2_SLICE_ALL_ME: 2,
    _P.NVML_GPU_INSTANCE_PROFILE_3_SLICE_GFX: 3,
}
_PROFILE_SUFFIX = {
    _P.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1: "+me",
    _P.NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1: "+me",
    _P.NVML_GPU_INSTANCE_PROFILE_1_SLICE_ALL_ME: "+me.all",
    _P.NVML_GPU_INSTANCE_PROFILE_2_SLICE_ALL_ME: "+me.all",
    _P.NVML_GPU_INSTANCE_PROFILE_1_SLICE_GFX: "+gfx",
    _P.NVML_GPU_INSTANCE_PROFILE_2_SLICE_GFX: "+gfx",
    _P.NVML_GPU_INSTANCE_PROFILE_3_SLICE_GFX: "+gfx",
    _P.NVML_GPU_INSTANCE_PROFILE_4_SLICE_GFX: "+gfx",
    _P.NVML_GPU_INSTANCE_PROFILE_1_SLICE_NO_ME: "-me",
    _P.NVML_GPU_INSTANCE_PROFILE_2_SLICE_NO_ME: "-me",
}

_BUS_ID = re.compile(r"^([0-9a-f]{4,8}):([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])$")
_PCIE_ROOT = re.compile(r"^pci[0-9a-f]{4}:[0-9a-f]{2}$")
_MIB = 1024 * 1024

T = TypeVar("T")


def library_candidates(driver_root: Path) -> list[Path]:
    """The paths tried for libnvidia-ml.so.1 under ``driver_root``, in order."""
    return [driver_root / d / LIBRARY_NAME for d in LIBRARY_DIRS]


def discover(*, driver_root: Path, sysfs_root: Path = DEFAULT_SYSFS_ROOT) -> Inventory:
    """Query every GPU NVML sees; one pass, NVML initialised and always shut down again.

    Loads the library from ``driver_root`` unless pynvml already holds one (a real one loaded
    earlier, or simulated GPUs installed by ``simulated_nvml``). A GPU that fails a query is
    logged and recorded in ``Inventory.failures``; the others are still returned.
    Raises NvmlLibraryNotFound, NoGpusFound, or DiscoveryError when NVML as a whole fails.
    """
    _load_library(driver_root)
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise DiscoveryError(
            f"NVML could not be initialised: {exc} (is the NVIDIA kernel driver loaded?)"
        ) from exc
    try:
        return _inventory(sysfs_root)
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError as exc:
            logger.warning("nvmlShutdown failed: %s", exc)


def _load_library(driver_root: Path) -> None:
    with pynvml.libLoadLock:
        if pynvml.nvmlLib is not None:
            return
        problems = []
        for path in library_candidates(driver_root):
            if not path.exists():
                continue
            try:
                library = ctypes.CDLL(str(path))
            except OSError as exc:
                problems.append(f"{path}: {exc}")
                continue
            _install(library)
            logger.info("loaded NVML from %s", path)
            return
        try:
            library = ctypes.CDLL(LIBRARY_NAME)
        except OSError as exc:
            problems.append(f"{LIBRARY_NAME} from the loader's default search path: {exc}")
        else:
            _install(library)
            logger.info("loaded NVML (%s) from the loader's default search path", LIBRARY_NAME)
            return
    searched = ", ".join(str(p) for p in library_candidates(driver_root))
    raise NvmlLibraryNotFound(
        f"cannot load {LIBRARY_NAME} with NVIDIA_DRIVER_ROOT={driver_root}: searched {searched}; "
        f"{'; '.join(problems)}. Set --nvidia-driver-root (NVIDIA_DRIVER_ROOT) to where the "
        "driver is installed (/ for a host install, /run/nvidia/driver with the GPU Operator), "
        "or run with --simulate to use simulated GPUs."
    )


def _install(library: ctypes.CDLL) -> None:
    """Make ``library`` pynvml's NVML (caller holds pynvml.libLoadLock)."""
    pynvml.nvmlLib = library
    pynvml._nvmlGetFunctionPointer_cache.clear()


def _inventory(sysfs_root: Path) -> Inventory:
    try:
        driver_version = pynvml.nvmlSystemGetDriverVersion()
        cuda_driver_version = pynvml.nvmlSystemGetCudaDriverVersion()
        count = pynvml.nvmlDeviceGetCount()
    except pynvml.NVMLError as exc:
        raise DiscoveryError(f"NVML cannot report the driver or the GPU count: {exc}") from exc
    if count == 0:
        raise NoGpusFound(
            f"NVML (driver {driver_version}) reports no GPU on this node; check `nvidia-smi -L`, "
            "or do not run the plugin on nodes without GPUs"
        )
    gpus = []
    failures = []
    for index in range(count):
        try:
            gpus.append(
                _gpu_info(
                    index,
                    driver_version=driver_version,
                    cuda_driver_version=cuda_driver_version,
                    sysfs_root=sysfs_root,
                )
            )
        except GpuError as exc:
            logger.warning("%s; not publishing this GPU", exc)
            failures.append(GpuFailure(index=index, error=str(exc)))
    return Inventory(gpus=tuple(gpus), failures=tuple(failures))


def _query(index: int, fn: Callable[..., T], *args: Any) -> T:
    """Call one pynvml function for GPU ``index``; NVML errors become GpuError naming the call."""
    try:
        return fn(*args)
    except pynvml.NVMLError as exc:
        raise GpuError(index, f"{fn.__name__} failed: {exc}") from exc


def _gpu_info(
    index: int, *, driver_version: str, cuda_driver_version: int, sysfs_root: Path
) -> GpuInfo:
    handle = _query(index, pynvml.nvmlDeviceGetHandleByIndex, index)
    memory_bytes = int(_query(index, pynvml.nvmlDeviceGetMemoryInfo, handle).total)
    pci_bus_id = normalize_pci_bus_id(_query(index, pynvml.nvmlDeviceGetPciInfo, handle).busId)
    brand = _query(index, pynvml.nvmlDeviceGetBrand, handle)
    architecture = _query(index, pynvml.nvmlDeviceGetArchitecture, handle)
    mig_capable, mig_enabled, mig_pending = _mig_mode(index, handle)
    profiles: tuple[MigProfile, ...] = ()
    if mig_capable:
        try:
            profiles = _mig_profiles(index, handle, memory_bytes=memory_bytes)
        except GpuError as exc:
            if mig_enabled:
                raise
            # Not in MIG mode the GPU is usable whole without them: published as a plain GPU.
            logger.warning(
                "cannot read the MIG profiles of GPU %d (not in MIG mode); it is a plain GPU: %s",
                index,
                exc,
            )
    return GpuInfo(
        index=index,
        minor=_query(index, pynvml.nvmlDeviceGetMinorNumber, handle),
        uuid=_query(index, pynvml.nvmlDeviceGetUUID, handle),
        product_name=_query(index, pynvml.nvmlDeviceGetName, handle),
        brand=BRANDS.get(brand, "Unknown"),
        architecture=ARCHITECTURES.get(architecture, "Unknown"),
        cuda_compute_capability=_query(index, pynvml.nvmlDeviceGetCudaComputeCapability, handle),
        memory_bytes=memory_bytes,
        pci_bus_id=pci_bus_id,
        pcie_root=pcie_root(pci_bus_id, sysfs_root=sysfs_root),
        driver_version=driver_version,
        cuda_driver_version=cuda_driver_version,
        mig_capable=mig_capable,
        mig_enabled=mig_enabled,
        mig_pending=mig_pending,
        mig_profiles=profiles,
        mig_instances=_mig_instances(index, handle, profiles) if mig_enabled else (),
        addressing_mode=_addressing_mode(index, handle),
        numa_node=numa_node(pci_bus_id, sysfs_root=sysfs_root),
    )


def normalize_pci_bus_id(bus_id: str | bytes) -> str:
    """NVML's ``00000000:1B:00.0`` as the extended BDF Kubernetes uses: ``0000:1b:00.0``."""
    text = bus_id.decode() if isinstance(bus_id, bytes) else bus_id
    match = _BUS_ID.match(text.strip().lower())
    if match is None:
        raise DiscoveryError(f"NVML returned an unexpected PCI bus id {text!r}")
    domain, bus, device, function = match.groups()
    return f"{int(domain, 16):04x}:{bus}:{device}.{function}"


def pcie_root(pci_bus_id: str, *, sysfs_root: Path = DEFAULT_SYSFS_ROOT) -> str | None:
    """The PCIe root complex (``pci0000:00``) above a device, from its sysfs path; None if unknown.

    ``<sysfs>/bus/pci/devices/<bdf>`` links to ``<sysfs>/devices/pci<domain>:<bus>/.../<bdf>``;
    the ``pci<domain>:<bus>`` component names the root, as in Kubernetes'
    ``deviceattribute.GetPCIeRootAttributeByPCIBusID``.
    """
    link = sysfs_root / "bus" / "pci" / "devices" / pci_bus_id
    try:
        resolved = link.resolve(strict=True)
    except OSError:
        logger.info("no sysfs entry %s; publishing %s without pcieRoot", link, pci_bus_id)
        return None
    for part in resolved.parts:
        if _PCIE_ROOT.match(part):
            return part
    logger.info("sysfs path %s of %s names no PCIe root", resolved, pci_bus_id)
    return None


def numa_node(pci_bus_id: str, *, sysfs_root: Path = DEFAULT_SYSFS_ROOT) -> int | None:
    """The NUMA node the kernel reports for a PCI device, or None when there is none.

    Reads ``<sysfs>/bus/pci/devices/<bdf>/numa_node``, as Kubernetes'
    ``deviceattribute.GetNUMANodeAttributeByPCIBusID`` (which NVIDIA's driver calls) does. The
    kernel writes -1 for a device without NUMA affinity; such a device must not publish
    ``numaNode`` at all, because -1 would match every other NUMA-less device in a
    ``matchAttribute`` constraint. A missing or unreadable file also means None.
    """
    path = sysfs_root / "bus" / "pci" / "devices" / pci_bus_id / "numa_node"
    try:
        text = path.read_text()
    except OSError:
        logger.info("no sysfs file %s; publishing %s without numaNode", path, pci_bus_id)
        return None
    try:
        node = int(text.strip())
    except ValueError:
        logger.warning("sysfs file %s holds %r, not a NUMA node; ignoring it", path, text)
        return None
    if node < 0:
        logger.info("%s has no NUMA affinity (numa_node=%d); no numaNode", pci_bus_id, node)
        return None
    return node


def _mig_mode(index: int, handle: Any) -> tuple[bool, bool, bool]:
    """(capable, current, pending); GPUs without MIG answer NOT_SUPPORTED."""
    try:
        current, pending = pynvml.nvmlDeviceGetMigMode(handle)
    except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound):
        return False, False, False
    except pynvml.NVMLError as exc:
        raise GpuError(index, f"nvmlDeviceGetMigMode failed: {exc}") from exc
    enabled = pynvml.NVML_DEVICE_MIG_ENABLE
    return True, current == enabled, pending == enabled


def mig_profile_name(
    *, profile_index: int, slice_count: int, memory_mib: int, gpu_memory_bytes: int
) -> str:
    """The profile name NVIDIA's driver publishes, e.g. ``1g.10gb``, ``1g.5gb+me``.

    go-nvlib derives it rather than reading NVML's name field: compute slices from the profile
    index, and memory as the profile's share of the GPU rounded up to eighths, times the GPU's
    memory in whole GiB (rounded up), rounded half away from zero.
    """
    slices = _PROFILE_SLICES.get(profile_index, slice_count)
    fraction = math.ceil(memory_mib * _MIB / gpu_memory_bytes * 8) / 8
    total_gib = (gpu_memory_bytes + 1024 * _MIB - 1) // (1024 * _MIB)
    memory_gb = math.floor(fraction * total_gib + 0.5)
    return f"{slices}g.{memory_gb}gb{_PROFILE_SUFFIX.get(profile_index, '')}"


def _mig_profiles(index: int, handle: Any, *, memory_bytes: int) -> tuple[MigProfile, ...]:
    profiles = []
    for profile_index in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
        try:
            info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, profile_index)
        except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_InvalidArgument):
            continue
        except pynvml.NVMLError as exc:
            raise GpuError(
                index, f"nvmlDeviceGetGpuInstanceProfileInfoV({profile_index}) failed: {exc}"
            ) from exc
        placements = _placements(index, handle, info.id)
        if placements is None:
            continue
        profiles.append(
            MigProfile(
                profile_id=info.id,
                name=mig_profile_name(
                    profile_index=profile_index,
                    slice_count=info.sliceCount,
                    memory_mib=info.memorySizeMB,
                    gpu_memory_bytes=memory_bytes,
                ),
                slice_count=info.sliceCount,
                memory_bytes=info.memorySizeMB * _MIB,
                multiprocessors=info.multiprocessorCount,
                copy_engines=info.copyEngineCount,
                decoders=info.decoderCount,
                encoders=info.encoderCount,
                jpeg_engines=info.jpegCount,
                ofa_engines=info.ofaCount,
                instance_count=info.instanceCount,
                placements=placements,
            )
        )
    return _shared_table(tuple(profiles))


@functools.lru_cache(maxsize=16)
def _shared_table(table: tuple[MigProfile, ...]) -> tuple[MigProfile, ...]:
    """The first of equal profile tables: every GPU of a model has the same one (about 60
    placements), so one copy per table, not one per GPU (0.2 MiB of a 64-GPU node's agent).
    Bounded: a node has few models."""
    return table


def _placements(index: int, handle: Any, profile_id: int) -> tuple[MigPlacement, ...] | None:
    """Every possible placement of a profile; None (the profile is skipped, as NVIDIA's driver
    skips it) when NVML answers NOT_SUPPORTED or INVALID_ARGUMENT."""
    count = ctypes.c_uint(0)
    placements_fn = pynvml.nvmlDeviceGetGpuInstancePossiblePlacements
    try:
        # First call with no array: NVML only reports how many placements there are.
        placements_fn(handle, profile_id, None, ctypes.byref(count))
        array = (pynvml.c_nvmlGpuInstancePlacement_t * count.value)()
        placements_fn(handle, profile_id, array, ctypes.byref(count))
    except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_InvalidArgument):
        return None
    except pynvml.NVMLError as exc:
        raise GpuError(index, f"nvmlDeviceGetGpuInstancePossiblePlacements failed: {exc}") from exc
    return tuple(MigPlacement(start=p.start, size=p.size) for p in array[: count.value])


def _mig_instances(
    index: int, handle: Any, profiles: tuple[MigProfile, ...]
) -> tuple[MigInstance, ...]:
    by_id = {p.profile_id: p for p in profiles}
    instances = []
    for mig_index in range(_query(index, pynvml.nvmlDeviceGetMaxMigDeviceCount, handle)):
        try:
            mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, mig_index)
        except (pynvml.NVMLError_NotFound, pynvml.NVMLError_InvalidArgument):
            continue  # an empty slot, as go-nvlib's VisitMigDevices treats it
        except pynvml.NVMLError as exc:
            raise GpuError(index, f"nvmlDeviceGetMigDeviceHandleByIndex failed: {exc}") from exc
        gpu_instance_id = _query(index, pynvml.nvmlDeviceGetGpuInstanceId, mig)
        gpu_instance = _query(index, pynvml.nvmlDeviceGetGpuInstanceById, handle, gpu_instance_id)
        gi_info = _query(index, pynvml.nvmlGpuInstanceGetInfo, gpu_instance)
        profile = by_id.get(gi_info.profileId)
        if profile is None:
            raise GpuError(
                index,
                f"MIG device in GPU instance {gpu_instance_id} uses profile id "
                f"{gi_info.profileId}, which NVML did not list for this GPU",
            )
        instances.append(
            MigInstance(
                uuid=_query(index, pynvml.nvmlDeviceGetUUID, mig),
                gpu_instance_id=gpu_instance_id,
                compute_instance_id=_query(index, pynvml.nvmlDeviceGetComputeInstanceId, mig),
                profile=profile,
                placement=MigPlacement(start=gi_info.placement.start, size=gi_info.placement.size),
                memory_bytes=int(_query(index, pynvml.nvmlDeviceGetMemoryInfo, mig).total),
                multiprocessors=_query(
                    index, pynvml.nvmlDeviceGetAttributes, mig
                ).multiprocessorCount,
            )
        )
    return tuple(instances)


def _addressing_mode(index: int, handle: Any) -> str | None:
    """HMM or ATS on coherent-memory platforms; None where unsupported or inactive."""
    try:
        mode = pynvml.nvmlDeviceGetAddressingMode(handle)
    except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound):
        return None
    except pynvml.NVMLError as exc:
        raise GpuError(index, f"nvmlDeviceGetAddressingMode failed: {exc}") from exc
    return ADDRESSING_MODES.get(mode)
