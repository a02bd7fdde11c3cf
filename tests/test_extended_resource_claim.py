"""A pod with ``limits: {nvidia.com/gpu: 2}`` and no claim, as KEP-5004 serves it through the
chart's ``gpu.nvidia.com`` class (``extendedResourceName: nvidia.com/gpu``).

The kube-scheduler writes a ResourceClaim for such a pod (annotation
``resource.kubernetes.io/extended-resource-claim: "true"``, owned by the pod, one request
``container-<i>-request-<j>`` per container and extended resource: ``exactly`` the class,
``ExactCount``, the quantity), allocates it, and the kubelet asks the driver to prepare it like any
claim. Here the classes the code ships (those the chart renders) allocate that claim with the
project's allocator, and the real Preparer prepares the allocation on simulated GPUs.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dra_driver.devices.classes import default_device_classes
from dra_driver.prepare.state.checkpoint import PREPARE_COMPLETED
from dra_driver.scheduling.explanation import allocate
from tests.claimdata import allocated_claim
from tests.simulatedslices import simulated_slices
from tests.test_prepare import SPEC, VENDOR, Env, build_env

REQUEST = "container-0-request-0"  # the first container's first extended resource


def scheduler_claim(count: int) -> dict[str, Any]:
    """The claim the kube-scheduler makes for a pod asking ``nvidia.com/gpu: <count>``."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {
            "name": "legacy-extended-resources-x7k2p",
            "namespace": "default",
            "annotations": {"resource.kubernetes.io/extended-resource-claim": "true"},
            "ownerReferences": [
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": "legacy",
                    "uid": "pod-uid-1",
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": REQUEST,
                        "exactly": {
                            "deviceClassName": "gpu.nvidia.com",
                            "allocationMode": "ExactCount",
                            "count": count,
                        },
                    }
                ]
            }
        },
    }


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    e = build_env(tmp_path)
    yield e
    e.preparer.close()


def test_the_class_the_chart_ships_allocates_whole_gpus_only() -> None:
    classes = default_device_classes()
    assert classes[0]["spec"]["extendedResourceName"] == "nvidia.com/gpu"
    slices = simulated_slices(SPEC, node_name="node1")  # four H100s and an A100 in MIG mode
    result = allocate(scheduler_claim(2), classes, slices)
    assert result.chosen is not None
    (allocation,) = result.chosen.allocations
    assert [(r.request, r.device) for r in allocation.results] == [
        (REQUEST, "gpu-0"),
        (REQUEST, "gpu-1"),
    ]
    # MIG devices are never the device plugin's nvidia.com/gpu: five asks more than there are
    assert not allocate(scheduler_claim(5), classes, slices).satisfiable


def test_the_agent_prepares_the_schedulers_claim_like_any_other(env: Env) -> None:
    claim = allocated_claim(name="legacy-extended-resources-x7k2p",
                            devices=[(REQUEST, "gpu-0"), (REQUEST, "gpu-1")])  # fmt: skip
    made = scheduler_claim(2)
    claim["metadata"] |= {k: made["metadata"][k] for k in ("annotations", "ownerReferences")}
    claim["spec"] = made["spec"]
    env.store.add(claim)
    uid = claim["metadata"]["uid"]
    devices = env.preparer.prepare(env.ref(claim))
    assert [(d.request_names, d.device, d.cdi_device_ids) for d in devices] == [
        ((REQUEST,), "gpu-0", (f"{VENDOR}/claim={uid}-gpu-0",)),
        ((REQUEST,), "gpu-1", (f"{VENDOR}/claim={uid}-gpu-1",)),
    ]
    spec = json.loads(env.specs.path_for(uid).read_bytes())
    assert [d["name"] for d in spec["devices"]] == [f"{uid}-gpu-0", f"{uid}-gpu-1"]
    record = env.checkpoint.get(uid)
    assert record is not None and record.phase == PREPARE_COMPLETED
    env.preparer.unprepare(env.ref(claim))
    assert env.checkpoint.get(uid) is None
