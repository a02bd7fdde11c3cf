"""Hypothesis strategies for the oracle tier: small clusters (pools of ResourceSlices on a node,
DeviceClasses, claims in use) and the claims of one pod to allocate on them, as v1 API JSON.

Drawn to reach every part of the scheduler's allocator that explain mirrors: shared counters
(a counter slice beside the device slices, devices consuming from it), consumable capacity
(``allowMultipleAllocations``, ``requestPolicy`` with valid values or a range, capacity
requests), taints and tolerations, ``firstAvailable``, ``allocationMode: All``, binding
conditions (and ``bindsToNode``), admin access, ``matchAttribute``/``distinctAttribute``
constraints, class and request selectors (a few of which fail at run time), incomplete pools
and stale generations, slices for another node, ``allNodes`` and node selectors, and devices
already held by other claims (whole, as shares with consumed capacity, with admin access).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.oracle import NODE, Case

JSON = dict[str, Any]
DRIVER = "gpu.nvidia.com"
OTHER_DRIVER = "nic.example.com"
COUNTER_SET = "gpu-cs"

# Class selectors, each with its name; "typed" fails at run time on a device without "type".
CLASSES: list[JSON] = [
    {"metadata": {"name": "any"}, "spec": {}},
    {
        "metadata": {"name": "nvidia"},
        "spec": {"selectors": [{"cel": {"expression": f"device.driver == '{DRIVER}'"}}]},
    },
    {
        "metadata": {"name": "mig"},
        "spec": {
            "selectors": [
                {
                    "cel": {
                        "expression": f"device.driver == '{DRIVER}' && "
                        f"'type' in device.attributes['{DRIVER}'] && "
                        f"device.attributes['{DRIVER}'].type == 'mig'"
                    }
                }
            ],
            "config": [
                {
                    "opaque": {
                        "driver": DRIVER,
                        "parameters": {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "x"},
                    }
                }
            ],
        },
    },
    {
        "metadata": {"name": "typed"},
        "spec": {
            "selectors": [
                {"cel": {"expression": "device.attributes['gpu.nvidia.com'].type == 'gpu'"}}
            ]
        },
    },
]
CLASS_NAMES = [c["metadata"]["name"] for c in CLASSES]

REQUEST_SELECTORS = [
    f"device.capacity['{DRIVER}'].memory.compareTo(quantity('40Gi')) >= 0",
    f"device.attributes['{DRIVER}'].index % 2 == 0",
    f"device.attributes['{DRIVER}'].product.startsWith('H')",
    "device.allowMultipleAllocations",
    f"!('product' in device.attributes['{DRIVER}']) || "
    f"device.attributes['{DRIVER}'].product != 'A100'",
]
MEMORY = ["10Gi", "20Gi", "40Gi", "80Gi"]
TAINT_KEYS = ["example.com/xid", "example.com/maintenance"]


def rare(draw: st.DrawFn, n: int) -> bool:
    """True about once in ``n`` draws; False in the minimal (shrunk) example."""
    return draw(st.integers(0, n - 1)) == n - 1


@st.composite
def device(draw: st.DrawFn, *, index: int, counters: bool, driver: str) -> JSON:
    attributes: JSON = {"index": {"int": index}}
    if not rare(draw, 10):  # rarely without "type": the "typed" class then fails
        attributes["type"] = {"string": draw(st.sampled_from(["gpu", "mig"]))}
    if draw(st.booleans()):
        attributes["product"] = {"string": draw(st.sampled_from(["H100", "A100"]))}
    attributes["resource.kubernetes.io/pcieRoot"] = {
        "string": draw(st.sampled_from(["pci0", "pci1"]))
    }
    memory: JSON = {"value": draw(st.sampled_from(MEMORY))}
    dev: JSON = {"name": f"dev-{index}", "attributes": attributes, "capacity": {"memory": memory}}
    if driver == DRIVER and rare(draw, 4):
        dev["allowMultipleAllocations"] = True
        policy = draw(st.sampled_from(["none", "values", "range", "step"]))
        if policy == "values":
            memory["requestPolicy"] = {"default": "10Gi", "validValues": ["5Gi", "10Gi", "20Gi"]}
        elif policy == "range":
            memory["requestPolicy"] = {"default": "10Gi", "validRange": {"min": "5Gi"}}
        elif policy == "step":
            memory["requestPolicy"] = {
                "default": "10Gi",
                "validRange": {"min": "5Gi", "max": "40Gi", "step": "5Gi"},
            }
    if counters and draw(st.booleans()):
        dev["consumesCounters"] = [
            {
                "counterSet": COUNTER_SET,
                "counters": {"slices": {"value": str(draw(st.integers(1, 4)))}},
            }
        ]
    if rare(draw, 5):
        dev["taints"] = [
            {
                "key": draw(st.sampled_from(TAINT_KEYS)),
                **({"value": "79"} if draw(st.booleans()) else {}),
                "effect": draw(st.sampled_from(["NoSchedule", "NoExecute", "None"])),
            }
        ]
    if rare(draw, 8):
        dev["bindingConditions"] = ["example.com/ready"]
        dev["bindingFailureConditions"] = ["example.com/failed"]
        if draw(st.booleans()):
            dev["bindsToNode"] = True
    return dev


@st.composite
def pool(draw: st.DrawFn, *, index: int) -> list[JSON]:
    driver = OTHER_DRIVER if index > 0 and rare(draw, 4) else DRIVER
    name = f"pool-{index}"
    counters = driver == DRIVER and draw(st.booleans())
    n_slices = draw(st.integers(1, 2))
    where = draw(st.sampled_from(["node", "node", "node", "other", "all", "selector"]))
    placement: JSON = {
        "node": {"nodeName": NODE},
        "other": {"nodeName": "node2"},
        "all": {"allNodes": True},
        "selector": {
            "nodeSelector": {
                "nodeSelectorTerms": [
                    {
                        "matchExpressions": [
                            {
                                "key": "kubernetes.io/hostname",
                                "operator": "In",
                                "values": [NODE],
                            }
                        ]
                    }
                ]
            }
        },
    }[where]
    slices: list[JSON] = []
    next_device = 0
    count = n_slices + (1 if counters else 0)
    if rare(draw, 10):
        count += 1  # a slice is not published yet: the pool is incomplete
    for s in range(n_slices):
        devices = []
        for _ in range(draw(st.integers(0 if s else 1, 3))):
            devices.append(draw(device(index=next_device, counters=counters, driver=driver)))
            next_device += 1
        slices.append(_slice(f"{name}-s{s}", driver, name, count, placement, devices=devices))
    if counters:
        total = {"slices": {"value": str(draw(st.integers(2, 6)))}}
        slices.append(
            _slice(
                f"{name}-counters",
                driver,
                name,
                count,
                placement,
                sharedCounters=[{"name": COUNTER_SET, "counters": total}],
            )
        )
    if rare(draw, 10):  # a stale slice of an older generation: ignored
        stale = _slice(
            f"{name}-old",
            driver,
            name,
            1,
            placement,
            devices=[draw(device(index=90, counters=False, driver=driver))],
        )
        stale["spec"]["pool"]["generation"] = 0
        slices.append(stale)
    return draw(st.permutations(slices))


def _slice(
    name: str, driver: str, pool_name: str, count: int, placement: JSON, **content: Any
) -> JSON:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {
            "driver": driver,
            "pool": {"name": pool_name, "generation": 1, "resourceSliceCount": count},
            **placement,
            **content,
        },
    }


@st.composite
def exact_request(draw: st.DrawFn, *, name: str) -> JSON:
    body: JSON = {"deviceClassName": draw(st.sampled_from(CLASS_NAMES))}
    if rare(draw, 8):
        body["allocationMode"] = "All"
    else:
        body["allocationMode"] = "ExactCount"
        body["count"] = draw(st.integers(1, 3))
    if rare(draw, 3):
        body["selectors"] = [{"cel": {"expression": draw(st.sampled_from(REQUEST_SELECTORS))}}]
    if rare(draw, 4):
        op = draw(st.sampled_from(["Exists", "Equal"]))
        toleration: JSON = {"operator": op}
        if op == "Equal" or draw(st.booleans()):
            toleration["key"] = draw(st.sampled_from(TAINT_KEYS))
        if op == "Equal" and draw(st.booleans()):
            toleration["value"] = "79"
        if draw(st.booleans()):
            toleration["effect"] = draw(st.sampled_from(["NoSchedule", "NoExecute"]))
        body["tolerations"] = [toleration]
    if rare(draw, 4):
        body["capacity"] = {
            "requests": {"memory": draw(st.sampled_from(["1Gi", "7Gi", "10Gi", "20Gi", "50Gi"]))}
        }
    return {"name": name, **body}


@st.composite
def request(draw: st.DrawFn, *, name: str) -> JSON:
    if rare(draw, 4):
        subs = [draw(exact_request(name=f"s{i}")) for i in range(draw(st.integers(2, 3)))]
        return {"name": name, "firstAvailable": subs}
    body = draw(exact_request(name=name))
    del body["name"]
    if rare(draw, 12):  # only a request's own devices may be taken with admin access
        body["adminAccess"] = True
    return {"name": name, "exactly": body}


@st.composite
def claim(draw: st.DrawFn, *, index: int) -> JSON:
    names = [f"r{i}" for i in range(draw(st.integers(1, 2)))]
    devices: JSON = {"requests": [draw(request(name=n)) for n in names]}
    if rare(draw, 4):
        attribute = draw(
            st.sampled_from(
                ["resource.kubernetes.io/pcieRoot", f"{DRIVER}/product", f"{DRIVER}/index"]
            )
        )
        kind = draw(st.sampled_from(["matchAttribute", "distinctAttribute"]))
        devices["constraints"] = [
            {kind: attribute, **({"requests": names} if draw(st.booleans()) else {})}
        ]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": f"claim-{index}", "namespace": "default", "uid": f"uid-{index}"},
        "spec": {"devices": devices},
    }


@st.composite
def in_use(draw: st.DrawFn, slices: list[JSON]) -> list[JSON]:
    """Claims of other pods holding some of the node's devices (whole, shares, admin access)."""
    devices = [
        (s["spec"]["driver"], s["spec"]["pool"]["name"], d)
        for s in slices
        if s["spec"]["pool"]["generation"] == 1
        for d in s["spec"].get("devices") or []
    ]
    if not devices:
        return []
    held = draw(st.lists(st.sampled_from(devices), max_size=4))
    results = []
    for driver, pool_name, dev in held:
        result: JSON = {"request": "r", "driver": driver, "pool": pool_name, "device": dev["name"]}
        if dev.get("allowMultipleAllocations"):
            result["shareID"] = f"{len(results):08d}-0000-4000-8000-000000000000"
            result["consumedCapacity"] = {"memory": draw(st.sampled_from(["5Gi", "10Gi", "20Gi"]))}
        elif rare(draw, 6):
            result["adminAccess"] = True
        results.append(result)
    return [
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": f"held-{i}", "namespace": "other", "uid": f"held-uid-{i}"},
            "spec": {"devices": {"requests": []}},
            "status": {"allocation": {"devices": {"results": [r]}}},
        }
        for i, r in enumerate(results)
    ]


@st.composite
def cases(draw: st.DrawFn) -> Case:
    slices = [s for i in range(draw(st.integers(1, 3))) for s in draw(pool(index=i))]
    claims = [draw(claim(index=i)) for i in range(draw(st.integers(1, 2)))]
    allocated = draw(in_use(slices)) if draw(st.booleans()) else []
    return Case(id="", slices=slices, classes=CLASSES, claims=claims, allocated=allocated)


def generated_cases(count: int) -> list[Case]:
    """``count`` cases drawn by Hypothesis (derandomized: the same in every run), to be
    answered by one oracle process: Hypothesis draws, the batch is compared afterwards."""
    drawn: list[Case] = []

    @settings(
        max_examples=count,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(cases())
    def collect(case: Case) -> None:
        drawn.append(case)

    collect()
    return [dataclasses.replace(c, id=f"gen-{i}") for i, c in enumerate(drawn)]
