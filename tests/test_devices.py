"""GPU facts become DRA devices with NVIDIA's names and attributes, within the API's rules."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dra_driver.devices import (
    MAX_ATTRIBUTES_AND_CAPACITIES,
    NUMA_NODE_ATTRIBUTE,
    PCI_BUS_ID_ATTRIBUTE,
    PCIE_ROOT_ATTRIBUTE,
    Device,
    Taint,
    Version,
    mig_device_name,
    mig_profile_slug,
    node_devices,
    parse_mig_device_name,
    semver_cuda_driver_version,
    semver_driver_version,
    validate_device,
)
from dra_driver.errors import DeviceModelError
from dra_driver.gpus.info import GpuInfo, Inventory, MigInstance, MigPlacement, MigProfile
from dra_driver.sim.nvml import discover_simulated
from dra_driver.sim.profiles import HARDWARE_PROFILES

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


def test_full_gpu_is_named_by_minor_with_nvidia_attributes_and_memory() -> None:
    (device,) = node_devices(Inventory(gpus=(H100,)), driver_name=DRIVER).devices

    assert device.name == "gpu-3"
    assert device.attributes == {
        "type": "gpu",
        "uuid": "GPU-8f2c1d7e-0b1a-4c55-9e3d-2a6f0c9b7d41",
        "productName": "NVIDIA H100 80GB HBM3",
        "brand": "Nvidia",
        "architecture": "Hopper",
        "cudaComputeCapability": Version("9.0.0"),
        "driverVersion": Version("570.124.6"),
        "cudaDriverVersion": Version("12.8.0"),
        "resource.kubernetes.io/pciBusID": "0000:1b:00.0",
        "resource.kubernetes.io/pcieRoot": "pci0000:15",
        "resource.kubernetes.io/numaNode": 1,
    }
    assert device.capacity == {"memory": "81559Mi"}
    assert device.consumes_counters == ()


def test_pcie_root_numa_node_and_addressing_mode_appear_only_when_known() -> None:
    unknown = dataclasses.replace(H100, pcie_root=None, numa_node=None)
    coherent = dataclasses.replace(H100, minor=4, addressing_mode="ATS", numa_node=0)

    devices = node_devices(Inventory(gpus=(unknown, coherent)), driver_name=DRIVER).devices

    assert PCIE_ROOT_ATTRIBUTE not in devices[0].attributes
    assert NUMA_NODE_ATTRIBUTE not in devices[0].attributes
    assert "addressingMode" not in devices[0].attributes
    assert devices[1].attributes["addressingMode"] == "ATS"
    assert devices[1].attributes[NUMA_NODE_ATTRIBUTE] == 0  # node 0 is a node, not "unknown"
    assert devices[0].attributes[PCI_BUS_ID_ATTRIBUTE] == "0000:1b:00.0"


def test_index_and_minor_are_never_attributes() -> None:
    inventory = Inventory(gpus=(H100, H100_MIG))

    for device in node_devices(inventory, driver_name=DRIVER).devices:
        assert not {"index", "minor"} & set(device.attributes)


def test_gpu_in_mig_mode_publishes_its_mig_devices_instead_of_itself() -> None:
    devices = node_devices(Inventory(gpus=(H100, H100_MIG)), driver_name=DRIVER).devices

    assert [d.name for d in devices] == [
        "gpu-1-mig-1g10gb-me-20-0",
        "gpu-1-mig-3g40gb-9-4",
        "gpu-3",
    ]


def test_mig_device_carries_parent_facts_and_profile_capacities() -> None:
    devices = node_devices(Inventory(gpus=(H100_MIG,)), driver_name=DRIVER).devices
    device = next(d for d in devices if d.name == "gpu-1-mig-3g40gb-9-4")

    assert device.attributes == {
        "type": "mig",
        "uuid": "MIG-00000000-0000-4000-8000-000000000001",
        "parentUUID": H100.uuid,
        "profile": "3g.40gb",
        "productName": "NVIDIA H100 80GB HBM3",
        "brand": "Nvidia",
        "architecture": "Hopper",
        "cudaComputeCapability": Version("9.0.0"),
        "driverVersion": Version("570.124.6"),
        "cudaDriverVersion": Version("12.8.0"),
        "resource.kubernetes.io/pciBusID": "0000:1b:00.0",
        "resource.kubernetes.io/pcieRoot": "pci0000:15",
        "resource.kubernetes.io/numaNode": 1,
    }
    assert device.capacity == {
        "multiprocessors": "60",
        "copyEngines": "3",
        "decoders": "3",
        "encoders": "0",
        "jpegEngines": "3",
        "ofaEngines": "0",
        "memory": "40448Mi",
        "memorySlice4": "1",
        "memorySlice5": "1",
        "memorySlice6": "1",
        "memorySlice7": "1",
    }


def test_each_mig_device_has_a_memory_slice_capacity_per_slice_of_its_placement() -> None:
    devices = node_devices(Inventory(gpus=(H100_MIG,)), driver_name=DRIVER).devices

    slices = {d.name: sorted(c for c in d.capacity if c.startswith("memorySlice")) for d in devices}
    assert slices == {
        "gpu-1-mig-1g10gb-me-20-0": ["memorySlice0"],
        "gpu-1-mig-3g40gb-9-4": ["memorySlice4", "memorySlice5", "memorySlice6", "memorySlice7"],
    }


def test_a_7g_mig_device_with_every_optional_attribute_stays_within_the_api_limit() -> None:
    """8 memory slices + 7 capacities + 14 attributes = 29 of the 32 the API allows."""
    (profile,) = [
        p
        for p in (discover_simulated("h100:1:mig=7g.80gb", node_name="n").gpus[0].mig_profiles)
        if p.name == "7g.80gb"
    ]
    gpu = dataclasses.replace(
        H100_MIG,
        addressing_mode="ATS",
        mig_profiles=(profile,),
        mig_instances=(mig_instance(profile, 0, 0),),
    )

    (device,) = node_devices(Inventory(gpus=(gpu,)), driver_name=DRIVER).devices

    assert device.name == "gpu-1-mig-7g80gb-0-0"
    assert [f"memorySlice{i}" in device.capacity for i in range(8)] == [True] * 8
    assert len(device.attributes) == 14
    assert len(device.capacity) == 15
    assert len(device.attributes) + len(device.capacity) <= MAX_ATTRIBUTES_AND_CAPACITIES
    validate_device(device)


@pytest.mark.parametrize(
    ("version", "semver"),
    [
        ("570.124.06", "570.124.6"),
        ("535.104.05", "535.104.5"),
        ("550.54.15", "550.54.15"),
        ("470.82", "470.82.0"),
        ("580", "580.0.0"),
    ],
)
def test_driver_version_is_semver_normalised(version: str, semver: str) -> None:
    assert semver_driver_version(version) == semver


@pytest.mark.parametrize("version", ["", "570.124.06.1", "r570", "570.x.1"])
def test_unreadable_driver_version_is_a_device_model_error(version: str) -> None:
    with pytest.raises(DeviceModelError, match="driver version"):
        semver_driver_version(version)


@pytest.mark.parametrize(
    ("version", "semver"),
    [(12080, "12.8.0"), (12020, "12.2.0"), (11040, "11.4.0"), (13000, "13.0.0")],
)
def test_cuda_driver_version_integer_becomes_semver(version: int, semver: str) -> None:
    assert semver_cuda_driver_version(version) == semver


@pytest.mark.parametrize(
    ("profile", "slug"),
    [
        ("1g.5gb", "1g5gb"),
        ("1g.5gb+me", "1g5gb-me"),
        ("2g.47gb", "2g47gb"),
        ("1g.24gb+me.all", "1g24gb-meall"),
        ("1g.24gb-me", "1g24gb-me"),
        ("1c.3g.40gb", "1c3g40gb"),
    ],
)
def test_profile_slugs_drop_dots_and_replace_plus_as_nvidia_does(profile: str, slug: str) -> None:
    assert mig_profile_slug(profile) == slug


def test_mig_names_match_nvidias_example() -> None:
    name = mig_device_name(parent_minor=1, profile="2g.47gb", profile_id=14, placement_start=0)

    assert name == "gpu-1-mig-2g47gb-14-0"
    assert parse_mig_device_name(name) == (1, 14, 0, "2g47gb")


ALL_PROFILE_NAMES = sorted(
    {p.name for hw in HARDWARE_PROFILES.values() for p in hw.gpu_instance_profiles}
    | {"1g.24gb+me.all", "1g.24gb-me", "2g.48gb+gfx"}
)


@given(
    parent=st.integers(min_value=0, max_value=10_000),
    profile=st.sampled_from(ALL_PROFILE_NAMES),
    profile_id=st.integers(min_value=0, max_value=100),
    start=st.integers(min_value=0, max_value=7),
)
def test_mig_device_names_parse_back_into_what_made_them(
    parent: int, profile: str, profile_id: int, start: int
) -> None:
    name = mig_device_name(
        parent_minor=parent, profile=profile, profile_id=profile_id, placement_start=start
    )

    assert parse_mig_device_name(name) == (parent, profile_id, start, mig_profile_slug(profile))


@pytest.mark.parametrize(
    "name",
    [
        "gpu-1",
        "gpu-01-mig-1g5gb-19-0",
        "gpu-1-mig--19-0",
        "gpu-1-mig-1g5gb-19",
        "gpu-1-mig-1g5gb-19-00",
        "GPU-1-mig-1g5gb-19-0",
        "gpu-1-mig-1g.5gb-19-0",
    ],
)
def test_names_that_are_not_mig_device_names_are_refused(name: str) -> None:
    with pytest.raises(DeviceModelError, match="not a MIG device name"):
        parse_mig_device_name(name)


def device(**changes: object) -> Device:
    base = Device(name="gpu-0", attributes={"type": "gpu"}, capacity={"memory": "80Gi"})
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def test_a_valid_device_passes_validation() -> None:
    validate_device(
        device(
            attributes={
                "type": "gpu",
                "count": 3,
                "coherent": False,
                "driverVersion": Version("570.124.6-rc.1+build.5"),
                "resource.kubernetes.io/pcieRoot": "pci0000:00",
                "x" * 32: "y" * 64,
            },
            taints=(Taint(key="gpu.nvidia.com/xid", value="79", effect="NoSchedule"),),
        )
    )


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"name": "GPU-0"}, "name is not a DNS label"),
        ({"name": "gpu-" + "0" * 60}, "name is not a DNS label"),
        ({"name": "gpu.0"}, "name is not a DNS label"),
        ({"attributes": {f"a{i}": i for i in range(32)}}, "33 attributes and capacities"),
        ({"attributes": {"productName": "x" * 65}}, "attribute 'productName': string is 65"),
        ({"attributes": {"v": Version("1.02.3")}}, "attribute 'v': version '1.02.3'"),
        ({"attributes": {"v": Version("v1.2.3")}}, "is not semver"),
        ({"attributes": {"v": Version("1.2")}}, "is not semver"),
        ({"attributes": {"n": 2**63}}, "does not fit in int64"),
        ({"attributes": {"f": 1.5}}, "float is not an attribute type"),
        ({"attributes": {"9lives": "x"}}, "is not a C identifier"),
        ({"attributes": {"a" * 33: "x"}}, "longer than 32"),
        ({"attributes": {"Bad_Domain!/x": "x"}}, "is not a DNS subdomain"),
        ({"attributes": {("d" * 64) + ".io/x": "x"}}, "is not a DNS subdomain"),
        ({"attributes": {"/x": "x"}}, "domain before '/' is empty"),
        ({"attributes": {"index": 0}}, "attribute 'index': index and minor are not stable"),
        ({"attributes": {"minor": 1}}, "attribute 'minor'"),
        ({"capacity": {"memory": "80 GiB"}}, "capacity 'memory': '80 GiB' is not a valid quantity"),
        ({"capacity": {"memory-size": "1"}}, "capacity 'memory-size'"),
        ({"taints": (Taint(key="k", value="v", effect="Evict"),) * 1}, "effect 'Evict'"),  # type: ignore[arg-type]
        ({"taints": (Taint(key="k", value="v", effect="NoSchedule"),) * 17}, "17 taints"),
    ],
)
def test_validation_names_the_device_and_the_offending_field(
    changes: dict[str, object], message: str
) -> None:
    bad = device(**changes)

    with pytest.raises(DeviceModelError) as caught:
        validate_device(bad)

    assert f"device {bad.name!r}" in str(caught.value)
    assert message in str(caught.value)


def test_node_devices_refuses_a_device_the_api_would_reject() -> None:
    long_name = dataclasses.replace(H100, product_name="NVIDIA " + "X" * 60)

    with pytest.raises(DeviceModelError, match="device 'gpu-3': attribute 'productName'"):
        node_devices(Inventory(gpus=(long_name,)), driver_name=DRIVER)


def test_node_devices_refuses_duplicate_names() -> None:
    twin = dataclasses.replace(H100, index=1, uuid="GPU-other")

    with pytest.raises(DeviceModelError, match="'gpu-3' would be published twice"):
        node_devices(Inventory(gpus=(H100, twin)), driver_name=DRIVER)


def test_node_devices_refuses_an_invalid_driver_name() -> None:
    with pytest.raises(DeviceModelError, match="driver name"):
        node_devices(Inventory(gpus=(H100,)), driver_name="GPU_nvidia")


def test_simulated_node_publishes_the_expected_devices() -> None:
    inventory = discover_simulated(
        "a100-40gb:1:mig=3g.20gb+2g.10gb+1g.5gb+me,h100:1,l4:1", node_name="node-1"
    )

    devices = node_devices(inventory, driver_name=DRIVER).devices

    assert [d.name for d in devices] == [
        "gpu-0-mig-3g20gb-9-0",
        "gpu-0-mig-2g10gb-14-4",
        "gpu-0-mig-1g5gb-me-20-6",
        "gpu-1",
        "gpu-2",
    ]
    assert devices[2].attributes["profile"] == "1g.5gb+me"
    assert devices[2].capacity["memory"] == "4864Mi"
    assert devices[3].capacity["memory"] == "81559Mi"
    assert devices[4].attributes["architecture"] == "Ada Lovelace"
    assert devices[4].attributes["cudaComputeCapability"] == Version("8.9.0")
    # Three GPUs, two root complexes: the A100 and the H100 on NUMA node 0, the L4 on node 1.
    assert [d.attributes[NUMA_NODE_ATTRIBUTE] for d in devices] == [0, 0, 0, 0, 1]
    assert [sorted(c for c in d.capacity if c.startswith("memorySlice")) for d in devices[:3]] == [
        ["memorySlice0", "memorySlice1", "memorySlice2", "memorySlice3"],
        ["memorySlice4", "memorySlice5"],
        ["memorySlice6"],
    ]
    assert not any(c.startswith("memorySlice") for d in devices[3:] for c in d.capacity)


_MIG_LAYOUTS = {
    "a100-40gb": ["", "3g.20gb+2g.10gb+1g.5gb", "1g.5gb*7", "1g.5gb+me+1g.10gb*3", "7g.40gb"],
    "a100-80gb": ["", "4g.40gb+3g.40gb", "1g.20gb*4", "2g.20gb*3+1g.10gb+me"],
    "h100-80gb": ["", "1g.10gb*7", "3g.40gb*2", "1g.20gb+2g.20gb+4g.40gb"],
    "h200-141gb": ["", "7g.141gb", "1g.18gb+me+1g.35gb*3", "3g.71gb+2g.35gb+1g.18gb*2"],
}


@st.composite
def simulate_specs(draw: st.DrawFn) -> str:
    groups = []
    for _ in range(draw(st.integers(min_value=1, max_value=4))):
        key = draw(st.sampled_from(sorted(HARDWARE_PROFILES)))
        group = f"{key}:{draw(st.integers(min_value=1, max_value=4))}"
        if key in _MIG_LAYOUTS and draw(st.booleans()):
            layout = draw(st.sampled_from(_MIG_LAYOUTS[key]))
            group += f":mig={layout}" if layout else ":mig"
        group += draw(st.sampled_from(["", ":fail", ":addressing=hmm", ":addressing=ats"]))
        group += draw(st.sampled_from(["", ":numa=none", ":numa=3"]))
        groups.append(group)
    return ",".join(groups)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=simulate_specs(), node=st.from_regex(r"[a-z][a-z0-9-]{0,20}[a-z0-9]", fullmatch=True))
def test_every_device_of_a_random_simulated_node_is_valid(spec: str, node: str) -> None:
    inventory = discover_simulated(spec, node_name=node)

    devices = node_devices(inventory, driver_name=DRIVER).devices

    names = [d.name for d in devices]
    assert len(names) == len(set(names))
    for d in devices:
        validate_device(d)
        if d.attributes["type"] == "mig":
            parent, profile_id, start, slug = parse_mig_device_name(d.name)
            assert slug == mig_profile_slug(str(d.attributes["profile"]))
            parent_gpu = next(g for g in inventory.gpus if g.uuid == d.attributes["parentUUID"])
            assert parent_gpu.minor == parent
            mig = next(m for m in parent_gpu.mig_instances if m.uuid == d.attributes["uuid"])
            assert (mig.profile.profile_id, mig.placement.start) == (profile_id, start)
            span = range(mig.placement.start, mig.placement.start + mig.placement.size)
            assert {c: v for c, v in d.capacity.items() if c.startswith("memorySlice")} == {
                f"memorySlice{i}": "1" for i in span
            }
        gpu = next(
            g
            for g in inventory.gpus
            if g.uuid == d.attributes.get("parentUUID", d.attributes["uuid"])
        )
        assert d.attributes.get(NUMA_NODE_ATTRIBUTE) == gpu.numa_node
    published_gpus = {d.attributes.get("parentUUID", d.attributes["uuid"]) for d in devices}
    assert published_gpus <= {g.uuid for g in inventory.gpus}
    for gpu in inventory.gpus:
        if not gpu.mig_enabled:
            assert f"gpu-{gpu.minor}" in names
