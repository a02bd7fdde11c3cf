"""validation.py: a device the API server would refuse fails here, naming the device and field."""

from __future__ import annotations

import dataclasses

import pytest

from dra_driver.devices.model import CounterConsumption, Device, RequestPolicy, Taint, Version
from dra_driver.devices.validation import (
    request_policy_problem,
    validate_device,
    validate_driver_name,
)
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


def test_the_largest_device_the_api_accepts_passes_validation() -> None:
    """Every limit at its bound: a 63-character name, 32 attributes and capacities together, a
    63-character domain, int64's ends, a 64-character string and version, two counter sets of
    32 counters with 63-character names, 16 taints of each effect."""
    longest_version = "1.2.3-" + "a" * 58
    validate_device(
        Device(
            name="g" * 63,
            attributes={
                "flag": True,
                "low": -(2**63),
                "high": 2**63 - 1,
                "text": "t" * 64,
                "version": Version(longest_version),
                ("d" * 63) + "/x": "y",
                "Example.COM/y": "z",  # the domain is compared in lowercase, as upstream does
                **{f"a{i}": i for i in range(24)},
            },
            capacity={"memory": "80Gi"},
            consumes_counters=tuple(
                CounterConsumption(counter_set=s, counters={f"c{i}": "1" for i in range(32)})
                for s in ("set-a", "set-b")
            ),
            taints=tuple(
                Taint(key=f"k{i}", value="v", effect=("None", "NoSchedule", "NoExecute")[i % 3])
                for i in range(16)
            ),
        )
    )
    validate_device(
        device(consumes_counters=(CounterConsumption("s", {"c" * 63: "1", "b": "2Gi"}),))
    )
    assert len(longest_version) == 64


def too_many_counters() -> CounterConsumption:
    return CounterConsumption(counter_set="s", counters={f"c{i}": "1" for i in range(33)})


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"name": "g" * 64},
            "name is not a DNS label (lowercase letters, digits and '-', at most 63 characters, "
            "starting and ending with a letter or digit)",
        ),
        (
            {"attributes": {f"a{i}": i for i in range(32)}},
            "33 attributes and capacities, at most 32 allowed",
        ),
        (
            {"attributes": {"n": -(2**63) - 1}},
            f"attribute 'n': int {-(2**63) - 1} does not fit in int64",
        ),
        ({"attributes": {"s": "x" * 65}}, "attribute 's': string is 65 characters, more than 64"),
        (
            {"attributes": {"v": Version("1.2.3-" + "a" * 59)}},
            "attribute 'v': version is longer than 64 characters",
        ),
        (
            {"attributes": {"v": Version("01.2.3")}},
            "attribute 'v': version '01.2.3' is not semver 2.0.0 "
            "(MAJOR.MINOR.PATCH, no leading zeros)",
        ),
        (
            {"attributes": {"f": 1.5}},
            "attribute 'f': float is not an attribute type (bool, int, str, Version)",
        ),
        (
            {"attributes": {"a-b": 1}},
            "attribute 'a-b': 'a-b' is not a C identifier ([A-Za-z_][A-Za-z0-9_]*)",
        ),
        (
            {"attributes": {"a" * 33: 1}},
            f"attribute '{'a' * 33}': '{'a' * 33}' is longer than 32 characters",
        ),
        (
            {"attributes": {("d" * 64) + "/x": 1}},
            f"attribute '{'d' * 64}/x': domain '{'d' * 64}' "
            "is not a DNS subdomain of at most 63 chars",
        ),
        (
            {"attributes": {"a/b/c": 1}},
            "attribute 'a/b/c': domain 'a/b' is not a DNS subdomain of at most 63 chars",
        ),
        ({"attributes": {"/x": 1}}, "attribute '/x': the domain before '/' is empty"),
        (
            {"attributes": {"minor": 1}},
            "attribute 'minor': "
            "index and minor are not stable across GPU drains and are not published",
        ),
        (
            {"capacity": {"memory": "80 GiB"}},
            "capacity 'memory': '80 GiB' is not a valid quantity (expected e.g. 40Gi, 500m, 1e3)",
        ),
        (
            {"capacity": {"x.io/-": "1"}},
            "capacity 'x.io/-': '-' is not a C identifier ([A-Za-z_][A-Za-z0-9_]*)",
        ),
        (
            {"taints": (Taint(key="k", value="v", effect="NoSchedule"),) * 17},
            "17 taints, at most 16",
        ),
        ({"taints": (Taint(key="k", value="v", effect="Evict"),)}, "taint 'k' has effect 'Evict'"),  # type: ignore[arg-type]
        (
            {"consumes_counters": tuple(CounterConsumption(f"s{i}", {"c": "1"}) for i in range(3))},
            "consumes counters from 3 counter sets, at most 2",
        ),
        (
            {"consumes_counters": (CounterConsumption("S", {"c": "1"}),)},
            "counter set 'S': not a DNS label, or listed twice",
        ),
        (
            {"consumes_counters": (CounterConsumption("s", {"c": "1"}),) * 2},
            "counter set 's': not a DNS label, or listed twice",
        ),
        ({"consumes_counters": (too_many_counters(),)}, "counter set 's': more than 32 counters"),
        (
            {"consumes_counters": (CounterConsumption("s", {"c" * 64: "1"}),)},
            f"counter set 's': counter name '{'c' * 64}' is not a DNS label",
        ),
        (
            {"consumes_counters": (CounterConsumption("s", {"C": "1"}),)},
            "counter set 's': counter name 'C' is not a DNS label",
        ),
        (
            {"consumes_counters": (CounterConsumption("s", {"c": "x"}),)},
            "counter set 's': counter 'c': 'x' is not a valid quantity "
            "(expected e.g. 40Gi, 500m, 1e3)",
        ),
        (
            {"request_policies": {"memory": RequestPolicy(default="1Gi")}},
            "a requestPolicy is only allowed on a device with allowMultipleAllocations",
        ),
        (
            {"allow_multiple_allocations": True, "request_policies": {"cores": RequestPolicy()}},
            "capacity 'cores': requestPolicy for a capacity the device does not have",
        ),
        (
            {
                "allow_multiple_allocations": True,
                "request_policies": {"memory": RequestPolicy(default="1 Gi")},
            },
            "capacity 'memory': requestPolicy: "
            "'1 Gi' is not a valid quantity (expected e.g. 40Gi, 500m, 1e3)",
        ),
    ],
)
def test_validation_says_word_for_word_what_the_api_would_refuse(
    changes: dict[str, object], message: str
) -> None:
    with pytest.raises(DeviceModelError) as caught:
        validate_device(device(**changes))

    name = changes.get("name", "gpu-0")
    assert str(caught.value) == f"device {name!r}: {message}"


def test_a_driver_name_is_a_dns_subdomain_of_at_most_63_characters() -> None:
    validate_driver_name("gpu.nvidia.com")
    validate_driver_name("GPU.Example.com")  # compared in lowercase, as upstream does
    validate_driver_name("d" * 63)
    for bad in ("d" * 64, "gpu_nvidia.com", "-gpu.com"):
        with pytest.raises(DeviceModelError) as caught:
            validate_driver_name(bad)
        assert str(caught.value) == (
            f"driver name {bad!r} is not a DNS subdomain of at most 63 characters"
        )


def policy(fields: dict[str, object], capacity: str = "10") -> str | None:
    return request_policy_problem(RequestPolicy(**fields), capacity=capacity)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"default": "0"},
        {"default": "10"},
        {"valid_values": tuple(str(i) for i in range(1, 11)), "default": "10"},
        {"valid_values": ("1", "10")},
        {"range_min": "10"},
        {"range_min": "0", "range_max": "10", "default": "10"},
        {"range_min": "2", "range_max": "2", "default": "2"},
        {"range_min": "1", "default": "1"},
        {"range_min": "2", "range_step": "8", "range_max": "10", "default": "10"},
        {"range_min": "2", "range_step": "4", "range_max": "6", "default": "6"},
        {"range_min": "0", "range_step": "1", "range_max": "10"},
        {"range_min": "0", "range_step": "500m", "default": "1500m"},
    ],
)
def test_a_request_policy_the_api_accepts_has_no_problem(fields: dict[str, object]) -> None:
    assert policy(fields) is None


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        (
            {"valid_values": ("1",), "range_min": "1"},
            "validValues and validRange are mutually exclusive",
        ),
        (
            {"valid_values": ("1",), "range_max": "1"},
            "validValues and validRange are mutually exclusive",
        ),
        (
            {"valid_values": ("1",), "range_step": "1"},
            "validValues and validRange are mutually exclusive",
        ),
        ({"valid_values": tuple(str(i) for i in range(11))}, "11 validValues, at most 10"),
        ({"valid_values": ("2", "1")}, "validValues must be ascending, without duplicates"),
        ({"valid_values": ("1", "1")}, "validValues must be ascending, without duplicates"),
        ({"valid_values": ("1", "11")}, "validValues go beyond the capacity 10"),
        ({"valid_values": ("11",)}, "validValues go beyond the capacity 10"),
        ({"valid_values": ("1", "2", "11")}, "validValues go beyond the capacity 10"),
        ({"valid_values": ("1", "2"), "default": "3"}, "validValues must include the default"),
        ({"range_max": "5"}, "validRange.min is required"),
        ({"range_step": "5"}, "validRange.min is required"),
        ({"range_min": "11"}, "validRange.min is more than the capacity 10"),
        ({"range_min": "2", "default": "1"}, "the default is outside validRange"),
        ({"range_min": "2", "range_max": "4", "default": "5"}, "the default is outside validRange"),
        (
            {"range_min": "2", "range_max": "11"},
            "validRange.max must be between min and the capacity 10",
        ),
        (
            {"range_min": "2", "range_max": "1"},
            "validRange.max must be between min and the capacity 10",
        ),
        (
            {"range_min": "2", "range_step": "0"},
            "validRange.step must be positive and min + step at most 10",
        ),
        (
            {"range_min": "2", "range_step": "-1"},
            "validRange.step must be positive and min + step at most 10",
        ),
        (
            {"range_min": "2", "range_step": "9"},
            "validRange.step must be positive and min + step at most 10",
        ),
        (
            {"range_min": "2", "range_step": "4", "default": "4"},
            "validRange: the default is not min plus a multiple of step",
        ),
        (
            {"range_min": "2", "range_step": "4", "range_max": "8"},
            "validRange: the max is not min plus a multiple of step",
        ),
        ({"default": "-1"}, "the default is not between 0 and the capacity 10"),
        ({"default": "11"}, "the default is not between 0 and the capacity 10"),
        ({"range_max": "x"}, "'x' is not a valid quantity (expected e.g. 40Gi, 500m, 1e3)"),
        ({"range_min": "x"}, "'x' is not a valid quantity (expected e.g. 40Gi, 500m, 1e3)"),
        ({"range_step": "x"}, "'x' is not a valid quantity (expected e.g. 40Gi, 500m, 1e3)"),
        ({"valid_values": ("x",)}, "'x' is not a valid quantity (expected e.g. 40Gi, 500m, 1e3)"),
    ],
)
def test_a_request_policy_the_api_refuses_is_named_word_for_word(
    fields: dict[str, object], problem: str
) -> None:
    assert policy(fields) == problem


def test_a_bad_capacity_value_under_a_policy_is_named() -> None:
    assert (
        policy({}, capacity="ten")
        == "'ten' is not a valid quantity (expected e.g. 40Gi, 500m, 1e3)"
    )
