"""plan.py: a claim's plan before anything on the node changes (the checks and their words, the
configs that apply to each request), a recorded claim's devices, what the kubelet is told, and
why a prepared claim is stale. Pure: claims are JSON, devices a simulated inventory's targets."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import pytest

from dra_driver.cdi.driverfiles import DEFAULT_CAPABILITIES
from dra_driver.errors import (
    ClaimNotFound,
    ConfigDecodeError,
    ConfigNotSupported,
    LimitExceeded,
    PrepareError,
)
from dra_driver.prepare.deviceconfig import ALL_DRIVER_CAPABILITIES
from dra_driver.prepare.plan import (
    ClaimPlan,
    ClaimRef,
    PlannedDevice,
    answer,
    default_config_json,
    get,
    owner,
    parse_share_device_name,
    plan_claim,
    recorded_capabilities,
    recorded_claim,
    reserved_pods,
    share_device_name,
    stale_reason,
    validate_ref,
)
from dra_driver.prepare.state.checkpointrecords import ClaimRecord, PreparedDevice
from dra_driver.prepare.targets import device_targets
from dra_driver.sim.fakedriver import simulated_inventory
from tests.claimdata import DRIVER, allocated_claim, opaque

NODE = "node1"
TARGETS = device_targets(simulated_inventory("h100:2,a100-40gb:1:mig=1g.5gb*2", node_name=NODE))
MIG = "gpu-2-mig-1g5gb-19-0"
UID = "0f8fad5b-d9cb-469f-a165-70867728950e"
SHARE_ID = "7c9e6679-7425-40de-944b-e07fc1f90ae7"
API = "resource.nvidia.com/v1beta1"
REF = ClaimRef(namespace="default", name="c", uid=UID)
WHERE = "ResourceClaim default/c"


def claim(**kw: Any) -> dict[str, Any]:
    return allocated_claim(name="c", uid=UID, node=NODE, **kw)


def plan(obj: dict[str, Any], ref: ClaimRef = REF) -> ClaimPlan:
    return plan_claim(ref, obj, driver_name=DRIVER, node_name=NODE, targets=TARGETS)


def refused(obj: dict[str, Any], error: type[Exception] = PrepareError) -> str:
    with pytest.raises(error) as exc:
        plan(obj)
    return str(exc.value)


def gpu_config(**fields: Any) -> dict[str, Any]:
    return {"apiVersion": API, "kind": "GpuConfig", **fields}


TIME_SLICING = gpu_config(sharing={"strategy": "TimeSlicing"})
MPS = gpu_config(sharing={"strategy": "MPS"})


# --- the claim reference ---------------------------------------------------------------------


def test_a_reference_the_api_server_could_have_sent_is_accepted() -> None:
    validate_ref(ClaimRef(namespace="a" * 63, name="a" * 253, uid=UID))
    validate_ref(ClaimRef(namespace="kube-system", name="web-0.claim-1", uid=UID))


@pytest.mark.parametrize(
    ("ref", "message"),
    [
        (
            ClaimRef(namespace="default", name="c", uid=UID.upper()),
            f"claim UID {UID.upper()!r} is not a lowercase UUID",
        ),
        (
            ClaimRef(namespace="default", name="c", uid=UID + "0"),
            f"claim UID {UID + '0'!r} is not a lowercase UUID",
        ),
        (
            ClaimRef(namespace="Default", name="c", uid=UID),
            "claim namespace 'Default' is not a valid namespace name",
        ),
        (
            ClaimRef(namespace="a" * 64, name="c", uid=UID),
            f"claim namespace {'a' * 64!r} is not a valid namespace name",
        ),
        (
            ClaimRef(namespace="default", name="a" * 254, uid=UID),
            f"claim name {'a' * 254!r} is not a valid object name",
        ),
        (
            ClaimRef(namespace="default", name="c_1", uid=UID),
            "claim name 'c_1' is not a valid object name",
        ),
    ],
    ids=["uppercase-uid", "long-uid", "namespace", "long-namespace", "long-name", "name"],
)
def test_a_reference_that_could_not_come_from_the_api_server_is_refused(
    ref: ClaimRef, message: str
) -> None:
    with pytest.raises(PrepareError) as exc:
        validate_ref(ref)
    assert str(exc.value) == message


def test_an_unprepare_by_uid_alone_needs_no_names() -> None:
    validate_ref(ClaimRef(namespace="", name="", uid=UID), need_names=False)
    with pytest.raises(PrepareError, match="is not a lowercase UUID"):
        validate_ref(ClaimRef(namespace="", name="", uid="x"), need_names=False)


# --- names -----------------------------------------------------------------------------------


def test_a_share_device_name_round_trips_and_other_names_have_no_share() -> None:
    name = share_device_name(MIG, SHARE_ID)
    assert name == f"{MIG}-share-{SHARE_ID}"
    assert parse_share_device_name(name) == (MIG, SHARE_ID)
    for plain in ("gpu-0", f"gpu-0-share-{SHARE_ID.upper()}", f"gpu-0-share-{SHARE_ID}x"):
        assert parse_share_device_name(plain) == (plain, None)


def test_the_default_config_is_recorded_by_kind() -> None:
    assert default_config_json("gpu") == {"apiVersion": API, "kind": "GpuConfig"}
    assert default_config_json("mig") == {"apiVersion": API, "kind": "MigDeviceConfig"}


def test_owner_reads_a_record() -> None:
    record = ClaimRecord(uid=UID, namespace="ns", name="c", phase="PrepareCompleted", devices=())
    assert owner(record) == f"ns/c ({UID})"
    rebuilt = ClaimRecord(uid=UID, namespace="", name="", phase="PrepareStarted", devices=())
    assert owner(rebuilt) == UID  # rebuilt from its CDI spec: only the UID is known


def test_get_walks_mappings_and_stops_at_anything_else() -> None:
    obj = {"a": {"b": {"c": 1}}, "l": [1]}
    assert get(obj, "a", "b", "c") == 1
    assert get(obj, "a", "x", "c") is None
    assert get(obj, "l", "0") is None
    assert get(obj) == obj
    # any Mapping, not only the dicts a decoded claim is made of
    assert get(MappingProxyType({"a": MappingProxyType({"b": 2})}), "a", "b") == 2


def _frozen(value: Any) -> Any:
    """``value`` with every dict a read-only Mapping that is not a dict."""
    if isinstance(value, dict):
        return MappingProxyType({k: _frozen(v) for k, v in value.items()})
    if isinstance(value, list):
        return [_frozen(v) for v in value]
    return value


def test_a_claim_of_mappings_that_are_not_dicts_plans_as_its_dicts_do() -> None:
    """The checks tell a dict at once and ask the Mapping ABC for anything else: same plan."""
    obj = claim(devices=[("a", "gpu-1"), ("b/x", MIG)])
    obj["status"]["reservedFor"] = [{"resource": "pods", "name": "p1", "uid": "u1"}]
    as_dicts, as_mappings = plan(obj), plan(_frozen(obj))
    assert [(d.request, d.target.name, d.config_json) for d in as_mappings.devices] == [
        (d.request, d.target.name, d.config_json) for d in as_dicts.devices
    ]
    assert reserved_pods(_frozen(obj)) == reserved_pods(obj) == ("p1",)
    other = claim(devices=["gpu-1"])
    selector = other["status"]["allocation"]["nodeSelector"]
    selector["nodeSelectorTerms"][0]["matchFields"][0]["values"] = ["other-node"]
    assert refused(_frozen(other)) == refused(other)


# --- plan_claim: the claim's checks, word for word ---------------------------------------------


def test_a_claim_re_created_under_another_uid_is_not_found() -> None:
    other = claim()
    other["metadata"]["uid"] = "11111111-2222-3333-4444-555555555555"
    assert refused(other, ClaimNotFound) == (
        f"{WHERE} has UID '11111111-2222-3333-4444-555555555555', not {UID!r} (it was deleted "
        "and re-created)"
    )
    del other["metadata"]
    assert refused(other, ClaimNotFound) == (
        f"{WHERE} has UID None, not {UID!r} (it was deleted and re-created)"
    )


@pytest.mark.parametrize("allocation", [None, [], "yes"])
def test_a_claim_without_an_allocation_is_refused(allocation: object) -> None:
    obj = claim()
    obj["status"]["allocation"] = allocation
    assert refused(obj) == f"{WHERE} is not allocated"


def test_a_claim_allocated_on_other_nodes_names_them_sorted_once() -> None:
    obj = claim()
    terms = obj["status"]["allocation"]["nodeSelector"]["nodeSelectorTerms"]
    terms[0]["matchFields"][0]["values"] = ["node3", "node2"]
    terms.append(copy.deepcopy(terms[0]))
    assert refused(obj) == f"{WHERE} is allocated on node node2, node3, not on this node (node1)"


@pytest.mark.parametrize(
    "selector",
    [
        None,
        "node2",
        {"nodeSelectorTerms": "node2"},
        {"nodeSelectorTerms": None},
        {"nodeSelectorTerms": [{"matchFields": None}]},
        {"nodeSelectorTerms": ["node2", {"matchFields": "node2"}]},
        {"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In"}]}]},
        {"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "values": ["node2"]}]}]},
        {
            "nodeSelectorTerms": [
                {"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["x"]}]}
            ]
        },
        {
            "nodeSelectorTerms": [
                {"matchFields": [{"key": "metadata.uid", "operator": "In", "values": ["node2"]}]}
            ]
        },
        {
            "nodeSelectorTerms": [
                {"matchFields": [{"key": "metadata.name", "operator": "In", "values": "node2"}]}
            ]
        },
        {
            "nodeSelectorTerms": [
                {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [2]}]}
            ]
        },
        {
            "nodeSelectorTerms": [
                {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [NODE]}]},
                {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n2"]}]},
            ]
        },
    ],
    ids=[
        "none",
        "not-a-mapping",
        "terms-not-a-list",
        "terms-null",
        "match-fields-null",
        "term-not-a-mapping",
        "no-values",
        "no-operator",
        "not-in",
        "other-field",
        "values-not-a-list",
        "values-not-strings",
        "this-node-among-others",
    ],
)
def test_a_node_selector_that_names_no_other_node_lets_the_claim_through(selector: object) -> None:
    obj = claim()
    if selector is None:
        del obj["status"]["allocation"]["nodeSelector"]
    else:
        obj["status"]["allocation"]["nodeSelector"] = selector
    assert [d.target.name for d in plan(obj).devices] == ["gpu-0"]


def test_a_claim_with_no_device_of_ours_is_refused() -> None:
    obj = claim(driver="net.example.com")
    obj["status"]["allocation"]["devices"]["results"].append("not a result")
    assert refused(obj) == f"{WHERE} has no device of driver {DRIVER}"


@pytest.mark.parametrize(
    ("pool", "device", "message"),
    [
        ("node2", "gpu-0", "is allocated device node2/gpu-0, which this node does not have"),
        (
            NODE,
            "gpu-9",
            "is allocated device node1/gpu-9, which this node does not have as a whole GPU (a "
            "GPU in MIG mode is prepared whole only under --mig-mode dynamic, when it has no MIG "
            "devices this driver did not create and leaves MIG mode without a reset: Hopper and "
            "newer)",
        ),
        (
            NODE,
            "gpu-2-mig-1g5gb-19-5",
            "is allocated device node1/gpu-2-mig-1g5gb-19-5, which this node does not have: no "
            "such MIG device exists (under --mig-mode dynamic, a GPU with MIG devices this "
            "driver did not create offers only those, as static MIG devices, until they are "
            "removed)",
        ),
        ("node2", "gpu-2-mig-1g5gb-19-5", "is allocated device node2/gpu-2-mig-1g5gb-19-5, "),
    ],
    ids=["other-pool", "whole-gpu", "mig-device", "other-pool-mig"],
)
def test_a_device_this_node_does_not_have_is_refused_saying_why(
    pool: str, device: str, message: str
) -> None:
    obj = claim()
    result = obj["status"]["allocation"]["devices"]["results"][0]
    result.update(pool=pool, device=device)
    text = refused(obj)
    if message.endswith(", "):  # another pool: no word on why this node lacks it
        assert text == f"{WHERE} {message}which this node does not have"
    else:
        assert text == f"{WHERE} {message}"


def test_each_device_of_ours_is_planned_in_order_with_its_result() -> None:
    obj = claim(devices=[("a", "gpu-1"), ("b/x", MIG), ("a", "gpu-0")])
    results = obj["status"]["allocation"]["devices"]["results"]
    results.insert(1, {"request": "nic", "driver": "net.example.com", "pool": NODE, "device": "e"})
    results[2]["adminAccess"] = True
    planned = plan(obj)
    assert planned.ref == REF
    assert planned.where == WHERE
    assert [(d.request, d.pool, d.target.name, d.admin_access) for d in planned.devices] == [
        ("a", NODE, "gpu-1", False),
        ("b/x", NODE, MIG, True),
        ("a", NODE, "gpu-0", False),
    ]
    assert [d.result for d in planned.devices] == [results[0], results[2], results[3]]
    assert [d.config_json for d in planned.devices] == [
        {"apiVersion": API, "kind": "GpuConfig"},
        {"apiVersion": API, "kind": "MigDeviceConfig"},
        {"apiVersion": API, "kind": "GpuConfig"},
    ]
    assert all(d.config is None and d.share_id is None for d in planned.devices)
    assert all(d.capabilities == DEFAULT_CAPABILITIES for d in planned.devices)


def test_a_result_without_request_or_pool_is_not_ours_to_have() -> None:
    obj = claim()
    result = obj["status"]["allocation"]["devices"]["results"][0]
    del result["pool"]
    assert refused(obj) == f"{WHERE} is allocated device /gpu-0, which this node does not have"
    result["pool"] = NODE
    del result["request"]
    (device,) = plan(obj).devices
    assert device.request == ""
    del result["device"]
    assert refused(obj).startswith(f"{WHERE} is allocated device node1/, which this node does")


def test_the_claims_limits_name_the_claim_and_hold_for_our_driver_s_configs_only() -> None:
    obj = claim()
    obj["status"]["allocation"]["devices"]["config"] = "not a list"
    assert refused(obj) == f"{WHERE}: configs is not a list"
    deep: Any = {"apiVersion": API, "kind": "GpuConfig"}
    for _ in range(40):
        deep = {"x": deep}
    theirs = claim(configs=[opaque(deep, driver="net.example.com")])
    assert [d.target.name for d in plan(theirs).devices] == ["gpu-0"]
    message = refused(claim(configs=[opaque(deep)]), LimitExceeded)
    assert message.startswith(
        f"{WHERE}: config 0: its opaque parameters are nested more than 32 levels deep"
    )


# --- plan_claim: configs -------------------------------------------------------------------------


def test_a_config_of_ours_applies_and_is_recorded_as_decoded() -> None:
    config = gpu_config(sharing={"strategy": "TimeSlicing"}, driverCapabilities=["graphics"])
    (device,) = plan(claim(configs=[opaque(config)])).devices
    assert device.config is not None and device.config.kind == "GpuConfig"
    assert device.config_json == {
        "apiVersion": API,
        "kind": "GpuConfig",
        "sharing": {"strategy": "TimeSlicing"},
        "driverCapabilities": ["graphics"],
    }
    assert device.capabilities == frozenset({"graphics"})


def test_other_drivers_configs_and_entries_without_opaque_parameters_are_ignored() -> None:
    configs = [
        opaque({"anything": True}, driver="net.example.com"),
        {"source": "FromClaim", "opaque": "not an object"},
        {"source": "FromClaim"},
        "not an entry",
    ]
    (device,) = plan(claim(configs=configs)).devices
    assert device.config is None
    assert device.config_json == {"apiVersion": API, "kind": "GpuConfig"}


def strategy(config_json: Mapping[str, Any]) -> str | None:
    """The sharing strategy a planned device's effective config names (None: none)."""
    sharing = config_json.get("sharing")
    return sharing.get("strategy") if isinstance(sharing, Mapping) else None


def test_the_last_config_naming_a_request_wins_and_class_configs_come_first() -> None:
    configs = [
        opaque(MPS, requests=["a"]),  # the claim's, for request a: beats the class's
        opaque(gpu_config(), source="FromClass"),  # the class's, for every request
        opaque(TIME_SLICING, requests=["b"]),
    ]
    obj = claim(
        devices=[("a", "gpu-0"), ("a/sub", "gpu-1"), ("b", "gpu-1"), ("c", "gpu-0")],
        configs=configs,
    )
    got = [strategy(d.config_json) for d in plan(obj).devices]
    assert got == ["MPS", "MPS", "TimeSlicing", None]


def test_a_config_without_requests_applies_to_every_request() -> None:
    obj = claim(devices=[("a", "gpu-0"), ("b", "gpu-1")], configs=[opaque(TIME_SLICING)])
    assert [strategy(d.config_json) for d in plan(obj).devices] == ["TimeSlicing"] * 2


def test_a_config_that_does_not_decode_names_its_place_in_the_claim() -> None:
    configs = [
        opaque(TIME_SLICING),
        opaque({"apiVersion": API, "kind": "Nope"}),
        opaque(gpu_config(), source="FromClass"),
    ]
    assert refused(claim(configs=configs), ConfigDecodeError) == (
        f"{WHERE}: config 2 (FromClaim): opaque config kind 'Nope' is unknown (known: "
        "GpuConfig, MigDeviceConfig)"
    )
    bad_class = opaque({"apiVersion": "v9", "kind": "GpuConfig"}, source="FromClass")
    assert refused(claim(configs=[bad_class]), ConfigDecodeError) == (
        f"{WHERE}: config 0 (FromClass): opaque config apiVersion 'v9' is not supported (use "
        f"{API!r})"
    )
    no_source = opaque({"kind": "GpuConfig"})
    del no_source["source"]
    assert refused(claim(configs=[no_source]), ConfigDecodeError) == (
        f"{WHERE}: config 0 (FromClaim): opaque config apiVersion None is not supported (use "
        f"{API!r})"
    )


def test_a_config_that_does_not_fit_or_is_not_carried_out_keeps_its_error_type() -> None:
    obj = claim(devices=[MIG], configs=[opaque(TIME_SLICING)])
    assert refused(obj, ConfigDecodeError) == (
        f"{WHERE}: device {MIG} is a mig device: GpuConfig does not apply to it (use "
        "MigDeviceConfig)"
    )
    zero = gpu_config(
        sharing={"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 0}}
    )
    with pytest.raises(ConfigNotSupported) as exc:
        plan(claim(configs=[opaque(zero)]))
    assert str(exc.value).startswith(
        f"{WHERE}: the config of request gpus (device gpu-0): mpsConfig."
        "defaultActiveThreadPercentage 0 is refused"
    )


# --- a recorded claim, the kubelet's answer, the capabilities of a record ------------------------


def record(*devices: PreparedDevice, namespace: str = "ns") -> ClaimRecord:
    return ClaimRecord(
        uid=UID, namespace=namespace, name="c", phase="PrepareCompleted", devices=devices
    )


def prepared(device: str, **kw: Any) -> PreparedDevice:
    return PreparedDevice(request_names=("r",), pool=NODE, device=device, cdi_device_ids=(), **kw)


def test_a_recorded_claim_has_the_devices_the_node_still_has_with_their_shares() -> None:
    config = {"apiVersion": API, "kind": "GpuConfig", "sharing": {"strategy": "MPS"}}
    rebuilt = recorded_claim(
        record(
            prepared("gpu-0", config=config, admin_access=True),
            prepared("gpu-7"),
            prepared(MIG, share_id=SHARE_ID, consumed_capacity={"memory": "1Gi"}),
        ),
        TARGETS,
    )
    assert rebuilt.ref == ClaimRef(namespace="ns", name="c", uid=UID)
    assert [
        (d.target.name, d.config_json, d.admin_access, d.pool, d.share_id, d.consumed_capacity)
        for d in rebuilt.devices
    ] == [
        ("gpu-0", config, True, NODE, None, {}),
        (MIG, {}, False, NODE, SHARE_ID, {"memory": "1Gi"}),
    ]
    assert rebuilt.devices[1].cdi_name == f"{MIG}-share-{SHARE_ID}"


def test_the_kubelet_is_told_the_request_device_and_cdi_id_of_each_device() -> None:
    whole = PlannedDevice(
        target=TARGETS["gpu-0"],
        config_json={"kind": "GpuConfig"},
        request="gpus/first",
        pool=NODE,
        admin_access=True,
    )
    assert answer(whole, claim_uid=UID, cdi_vendor="k8s.gpu.nvidia.com") == PreparedDevice(
        request_names=("gpus",),
        pool=NODE,
        device="gpu-0",
        cdi_device_ids=(f"k8s.gpu.nvidia.com/claim={UID}-gpu-0",),
        share_id=None,
        admin_access=True,
        config={"kind": "GpuConfig"},
        consumed_capacity={},
    )
    share = PlannedDevice(
        target=TARGETS[MIG],
        config_json={},
        request="r",
        pool=NODE,
        share_id=SHARE_ID,
        consumed_capacity={"memory": "1Gi"},
    )
    assert answer(share, claim_uid=UID, cdi_vendor="v") == PreparedDevice(
        request_names=("r",),
        pool=NODE,
        device=MIG,
        cdi_device_ids=(f"v/claim={UID}-{MIG}-share-{SHARE_ID}",),
        share_id=SHARE_ID,
        admin_access=False,
        config={},
        consumed_capacity={"memory": "1Gi"},
    )


def test_a_records_capabilities_are_the_union_of_its_devices_configs() -> None:
    def config(*names: str) -> dict[str, Any]:
        return {"apiVersion": API, "kind": "GpuConfig", "driverCapabilities": list(names)}

    assert recorded_capabilities(record()) == DEFAULT_CAPABILITIES
    assert recorded_capabilities(record(prepared("gpu-0"))) == DEFAULT_CAPABILITIES
    assert recorded_capabilities(
        record(prepared("gpu-0", config=config("graphics")), prepared("gpu-1"))
    ) == frozenset({"graphics", *DEFAULT_CAPABILITIES})
    assert recorded_capabilities(
        record(
            prepared("gpu-0", config=config("video")), prepared("gpu-1", config=config("display"))
        )
    ) == frozenset({"video", "display"})
    assert recorded_capabilities(record(prepared("gpu-0", config=config("all")))) == frozenset(
        ALL_DRIVER_CAPABILITIES
    )
    # an older agent's config that no longer decodes: its default
    older = {"apiVersion": API, "kind": "GpuConfig", "driverCapabilities": ["hologram"]}
    assert recorded_capabilities(record(prepared("gpu-0", config=older))) == DEFAULT_CAPABILITIES
    # a config without driverCapabilities is not decoded: its default
    sharing = {"apiVersion": API, "kind": "GpuConfig", "sharing": {"strategy": "MPS"}}
    assert recorded_capabilities(record(prepared("gpu-0", config=sharing))) == DEFAULT_CAPABILITIES


# --- stale claims and their pods -------------------------------------------------------------


def test_a_prepared_claim_is_stale_for_each_reason_or_not_at_all() -> None:
    held = record(prepared("gpu-0"), prepared("gpu-1"))

    def reason(obj: dict[str, Any] | None) -> str | None:
        return stale_reason(held, obj, driver_name=DRIVER, node_name=NODE)

    live = claim(devices=["gpu-1"])
    assert reason(live) is None
    assert reason(None) == "deleted"
    other = copy.deepcopy(live)
    other["metadata"]["uid"] = "11111111-2222-3333-4444-555555555555"
    assert reason(other) == "deleted and re-created with another UID"
    for allocation in (None, {}, {"devices": {"results": "x"}}):
        unallocated = copy.deepcopy(live)
        unallocated["status"]["allocation"] = allocation
        assert reason(unallocated) == "no longer allocated"
    assert reason(claim(devices=["gpu-3"])) == "allocated other devices"
    assert reason(claim(devices=["gpu-0"], driver="net.example.com")) == "allocated other devices"
    elsewhere = claim(devices=["gpu-0"])
    elsewhere["status"]["allocation"]["devices"]["results"][0]["pool"] = "node2"
    elsewhere["status"]["allocation"]["devices"]["results"].append("not a result")
    assert reason(elsewhere) == "allocated other devices"
    unreserved = copy.deepcopy(live)
    unreserved["status"]["reservedFor"] = []
    assert reason(unreserved) == "reserved for no pod"
    del unreserved["status"]["reservedFor"]
    assert reason(unreserved) == "reserved for no pod"


def test_reserved_pods_are_the_core_groups_pods_in_the_claims_order() -> None:
    obj = claim()
    obj["status"]["reservedFor"] = [
        {"resource": "pods", "name": "b", "uid": "1"},
        {"resource": "pods", "apiGroup": "example.com", "name": "not-a-pod", "uid": "2"},
        {"resource": "jobs", "name": "job", "uid": "3"},
        "not a consumer",
        {"resource": "pods", "apiGroup": "", "name": "a", "uid": "4"},
        {"resource": "pods", "uid": "5"},
    ]
    assert reserved_pods(obj) == ("b", "a", "")
    del obj["status"]["reservedFor"]
    assert reserved_pods(obj) == ()
