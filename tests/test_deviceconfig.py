"""Opaque configs decode strictly and completely, say what they cannot be carried out for, and
come back unchanged from the checkpoint's JSON.

prepare.py's use of them (precedence, refusal per claim) is tested in tests/test_prepare.py.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dra_driver.errors import ConfigDecodeError, ConfigNotSupported
from dra_driver.prepare import deviceconfig
from dra_driver.prepare.deviceconfig import (
    ALL_DRIVER_CAPABILITIES,
    DEFAULT_DRIVER_CAPABILITIES,
    GpuConfig,
    MigDeviceConfig,
    check_supported,
    decode,
    driver_capabilities,
    to_json,
)
from dra_driver.quantity import parse_quantity

API = "resource.nvidia.com/v1beta1"


def gpu(**fields: Any) -> dict[str, Any]:
    return {"apiVersion": API, "kind": "GpuConfig", **fields}


def mig(**fields: Any) -> dict[str, Any]:
    return {"apiVersion": API, "kind": "MigDeviceConfig", **fields}


def mps_limits(**mps_config: Any) -> dict[str, Any]:
    """The decoded mpsConfig of a GpuConfig with ``mps_config``, as the checkpoint records it."""
    config = decode(gpu(sharing={"strategy": "MPS", "mpsConfig": mps_config}))
    return to_json(config)["sharing"]["mpsConfig"]


# -- MPS limits: Kubernetes quantities, as strings or numbers ----------------------------------


@pytest.mark.parametrize(
    ("value", "canonical"),
    [
        ("10Gi", "10Gi"),
        ("1024Mi", "1Gi"),  # strings too come back in the API server's canonical form
        ("1.5e9", "1500e6"),  # as Go's resource.Quantity writes it
        (1073741824, "1073741824"),  # a JSON integer is the quantity of its digits
        (10 * 1000**3, "10G"),
        (1.5e9, "1500M"),  # a JSON float: the same value (Go would write 1500e6)
        (0.5, "500m"),
        (0, "0"),
    ],
)
def test_a_pinned_memory_limit_is_a_quantity_given_as_a_string_or_a_number(
    value: object, canonical: str
) -> None:
    assert mps_limits(defaultPinnedDeviceMemoryLimit=value) == {
        "defaultPinnedDeviceMemoryLimit": canonical
    }


def test_per_device_pinned_memory_limits_take_numbers_too() -> None:
    limits = {"0": 2**31, "GPU-5d8a1b2c-0000-0000-0000-000000000000": "4096Mi", "1": 2.5e9}
    assert mps_limits(defaultPerDevicePinnedMemoryLimit=limits) == {
        "defaultPerDevicePinnedMemoryLimit": {
            "0": "2147483648",
            "GPU-5d8a1b2c-0000-0000-0000-000000000000": "4Gi",
            "1": "2500M",
        }
    }


@given(
    mantissa=st.integers(min_value=-(10**15) + 1, max_value=10**15 - 1),
    exponent=st.integers(min_value=-9, max_value=12),
)
def test_a_json_number_means_the_quantity_its_text_means(mantissa: int, exponent: int) -> None:
    # What NVIDIA's driver does with a JSON number: parse its text as a quantity.
    text = f"{mantissa}e{exponent}"
    decoded = mps_limits(defaultPinnedDeviceMemoryLimit=json.loads(text))
    got = parse_quantity(decoded["defaultPinnedDeviceMemoryLimit"]).value
    want = parse_quantity(parse_quantity(text).canonical()).value
    assert got == want


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("lots", "'lots' is not a valid quantity"),
        ("10 Gi", "is not a valid quantity"),
        (True, "must be a string such as '10Gi' or a number, not bool"),
        ([10], "not list"),
        ({"value": 10}, "not dict"),
        (None, "not NoneType"),
        (float("nan"), "nan is not a valid quantity"),
        (float("inf"), "inf is not a valid quantity"),
    ],
)
def test_anything_else_as_a_limit_is_an_error_that_names_the_field(
    value: object, message: str
) -> None:
    with pytest.raises(ConfigDecodeError) as info:
        decode(
            gpu(
                sharing={
                    "strategy": "MPS",
                    "mpsConfig": {"defaultPerDevicePinnedMemoryLimit": {"0": value}},
                }
            )
        )
    assert "sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit.0: " in str(info.value)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        (
            gpu(sharing={"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 50.0}}),
            "sharing.mpsConfig.defaultActiveThreadPercentage: Input should be a valid integer",
        ),
        (
            gpu(sharing={"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": "50"}}),
            "defaultActiveThreadPercentage: Input should be a valid integer",
        ),
        (
            gpu(sharing={"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 101}}),
            "less than or equal to 100",
        ),
        (
            gpu(sharing={"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": -1}}),
            "defaultActiveThreadPercentage: Input should be greater than or equal to 0",
        ),
        (
            gpu(sharing={"strategy": "MPS", "mpsConfig": {"multiUser": "true"}}),
            "sharing.mpsConfig.multiUser: Input should be a valid boolean",
        ),
        (
            mig(sharing={"strategy": "MPS", "mpsConfig": {"multiUser": 1}}),
            "sharing.mpsConfig.multiUser: Input should be a valid boolean",
        ),
        (
            gpu(sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": 3}}),
            "sharing.timeSlicingConfig.interval",
        ),
        (gpu(sharing={"strategy": "MPS", "timeSlicingConfig": {}}), "cannot be set with"),
        (mig(sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {}}), "Extra inputs"),
    ],
)
def test_everything_else_stays_strict(parameters: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigDecodeError, match=message):
        decode(parameters)


# -- driverCapabilities -------------------------------------------------------------------------


def test_capability_names_are_the_container_runtime_ones_and_compute_utility_the_default() -> None:
    assert ALL_DRIVER_CAPABILITIES == ("compute", "utility", "video", "graphics", "display")
    assert frozenset({"compute", "utility"}) == DEFAULT_DRIVER_CAPABILITIES


@pytest.mark.parametrize("make", [gpu, mig])
@pytest.mark.parametrize(
    ("names", "effective"),
    [
        (None, {"compute", "utility"}),
        (["compute", "utility", "video"], {"compute", "utility", "video"}),
        (["video"], {"video"}),  # exactly what is listed: the default is not added
        (["all"], set(ALL_DRIVER_CAPABILITIES)),
        (["video", "all"], set(ALL_DRIVER_CAPABILITIES)),
        (["display", "graphics"], {"display", "graphics"}),
    ],
)
def test_driver_capabilities_are_what_the_config_lists_with_all_expanded(
    make: Any, names: list[str] | None, effective: set[str]
) -> None:
    fields = {} if names is None else {"driverCapabilities": names}
    assert driver_capabilities(decode(make(**fields))) == frozenset(effective)


def test_a_device_without_any_config_gets_the_default_capabilities() -> None:
    for device_type in ("gpu", "mig"):
        config = deviceconfig.default_for(device_type)  # type: ignore[arg-type]
        assert driver_capabilities(config) == DEFAULT_DRIVER_CAPABILITIES


@pytest.mark.parametrize(
    ("names", "message"),
    [
        (
            ["compute", "vidoe"],
            "driverCapabilities: Value error, unknown driver capability 'vidoe' "
            "(allowed: compute, utility, video, graphics, display, all)",
        ),
        (["COMPUTE"], "unknown driver capability 'COMPUTE'"),
        ([], "driverCapabilities: Value error, must name at least one capability"),
        (["video", "compute", "video"], "driver capability 'video' is listed more than once"),
        ("compute,video", "driverCapabilities: Input should be a valid list"),
        ([1], "driverCapabilities.0: Input should be a valid string"),
    ],
)
def test_bad_driver_capabilities_are_a_claim_error_naming_the_value(
    names: object, message: str
) -> None:
    for make in (gpu, mig):
        with pytest.raises(ConfigDecodeError) as info:
            decode(make(driverCapabilities=names))
        assert message in str(info.value)


def test_a_huge_capability_list_is_checked_in_linear_time() -> None:
    """Issue 37: 650,000 valid names (repeats of the known ones) hung a prepare worker, since
    each name was counted in the whole list. 40,000 took about 12 s that way; one pass takes
    milliseconds, so a second is a bound with room for a slow machine."""
    names = list(ALL_DRIVER_CAPABILITIES) * (40_000 // len(ALL_DRIVER_CAPABILITIES))
    started = time.perf_counter()
    with pytest.raises(ConfigDecodeError, match="'compute' is listed more than once"):
        decode(gpu(driverCapabilities=names))
    assert time.perf_counter() - started < 1.0


def test_a_config_with_many_problems_names_the_first_few_and_counts_the_rest() -> None:
    with pytest.raises(ConfigDecodeError) as info:
        decode(gpu(driverCapabilities=list(range(1000))))
    message = str(info.value)
    assert message.count("Input should be a valid string") == 5
    assert message.endswith("; and 995 more")
    assert len(message) < 1000


# -- what the agent can carry out ---------------------------------------------------------------


@pytest.mark.parametrize(
    "parameters",
    [
        gpu(sharing={"strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": 1e9}}),
        mig(sharing={"strategy": "MPS"}),
        gpu(sharing={"strategy": "TimeSlicing"}),
        mig(sharing={"strategy": "TimeSlicing"}),  # no effect, accepted as NVIDIA's driver does
        gpu(sharing={"strategy": "MPS", "mpsConfig": {"multiUser": True}}),
        mig(sharing={"strategy": "MPS", "mpsConfig": {"multiUser": False}}),
        gpu(sharing={"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 1}}),
        gpu(sharing={"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 100}}),
    ],
)
def test_mps_on_gpus_and_mig_devices_and_time_slicing_of_gpus_are_carried_out(
    parameters: dict[str, Any],
) -> None:
    # accepted here; whether the agent runs MPS daemons and the limits fit is prepare's question
    check_supported(decode(parameters), device_name="gpu-0", request="gpu")


_ZERO_PERCENTAGE = (
    "mpsConfig.defaultActiveThreadPercentage 0 is refused: NVIDIA's driver passes 0 to the MPS "
    "control daemon (set_default_active_thread_percentage 0), whose documentation gives 0 no "
    "meaning; use 1..100, or leave the field out for MPS's default (100)"
)


@pytest.mark.parametrize(
    ("parameters", "why"),
    [
        (
            gpu(sharing={"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 0}}),
            _ZERO_PERCENTAGE,
        ),
        (
            mig(sharing={"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 0}}),
            _ZERO_PERCENTAGE,
        ),
    ],
)
def test_valid_configs_not_carried_out_are_decoded_but_refused_naming_why(
    parameters: dict[str, Any], why: str
) -> None:
    config = decode(parameters)  # a valid config: decoding accepts it
    with pytest.raises(ConfigNotSupported) as info:
        check_supported(config, device_name="gpu-0", request="gpu")
    assert str(info.value) == f"the config of request gpu (device gpu-0): {why}"


@pytest.mark.parametrize(
    "parameters",
    [
        gpu(sharing={"strategy": "TimeSlicing"}),
        gpu(sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Short"}}),
        gpu(sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {}}),
    ],
)
def test_time_slicing_of_a_full_gpu_is_supported(parameters: dict[str, Any]) -> None:
    check_supported(decode(parameters), device_name="gpu-0", request="gpu")


@pytest.mark.parametrize(
    "parameters", [gpu(), mig(), gpu(driverCapabilities=["all"]), mig(driverCapabilities=["video"])]
)
def test_configs_without_sharing_are_supported(parameters: dict[str, Any]) -> None:
    check_supported(decode(parameters), device_name="gpu-0", request="gpu")


# -- the checkpoint's JSON ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "parameters",
    [
        gpu(),
        mig(),
        gpu(driverCapabilities=["compute", "utility", "video"]),
        mig(driverCapabilities=["all"]),
        gpu(
            driverCapabilities=["graphics"],
            sharing={
                "strategy": "MPS",
                "mpsConfig": {
                    "defaultActiveThreadPercentage": 25,
                    "defaultPinnedDeviceMemoryLimit": 1.5e9,
                    "defaultPerDevicePinnedMemoryLimit": {"0": 2**30, "1": "1024Mi"},
                    "multiUser": True,
                },
            },
        ),
        mig(sharing={"strategy": "MPS", "mpsConfig": {"multiUser": False}}),
        gpu(sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}),
    ],
)
def test_to_json_round_trips_through_decode(parameters: dict[str, Any]) -> None:
    config = decode(parameters)
    recorded = json.loads(json.dumps(to_json(config)))  # what the checkpoint file holds
    assert decode(recorded) == config
    assert to_json(decode(recorded)) == recorded
    assert driver_capabilities(decode(recorded)) == driver_capabilities(config)


def test_to_json_omits_fields_left_at_their_default() -> None:
    assert to_json(GpuConfig()) == {"apiVersion": API, "kind": "GpuConfig"}
    assert to_json(MigDeviceConfig(driverCapabilities=["video"])) == {
        "apiVersion": API,
        "kind": "MigDeviceConfig",
        "driverCapabilities": ["video"],
    }
