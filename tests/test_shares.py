"""shares.py: the --consumable-shares modes, the devices they publish (checked against the strict
1.35-1.37 schemas and the API's requestPolicy rules), and what a share's container is told. Pure."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import kubernetes_validate
import pytest

from dra_driver.devices import (
    CounterConsumption,
    Device,
    NodeDevices,
    RequestPolicy,
    node_devices,
    validate_device,
)
from dra_driver.errors import DeviceModelError
from dra_driver.prepare.plan import parse_share_device_name, share_device_name
from dra_driver.publish.slices import build_slices
from dra_driver.publish.syncplan import plan_sync
from dra_driver.quantity import parse_quantity
from dra_driver.scheduling.allocator import ExactRequest, capacity_problem, parse_slice
from dra_driver.sharing.shares import (
    DISABLED,
    Share,
    SharesMode,
    device_capacity,
    parse_mode,
    share_env,
    share_of_result,
    shareable,
)
from dra_driver.sharing.shares import (
    capacity_problem as shares_capacity_problem,
)
from dra_driver.sim.localapi import validate_slice
from dra_driver.sim.nvml import discover_simulated

DRIVER = "gpu.nvidia.com"
NODE = "node1"
KUBERNETES_VERSIONS = ("1.35.0", "1.36.0", "1.37.0")
# a full H100 (81559Mi), 7g and 1g MIG devices (the 7g carries every memory slice: the most
# capacities a device has), an L4
NODE_SPEC = "h100:1,h100:1:mig=7g.80gb:addressing=ats,a100-40gb:1:mig=1g.5gb+me+1g.5gb*6,l4:1"
MODES = ("unlimited", "memory", "compute", "2", "8")


def devices(mode: SharesMode) -> NodeDevices:
    return shareable(
        node_devices(discover_simulated(NODE_SPEC, node_name=NODE), driver_name=DRIVER), mode
    )


def slice_objects(mode: SharesMode) -> list[dict[str, Any]]:
    pool = build_slices(devices(mode), driver_name=DRIVER, node_name=NODE)
    return [w.body for w in plan_sync(pool, [], node_uid="node-uid").creates]


def by_name(mode: SharesMode) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for o in slice_objects(mode) for d in o["spec"]["devices"]}


# --- the flag --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "mode"),
    [
        ("disabled", SharesMode()),
        ("unlimited", SharesMode(kind="unlimited")),
        ("memory", SharesMode(kind="memory")),
        ("compute", SharesMode(kind="compute")),
        ("2", SharesMode(kind="shares", count=2)),
        (" 16 ", SharesMode(kind="shares", count=16)),
    ],
)
def test_modes_parse_as_nvidia_names_them_plus_compute(text: str, mode: SharesMode) -> None:
    assert parse_mode(text) == mode
    assert str(mode) == text.strip()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("1", "use at least 2"),
        ("0", "use at least 2"),
        ("-3", "use disabled, unlimited, memory, compute or a number of shares"),
        ("half", "use disabled, unlimited, memory, compute or a number of shares"),
        ("Memory", "use disabled, unlimited, memory, compute or a number of shares"),
    ],
)
def test_other_values_are_refused_saying_what_is_accepted(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_mode(text)


# --- what is published -----------------------------------------------------------------------


def test_disabled_publishes_the_devices_unchanged() -> None:
    plain = node_devices(discover_simulated(NODE_SPEC, node_name=NODE), driver_name=DRIVER)
    assert shareable(plain, DISABLED) is plain
    assert all("allowMultipleAllocations" not in d for d in by_name(DISABLED).values())


def test_unlimited_memory_and_integer_modes_publish_nvidias_policies() -> None:
    memory_policy = {
        "unlimited": {"default": "0", "validRange": {"min": "0", "max": "81559Mi", "step": "1Mi"}},
        "memory": {
            "default": "81559Mi",
            "validRange": {"min": "1Mi", "max": "81559Mi", "step": "1Mi"},
        },
        "4": {"default": "0", "validRange": {"min": "0", "max": "81559Mi", "step": "1Mi"}},
    }
    for text, policy in memory_policy.items():
        gpu = by_name(parse_mode(text))["gpu-0"]
        assert gpu["allowMultipleAllocations"] is True
        assert gpu["capacity"]["memory"] == {"value": "81559Mi", "requestPolicy": policy}
    shares = by_name(parse_mode("4"))["gpu-0"]["capacity"]["shares"]
    assert shares == {
        "value": "4",
        "requestPolicy": {"default": "1", "validRange": {"min": "1", "max": "4", "step": "1"}},
    }
    assert "shares" not in by_name(parse_mode("unlimited"))["gpu-0"]["capacity"]


def test_compute_mode_publishes_percent_of_sms_taken_whole_by_default() -> None:
    gpu = by_name(parse_mode("compute"))["gpu-0"]
    assert gpu["capacity"]["compute"] == {
        "value": "100",
        "requestPolicy": {"default": "100", "validRange": {"min": "1", "max": "100", "step": "1"}},
    }
    assert gpu["capacity"]["memory"]["requestPolicy"]["default"] == "0"


def test_memory_is_rounded_down_to_the_1mi_step() -> None:
    odd = Device(name="gpu-9", attributes={}, capacity={"memory": str(80 * 2**30 + 12345)})
    (device,) = shareable(NodeDevices(devices=(odd,)), parse_mode("memory")).devices
    assert device.capacity["memory"] == "80Gi"
    assert device.request_policies["memory"].range_max == "80Gi"
    validate_device(device)


def test_mig_devices_are_shareable_and_their_other_capacities_default_to_zero() -> None:
    devices = by_name(parse_mode("unlimited"))
    mig = next(d for name, d in devices.items() if "-mig-1g5gb-me-" in name)
    assert mig["allowMultipleAllocations"] is True
    assert mig["capacity"]["multiprocessors"]["requestPolicy"] == {
        "default": "0",
        "validRange": {"min": "0", "max": mig["capacity"]["multiprocessors"]["value"], "step": "1"},
    }
    # a capacity of 0 cannot have a range (min + step must fit): its one valid value is 0
    zero = [n for n, c in mig["capacity"].items() if c["value"] == "0"]
    assert zero
    for name in zero:
        assert mig["capacity"][name]["requestPolicy"] == {"default": "0", "validValues": ["0"]}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kubernetes_version", KUBERNETES_VERSIONS)
def test_shareable_slices_pass_the_strict_schema_and_the_api_limits(
    mode: str, kubernetes_version: str
) -> None:
    objs = slice_objects(parse_mode(mode))
    assert objs
    for obj in objs:
        kubernetes_validate.validate(obj, kubernetes_version, strict=True)
        assert validate_slice(obj) == []
        for device in obj["spec"]["devices"]:
            assert len(device["attributes"]) + len(device["capacity"]) <= 32


@pytest.mark.parametrize("mode", MODES)
def test_every_published_policy_keeps_the_apis_request_policy_rules(mode: str) -> None:
    """Each device passed validate_device; here the rules are re-checked from the JSON alone,
    as the scheduler reads it: a request of nothing consumes the default, which fits."""
    for obj in slice_objects(parse_mode(mode)):
        for device in parse_slice(obj).devices:
            assert device.allow_multiple_allocations
            for name, policy in device.policies.items():
                value = device.capacity[name]
                assert policy.default is not None and 0 <= policy.default <= value
                if policy.range_min is not None:
                    assert policy.range_step is not None and policy.range_max is not None
                    assert policy.range_min + policy.range_step <= value
                    assert policy.range_max <= value
                    assert (policy.default - policy.range_min) % policy.range_step == 0
                    assert (policy.range_max - policy.range_min) % policy.range_step == 0
                else:
                    assert policy.default in policy.valid_values


@pytest.mark.parametrize(
    ("policy", "problem"),
    [
        (RequestPolicy(default="1", valid_values=("1",), range_min="0"), "mutually exclusive"),
        (RequestPolicy(valid_values=("2", "1")), "ascending"),
        (RequestPolicy(valid_values=("1", "20")), "beyond the capacity 10"),
        (RequestPolicy(default="3", valid_values=("1", "2")), "must include the default"),
        (RequestPolicy(range_max="5"), "validRange.min is required"),
        (RequestPolicy(range_min="11"), "min is more than the capacity"),
        (RequestPolicy(default="8", range_min="1", range_max="5"), "default is outside"),
        (RequestPolicy(range_min="0", range_max="12"), "max must be between min"),
        (RequestPolicy(range_min="5", range_step="6"), r"min \+ step at most 10"),
        (RequestPolicy(default="2", range_min="0", range_step="3"), "default is not min plus"),
        (RequestPolicy(default="11"), "default is not between 0 and the capacity"),
    ],
)
def test_policies_the_api_server_refuses_are_refused_before_publishing(
    policy: RequestPolicy, problem: str
) -> None:
    device = Device(
        name="gpu-0",
        attributes={},
        capacity={"cores": "10"},
        allow_multiple_allocations=True,
        request_policies={"cores": policy},
    )
    with pytest.raises(DeviceModelError, match=problem):
        validate_device(device)


def test_a_policy_needs_allow_multiple_allocations_and_its_capacity() -> None:
    policy = RequestPolicy(default="0", range_min="0", range_step="1")
    single = Device(
        name="gpu-0", attributes={}, capacity={"c": "2"}, request_policies={"c": policy}
    )
    with pytest.raises(DeviceModelError, match="only allowed on a device with allowMultiple"):
        validate_device(single)
    stray = Device(
        name="gpu-0",
        attributes={},
        capacity={"c": "2"},
        allow_multiple_allocations=True,
        request_policies={"d": policy},
    )
    with pytest.raises(DeviceModelError, match="capacity the device does not have"):
        validate_device(stray)


def test_the_scheduler_rounds_a_request_up_to_the_1mi_step_of_a_published_device() -> None:
    """A request of 20Gi + 1 byte consumes 20481Mi: what share_env then limits the share to."""
    (obj, *_) = slice_objects(parse_mode("unlimited"))
    gpu = next(d for d in parse_slice(obj).devices if d.name == "gpu-0")
    request = ExactRequest(
        name="r",
        device_class_name="gpu.nvidia.com",
        capacity_requests={"memory": parse_quantity(str(20 * 2**30 + 1)).value},
    )
    assert capacity_problem(request, gpu, {"memory": Fraction(70 * 2**30)}) == (
        "memory: 20481Mi requested (21474836481 rounded up by the requestPolicy), 9879Mi left "
        "on gpu-0"
    )


# --- one share -------------------------------------------------------------------------------


def test_share_env_gives_mps_the_consumed_memory_in_mib_and_compute_in_percent() -> None:
    assert share_env(device_uuid="GPU-1", consumed={"memory": "20Gi"}) == (
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=GPU-1=20480M",
    )
    # rounded down: the limit never exceeds the share
    assert share_env(device_uuid="GPU-1", consumed={"memory": str(2**20 + 2**19)}) == (
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=GPU-1=1M",
    )
    assert share_env(device_uuid="MIG-2", consumed={"memory": "1Gi", "compute": "25"}) == (
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=MIG-2=1024M",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25",
    )
    assert share_env(device_uuid="GPU-1", consumed={"memory": "0", "shares": "1"}) == ()


def test_share_device_names_round_trip_and_plain_names_have_no_share() -> None:
    share = "0f8fad5b-d9cb-469f-a165-70867728950e"
    name = share_device_name("gpu-1-mig-1g5gb-19-0", share)
    assert name == f"gpu-1-mig-1g5gb-19-0-share-{share}"
    assert parse_share_device_name(name) == ("gpu-1-mig-1g5gb-19-0", share)
    assert parse_share_device_name("gpu-1") == ("gpu-1", None)


def test_capacity_problem_adds_up_the_shares_of_a_device() -> None:
    capacity = {"memory": "80Gi", "compute": "100"}
    assert shares_capacity_problem(capacity, [{"memory": "40Gi"}] * 2, device="gpu-0") is None
    assert shares_capacity_problem(
        capacity, [{"memory": "40Gi", "compute": "60"}, {"compute": "41"}], device="gpu-0"
    ) == ("compute: shares consume 101 of device gpu-0, which has 100")


# --- what mutation testing of shares.py showed untested (issue 37 item 6) ----------------------


def test_the_largest_share_count_is_the_largest_int32() -> None:
    assert parse_mode(str(2**31 - 1)) == SharesMode(kind="shares", count=2**31 - 1)
    with pytest.raises(ValueError) as refused:
        parse_mode(str(2**31))
    assert str(refused.value) == "2147483648 shares is more than the API allows (int32)"


def test_an_unknown_mode_is_refused_with_the_whole_list() -> None:
    with pytest.raises(ValueError) as refused:
        parse_mode("shared")
    assert str(refused.value) == (
        "use disabled, unlimited, memory, compute or a number of shares (>= 2)"
    )


def test_a_device_that_consumes_counters_stays_whole() -> None:
    placement = Device(
        name="gpu-0-mig-1g10gb-0",
        attributes={},
        capacity={"memory": "10Gi"},
        consumes_counters=(CounterConsumption(counter_set="gpu-0", counters={"memory": "10Gi"}),),
    )
    whole = Device(name="gpu-1", attributes={}, capacity={"memory": "80Gi"})
    kept, shared = shareable(
        NodeDevices(devices=(placement, whole)), parse_mode("unlimited")
    ).devices
    assert kept == placement
    assert shared.allow_multiple_allocations


def test_every_capacity_besides_memory_gets_a_policy_whatever_their_order() -> None:
    device = Device(
        name="gpu-0-mig-1g10gb-0",
        attributes={},
        capacity={
            "memory": "10Gi",
            "multiprocessors": "16",
            "copyEngines": "1",
            "jpegEngines": "0",
        },
    )
    (shared,) = shareable(NodeDevices(devices=(device,)), parse_mode("unlimited")).devices
    assert dict(shared.request_policies) == {
        "memory": RequestPolicy(default="0", range_min="0", range_max="10Gi", range_step="1Mi"),
        "multiprocessors": RequestPolicy(
            default="0", range_min="0", range_max="16", range_step="1"
        ),
        # a capacity of exactly 1 still has a range (min 0 + step 1 <= 1) ...
        "copyEngines": RequestPolicy(default="0", range_min="0", range_max="1", range_step="1"),
        # ... one of 0 has only the valid value 0
        "jpegEngines": RequestPolicy(default="0", valid_values=("0",)),
    }
    validate_device(shared)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("disabled", {}),
        ("unlimited", {"memory": "80Gi"}),
        ("memory", {"memory": "80Gi"}),
        ("4", {"memory": "80Gi", "shares": "4"}),
        ("compute", {"memory": "80Gi", "compute": "100"}),
    ],
)
def test_device_capacity_is_what_the_device_publishes_memory_rounded_down(
    mode: str, expected: dict[str, str]
) -> None:
    assert device_capacity(parse_mode(mode), memory_bytes=80 * 2**30 + 2**20 - 1) == expected


SHARE_ID = "0f8fad5b-d9cb-469f-a165-70867728950e"


def test_a_share_is_read_from_its_result_with_canonical_quantities() -> None:
    share = share_of_result(
        share_id=SHARE_ID,
        consumed={"memory": "1024Mi", "compute": "25", "shares": 1},
        device="gpu-0",
        shareable_device=True,
    )
    assert share == Share(
        share_id=SHARE_ID, consumed={"memory": "1Gi", "compute": "25", "shares": "1"}
    )
    zero = share_of_result(
        share_id=SHARE_ID, consumed={"memory": "0"}, device="gpu-0", shareable_device=True
    )
    assert zero == Share(share_id=SHARE_ID, consumed={"memory": "0"})


@pytest.mark.parametrize("share_id", [None, ""])
def test_a_result_without_a_share_id_holds_the_device_whole(share_id: object) -> None:
    for consumed in (None, {}):
        assert (
            share_of_result(
                share_id=share_id, consumed=consumed, device="gpu-0", shareable_device=False
            )
            is None
        )


@pytest.mark.parametrize(
    ("share_id", "consumed", "shareable_device", "message"),
    [
        (None, {"memory": "1Gi"}, False, "device gpu-0: consumedCapacity without a shareID"),
        ("", {"memory": "1Gi"}, True, "device gpu-0: consumedCapacity without a shareID"),
        (
            None,
            None,
            True,
            "device gpu-0 allows multiple allocations (--consumable-shares), but its allocation "
            "result has no shareID: it was allocated before sharing was turned on; re-create the "
            "claim",
        ),
        (
            SHARE_ID,
            {"memory": "1Gi"},
            False,
            f"device gpu-0: the allocation result has shareID {SHARE_ID}, but this node does not "
            "publish the device with allowMultipleAllocations (--consumable-shares is disabled, "
            "or the device is a partitionable GPU's placement or whole GPU, which stay whole)",
        ),
        (
            SHARE_ID.upper(),
            {"memory": "1Gi"},
            True,
            f"device gpu-0: shareID '{SHARE_ID.upper()}' is not a lowercase UUID",
        ),
        (7, {"memory": "1Gi"}, True, "device gpu-0: shareID 7 is not a lowercase UUID"),
        (SHARE_ID, None, True, f"device gpu-0: share {SHARE_ID} has no consumedCapacity"),
        (SHARE_ID, {}, True, f"device gpu-0: share {SHARE_ID} has no consumedCapacity"),
        (SHARE_ID, ["memory"], True, f"device gpu-0: share {SHARE_ID} has no consumedCapacity"),
        (
            SHARE_ID,
            {"memory": "lots"},
            True,
            "device gpu-0: consumedCapacity memory: 'lots' is not a valid quantity (expected "
            "e.g. 40Gi, 500m, 1e3)",
        ),
        (
            SHARE_ID,
            {"memory": "1Gi", "compute": "-1"},
            True,
            "device gpu-0: consumedCapacity compute -1 is negative",
        ),
    ],
    ids=[
        "consumed-without-id",
        "consumed-with-empty-id",
        "shareable-without-id",
        "id-on-a-whole-device",
        "uppercase-id",
        "id-not-a-string",
        "no-consumed",
        "empty-consumed",
        "consumed-not-a-mapping",
        "not-a-quantity",
        "negative",
    ],
)
def test_a_result_that_cannot_be_prepared_says_why(
    share_id: object, consumed: object, shareable_device: bool, message: str
) -> None:
    with pytest.raises(ValueError) as refused:
        share_of_result(
            share_id=share_id, consumed=consumed, device="gpu-0", shareable_device=shareable_device
        )
    assert str(refused.value) == message


def test_capacity_problem_prints_the_total_in_the_capacitys_own_format() -> None:
    assert shares_capacity_problem(
        {"memory": "80Gi"}, [{"memory": "50Gi"}, {"memory": "40Gi"}], device="gpu-0"
    ) == ("memory: shares consume 90Gi of device gpu-0, which has 80Gi")
