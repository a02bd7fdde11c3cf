"""validation.py: a device the API server would refuse fails here, naming the device and field."""

from __future__ import annotations

import dataclasses

import pytest

from dra_driver.devices.model import Device, Taint, Version
from dra_driver.devices.validation import validate_device
from dra_driver.errors import DeviceModelError


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
