"""Inputs for the allocator's tests: GPUs, MIG partitions, slices and claims as API JSON, and
`run` to allocate them on one node."""

from __future__ import annotations

from typing import Any

from dra_driver.devices.classes import default_device_classes
from dra_driver.scheduling.allocator import (
    AllocationResult,
    Node,
    allocate,
    allocated_state,
    parse_claim,
    parse_device_class,
    parse_slice,
)

DRIVER = "gpu.nvidia.com"


NODE = Node("node1")


CLASSES = {c.name: c for c in (parse_device_class(o) for o in default_device_classes())}


def gpu(
    name: str,
    *,
    memory: str = "80Gi",
    product: str = "NVIDIA H100",
    root: str = "pci0",
    **extra: Any,
) -> dict[str, Any]:
    dev: dict[str, Any] = {
        "name": name,
        "attributes": {
            "type": {"string": "gpu"},
            "productName": {"string": product},
            "resource.kubernetes.io/pcieRoot": {"string": root},
        },
        "capacity": {"memory": {"value": memory}},
    }
    dev.update(extra)
    return dev


def mig(name: str, *, start: int, size: int, counter_set: str = "gpu-0-cs") -> dict[str, Any]:
    return {
        "name": name,
        "attributes": {"type": {"string": "mig"}, "profile": {"string": f"{size}g"}},
        "capacity": {"memory": {"value": f"{size * 10}Gi"}},
        "consumesCounters": [
            {
                "counterSet": counter_set,
                "counters": {
                    f"memory-slice-{i}": {"value": "1"} for i in range(start, start + size)
                },
            }
        ],
    }


def slice_(
    devices: list[dict[str, Any]],
    *,
    name: str = "s1",
    generation: int = 1,
    count: int = 1,
    counters: list[dict[str, Any]] | None = None,
    pool: str = "node1",
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "driver": DRIVER,
        "nodeName": "node1",
        "pool": {"name": pool, "generation": generation, "resourceSliceCount": count},
        "devices": devices,
    }
    if counters:
        spec["sharedCounters"] = counters
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": spec,
    }


def claim(
    *requests: dict[str, Any], constraints: list[dict[str, Any]] | None = None, name: str = "c"
) -> dict[str, Any]:
    devices: dict[str, Any] = {"requests": list(requests)}
    if constraints:
        devices["constraints"] = constraints
    return {
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "ns"},
        "spec": {"devices": devices},
    }


def exactly(
    name: str = "gpu",
    *,
    cls: str = "gpu.nvidia.com",
    selectors: tuple[str, ...] = (),
    **fields: Any,
) -> dict[str, Any]:
    body: dict[str, Any] = {"deviceClassName": cls, **fields}
    if selectors:
        body["selectors"] = [{"cel": {"expression": s}} for s in selectors]
    return {"name": name, "exactly": body}


def run(
    claims: list[dict[str, Any]],
    slices: list[dict[str, Any]],
    allocated: list[dict[str, Any]] | None = None,
) -> AllocationResult:
    return allocate(
        [parse_claim(c) for c in claims],
        classes=CLASSES,
        slices=[parse_slice(s) for s in slices],
        node=NODE,
        allocated=allocated_state(allocated or []),
    )


def devices_of(result: AllocationResult) -> list[str]:
    assert result.satisfiable, result
    return [r.device for a in result.allocations for r in a.results]


def allocated_claim(*devices: str, share: bool = False) -> dict[str, Any]:
    return {
        "metadata": {"name": "other", "namespace": "ns"},
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {
                            "request": "r",
                            "driver": DRIVER,
                            "pool": "node1",
                            "device": d,
                            **(
                                {"shareID": "1", "consumedCapacity": {"memory": "30Gi"}}
                                if share
                                else {}
                            ),
                        }
                        for d in devices
                    ]
                }
            }
        },
    }
