"""API objects -> the allocator's inputs (scheduling/allocator/parse.py): v1beta1 shapes, what
allocated claims hold."""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import Any

import pytest

from dra_driver.errors import ExplainError
from dra_driver.scheduling import cel
from dra_driver.scheduling.allocator import (
    CapacityPolicy,
    Claim,
    ClaimAllocation,
    Constraint,
    DeviceClass,
    DeviceResult,
    DeviceTaintRule,
    ExactRequest,
    Request,
    Taint,
    Toleration,
    allocated_state,
    parse_claim,
    parse_device_class,
    parse_device_taint_rule,
    parse_slice,
)
from tests.allocatordata import (
    DRIVER,
    allocated_claim,
    devices_of,
    gpu,
    run,
    slice_,
)


def test_v1beta1_shapes_are_normalised() -> None:
    beta_claim = {
        "kind": "ResourceClaim",
        "metadata": {"name": "c"},
        "spec": {
            "devices": {
                "requests": [{"name": "gpu", "deviceClassName": "gpu.nvidia.com", "count": 1}]
            }
        },
    }
    beta_slice = slice_([])
    beta_slice["spec"]["devices"] = [
        {"name": "gpu-0", "basic": {k: v for k, v in gpu("gpu-0").items() if k != "name"}}
    ]
    assert devices_of(run([beta_claim], [beta_slice])) == ["gpu-0"]


def test_allocated_state_counts_each_kind_of_result_as_the_scheduler_does() -> None:
    def named(name: str, c: dict[str, Any]) -> dict[str, Any]:
        c["metadata"]["name"] = name
        return c

    admin = named("monitor", allocated_claim("gpu-0"))
    admin["status"]["allocation"]["devices"]["results"][0]["adminAccess"] = True
    state = allocated_state(
        [
            admin,
            named("share-a", allocated_claim("gpu-1", share=True)),
            named("share-b", allocated_claim("gpu-1", share=True)),
            named("whole", allocated_claim("gpu-2")),
            {"metadata": {"name": "pending", "namespace": "ns"}},
        ]
    )
    assert state.holders((DRIVER, "node1", "gpu-0")) == ()  # admin access holds nothing
    assert state.holders((DRIVER, "node1", "gpu-1")) == ("ns/share-a", "ns/share-b")
    assert state.holders((DRIVER, "node1", "gpu-2")) == ("ns/whole",)
    assert state.shared_capacity[(DRIVER, "node1", "gpu-1")] == {"memory": 60 * 2**30}
    assert sorted(state.claims) == ["ns/monitor", "ns/share-a", "ns/share-b", "ns/whole"]
    assert state.claims["ns/monitor"].results[0].admin_access


# -- every field, parsed ----------------------------------------------------------------------

BAD_QUANTITY = "'lots' is not a valid quantity (expected e.g. 40Gi, 500m, 1e3)"


def test_a_claim_is_parsed_field_by_field() -> None:
    obj = {
        "kind": "ResourceClaim",
        "metadata": {"name": "c", "namespace": "ns", "uid": "u-1"},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "gpu",
                        "exactly": {
                            "deviceClassName": "gpu.nvidia.com",
                            "selectors": [{"cel": {"expression": "true"}}],
                            "allocationMode": "ExactCount",
                            "count": 2,
                            "adminAccess": True,
                            "tolerations": [
                                {"key": "k", "operator": "Exists", "effect": "NoSchedule"},
                                {"key": "j", "value": "v"},
                                {},
                            ],
                            "capacity": {"requests": {"memory": "10Gi"}},
                        },
                    },
                    {
                        "name": "alt",
                        "firstAvailable": [
                            {
                                "name": "all",
                                "deviceClassName": "mig.nvidia.com",
                                "allocationMode": "All",
                            },
                            {"name": "one", "deviceClassName": "gpu.nvidia.com", "count": None},
                        ],
                    },
                ],
                "constraints": [
                    {"requests": ["gpu", "alt"], "matchAttribute": "gpu.nvidia.com/productName"},
                    {"distinctAttribute": "resource.kubernetes.io/pcieRoot"},
                ],
                "config": [{"requests": ["gpu"], "opaque": {"driver": DRIVER}}],
            }
        },
    }
    assert parse_claim(obj) == Claim(
        namespace="ns",
        name="c",
        requests=(
            Request(
                "gpu",
                ExactRequest(
                    name="gpu",
                    device_class_name="gpu.nvidia.com",
                    selectors=("true",),
                    allocation_mode="ExactCount",
                    count=2,
                    admin_access=True,
                    tolerations=(
                        Toleration("k", "Exists", "", "NoSchedule"),
                        Toleration("j", "Equal", "v", ""),
                        Toleration("", "Equal", "", ""),
                    ),
                    capacity_requests={"memory": Fraction(10 * 2**30)},
                ),
            ),
            Request(
                "alt",
                None,
                (
                    ExactRequest("all", "mig.nvidia.com", allocation_mode="All", count=0),
                    ExactRequest("one", "gpu.nvidia.com", count=1),
                ),
            ),
        ),
        constraints=(
            Constraint(("gpu", "alt"), match_attribute="gpu.nvidia.com/productName"),
            Constraint((), distinct_attribute="resource.kubernetes.io/pcieRoot"),
        ),
        config=({"requests": ["gpu"], "opaque": {"driver": DRIVER}},),
        uid="u-1",
    )


def test_a_template_and_claims_without_names() -> None:
    spec = {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "g"}}]}}
    template = {
        "kind": "ResourceClaimTemplate",
        "metadata": {"generateName": "t-"},
        "spec": {"spec": spec},
    }
    parsed = parse_claim(template)
    assert (parsed.namespace, parsed.name, parsed.uid) == ("", "t-", "")
    assert parsed.requests == (Request("gpu", ExactRequest("gpu", "g")),)
    assert parse_claim({"spec": spec}).name == "unnamed"
    assert parse_claim({"spec": spec}).key == "unnamed"
    assert parse_claim({"metadata": {"name": "n", "generateName": "g-"}, "spec": spec}).name == "n"
    assert parse_claim({"kind": "ResourceClaim", "metadata": {"name": "n"}}).requests == ()


def _request(**fields: Any) -> dict[str, Any]:
    return {"spec": {"devices": {"requests": [{"name": "r", "exactly": fields}]}}}


def _sub(**fields: Any) -> dict[str, Any]:
    return {
        "spec": {
            "devices": {"requests": [{"name": "r", "firstAvailable": [{"name": "s", **fields}]}]}
        }
    }


R0 = "spec.devices.requests[0]"
C0 = "spec.devices.constraints[0]"
EXACT = f"{R0}.exactly"
CLAIM_ERRORS = [
    (_request(deviceClassName="g", count=0), f"{EXACT}: count must be a positive integer, got 0"),
    ({"metadata": []}, "metadata: expected an object, got list"),
    ({"spec": "x"}, "spec: expected an object, got str"),
    (
        {"kind": "ResourceClaimTemplate", "spec": {"spec": 1}},
        "spec.spec: expected an object, got int",
    ),
    ({"spec": {"devices": []}}, "spec.devices: expected an object, got list"),
    ({"spec": {"devices": {"requests": {}}}}, "spec.devices.requests: expected a list, got dict"),
    ({"spec": {"devices": {"requests": ["r"]}}}, f"{R0}: expected an object, got str"),
    ({"spec": {"devices": {"requests": [{"exactly": {}}]}}}, f"{R0}: name is required"),
    ({"spec": {"devices": {"requests": [{"name": "", "exactly": {}}]}}}, f"{R0}: name is required"),
    (
        {"spec": {"devices": {"requests": [{"name": "r", "deviceClassName": "g"}] * 2}}},
        "spec.devices.requests[1]: duplicate request name 'r'",
    ),
    (
        {"spec": {"devices": {"requests": [{"name": "r", "firstAvailable": {}}]}}},
        f"{R0}.firstAvailable: expected a list, got dict",
    ),
    (
        {"spec": {"devices": {"requests": [{"name": "r"}]}}},
        f"{R0}: exactly one of exactly (or v1beta1 deviceClassName) and firstAvailable",
    ),
    (
        {
            "spec": {
                "devices": {
                    "requests": [
                        {
                            "name": "r",
                            "exactly": {"deviceClassName": "g"},
                            "firstAvailable": [{"name": "s"}],
                        }
                    ]
                }
            }
        },
        f"{R0}: exactly one of exactly (or v1beta1 deviceClassName) and firstAvailable",
    ),
    (
        {"spec": {"devices": {"requests": [{"name": "r", "exactly": []}]}}},
        f"{R0}: expected an object, got list",
    ),
    (
        {"spec": {"devices": {"requests": [{"name": "r", "firstAvailable": ["s"]}]}}},
        f"{R0}.firstAvailable[0]: expected an object, got str",
    ),
    (
        {"spec": {"devices": {"requests": [{"name": "r", "firstAvailable": [{"name": ""}]}]}}},
        f"{R0}.firstAvailable[0]: name is required",
    ),
    (_request(), f"{EXACT}: deviceClassName is required"),
    (_request(deviceClassName=""), f"{EXACT}: deviceClassName is required"),
    (_request(deviceClassName=5), f"{EXACT}: deviceClassName is required"),
    (
        _request(deviceClassName="g", allocationMode="Some"),
        f"{EXACT}: allocationMode 'Some' is not ExactCount or All",
    ),
    (
        _request(deviceClassName="g", allocationMode="All", count=2),
        f"{EXACT}: count must not be set with allocationMode All",
    ),
    (
        _request(deviceClassName="g", count="2"),
        f"{EXACT}: count must be a positive integer, got '2'",
    ),
    (
        _request(deviceClassName="g", count=True),
        f"{EXACT}: count must be a positive integer, got True",
    ),
    (_request(deviceClassName="g", count=-1), f"{EXACT}: count must be a positive integer, got -1"),
    (_request(deviceClassName="g", capacity=[]), f"{EXACT}.capacity: expected an object, got list"),
    (
        _request(deviceClassName="g", capacity={"requests": []}),
        f"{EXACT}: expected an object, got list",
    ),
    (
        _request(deviceClassName="g", capacity={"requests": {"memory": "lots"}}),
        f"{EXACT}.capacity.requests.memory: {BAD_QUANTITY}",
    ),
    (
        _sub(deviceClassName="g", adminAccess=False),
        f"{R0}.firstAvailable[0]: adminAccess is not allowed in a firstAvailable sub-request",
    ),
    (_request(deviceClassName="g", selectors={}), f"{EXACT}.selectors: expected a list, got dict"),
    (
        _request(deviceClassName="g", selectors=["x"]),
        f"{EXACT}.selectors[0]: expected an object, got str",
    ),
    (
        _request(deviceClassName="g", selectors=[{"cel": "x"}]),
        f"{EXACT}.selectors[0].cel: expected an object, got str",
    ),
    (
        _request(deviceClassName="g", selectors=[{"cel": {}}]),
        f"{EXACT}.selectors[0]: only CEL selectors are supported (cel.expression)",
    ),
    (
        _request(deviceClassName="g", tolerations={}),
        f"{EXACT}.tolerations: expected a list, got dict",
    ),
    (
        _request(deviceClassName="g", tolerations=["t"]),
        f"{EXACT}.tolerations[0]: expected an object, got str",
    ),
    (
        {"spec": {"devices": {"constraints": {}}}},
        "spec.devices.constraints: expected a list, got dict",
    ),
    (
        {"spec": {"devices": {"constraints": ["c"]}}},
        "spec.devices.constraints[0]: expected an object, got str",
    ),
    (
        {"spec": {"devices": {"constraints": [{}]}}},
        f"{C0}: exactly one of matchAttribute and distinctAttribute is required",
    ),
    (
        {
            "spec": {
                "devices": {"constraints": [{"matchAttribute": "a/b", "distinctAttribute": "a/b"}]}
            }
        },
        f"{C0}: exactly one of matchAttribute and distinctAttribute is required",
    ),
    (
        {"spec": {"devices": {"constraints": [{"distinctAttribute": "model"}]}}},
        "spec.devices.constraints[0]: attribute 'model' must be fully qualified (domain/name)",
    ),
    (
        {"spec": {"devices": {"constraints": [{"matchAttribute": "a/b", "requests": "r"}]}}},
        "spec.devices.constraints[0].requests: expected a list, got str",
    ),
    ({"spec": {"devices": {"config": {}}}}, "spec.devices.config: expected a list, got dict"),
    (
        {"spec": {"devices": {"config": [{}, "c"]}}},
        "spec.devices.config[1]: expected an object, got str",
    ),
]


@pytest.mark.parametrize(("obj", "message"), CLAIM_ERRORS)
def test_what_the_api_server_would_refuse_in_a_claim_is_named(
    obj: dict[str, Any], message: str
) -> None:
    with pytest.raises(ExplainError) as err:
        parse_claim(obj)
    assert str(err.value) == message
    with pytest.raises(ExplainError) as err:
        parse_claim(obj, where="claim.yaml: ")
    assert str(err.value) == f"claim.yaml: {message}"


def test_an_all_request_may_say_count_zero() -> None:
    (request,) = parse_claim(_request(deviceClassName="g", allocationMode="All", count=0)).requests
    assert request.exactly == ExactRequest("r", "g", allocation_mode="All", count=0)


def test_a_device_class_is_parsed_and_its_errors_named() -> None:
    obj = {
        "metadata": {"name": "x"},
        "spec": {"selectors": [{"cel": {"expression": "true"}}], "config": [{"opaque": {}}]},
    }
    assert parse_device_class(obj) == DeviceClass("x", ("true",), ({"opaque": {}},))
    assert parse_device_class({"metadata": {"name": "y"}}) == DeviceClass("y")
    errors: list[tuple[dict[str, Any], str]] = [
        ({"metadata": []}, "metadata: expected an object, got list"),
        ({"metadata": {}}, "DeviceClass: metadata.name is required"),
        ({"metadata": {"name": ""}}, "DeviceClass: metadata.name is required"),
        (
            {"metadata": {"name": "x"}, "spec": []},
            "DeviceClass x: spec: expected an object, got list",
        ),
        (
            {"metadata": {"name": "x"}, "spec": {"selectors": {}}},
            "DeviceClass x: spec.selectors: expected a list, got dict",
        ),
        (
            {"metadata": {"name": "x"}, "spec": {"selectors": [{"cel": {}}]}},
            "DeviceClass x: spec.selectors[0]: only CEL selectors are supported (cel.expression)",
        ),
        (
            {"metadata": {"name": "x"}, "spec": {"config": ["c"]}},
            "DeviceClass x: spec.config: expected an object, got str",
        ),
        (
            {"metadata": {"name": "x"}, "spec": {"config": {}}},
            "DeviceClass x: spec.config: expected a list, got dict",
        ),
    ]
    for bad, message in errors:
        with pytest.raises(ExplainError) as err:
            parse_device_class(bad)
        assert str(err.value) == message


def _fields(obj: Any) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.name != "cel_device"}


def test_a_slice_is_parsed_field_by_field() -> None:
    obj = {
        "metadata": {"name": "s"},
        "spec": {
            "driver": DRIVER,
            "pool": {"name": "p", "generation": 3, "resourceSliceCount": 2},
            "nodeName": "node1",
            "sharedCounters": [{"name": "cs", "counters": {"mem": {"value": "1Gi"}}}, {}],
            "devices": [
                {
                    "name": "d",
                    "attributes": {"type": {"string": "gpu"}, "x.example.com/n": {"int": 3}},
                    "capacity": {
                        "memory": {
                            "value": "80Gi",
                            "requestPolicy": {"default": "1Gi", "validValues": ["1Gi", "2"]},
                        },
                        "cores": "100",
                        "slices": {
                            "value": "8",
                            "requestPolicy": {"validRange": {"min": "1", "max": "8", "step": "2"}},
                        },
                    },
                    "consumesCounters": [
                        {"counterSet": "cs", "counters": {"mem": {"value": "1Gi"}}},
                        {},
                    ],
                    "taints": [{"key": "k", "value": "v", "effect": "NoSchedule"}, {}],
                    "allowMultipleAllocations": True,
                    "nodeName": "node1",
                    "allNodes": True,
                    "nodeSelector": {"nodeSelectorTerms": []},
                    "bindingConditions": ["a"],
                    "bindingFailureConditions": ["b", "c"],
                    "bindsToNode": True,
                }
            ],
        },
    }
    s = parse_slice(obj)
    assert (
        s.name,
        s.driver,
        s.pool,
        s.generation,
        s.resource_slice_count,
        s.node_name,
        s.all_nodes,
        s.node_selector,
        s.per_device_node_selection,
    ) == ("s", DRIVER, "p", 3, 2, "node1", False, None, False)
    assert s.shared_counters == {"cs": {"mem": Fraction(2**30)}, "": {}}
    (d,) = s.devices
    assert _fields(d) == {
        "name": "d",
        "attributes": {"type": "gpu", "x.example.com/n": 3},
        "capacity": {"memory": Fraction(80 * 2**30), "cores": Fraction(100), "slices": Fraction(8)},
        "capacity_formats": {"memory": "BinarySI", "cores": "DecimalSI", "slices": "DecimalSI"},
        "policies": {
            "memory": CapacityPolicy(
                default=Fraction(2**30), valid_values=(Fraction(2**30), Fraction(2))
            ),
            "slices": CapacityPolicy(
                range_min=Fraction(1), range_max=Fraction(8), range_step=Fraction(2)
            ),
        },
        "consumes_counters": (("cs", {"mem": Fraction(2**30)}), ("", {})),
        "taints": (Taint("k", "v", "NoSchedule"), Taint("", "", "")),
        "allow_multiple_allocations": True,
        "node_name": "node1",
        "all_nodes": True,
        "node_selector": {"nodeSelectorTerms": []},
        "binding_conditions": ("a",),
        "binding_failure_conditions": ("b", "c"),
        "binds_to_node": True,
    }
    # the CEL view of the device: its driver, attributes in their domain, capacity, sharing
    for expr in (
        f"device.driver == '{DRIVER}'",
        f"device.attributes['{DRIVER}'].type == 'gpu'",
        "device.attributes['x.example.com'].n == 3",
        f"device.capacity['{DRIVER}'].memory.compareTo(quantity('80Gi')) == 0",
        f"device.capacity['{DRIVER}'].cores.compareTo(quantity('100')) == 0",
        "device.allowMultipleAllocations",
    ):
        assert cel.compile_selector(expr).matches(d.cel_device), expr


def test_a_slice_without_optional_fields_gets_the_defaults() -> None:
    s = parse_slice(
        {
            "metadata": {"generateName": "g-"},
            "spec": {
                "driver": DRIVER,
                "pool": {"name": "p"},
                "nodeName": "",
                "allNodes": True,
                "nodeSelector": {"nodeSelectorTerms": []},
                "perDeviceNodeSelection": True,
                "devices": [{"name": "d", "basic": {"capacity": {"memory": {"value": "1"}}}}],
            },
        }
    )
    assert (
        s.name,
        s.generation,
        s.resource_slice_count,
        s.node_name,
        s.all_nodes,
        s.node_selector,
        s.per_device_node_selection,
        s.shared_counters,
    ) == ("g-", 0, 1, None, True, {"nodeSelectorTerms": []}, True, {})
    (d,) = s.devices
    assert _fields(d) == {
        "name": "d",
        "attributes": {},
        "capacity": {"memory": Fraction(1)},
        "capacity_formats": {"memory": "DecimalSI"},
        "policies": {},
        "consumes_counters": (),
        "taints": (),
        "allow_multiple_allocations": False,
        "node_name": None,
        "all_nodes": False,
        "node_selector": None,
        "binding_conditions": (),
        "binding_failure_conditions": (),
        "binds_to_node": False,
    }
    assert not cel.compile_selector("device.allowMultipleAllocations").matches(d.cel_device)
    assert parse_slice({"spec": {"driver": DRIVER, "pool": {"name": "p"}}}).name == "unnamed"


def _slice_with(device: dict[str, Any]) -> dict[str, Any]:
    return {
        "metadata": {"name": "s"},
        "spec": {"driver": DRIVER, "pool": {"name": "p"}, "devices": [device]},
    }


S = "ResourceSlice s"
D0 = f"{S}: spec.devices[0]"
SLICE_ERRORS = [
    (
        {
            "metadata": {"name": "s"},
            "spec": {"driver": DRIVER, "pool": {"name": "p"}, "sharedCounters": [{"counters": []}]},
        },
        f"{S}: spec.sharedCounters[0].counters: expected an object, got list",
    ),
    (
        {
            "metadata": {"name": "s"},
            "spec": {
                "driver": DRIVER,
                "pool": {"name": "p"},
                "sharedCounters": [{"counters": {"m": "1"}}],
            },
        },
        f"{S}: spec.sharedCounters[0].counters.m: expected an object, got str",
    ),
    (
        _slice_with({"name": "d", "consumesCounters": [{"counterSet": "cs", "counters": []}]}),
        f"{D0}.consumesCounters[0].counters: expected an object, got list",
    ),
    (
        _slice_with({"name": "d", "consumesCounters": [{"counters": {"m": 1}}]}),
        f"{D0}.consumesCounters[0].counters.m: expected an object, got int",
    ),
    ({"metadata": []}, "metadata: expected an object, got list"),
    ({"metadata": {"name": "s"}, "spec": []}, f"{S}: spec: expected an object, got list"),
    (
        {"metadata": {"name": "s"}, "spec": {"driver": DRIVER, "pool": []}},
        f"{S}: spec.pool: expected an object, got list",
    ),
    (
        {"metadata": {"name": "s"}, "spec": {"pool": {"name": "p"}}},
        f"{S}: spec.driver and spec.pool.name are required",
    ),
    (
        {"metadata": {"name": "s"}, "spec": {"driver": "", "pool": {"name": "p"}}},
        f"{S}: spec.driver and spec.pool.name are required",
    ),
    (
        {"metadata": {"name": "s"}, "spec": {"driver": 3, "pool": {"name": "p"}}},
        f"{S}: spec.driver and spec.pool.name are required",
    ),
    (
        {"metadata": {"name": "s"}, "spec": {"driver": DRIVER, "pool": {}}},
        f"{S}: spec.driver and spec.pool.name are required",
    ),
    (
        {
            "metadata": {"name": "s"},
            "spec": {"driver": DRIVER, "pool": {"name": "p"}, "sharedCounters": {}},
        },
        f"{S}: spec.sharedCounters: expected a list, got dict",
    ),
    (
        {
            "metadata": {"name": "s"},
            "spec": {"driver": DRIVER, "pool": {"name": "p"}, "sharedCounters": ["c"]},
        },
        f"{S}: spec.sharedCounters[0]: expected an object, got str",
    ),
    (
        {
            "metadata": {"name": "s"},
            "spec": {
                "driver": DRIVER,
                "pool": {"name": "p"},
                "sharedCounters": [{"counters": {"m": {"value": "lots"}}}],
            },
        },
        f"{S}: sharedCounters[0].m: {BAD_QUANTITY}",
    ),
    (
        {
            "metadata": {"name": "s"},
            "spec": {"driver": DRIVER, "pool": {"name": "p"}, "devices": {}},
        },
        f"{S}: spec.devices: expected a list, got dict",
    ),
    (
        {
            "metadata": {"name": "s"},
            "spec": {"driver": DRIVER, "pool": {"name": "p"}, "devices": [1]},
        },
        f"{D0}: expected an object, got int",
    ),
    (_slice_with({}), f"{D0}: device name is required"),
    (_slice_with({"name": ""}), f"{D0}: device name is required"),
    (_slice_with({"name": "d", "basic": []}), f"{D0}: expected an object, got list"),
    (
        _slice_with({"name": "d", "attributes": []}),
        f"{D0}.attributes: expected an object, got list",
    ),
    (
        _slice_with({"name": "d", "attributes": {"t": "gpu"}}),
        f"{D0}.attributes.t: expected an object, got str",
    ),
    (
        _slice_with({"name": "d", "attributes": {"t": {"float": 1}}}),
        f"{D0}.attributes.t: attribute value {{'float': 1}} has none of int/bool/string/version",
    ),
    (_slice_with({"name": "d", "capacity": []}), f"{D0}.capacity: expected an object, got list"),
    (
        _slice_with({"name": "d", "capacity": {"m": {"value": "lots"}}}),
        f"{D0}.capacity.m: {BAD_QUANTITY}",
    ),
    (_slice_with({"name": "d", "capacity": {"m": "lots"}}), f"{D0}.capacity.m: {BAD_QUANTITY}"),
    (
        _slice_with({"name": "d", "capacity": {"m": {"value": "1", "requestPolicy": []}}}),
        f"{D0}.capacity.m.requestPolicy: expected an object, got list",
    ),
    (
        _slice_with(
            {"name": "d", "capacity": {"m": {"value": "1", "requestPolicy": {"validRange": []}}}}
        ),
        f"{D0}.capacity.m.requestPolicy.validRange: expected an object, got list",
    ),
    (
        _slice_with(
            {"name": "d", "capacity": {"m": {"value": "1", "requestPolicy": {"default": "lots"}}}}
        ),
        f"{D0}.capacity.m.requestPolicy.default: {BAD_QUANTITY}",
    ),
    (
        _slice_with(
            {
                "name": "d",
                "capacity": {"m": {"value": "1", "requestPolicy": {"validValues": ["lots"]}}},
            }
        ),
        f"{D0}.capacity.m.requestPolicy.validValues: {BAD_QUANTITY}",
    ),
    (
        _slice_with(
            {"name": "d", "capacity": {"m": {"value": "1", "requestPolicy": {"validValues": {}}}}}
        ),
        f"{D0}.capacity.m.requestPolicy: expected a list, got dict",
    ),
    (
        _slice_with(
            {
                "name": "d",
                "capacity": {"m": {"value": "1", "requestPolicy": {"validRange": {"min": "lots"}}}},
            }
        ),
        f"{D0}.capacity.m.requestPolicy.validRange.min: {BAD_QUANTITY}",
    ),
    (
        _slice_with(
            {
                "name": "d",
                "capacity": {"m": {"value": "1", "requestPolicy": {"validRange": {"max": "lots"}}}},
            }
        ),
        f"{D0}.capacity.m.requestPolicy.validRange.max: {BAD_QUANTITY}",
    ),
    (
        _slice_with(
            {
                "name": "d",
                "capacity": {
                    "m": {"value": "1", "requestPolicy": {"validRange": {"step": "lots"}}}
                },
            }
        ),
        f"{D0}.capacity.m.requestPolicy.validRange.step: {BAD_QUANTITY}",
    ),
    (
        _slice_with({"name": "d", "consumesCounters": {}}),
        f"{D0}.consumesCounters: expected a list, got dict",
    ),
    (
        _slice_with({"name": "d", "consumesCounters": ["c"]}),
        f"{D0}.consumesCounters[0]: expected an object, got str",
    ),
    (
        _slice_with(
            {
                "name": "d",
                "consumesCounters": [{"counterSet": "cs", "counters": {"m": {"value": "lots"}}}],
            }
        ),
        f"{D0}.consumesCounters[0].m: {BAD_QUANTITY}",
    ),
    (_slice_with({"name": "d", "taints": {}}), f"{D0}.taints: expected a list, got dict"),
    (_slice_with({"name": "d", "taints": ["t"]}), f"{D0}.taints: expected an object, got str"),
    (
        _slice_with({"name": "d", "bindingConditions": {}}),
        f"{D0}.bindingConditions: expected a list, got dict",
    ),
    (
        _slice_with({"name": "d", "bindingConditions": ["a", 5]}),
        f"{D0}.bindingConditions[1]: expected a condition type, got 5",
    ),
    (
        _slice_with({"name": "d", "bindingFailureConditions": [""]}),
        f"{D0}.bindingFailureConditions[0]: expected a condition type, got ''",
    ),
]


@pytest.mark.parametrize(("obj", "message"), SLICE_ERRORS)
def test_what_the_api_server_would_refuse_in_a_slice_is_named(
    obj: dict[str, Any], message: str
) -> None:
    with pytest.raises(ExplainError) as err:
        parse_slice(obj)
    assert str(err.value) == message


def test_allocated_state_reads_every_field_of_a_result() -> None:
    def allocated(
        name: str, namespace: str | None, *results: dict[str, Any], **allocation: Any
    ) -> dict[str, Any]:
        meta = {"name": name, **({"namespace": namespace} if namespace else {})}
        return {
            "metadata": {**meta, "uid": f"uid-{name}"},
            "status": {
                "allocation": {
                    "devices": {"results": list(results), "config": [{"opaque": {}}]},
                    **allocation,
                }
            },
        }

    def result(device: str, **extra: Any) -> dict[str, Any]:
        return {"request": "r", "driver": DRIVER, "pool": "p", "device": device, **extra}

    share = {"shareID": "s1", "consumedCapacity": {"memory": "10Gi", "cores": "5"}}
    state = allocated_state(
        [
            allocated(
                "a",
                "ns",
                result(
                    "d0",
                    tolerations=[{"key": "k", "operator": "Exists"}],
                    bindingConditions=["ok"],
                    bindingFailureConditions=["no"],
                ),
                nodeSelector={"nodeSelectorTerms": []},
            ),
            allocated("b", None, result("d1", **share), result("d1", **share)),
            allocated("c", "ns", result("d1", shareID="s2", consumedCapacity={"memory": "1Gi"})),
            allocated("d", "ns", result("d2", adminAccess=True), nodeSelector={}),
            {"metadata": {"name": "pending"}, "status": {}},
            {"metadata": {"name": "e"}, "status": {"allocation": {}}},
        ]
    )
    p = (DRIVER, "p")
    assert state.exclusive == {(*p, "d0"): "ns/a"}
    assert state.shared_capacity == {
        (*p, "d1"): {"memory": Fraction(21 * 2**30), "cores": Fraction(10)}
    }
    assert state.shared_holders == {(*p, "d1"): ("b", "ns/c")}
    assert state.uids == {"uid-a": "ns/a", "uid-b": "b", "uid-c": "ns/c", "uid-d": "ns/d"}
    assert sorted(state.claims) == ["b", "e", "ns/a", "ns/c", "ns/d"]
    assert state.claims["ns/a"] == ClaimAllocation(
        claim="ns/a",
        results=(
            DeviceResult(
                request="r",
                driver=DRIVER,
                pool="p",
                device="d0",
                tolerations=(Toleration("k", "Exists", "", ""),),
                binding_conditions=("ok",),
                binding_failure_conditions=("no",),
            ),
        ),
        config=({"opaque": {}},),
        node_selector={"nodeSelectorTerms": []},
        existing=True,
    )
    assert state.claims["b"].results[0] == DeviceResult(
        "r", DRIVER, "p", "d1", share_id="s1", consumed_capacity={"memory": "10Gi", "cores": "5"}
    )
    assert state.claims["ns/d"].results[0].admin_access
    assert state.claims["ns/d"].node_selector is None
    assert state.claims["e"] == ClaimAllocation("e", (), (), None, existing=True)


RESULT0 = "c: status.allocation.devices.results[0]"


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        ({"metadata": []}, "metadata: expected an object, got list"),
        (
            {"metadata": {"name": "c", "namespace": "n"}, "status": []},
            "n/c: status: expected an object, got list",
        ),
        (
            {"metadata": {"name": "c"}, "status": {"allocation": []}},
            "c: status.allocation: expected an object, got list",
        ),
        (
            {"metadata": {"name": "c"}, "status": {"allocation": {"devices": []}}},
            "c: status.allocation.devices: expected an object, got list",
        ),
        (
            {"metadata": {"name": "c"}, "status": {"allocation": {"devices": {"results": {}}}}},
            "c: status.allocation.devices.results: expected a list, got dict",
        ),
        (
            {"metadata": {"name": "c"}, "status": {"allocation": {"devices": {"results": ["r"]}}}},
            "c: status.allocation.devices.results[0]: expected an object, got str",
        ),
        (
            {
                "metadata": {"name": "c"},
                "status": {"allocation": {"devices": {"results": [{"consumedCapacity": []}]}}},
            },
            f"{RESULT0}.consumedCapacity: expected an object, got list",
        ),
        (
            {
                "metadata": {"name": "c"},
                "status": {"allocation": {"devices": {"results": [{"tolerations": {}}]}}},
            },
            "c: status.allocation.devices.results[0].tolerations: expected a list, got dict",
        ),
        (
            {
                "metadata": {"name": "c"},
                "status": {"allocation": {"devices": {"results": [{"bindingConditions": [1]}]}}},
            },
            f"{RESULT0}.bindingConditions[0]: expected a condition type, got 1",
        ),
        (
            {
                "metadata": {"name": "c"},
                "status": {
                    "allocation": {"devices": {"results": [{"bindingFailureConditions": [""]}]}}
                },
            },
            "c: status.allocation.devices.results[0].bindingFailureConditions[0]: "
            "expected a condition type, got ''",
        ),
        (
            {
                "metadata": {"name": "c"},
                "status": {
                    "allocation": {
                        "devices": {
                            "results": [{"shareID": "s", "consumedCapacity": {"m": "lots"}}]
                        }
                    }
                },
            },
            f"c: status.allocation.devices.results[0].consumedCapacity.m: {BAD_QUANTITY}",
        ),
        (
            {"metadata": {"name": "c"}, "status": {"allocation": {"devices": {"config": {}}}}},
            "c: status.allocation.devices.config: expected a list, got dict",
        ),
        (
            {"metadata": {"name": "c"}, "status": {"allocation": {"devices": {"config": ["x"]}}}},
            "c: status.allocation.devices.config: expected an object, got str",
        ),
    ],
)
def test_what_an_allocated_claim_holds_wrongly_is_named(obj: dict[str, Any], message: str) -> None:
    with pytest.raises(ExplainError) as err:
        allocated_state([obj])
    assert str(err.value) == message


def test_a_device_taint_rule_is_parsed_field_by_field() -> None:
    def rule(spec: dict[str, Any], name: str | None = "r") -> Any:
        meta = {"name": name} if name is not None else {}
        return parse_device_taint_rule({"kind": "DeviceTaintRule", "metadata": meta, "spec": spec})

    taint = {"key": "k", "value": "v", "effect": "NoExecute"}
    assert rule(
        {
            "taint": taint,
            "deviceSelector": {
                "driver": DRIVER,
                "pool": "p",
                "device": "d",
                "deviceClassName": "c",
                "selectors": [{"cel": {"expression": "true"}}],
            },
        }
    ) == DeviceTaintRule(
        "r",
        Taint("k", "v", "NoExecute", rule="r"),
        driver=DRIVER,
        pool="p",
        device="d",
        device_class="c",
        selectors=("true",),
    )
    assert rule(
        {"taint": {"key": "k", "effect": "NoSchedule"}, "deviceSelector": {"pool": ""}}, name=None
    ) == DeviceTaintRule("unnamed", Taint("k", "", "NoSchedule", rule="unnamed"))
    assert rule({"taint": taint}) == DeviceTaintRule(
        "r", Taint("k", "v", "NoExecute", rule="r"), selected=False
    )
    for spec, message in [
        ([], "DeviceTaintRule r: spec: expected an object, got list"),
        ({"taint": []}, "DeviceTaintRule r: spec.taint: expected an object, got list"),
        (
            {"taint": {"key": "k"}},
            "DeviceTaintRule r: spec.taint.key and spec.taint.effect are required",
        ),
        (
            {"taint": {"effect": "NoSchedule"}},
            "DeviceTaintRule r: spec.taint.key and spec.taint.effect are required",
        ),
        (
            {"taint": taint, "deviceSelector": []},
            "DeviceTaintRule r: spec.deviceSelector: expected an object, got list",
        ),
        (
            {"taint": taint, "deviceSelector": {"selectors": {}}},
            "DeviceTaintRule r: spec.deviceSelector.selectors: expected a list, got dict",
        ),
    ]:
        with pytest.raises(ExplainError) as err:
            rule(spec)  # type: ignore[arg-type]
        assert str(err.value) == message
    with pytest.raises(ExplainError, match=r"^metadata: expected an object, got str$"):
        parse_device_taint_rule({"metadata": "x"})


def test_a_result_after_one_with_admin_access_still_holds_its_device() -> None:
    results = [
        {"request": "watch", "driver": DRIVER, "pool": "p", "device": "d0", "adminAccess": True},
        {"request": "use", "driver": DRIVER, "pool": "p", "device": "d1"},
    ]
    state = allocated_state(
        [{"metadata": {"name": "c"}, "status": {"allocation": {"devices": {"results": results}}}}]
    )
    assert state.exclusive == {(DRIVER, "p", "d1"): "c"}


def test_the_cel_view_of_a_capacity_keeps_its_format() -> None:
    s = parse_slice(
        {
            "metadata": {"name": "s"},
            "spec": {
                "driver": DRIVER,
                "pool": {"name": "p"},
                "devices": [
                    {
                        "name": "d",
                        "capacity": {"memory": {"value": "80Gi"}, "cores": {"value": "2k"}},
                    }
                ],
            },
        }
    )
    (d,) = s.devices
    why = cel.compile_selector(
        f"device.capacity['{DRIVER}'].memory.compareTo(quantity('90Gi')) >= 0 && "
        f"device.capacity['{DRIVER}'].cores.compareTo(quantity('3k')) >= 0"
    ).why_false(d.cel_device)
    assert why == ["memory 80Gi is less than 90Gi", "cores 2k is less than 3k"]
