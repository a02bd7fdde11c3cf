"""Devices and pools for the slice tests (test_slices, test_syncplan, test_kube_conversion):
hand-made GPUs, and what the API server would store of a created slice."""

from __future__ import annotations

import copy
import itertools
from typing import Any

from dra_driver.devices import CounterConsumption, CounterSet, Device, NodeDevices, Taint, Version
from dra_driver.publish.slices import DesiredPool, build_slices
from dra_driver.publish.syncplan import plan_sync

DRIVER = "gpu.nvidia.com"
NODE = "node1"
_uid = itertools.count()


def gpu(
    minor: int,
    *,
    taints: tuple[Taint, ...] = (),
    counter_set: str | None = None,
    memory: str = "80Gi",
) -> Device:
    consumes = (
        (CounterConsumption(counter_set=counter_set, counters={"memory": memory}),)
        if counter_set
        else ()
    )
    return Device(
        name=f"gpu-{minor}",
        attributes={
            "type": "gpu",
            "uuid": f"GPU-{minor:08d}",
            "cudaComputeCapability": Version("9.0.0"),
            "minorNumber": minor,
            "mig": False,
        },
        capacity={"memory": memory},
        consumes_counters=consumes,
        taints=taints,
    )


def counter_set(name: str) -> CounterSet:
    return CounterSet(name=name, counters={"memory": "80Gi", "multiprocessors": "132"})


def build(node_devices: NodeDevices, **kw: Any) -> DesiredPool:
    return build_slices(node_devices, driver_name=DRIVER, node_name=NODE, **kw)


def stored(body: dict[str, Any]) -> dict[str, Any]:
    """What the API server keeps of a created body: a name, uid, resourceVersion, taint times."""
    obj = copy.deepcopy(body)
    n = next(_uid)
    meta = obj["metadata"]
    meta["name"] = meta["generateName"] + f"x{n:04d}"[-5:]
    meta["uid"] = f"uid-{n}"
    meta["resourceVersion"] = str(1000 + n)
    for device in obj["spec"].get("devices", ()):
        for taint in device.get("taints", ()):
            taint.setdefault("timeAdded", "2026-01-01T00:00:00Z")
    return obj


def publish(pool: DesiredPool) -> list[dict[str, Any]]:
    plan = plan_sync(pool, [], node_uid="node-uid")
    return [stored(w.body) for w in plan.creates]


def sizes(pool: DesiredPool) -> list[tuple[int, int]]:
    return [(len(s.devices), len(s.shared_counters)) for s in pool.slices]
