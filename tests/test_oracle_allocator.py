"""``gpu-dra explain`` allocates as the kube-scheduler 1.37 does: the same claims, on the same
slices, classes and claims in use, get the same answer from explain's engine and from the
scheduler's own allocator (``k8s.io/dynamic-resource-allocation/structured`` v0.37.2 with the
scheduler's feature defaults, run by ``draoracle``, tests/oracle.py).

"The same" is: both allocate, with the same devices for the same requests (the scheduler's
choice among equal devices is deterministic: it walks pools, slices and devices in order), the
same consumed capacity, tolerations, binding conditions, configs and nodeSelector; or both find
no allocation; or both give up with an error (a CEL runtime error). Cases are batched: one
oracle process per batch.

Hand-picked: every example in examples/resourceclaims/ on the simulated nodes explain's example
test uses, idle, then busy (the devices of earlier rounds held by other claims, until nothing
fits), and with a tainted device. Generated: ``tests/oraclecases.py``.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dra_driver.devices.classes import default_device_classes
from dra_driver.scheduling.documents import claims_from_documents, load_documents
from dra_driver.sim.demo import DEMO_NODE, DEMO_SIMULATE
from tests.oracle import (
    Case,
    Outcome,
    difference,
    explain_outcome,
    named_slices,
    oracle_outcomes,
    run_oracle,
)
from tests.oraclecases import generated_cases
from tests.simulatedslices import simulated_slices
from tests.test_examples_explain import DYNAMIC_MIG, FILES, expectation

JSON = dict[str, Any]
ROUNDS = 4  # idle, then up to three rounds with the earlier rounds' devices held
# How many generated cases (one oracle run); GPU_DRA_ORACLE_CASES draws more (or fewer).
GENERATED = int(os.environ.get("GPU_DRA_ORACLE_CASES", "300"))


def compare(cases: Sequence[Case]) -> list[tuple[Case, Outcome, Outcome]]:
    """Every case with explain's and the scheduler's answer (one oracle run)."""
    theirs = oracle_outcomes(cases)
    return [(c, explain_outcome(c), t) for c, t in zip(cases, theirs, strict=True)]


def differences(compared: Sequence[tuple[Case, Outcome, Outcome]]) -> list[str]:
    return [
        difference(case, ours, theirs)
        for case, ours, theirs in compared
        if ours.comparable() != theirs.comparable()
    ]


def test_the_oracle_runs_the_scheduler_allocator_with_its_1_37_defaults() -> None:
    features = run_oracle()["features"]
    assert features == {
        "AdminAccess": True,
        "PrioritizedList": True,
        "PartitionableDevices": True,
        "DeviceTaints": True,
        "DeviceBindingAndStatus": True,
        "ConsumableCapacity": True,
        "FractionalCapacityRange": False,  # beta, on only from compatibility version 1.37
        "ListTypeAttributes": False,
        "OptionalNodeOperations": False,
        "DerivedAttributes": False,
        "CompatibilityGroups": False,
    }


def test_the_comparison_sees_a_different_device() -> None:
    """The tier can fail: a claim for one device, over two, answered with the other one."""
    slices = simulated_slices("h100:2", node_name="node1")
    case = Case(
        "two-gpus",
        named_slices(slices),
        default_device_classes(),
        [_claim("one", "gpu.nvidia.com")],
    )
    (theirs,) = oracle_outcomes([case])
    ours = explain_outcome(case)
    assert ours.comparable() == theirs.comparable()
    assert theirs.kind == "allocated"
    swapped = copy.deepcopy(theirs.claims[0])
    swapped["results"][0]["device"] = (
        "gpu-1" if swapped["results"][0]["device"] == "gpu-0" else "gpu-0"
    )
    assert Outcome("allocated", (swapped,)).comparable() != ours.comparable()


def _claim(name: str, device_class: str, **exact: Any) -> JSON:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "devices": {
                "requests": [{"name": "gpu", "exactly": {"deviceClassName": device_class, **exact}}]
            }
        },
    }


# -- every example, idle and busy --------------------------------------------------------------


def example_node(path: Path) -> tuple[str, list[JSON]]:
    """The node explain's example test checks ``path`` on, and its slices."""
    _, options = expectation(path)
    if path.parent == DYNAMIC_MIG:
        return "node1", simulated_slices(
            "h100:2:mig,a100-80gb:1", node_name="node1", mig_mode="dynamic"
        )
    shares = options.get("consumable-shares", "disabled")
    return DEMO_NODE, simulated_slices(DEMO_SIMULATE, node_name=DEMO_NODE, consumable_shares=shares)


def example_claims(path: Path) -> list[JSON]:
    return claims_from_documents(load_documents(str(path)), label=path.name)


def held(claims: Sequence[JSON], outcome: Outcome, round_: int) -> list[JSON]:
    """``claims`` as other pods' claims holding the devices ``outcome`` gave them."""
    out = []
    for claim, allocation in zip(claims, outcome.claims, strict=True):
        results = []
        for result in allocation["results"]:
            r = dict(result)
            if r.get("shareID"):
                r["shareID"] = f"{round_:08d}-{len(out):04d}-4000-8000-{len(results):012d}"
            results.append(r)
        name = (claim.get("metadata") or {}).get("name", "claim")
        out.append(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {"name": f"{name}-round{round_}", "namespace": "busy"},
                "spec": {"devices": {"requests": []}},
                "status": {
                    "allocation": {
                        "devices": {"results": results},
                        **(
                            {"nodeSelector": allocation["nodeSelector"]}
                            if allocation.get("nodeSelector")
                            else {}
                        ),
                    }
                },
            }
        )
    return out


def tainted(slices: Sequence[JSON]) -> list[JSON]:
    """The slices with their first device tainted NoSchedule, as a simulated XID taints it."""
    out = copy.deepcopy(list(slices))
    for s in out:
        devices = s["spec"].get("devices") or []
        if devices:
            devices[0]["taints"] = [
                {"key": "gpu.nvidia.com/xid", "value": "79", "effect": "NoSchedule"}
            ]
    return out


def example_cases() -> list[Case]:
    """Each example idle and in up to three busy rounds (explain's allocations held), and on a
    node whose first devices are tainted; built with explain's answers, so one oracle run
    checks them all."""
    out: list[Case] = []
    classes = default_device_classes()
    for path in FILES:
        node, slices = example_node(path)
        slices = named_slices(slices)
        claims = example_claims(path)
        allocated: list[JSON] = []
        for round_ in range(ROUNDS):
            case = Case(f"{path.name}/round{round_}", slices, classes, claims, allocated, node)
            out.append(case)
            ours = explain_outcome(case)
            if ours.kind != "allocated":
                break
            allocated = allocated + held(claims, ours, round_)
        out.append(Case(f"{path.name}/tainted", tainted(slices), classes, claims, [], node))
    return out


def test_every_example_is_allocated_as_the_scheduler_does_idle_busy_and_tainted() -> None:
    cases = example_cases()
    compared = compare(cases)
    found = differences(compared)
    assert not found, f"{len(found)} of {len(cases)} cases differ:\n" + "\n".join(found)
    kinds = {ours.kind for _, ours, _ in compared}
    assert kinds == {"allocated", "unsatisfiable"}, kinds  # both outcomes are exercised
    busy = [c for c, ours, _ in compared if c.allocated and ours.kind == "allocated"]
    assert busy, "no example was allocated on a busy node"


# -- generated clusters and claims -------------------------------------------------------------


def test_generated_claims_are_allocated_as_the_scheduler_does() -> None:
    cases = generated_cases(GENERATED)
    compared = compare(cases)
    found = differences(compared)
    assert not found, f"{len(found)} of {len(cases)} cases differ:\n" + "\n\n".join(found[:3])
    # not vacuous: the draw allocates, fails to fit and gives up with errors
    assert {theirs.kind for _, _, theirs in compared} == {"allocated", "unsatisfiable", "error"}


def test_one_request_never_takes_one_shared_device_twice_as_the_scheduler() -> None:
    """A request for two shares of a device with room for two: the scheduler's combinations,
    not permutations (explain's search docstring); two such devices give one share each."""
    from tests.allocatordata import DRIVER, gpu, slice_  # noqa: PLC0415
    from tests.oracle import NODE  # noqa: PLC0415

    def shared(name: str) -> JSON:
        device = gpu(name, allowMultipleAllocations=True)
        device["attributes"] = {}
        return device

    def slices(*names: str) -> list[JSON]:
        s = slice_([shared(n) for n in names])
        s["spec"]["nodeName"] = NODE
        s["spec"]["pool"]["name"] = NODE
        return [s]

    classes = [
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceClass",
            "metadata": {"name": "shared"},
            "spec": {"selectors": [{"cel": {"expression": f"device.driver == '{DRIVER}'"}}]},
        }
    ]
    two = _claim("two", "shared", count=2, capacity={"requests": {"memory": "10Gi"}})
    cases = [
        Case("one-device", slices("gpu-0"), classes, [two]),
        Case("two-devices", slices("gpu-0", "gpu-1"), classes, [two]),
    ]
    compared = compare(cases)
    assert not differences(compared)
    (_, one, _), (_, both, _) = compared
    assert one.kind == "unsatisfiable", one
    assert both.kind == "allocated"
    assert [r["device"] for r in both.claims[0]["results"]] == ["gpu-0", "gpu-1"]
