"""``gpu-dra explain`` against cluster state (scheduling/inventory.py ``read_cluster``, or the same
objects from files): claims in use, admin access, DeviceTaintRules, claims already allocated."""

from __future__ import annotations

import copy
import io
import json
from pathlib import Path
from typing import Any

import yaml

from dra_driver.cli import explain_main as main
from dra_driver.devices.classes import default_device_classes
from dra_driver.scheduling.explain import allocate
from dra_driver.sim.localapi import FakeKubeApi
from tests.simulatedslices import simulated_slices
from tests.test_explain import CLAIM

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "resourceclaims"
H100_NODE = "h100-node"
ON_H100_NODE = {
    "nodeSelectorTerms": [
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [H100_NODE]}]}
    ]
}


def held(namespace: str, name: str, *devices: str, admin: bool = False) -> dict[str, Any]:
    """A ResourceClaim whose status.allocation holds ``devices`` of the H100 node."""
    return {
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "gpus",
                        "exactly": {
                            "deviceClassName": "gpu.nvidia.com",
                            "count": len(devices),
                            **({"adminAccess": True} if admin else {}),
                        },
                    }
                ]
            }
        },
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {
                            "request": "gpus",
                            "driver": "gpu.nvidia.com",
                            "pool": H100_NODE,
                            "device": d,
                            **({"adminAccess": True} if admin else {}),
                        }
                        for d in devices
                    ]
                },
                # a copy: a test may change its claim's selector (it was this dict by
                # reference, and changing one changed every later claim: issue 37)
                "nodeSelector": copy.deepcopy(ON_H100_NODE),
            }
        },
    }


def busy_cluster(kubeapi: Any, *claims: dict[str, Any]) -> list[str]:
    """One H100 node with four GPUs (gpu-0/1 and gpu-2/3 share a PCIe root), the chart's
    classes, and ``claims`` stored with their allocations; the argv to reach it."""
    for obj in simulated_slices("h100:4", node_name=H100_NODE):
        kubeapi.put("resourceslices", obj)
    for cls in default_device_classes():
        kubeapi.put("deviceclasses", cls)
    for c in claims:
        kubeapi.add_claim(c)
    return ["--kubeconfig", str(kubeapi.kubeconfig_path)]


def run_explain(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    rc = main(list(argv), stdout=out, stderr=out)
    return rc, out.getvalue()


def allocated_devices(out: str) -> list[str]:
    data = json.loads(out)
    return [
        r["device"]
        for c in data["allocation"]["claims"]
        for r in c["allocation"]["devices"]["results"]
    ]


def test_on_a_busy_cluster_explain_skips_the_gpu_another_claim_holds(kubeapi: Any) -> None:
    """Issue 14: with gpu-0 held, the scheduler gave single-GPU claims gpu-1 and the
    same-PCIe-root pair gpu-2,gpu-3 (gpu-1's partner is the held gpu-0)."""
    cluster = busy_cluster(kubeapi, held("team-a", "train-7", "gpu-0"))
    for example in ("whole-gpu", "gpu-40gib", "shared-claim"):
        rc, out = run_explain(str(EXAMPLES / f"{example}.yaml"), *cluster, "-o", "json")
        assert rc == 0, out
        assert allocated_devices(out) == ["gpu-1"], example
    rc, out = run_explain(str(EXAMPLES / "same-pcie-root.yaml"), *cluster, "-o", "json")
    assert rc == 0, out
    assert allocated_devices(out) == ["gpu-2", "gpu-3"]
    assert json.loads(out)["notes"][0] == (
        "read from the cluster: 1 ResourceSlice, 2 DeviceClasses, 1 ResourceClaim (1 allocated)"
    )
    listed = {(r.verb, r.resource) for r in kubeapi.requests}
    assert ("list", "resourceclaims") in listed


def test_claims_explained_together_on_a_busy_cluster_take_the_free_gpus_in_order(
    tmp_path: Path, kubeapi: Any
) -> None:
    cluster = busy_cluster(kubeapi, held("team-a", "train-7", "gpu-0"))
    three = tmp_path / "three.yaml"
    three.write_text(
        "---\n".join(
            yaml.safe_dump(
                {
                    "apiVersion": "resource.k8s.io/v1",
                    "kind": "ResourceClaim",
                    "metadata": {"name": f"single-{i}", "namespace": "team-b"},
                    "spec": {
                        "devices": {
                            "requests": [
                                {"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}
                            ]
                        }
                    },
                }
            )
            for i in range(3)
        )
    )
    rc, out = run_explain(str(three), *cluster, "-o", "json")
    assert rc == 0, out
    assert allocated_devices(out) == ["gpu-1", "gpu-2", "gpu-3"]


def test_when_every_matching_gpu_is_taken_the_summary_says_by_whom(kubeapi: Any) -> None:
    cluster = busy_cluster(
        kubeapi,
        held("team-a", "train-7", "gpu-0"),
        held("team-b", "eval", "gpu-1", "gpu-2"),
        held("team-c", "notebook", "gpu-3"),
    )
    rc, out = run_explain(str(EXAMPLES / "whole-gpu.yaml"), *cluster)
    assert rc == 1, out
    assert (
        "  all 4 matching devices are allocated: gpu-0 (team-a/train-7), gpu-1 (team-b/eval), "
        "gpu-2 (team-b/eval), gpu-3 (team-c/notebook)\n"
    ) in out
    assert "  gpu-0   h100-node  in use by team-a/train-7\n" in out
    assert "  gpu-3   h100-node  in use by team-c/notebook\n" in out

    rc, out = run_explain(str(EXAMPLES / "whole-gpu.yaml"), *cluster, "-o", "json")
    devices = json.loads(out)["nodes"][0]["requests"][0]["devices"]
    assert [d["inUseBy"] for d in devices] == [
        ["team-a/train-7"],
        ["team-b/eval"],
        ["team-b/eval"],
        ["team-c/notebook"],
    ]


def test_the_summary_counts_only_devices_that_match_the_selectors(
    tmp_path: Path, kubeapi: Any
) -> None:
    """A GPU that fails the selector is not "taken": the headline is about the ones that fit."""
    cluster = busy_cluster(kubeapi, held("team-a", "train-7", "gpu-0", "gpu-1"))
    (gpu_0,) = [
        d
        for s in kubeapi.slices(node_name=H100_NODE)
        for d in s["spec"]["devices"]
        if d["name"] == "gpu-0"
    ]
    root = gpu_0["attributes"]["resource.kubernetes.io/pcieRoot"]["string"]  # gpu-1's too
    claim = tmp_path / "same-root-as-gpu-0.yaml"
    claim.write_text(
        CLAIM.replace(
            "count: 2}",
            "count: 1, selectors: [{cel: {expression: "
            f"\"device.attributes['resource.kubernetes.io'].pcieRoot == '{root}'\"}}}}]}}",
        )
    )
    rc, out = run_explain(str(claim), *cluster)
    assert rc == 1, out
    assert (
        "  all 2 matching devices are allocated: gpu-0 (team-a/train-7), gpu-1 (team-a/train-7)\n"
    ) in out


def test_a_claim_already_allocated_in_the_cluster_is_shown_with_its_allocation(
    kubeapi: Any,
) -> None:
    mine = held("default", "whole-gpu", "gpu-3")
    cluster = busy_cluster(kubeapi, held("team-a", "train-7", "gpu-0"), mine)
    rc, out = run_explain(str(EXAMPLES / "whole-gpu.yaml"), *cluster)
    assert rc == 0, out
    assert "whole-gpu  gpus     gpu-3   h100-node  gpu.nvidia.com  already allocated" in out
    assert (
        "note: claim whole-gpu is already allocated (status.allocation of default/whole-gpu): "
        "shown as it is, not allocated again"
    ) in out
    rc, out = run_explain(str(EXAMPLES / "whole-gpu.yaml"), *cluster, "-o", "json")
    (claim,) = json.loads(out)["allocation"]["claims"]
    assert claim["alreadyAllocated"] is True
    assert claim["allocation"]["nodeSelector"] == ON_H100_NODE


def test_a_pending_pods_generated_claim_is_found_through_its_status(
    tmp_path: Path, kubeapi: Any
) -> None:
    """``kubectl get pod -o yaml`` of a pod whose template claim exists: explain uses the
    cluster's claim (allocated here: shown as it is) rather than a new one."""
    generated = held("team-a", "trainer-gpu-x7k2p", "gpu-2")
    cluster = busy_cluster(kubeapi, generated)
    pod = tmp_path / "pod.yaml"
    pod.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "trainer", "namespace": "team-a"},
                "spec": {
                    "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}],
                    "containers": [{"name": "c", "image": "x"}],
                },
                "status": {
                    "resourceClaimStatuses": [
                        {"name": "gpu", "resourceClaimName": "trainer-gpu-x7k2p"}
                    ]
                },
            }
        )
    )
    rc, out = run_explain(str(pod), *cluster, "-o", "json")
    assert rc == 0, out
    data = json.loads(out)
    assert data["claims"] == ["team-a/trainer-gpu-x7k2p"]
    assert data["allocation"]["claims"][0]["alreadyAllocated"] is True
    assert allocated_devices(out) == ["gpu-2"]


def test_a_claim_allocated_for_another_node_fails_on_this_one(
    tmp_path: Path,
) -> None:
    slices = simulated_slices("h100:1", node_name="a") + simulated_slices("h100:1", node_name="b")
    mine = held("default", "two", "gpu-0")
    mine["status"]["allocation"]["nodeSelector"]["nodeSelectorTerms"][0]["matchFields"][0][
        "values"
    ] = ["b"]
    result = allocate(yaml.safe_load(CLAIM), default_device_classes(), slices, allocated=[mine])
    assert result.satisfiable_nodes == ("b",)
    result = allocate(
        yaml.safe_load(CLAIM), default_device_classes(), slices, allocated=[mine], node="a"
    )
    assert not result.satisfiable
    assert result.nodes[0].error == "claim default/two is already allocated, for node b"


def test_admin_access_allocations_neither_block_nor_are_blocked(kubeapi: Any) -> None:
    cluster = busy_cluster(
        kubeapi,
        held("gpu-monitoring", "monitor", "gpu-0", "gpu-1", "gpu-2", "gpu-3", admin=True),
        held("team-a", "train-7", "gpu-0"),
    )
    rc, out = run_explain(str(EXAMPLES / "whole-gpu.yaml"), *cluster, "-o", "json")
    assert rc == 0, out
    assert allocated_devices(out) == ["gpu-1"]  # the monitor holds nothing
    rc, out = run_explain(str(EXAMPLES / "admin-access.yaml"), *cluster, "-o", "json")
    assert rc == 0, out
    assert allocated_devices(out) == ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]  # train-7 is no block


TAINT_RULE = {
    "apiVersion": "resource.k8s.io/v1alpha3",
    "kind": "DeviceTaintRule",
    "metadata": {"name": "gpu-1-maintenance"},
    "spec": {
        "deviceSelector": {"driver": "gpu.nvidia.com", "pool": H100_NODE, "device": "gpu-1"},
        "taint": {"key": "example.com/maintenance", "effect": "NoSchedule"},
    },
}


def test_device_taint_rules_served_by_the_cluster_taint_the_devices_they_select(
    tmp_path: Path,
) -> None:
    api = FakeKubeApi(device_taint_rule_versions=("v1alpha3",)).start()
    try:
        api.write_kubeconfig(tmp_path / "kubeconfig")
        cluster = busy_cluster(api, held("team-a", "train-7", "gpu-0"))
        api.put("devicetaintrules", TAINT_RULE)
        rc, out = run_explain(str(EXAMPLES / "whole-gpu.yaml"), *cluster, "-o", "json")
        assert rc == 0, out
        assert allocated_devices(out) == ["gpu-2"]
        assert "1 DeviceTaintRule applied" in json.loads(out)["notes"]

        rc, out = run_explain(str(EXAMPLES / "all-gpus.yaml"), *cluster)
        assert rc == 1, out
        assert (
            "gpu-1   h100-node  taint example.com/maintenance:NoSchedule is not tolerated "
            "(from DeviceTaintRule gpu-1-maintenance)"
        ) in out
        assert ("list", "devicetaintrules", "", "") in api.requests
    finally:
        api.stop()


def test_device_taint_rules_not_served_are_skipped_with_a_note(kubeapi: Any) -> None:
    cluster = busy_cluster(kubeapi)
    rc, out = run_explain(str(EXAMPLES / "whole-gpu.yaml"), *cluster)
    assert rc == 0, out
    assert (
        "note: DeviceTaintRules: not served by this cluster; only the slices' own taints apply"
    ) in out
    assert not any(r.resource == "devicetaintrules" for r in kubeapi.requests)


def test_device_taint_rules_the_user_may_not_list_are_skipped_with_a_note(
    tmp_path: Path,
) -> None:
    api = FakeKubeApi(device_taint_rule_versions=("v1beta2",)).start()
    try:
        api.write_kubeconfig(tmp_path / "kubeconfig")
        cluster = busy_cluster(api)
        api.forbid("list", "devicetaintrules")
        rc, out = run_explain(str(EXAMPLES / "whole-gpu.yaml"), *cluster)
        assert rc == 0, out
        assert "note: DeviceTaintRules: these credentials may not list" in out
    finally:
        api.stop()


def test_claims_the_user_may_not_list_are_an_input_error(kubeapi: Any) -> None:
    """Without the claims every device would look free: no answer is better than a wrong one."""
    cluster = busy_cluster(kubeapi)
    kubeapi.forbid("list", "resourceclaims")
    rc, out = run_explain(str(EXAMPLES / "whole-gpu.yaml"), *cluster)
    assert rc == 2
    assert "may not list resourceclaims.resource.k8s.io in all namespaces" in out


def test_allocated_and_taint_rule_files_work_like_the_cluster(tmp_path: Path) -> None:
    slices = tmp_path / "slices.yaml"
    slices.write_text(
        yaml.safe_dump({"kind": "List", "items": simulated_slices("h100:4", node_name=H100_NODE)})
    )
    allocated = tmp_path / "allocated.yaml"
    allocated.write_text(
        yaml.safe_dump(
            {
                "kind": "List",
                "items": [
                    held("team-a", "train-7", "gpu-0"),
                    held("team-b", "eval", "gpu-2", "gpu-3"),
                ],
            }
        )
    )
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump(TAINT_RULE))
    inputs = ("--slices", str(slices), "--allocated", str(allocated))
    rc, out = run_explain(str(EXAMPLES / "whole-gpu.yaml"), *inputs, "--taint-rules", str(rules))
    assert rc == 1, out
    assert (
        "needs 1, 0 of 4 devices usable; 3 matching devices are allocated: "
        "gpu-0 (team-a/train-7), gpu-2 (team-b/eval), gpu-3 (team-b/eval)"
    ) in out
    rc, out = run_explain(str(EXAMPLES / "whole-gpu.yaml"), *inputs, "-o", "json")
    assert rc == 0, out
    assert allocated_devices(out) == ["gpu-1"]


def test_on_several_nodes_the_table_says_on_how_many_everything_is_taken(tmp_path: Path) -> None:
    items: list[dict[str, Any]] = []
    holding: list[dict[str, Any]] = []
    for node in ("node-a", "node-b", "node-c"):
        items += simulated_slices("h100:2", node_name=node)
        for team, device in (("team-a", "gpu-0"), ("team-b", "gpu-1")):
            c = held(team, f"job-{node}", device)
            c["status"]["allocation"]["devices"]["results"][0]["pool"] = node
            holding.append(c)
    slices, allocated = tmp_path / "slices.yaml", tmp_path / "allocated.yaml"
    slices.write_text(yaml.safe_dump({"kind": "List", "items": items}))
    allocated.write_text(yaml.safe_dump({"kind": "List", "items": holding[:-1]}))  # node-c: 1
    rc, out = run_explain(
        str(EXAMPLES / "whole-gpu.yaml"), "--slices", str(slices), "--allocated", str(allocated)
    )
    assert rc == 0, out  # node-c's gpu-1 is free
    rc, out = run_explain(
        str(EXAMPLES / "same-pcie-root.yaml"),
        "--slices",
        str(slices),
        "--allocated",
        str(allocated),
    )
    assert rc == 1, out
    assert "  on 2 of 3 nodes, allocated claims hold every matching device\n" in out
    assert (
        "  all 2 matching devices are allocated: gpu-0 (team-a/job-node-a), "
        "gpu-1 (team-b/job-node-a)  (node node-a)\n"
    ) in out
    assert "  gpu-1   node-c  usable\n" in out
