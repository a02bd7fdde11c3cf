"""GPU and MIG facts -> DRA devices: names, attributes, capacities, counters. Pure.

Input: ``gpus.info.GpuInfo`` values from discovery (NVML or simulated). Output: ``NodeDevices``,
the devices and shared counter sets of this node's pool, already within the API's validation
rules (nvidia-compat.md "Attributes", spec D.1). Nothing here does I/O.

MIG modes (``--mig-mode``): in ``static`` mode a GPU in MIG mode offers the MIG devices that
exist. In ``dynamic`` mode (partitionable devices, KEP-4815; nvidia-compat.md "Dynamic MIG") a GPU
in MIG mode whose existing MIG devices were all created by this driver offers one counter set
``gpu-<minor>-counter-set`` (its largest profile's capacities as counters plus one
``memory-slice-<i>`` counter per memory slice) and one device per GPU-instance profile and
placement (consuming the profile's capacities and the memory slices the placement covers), and
on GPUs that change MIG mode without a reset (Hopper and newer) the whole GPU ``gpu-<minor>``,
consuming every counter: preparing it takes the GPU out of MIG mode (docs/plugin.md "Dynamic
MIG"). A GPU with a MIG device the driver did not create keeps the static behaviour.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

from dra_driver.errors import DeviceModelError
from dra_driver.gpus.info import GpuInfo, Inventory, MigInstance, MigProfile
from dra_driver.quantity import QuantityError, binary, decimal, parse_quantity


@dataclass(frozen=True)
class Version:
    """A ``version`` attribute value: a semver 2.0.0 string without a leading v."""

    value: str


AttributeValue = bool | int | str | Version
"""One DRA attribute value; the Python type picks the API member (bool/int/string/version)."""

TaintEffect = Literal["None", "NoSchedule", "NoExecute"]


@dataclass(frozen=True)
class Taint:
    key: str
    value: str
    effect: TaintEffect


@dataclass(frozen=True)
class CounterConsumption:
    """Counters one device takes from a shared counter set while allocated (KEP-4815)."""

    counter_set: str
    counters: Mapping[str, str]  # counter name -> canonical quantity string


@dataclass(frozen=True)
class CounterSet:
    """A shared counter set: what all devices consuming from it may use together."""

    name: str
    counters: Mapping[str, str]  # counter name -> canonical quantity string


@dataclass(frozen=True, kw_only=True)
class RequestPolicy:
    """How shares of one capacity are requested from a device that allows multiple allocations
    (KEP-5075 ``requestPolicy``): the amount a request that names none consumes, and either the
    valid values or a valid range (``min``, optional ``max`` and ``step``). Canonical quantity
    strings, like capacities."""

    default: str | None = None
    valid_values: tuple[str, ...] = ()
    range_min: str | None = None
    range_max: str | None = None
    range_step: str | None = None


@dataclass(frozen=True)
class Device:
    """One device of the pool, in resource.k8s.io/v1 terms.

    Attribute and capacity names are unqualified (the driver's own domain) or carry a domain
    (``resource.kubernetes.io/pciBusID``). Capacity values are canonical quantity strings, so a
    published slice compares equal to what the API server stores.
    """

    name: str
    attributes: Mapping[str, AttributeValue]
    capacity: Mapping[str, str]
    consumes_counters: tuple[CounterConsumption, ...] = ()
    taints: tuple[Taint, ...] = ()
    # KEP-5075 (consumable capacity, shares.py): several claims may hold the device at once,
    # each consuming part of its capacities; request_policies is keyed by capacity name.
    allow_multiple_allocations: bool = False
    request_policies: Mapping[str, RequestPolicy] = field(default_factory=dict)


@dataclass(frozen=True)
class NodeDevices:
    """Everything this node offers: the devices of its pool and their shared counter sets."""

    devices: tuple[Device, ...] = ()
    counter_sets: tuple[CounterSet, ...] = field(default=())


def with_taints(node_devices: NodeDevices, taints: Mapping[str, tuple[Taint, ...]]) -> NodeDevices:
    """``node_devices`` with ``taints[name]`` added to each named device; names the pool does not
    have are ignored. Returns ``node_devices`` itself when nothing is added.

    A device of a partitionable GPU (dynamic MIG: it consumes from ``gpu-<minor>-counter-set``)
    that has no taints of its own in ``taints`` gets those of its GPU, ``taints["gpu-<minor>"]``:
    a lost GPU taints every placement, created or not.
    """

    def wanted(device: Device) -> tuple[Taint, ...]:
        own = taints.get(device.name)
        if own:
            return own
        for consumption in device.consumes_counters:
            gpu, suffix, rest = consumption.counter_set.rpartition(COUNTER_SET_SUFFIX)
            if suffix and not rest and taints.get(gpu):
                return taints[gpu]
        return ()

    added = [wanted(d) for d in node_devices.devices]
    if not any(added):
        return node_devices
    return NodeDevices(
        devices=tuple(
            replace(d, taints=d.taints + extra) if extra else d
            for d, extra in zip(node_devices.devices, added, strict=True)
        ),
        counter_sets=node_devices.counter_sets,
    )


# --- GPU/MIG facts -> devices ------------------------------------------------------------------

STANDARD_DOMAIN = "resource.kubernetes.io"
PCI_BUS_ID_ATTRIBUTE = f"{STANDARD_DOMAIN}/pciBusID"
PCIE_ROOT_ATTRIBUTE = f"{STANDARD_DOMAIN}/pcieRoot"
NUMA_NODE_ATTRIBUTE = f"{STANDARD_DOMAIN}/numaNode"

MAX_NAME_LENGTH = 63  # DNS label
MAX_ATTRIBUTES_AND_CAPACITIES = 32
MAX_STRING_LENGTH = 64
MAX_VERSION_LENGTH = 64
MAX_IDENTIFIER_LENGTH = 32
MAX_DOMAIN_LENGTH = 63
MAX_TAINTS = 16
MAX_COUNTER_CONSUMPTIONS = 2
MAX_COUNTERS = 32
MAX_VALID_VALUES = 10

UNSTABLE_ATTRIBUTES = frozenset({"index", "minor"})
"""NVIDIA's driver stopped publishing these in 2025: they change when GPUs are drained."""

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_C_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# semver.org's reference expression for 2.0.0.
_SEMVER = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
    r"(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?$"
)
_MIG_NAME = re.compile(
    r"^gpu-(0|[1-9]\d*)-mig-([a-z0-9]+(?:-[a-z0-9]+)*)-(0|[1-9]\d*)-(0|[1-9]\d*)$"
)
_INT64 = (-(2**63), 2**63 - 1)

MigMode = Literal["static", "dynamic"]
MIG_MODES: tuple[MigMode, ...] = ("static", "dynamic")
COUNTER_SET_SUFFIX = "-counter-set"


def node_devices(
    inventory: Inventory,
    *,
    driver_name: str,
    mig_mode: MigMode = "static",
    managed_mig: frozenset[str] = frozenset(),
) -> NodeDevices:
    """The devices (and counter sets) this node publishes for ``inventory``, in a stable order.

    ``static``: a GPU in MIG mode is not published itself; its existing MIG devices are.
    ``dynamic``: a GPU in MIG mode all of whose existing MIG devices are named in
    ``managed_mig`` (the MIG devices this driver created) is published as partitionable (see the
    module docstring); one with any other MIG device keeps the static behaviour
    (:func:`unmanaged_mig_devices` names them). Pure. Every device passes ``validate_device``;
    names are unique, or DeviceModelError is raised.
    """
    _validate_driver_name(driver_name)
    if mig_mode not in MIG_MODES:
        raise DeviceModelError(f"MIG mode {mig_mode!r} is not one of {', '.join(MIG_MODES)}")
    devices: list[Device] = []
    counter_sets: list[CounterSet] = []
    # Partitionable GPUs after the others: the scheduler takes the first device that fits, so a
    # whole-GPU claim gets a GPU not in MIG mode before one that must leave MIG mode for it.
    partitionable: list[Device] = []
    for gpu in sorted(inventory.gpus, key=lambda g: g.minor):
        if mig_mode == "dynamic" and is_partitionable(gpu, managed_mig=managed_mig):
            counter_set, partitions = partitionable_gpu(gpu)
            counter_sets.append(counter_set)
            partitionable.extend(partitions)
        elif gpu.mig_enabled:
            instances = sorted(gpu.mig_instances, key=lambda m: (m.placement.start, m.uuid))
            devices.extend(_mig_device(gpu, mig) for mig in instances)
        else:
            devices.append(_gpu_device(gpu))
    devices.extend(partitionable)
    seen: set[str] = set()
    for device in devices:
        validate_device(device)
        if device.name in seen:
            raise DeviceModelError(f"device name {device.name!r} would be published twice")
        seen.add(device.name)
    return NodeDevices(devices=tuple(devices), counter_sets=tuple(counter_sets))


def mig_instance_name(gpu: GpuInfo, mig: MigInstance) -> str:
    """The device name of an existing MIG device (the same for static and dynamic MIG)."""
    return mig_device_name(
        parent_minor=gpu.minor,
        profile=mig.profile.name,
        profile_id=mig.profile.profile_id,
        placement_start=mig.placement.start,
    )


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
    """Whether dynamic MIG mode publishes ``gpu`` as partitionable: it is in MIG mode, reports
    its GPU-instance profiles, and every MIG device on it is one this driver created."""
    return (
        gpu.mig_enabled
        and bool(gpu.mig_profiles)
        and not unmanaged_mig_devices(gpu, managed_mig=managed_mig)
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


def semver_driver_version(version: str) -> str:
    """NVML's driver version as semver: ``570.124.06`` -> ``570.124.6``, ``470.82`` -> ``470.82.0``.

    The same result as NVIDIA's driver, which parses it leniently (Masterminds/semver).
    """
    parts = version.strip().split(".")
    if not 1 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
        raise DeviceModelError(f"driver version {version!r} cannot be read as MAJOR.MINOR.PATCH")
    numbers = [int(p) for p in parts] + [0] * (3 - len(parts))
    return ".".join(str(n) for n in numbers)


def semver_cuda_driver_version(version: int) -> str:
    """NVML's CUDA driver version integer as semver: ``12080`` -> ``12.8.0``."""
    return f"{version // 1000}.{version % 1000 // 10}.0"


def _common_attributes(gpu: GpuInfo) -> dict[str, AttributeValue]:
    major, minor = gpu.cuda_compute_capability
    attributes: dict[str, AttributeValue] = {
        "productName": gpu.product_name,
        "brand": gpu.brand,
        "architecture": gpu.architecture,
        "cudaComputeCapability": Version(f"{major}.{minor}.0"),
        "driverVersion": Version(semver_driver_version(gpu.driver_version)),
        "cudaDriverVersion": Version(semver_cuda_driver_version(gpu.cuda_driver_version)),
        PCI_BUS_ID_ATTRIBUTE: gpu.pci_bus_id,
    }
    if gpu.pcie_root is not None:
        attributes[PCIE_ROOT_ATTRIBUTE] = gpu.pcie_root
    if gpu.numa_node is not None:
        attributes[NUMA_NODE_ATTRIBUTE] = gpu.numa_node
    if gpu.addressing_mode is not None:
        attributes["addressingMode"] = gpu.addressing_mode
    return attributes


def _gpu_device(gpu: GpuInfo) -> Device:
    return Device(
        name=gpu_device_name(gpu.minor),
        attributes={"type": "gpu", "uuid": gpu.uuid, **_common_attributes(gpu)},
        capacity={"memory": binary(gpu.memory_bytes)},
    )


def _mig_device(gpu: GpuInfo, mig: MigInstance) -> Device:
    profile = mig.profile
    return Device(
        name=mig_device_name(
            parent_minor=gpu.minor,
            profile=profile.name,
            profile_id=profile.profile_id,
            placement_start=mig.placement.start,
        ),
        attributes={
            "type": "mig",
            "uuid": mig.uuid,
            "parentUUID": gpu.uuid,
            "profile": profile.name,
            **_common_attributes(gpu),
        },
        capacity={
            "multiprocessors": decimal(profile.multiprocessors),
            "copyEngines": decimal(profile.copy_engines),
            "decoders": decimal(profile.decoders),
            "encoders": decimal(profile.encoders),
            "jpegEngines": decimal(profile.jpeg_engines),
            "ofaEngines": decimal(profile.ofa_engines),
            "memory": binary(profile.memory_bytes),
            **{
                memory_slice_capacity(i): decimal(1)
                for i in range(mig.placement.start, mig.placement.start + mig.placement.size)
            },
        },
    )


# --- dynamic MIG: partitionable GPUs (KEP-4815) ------------------------------------------------

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


def whole_gpu_offered(gpu: GpuInfo) -> bool:
    """Whether a partitionable GPU also offers itself whole (dynamic MIG): its architecture
    changes MIG mode without a GPU reset."""
    return gpu.architecture in MIG_TOGGLE_ARCHITECTURES


def partitionable_gpu(gpu: GpuInfo) -> tuple[CounterSet, tuple[Device, ...]]:
    """The counter set and devices of a GPU in dynamic MIG mode (nvidia-compat.md "Dynamic MIG").

    Counters: per capacity the largest value any of its GPU-instance profiles has, and one
    ``memory-slice-<i>`` per memory slice, up to the end of the furthest placement (NVIDIA's
    driver takes the largest placement size; both are 8 on A100, H100 and H200). Devices: every
    profile's every placement, smallest memory first, so that first fit picks the smallest
    partition that satisfies a selector. A placement device has no ``uuid`` (the MIG device
    does not exist until a claim gets it) and carries the static MIG device's ``memorySlice<i>``
    capacities too, so placement selectors work in both modes. The whole GPU comes first (as a
    GPU not in MIG mode is published, with its ``uuid``), consuming every counter, where
    :func:`whole_gpu_offered` says so: preparing it takes the GPU out of MIG mode, which GPUs
    before Hopper cannot do without a reset (NVIDIA's driver does not toggle them either).
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
    common = _common_attributes(gpu)
    devices: list[Device] = []
    if whole_gpu_offered(gpu):
        whole = _gpu_device(gpu)
        devices.append(
            replace(
                whole,
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


# --- validation (spec D.1, k8s:pkg/apis/resource/validation/validation.go) --------------------


def _validate_driver_name(driver_name: str) -> None:
    if len(driver_name) > MAX_DOMAIN_LENGTH or not _DNS_SUBDOMAIN.match(driver_name.lower()):
        raise DeviceModelError(
            f"driver name {driver_name!r} is not a DNS subdomain of at most "
            f"{MAX_DOMAIN_LENGTH} characters"
        )


def _qualified_name_problem(name: str) -> str | None:
    """Why ``name`` is not a valid attribute/capacity name, or None if it is."""
    domain, slash, identifier = name.rpartition("/")
    if slash:
        if not domain:
            return "the domain before '/' is empty"
        if len(domain) > MAX_DOMAIN_LENGTH or not _DNS_SUBDOMAIN.match(domain.lower()):
            return f"domain {domain!r} is not a DNS subdomain of at most {MAX_DOMAIN_LENGTH} chars"
    if not _C_IDENTIFIER.match(identifier):
        return f"{identifier!r} is not a C identifier ([A-Za-z_][A-Za-z0-9_]*)"
    if len(identifier) > MAX_IDENTIFIER_LENGTH:
        return f"{identifier!r} is longer than {MAX_IDENTIFIER_LENGTH} characters"
    return None


def _attribute_problem(value: object) -> str | None:
    """Why ``value`` is not a valid attribute value, or None if it is."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        if not _INT64[0] <= value <= _INT64[1]:
            return f"int {value} does not fit in int64"
        return None
    if isinstance(value, str):
        if len(value) > MAX_STRING_LENGTH:
            return f"string is {len(value)} characters, more than {MAX_STRING_LENGTH}"
        return None
    if isinstance(value, Version):
        if len(value.value) > MAX_VERSION_LENGTH:
            return f"version is longer than {MAX_VERSION_LENGTH} characters"
        if not _SEMVER.match(value.value):
            return (
                f"version {value.value!r} is not semver 2.0.0 (MAJOR.MINOR.PATCH, no leading zeros)"
            )
        return None
    return f"{type(value).__name__} is not an attribute type (bool, int, str, Version)"


def validate_device(device: Device) -> None:
    """Raise DeviceModelError naming the device and the field if the API server would reject it.

    Checks the ResourceSlice device rules of spec D.1: DNS-label name, qualified attribute and
    capacity names, at most 32 attributes and capacities together, string and version limits,
    canonical-parsable capacity quantities, counter consumption and taint limits. Also refuses
    ``index``/``minor`` attributes (nvidia-compat.md: not stable, not published).
    """
    where = f"device {device.name!r}"
    if len(device.name) > MAX_NAME_LENGTH or not _DNS_LABEL.match(device.name):
        raise DeviceModelError(
            f"{where}: name is not a DNS label (lowercase letters, digits and '-', at most "
            f"{MAX_NAME_LENGTH} characters, starting and ending with a letter or digit)"
        )
    total = len(device.attributes) + len(device.capacity)
    if total > MAX_ATTRIBUTES_AND_CAPACITIES:
        raise DeviceModelError(
            f"{where}: {total} attributes and capacities, at most "
            f"{MAX_ATTRIBUTES_AND_CAPACITIES} allowed"
        )
    for name, value in device.attributes.items():
        problem = _qualified_name_problem(name) or _attribute_problem(value)
        if problem is None and name in UNSTABLE_ATTRIBUTES:
            problem = "index and minor are not stable across GPU drains and are not published"
        if problem is not None:
            raise DeviceModelError(f"{where}: attribute {name!r}: {problem}")
    for name, quantity in device.capacity.items():
        problem = _qualified_name_problem(name)
        if problem is None:
            try:
                parse_quantity(quantity)
            except QuantityError as exc:
                problem = str(exc)
        if problem is not None:
            raise DeviceModelError(f"{where}: capacity {name!r}: {problem}")
    _validate_counters(device, where=where)
    _validate_request_policies(device, where=where)
    if len(device.taints) > MAX_TAINTS:
        raise DeviceModelError(f"{where}: {len(device.taints)} taints, at most {MAX_TAINTS}")
    for taint in device.taints:
        if taint.effect not in ("None", "NoSchedule", "NoExecute"):
            raise DeviceModelError(f"{where}: taint {taint.key!r} has effect {taint.effect!r}")


def _validate_counters(device: Device, *, where: str) -> None:
    if len(device.consumes_counters) > MAX_COUNTER_CONSUMPTIONS:
        raise DeviceModelError(
            f"{where}: consumes counters from {len(device.consumes_counters)} counter sets, "
            f"at most {MAX_COUNTER_CONSUMPTIONS}"
        )
    sets: set[str] = set()
    for consumption in device.consumes_counters:
        label = f"{where}: counter set {consumption.counter_set!r}"
        if not _DNS_LABEL.match(consumption.counter_set) or consumption.counter_set in sets:
            raise DeviceModelError(f"{label}: not a DNS label, or listed twice")
        sets.add(consumption.counter_set)
        if len(consumption.counters) > MAX_COUNTERS:
            raise DeviceModelError(f"{label}: more than {MAX_COUNTERS} counters")
        for counter, quantity in consumption.counters.items():
            if len(counter) > MAX_NAME_LENGTH or not _DNS_LABEL.match(counter):
                raise DeviceModelError(f"{label}: counter name {counter!r} is not a DNS label")
            try:
                parse_quantity(quantity)
            except QuantityError as exc:
                raise DeviceModelError(f"{label}: counter {counter!r}: {exc}") from exc


def _validate_request_policies(device: Device, *, where: str) -> None:
    """The ``requestPolicy`` rules of spec D.1 (``validateRequestPolicy`` upstream)."""
    if device.request_policies and not device.allow_multiple_allocations:
        raise DeviceModelError(
            f"{where}: a requestPolicy is only allowed on a device with allowMultipleAllocations"
        )
    for name, policy in device.request_policies.items():
        label = f"{where}: capacity {name!r}: requestPolicy"
        if name not in device.capacity:
            raise DeviceModelError(f"{label} for a capacity the device does not have")
        problem = request_policy_problem(policy, capacity=device.capacity[name])
        if problem is not None:
            raise DeviceModelError(f"{label}: {problem}")


def request_policy_problem(policy: RequestPolicy, *, capacity: str) -> str | None:
    """Why the API server would refuse ``policy`` on a capacity of value ``capacity``, or None."""
    try:
        value = parse_quantity(capacity).value
        default = None if policy.default is None else parse_quantity(policy.default).value
        values = [parse_quantity(v).value for v in policy.valid_values]
        low = None if policy.range_min is None else parse_quantity(policy.range_min).value
        high = None if policy.range_max is None else parse_quantity(policy.range_max).value
        step = None if policy.range_step is None else parse_quantity(policy.range_step).value
    except QuantityError as exc:
        return str(exc)
    ranged = low is not None or high is not None or step is not None
    if values and ranged:
        return "validValues and validRange are mutually exclusive"
    if values:
        if len(values) > MAX_VALID_VALUES:
            return f"{len(values)} validValues, at most {MAX_VALID_VALUES}"
        if any(b <= a for a, b in itertools.pairwise(values)):
            return "validValues must be ascending, without duplicates"
        if values[-1] > value:
            return f"validValues go beyond the capacity {capacity}"
        if default is not None and default not in values:
            return "validValues must include the default"
    if ranged:
        if low is None:
            return "validRange.min is required"
        if low > value:
            return f"validRange.min is more than the capacity {capacity}"
        if default is not None and (default < low or (high is not None and default > high)):
            return "the default is outside validRange"
        if high is not None and (high > value or high < low):
            return f"validRange.max must be between min and the capacity {capacity}"
        if step is not None:
            if step <= 0 or low + step > value:
                return f"validRange.step must be positive and min + step at most {capacity}"
            for what, v in (("default", default), ("max", high)):
                if v is not None and (v - low) % step:
                    return f"validRange: the {what} is not min plus a multiple of step"
    if default is not None and (default < 0 or default > value):
        return f"the default is not between 0 and the capacity {capacity}"
    return None
