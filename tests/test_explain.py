"""``gpu-dra explain``: inputs, outputs, exit codes (docs/explain.md)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from dra_driver.cli import explain_main as main
from dra_driver.cli import gpu_dra_main
from dra_driver.devices.classes import class_expression, default_device_classes
from dra_driver.scheduling.explain import allocate
from dra_driver.scheduling.explain import main as explain_command
from dra_driver.sim.localapi import FakeKubeApi
from tests.simulatedslices import simulated_slices

SIMULATE = "h100:2,l4:1"

CLAIM = """
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: two, namespace: default}
spec:
  devices:
    requests:
    - name: gpus
      exactly: {deviceClassName: gpu.nvidia.com, count: 2}
"""

BIG = """
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: big}
spec:
  devices:
    requests:
    - name: gpus
      exactly:
        deviceClassName: gpu.nvidia.com
        selectors:
        - cel: {expression: "device.capacity['gpu.nvidia.com'].memory
                 .compareTo(quantity('100Gi')) >= 0"}
"""


def explain(tmp_path: Path, text: str, *args: str) -> tuple[int, str, str]:
    path = tmp_path / "claim.yaml"
    path.write_text(text)
    out, err = io.StringIO(), io.StringIO()
    rc = main([str(path), *args], stdout=out, stderr=err)
    return rc, out.getvalue(), err.getvalue()


def test_satisfiable_claim_prints_the_allocation_and_exits_0(tmp_path: Path) -> None:
    rc, out, _ = explain(tmp_path, CLAIM, "--simulate", SIMULATE, "--node", "n1")
    assert rc == 0
    assert "satisfiable on node n1" in out
    assert "gpu-0" in out and "gpu-1" in out


def test_unsatisfiable_claim_says_why_and_exits_1(tmp_path: Path) -> None:
    rc, out, _ = explain(tmp_path, BIG, "--simulate", SIMULATE)
    assert rc == 1
    assert "NOT satisfiable" in out
    assert "memory 81559Mi is less than 100Gi" in out  # the simulated H100 has 81559Mi
    assert "memory 23034Mi is less than 100Gi" in out  # the L4


def test_json_and_yaml_outputs_carry_the_same_result(tmp_path: Path) -> None:
    rc, out, _ = explain(tmp_path, CLAIM, "--simulate", SIMULATE, "-o", "json")
    assert rc == 0
    data = json.loads(out)
    assert data["satisfiable"] is True
    results = data["allocation"]["claims"][0]["allocation"]["devices"]["results"]
    assert [r["device"] for r in results] == ["gpu-0", "gpu-1"]
    rc, out, _ = explain(tmp_path, BIG, "--simulate", SIMULATE, "-o", "yaml")
    assert rc == 1
    data = yaml.safe_load(out)
    devices = data["nodes"][0]["requests"][0]["devices"]
    assert all(not d["usable"] and d["reasons"] for d in devices)


def test_bad_yaml_is_an_input_error_with_file_and_position(tmp_path: Path) -> None:
    rc, _, err = explain(tmp_path, "spec: [\n", "--simulate", SIMULATE)
    assert rc == 2
    assert "claim.yaml:2:1: invalid YAML" in err


def test_unknown_class_is_an_input_error(tmp_path: Path) -> None:
    rc, _, err = explain(tmp_path, CLAIM.replace("gpu.nvidia.com", "nope"), "--simulate", SIMULATE)
    assert rc == 2
    assert "device class 'nope' not found" in err


def test_invalid_cel_is_an_input_error_with_position(tmp_path: Path) -> None:
    text = BIG.replace("compareTo(quantity('100Gi')) >= 0", "compareTo(quantity('100Gi')) >=")
    rc, _, err = explain(tmp_path, text, "--simulate", SIMULATE)
    assert rc == 2
    assert "claim.yaml: claim big: request gpus: selectors[0]: CEL compile error: line 1" in err
    assert "unexpected end of expression" in err


def test_pod_with_a_template_generates_its_claim(tmp_path: Path) -> None:
    text = """
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: one-gpu}
spec:
  spec:
    devices:
      requests: [{name: gpu, exactly: {deviceClassName: gpu.nvidia.com}}]
---
apiVersion: v1
kind: Pod
metadata: {name: trainer}
spec:
  resourceClaims: [{name: gpu, resourceClaimTemplateName: one-gpu}]
  containers: [{name: c, image: x}]
"""
    rc, out, _ = explain(tmp_path, text, "--simulate", SIMULATE)
    assert rc == 0
    assert "trainer-gpu" in out


def test_slices_file_and_allocated_claims(tmp_path: Path) -> None:
    slices = simulated_slices(SIMULATE, node_name="n1")
    (tmp_path / "slices.yaml").write_text(
        yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": slices})
    )
    allocated = {
        "metadata": {"name": "busy", "namespace": "default"},
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {"request": "r", "driver": "gpu.nvidia.com", "pool": "n1", "device": d}
                        for d in ("gpu-0", "gpu-1")
                    ]
                }
            }
        },
    }
    (tmp_path / "allocated.yaml").write_text(yaml.safe_dump(allocated))
    rc, out, _ = explain(
        tmp_path,
        CLAIM,
        "--slices",
        str(tmp_path / "slices.yaml"),
        "--allocated",
        str(tmp_path / "allocated.yaml"),
    )
    assert rc == 1
    assert "gpu-0   n1    in use by default/busy" in out
    assert (
        "needs 2, 1 of 3 devices usable: gpu-2; 2 matching devices are allocated: "
        "gpu-0 (default/busy), gpu-1 (default/busy)"
    ) in out


def test_library_allocate_reports_every_node(tmp_path: Path) -> None:
    slices = simulated_slices(SIMULATE, node_name="a") + simulated_slices("l4:1", node_name="b")
    result = allocate(yaml.safe_load(CLAIM), default_device_classes(), slices)
    assert result.satisfiable
    assert result.satisfiable_nodes == ("a",)
    assert result.chosen is not None and result.chosen.node == "a"


def test_default_classes_match_nvidia_selectors() -> None:
    exprs = {
        c["metadata"]["name"]: c["spec"]["selectors"][0]["cel"]["expression"]
        for c in default_device_classes()
    }
    nvidia = "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type =="
    assert exprs == {
        name: f"{nvidia} '{t}'"
        for name, t in (("gpu.nvidia.com", "gpu"), ("mig.nvidia.com", "mig"))
    }
    assert (
        class_expression("x.io", "gpu")
        == "device.driver == 'x.io' && device.attributes['x.io'].type == 'gpu'"
    )


def test_explain_reads_slices_and_classes_live_from_a_cluster(tmp_path: Path, kubeapi: Any) -> None:
    """--kubeconfig: every node's slices and the cluster's classes, through the real client."""
    for node, spec in (("small", "l4:1"), ("big", "h100:2")):
        for obj in simulated_slices(spec, node_name=node):
            kubeapi.put("resourceslices", obj)
    for cls in default_device_classes():
        kubeapi.put("deviceclasses", cls)
    claim = tmp_path / "claim.yaml"
    claim.write_text(CLAIM)  # two GPUs: only node "big" has them
    out = io.StringIO()
    code = main(
        [str(claim), "--kubeconfig", str(kubeapi.kubeconfig_path), "-o", "json"],
        stdout=out,
        stderr=io.StringIO(),
    )
    assert code == 0, out.getvalue()
    result = json.loads(out.getvalue())
    assert result["satisfiableNodes"] == ["big"]
    devices = [
        r["device"] for r in result["allocation"]["claims"][0]["allocation"]["devices"]["results"]
    ]
    assert devices == ["gpu-0", "gpu-1"]
    listed = {(r.verb, r.resource) for r in kubeapi.requests}
    assert {("list", "resourceslices"), ("list", "deviceclasses")} <= listed

    big = tmp_path / "big.yaml"
    big.write_text(BIG)  # >= 100Gi: no node has it
    code = main(
        [str(big), "--kubeconfig", str(kubeapi.kubeconfig_path)],
        stdout=io.StringIO(),
        stderr=io.StringIO(),
    )
    assert code == 1


def numa_mig_claim(count: int, slice_selector: str) -> str:
    return f"""
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {{name: near, namespace: default}}
spec:
  devices:
    requests:
    - name: migs
      exactly:
        deviceClassName: mig.nvidia.com
        count: {count}
        selectors:
        - cel: {{expression: "device.attributes['resource.kubernetes.io'].numaNode == 1"}}
        - cel: {{expression: "{slice_selector}"}}
"""


SLICE_0 = "device.capacity['gpu.nvidia.com'].memorySlice0.compareTo(quantity('1')) == 0"


def results_of(out: str) -> list[str]:
    data = json.loads(out)
    return [
        r["device"] for r in data["allocation"]["claims"][0]["allocation"]["devices"]["results"]
    ]


def test_selectors_on_numa_node_and_memory_slices_match_as_for_nvidias_driver(
    tmp_path: Path,
) -> None:
    # Four GPUs: 0-1 on NUMA node 0, 2-3 on node 1; a 7g device covers memory slices 0-7.
    rc, out, _ = explain(
        tmp_path,
        numa_mig_claim(2, SLICE_0),
        "--simulate",
        "h100:2:mig=7g.80gb,h100:2:mig=7g.80gb",
        "-o",
        "json",
    )

    assert rc == 0, out
    assert results_of(out) == ["gpu-2-mig-7g80gb-0-0", "gpu-3-mig-7g80gb-0-0"]


def test_a_memory_slice_selector_needs_a_guard_where_devices_lack_that_slice(
    tmp_path: Path,
) -> None:
    """As in the scheduler: a missing capacity is a CEL runtime error, not false."""
    simulate = "h100:2,h100:2:mig=1g.10gb*7"
    guarded = f"has(device.capacity['gpu.nvidia.com'].memorySlice0) && {SLICE_0}"

    rc, out, _ = explain(tmp_path, numa_mig_claim(2, guarded), "--simulate", simulate, "-o", "json")
    assert rc == 0, out
    assert results_of(out) == ["gpu-2-mig-1g10gb-19-0", "gpu-3-mig-1g10gb-19-0"]

    rc, out, _ = explain(tmp_path, numa_mig_claim(2, SLICE_0), "--simulate", simulate)
    assert rc == 1
    assert "gpu-2-mig-1g10gb-19-1: CEL runtime error: capacity gpu.nvidia.com/memorySlice0" in out


# --- live cluster state: claims in use, admin access, DeviceTaintRules ---------------------------

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
                "nodeSelector": ON_H100_NODE,
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


BIG_SELECTOR = (
    "device.capacity['gpu.nvidia.com'].memory\n                 .compareTo(quantity('100Gi')) >= 0"
)


def test_k8s_version_compiles_selectors_as_that_api_server_does(tmp_path: Path) -> None:
    text = BIG.replace(
        BIG_SELECTOR,
        "['a', 'b'].reverse()[0] == 'b'",
    )
    assert "reverse" in text
    rc, _, err = explain(tmp_path, text, "--simulate", SIMULATE, "--k8s-version", "1.34")
    assert rc == 2
    assert "claim big: request gpus: selectors[0]: CEL compile error: line 1, column 11:" in err
    assert "undeclared reference to 'reverse' (in container '')" in err
    for version in ("1.35", "1.37"):
        rc, out, err = explain(tmp_path, text, "--simulate", SIMULATE, "--k8s-version", version)
        assert rc == 0, err
        assert "satisfiable" in out
    rc, out, _ = explain(tmp_path, text, "--simulate", SIMULATE)  # default: the newest, 1.37
    assert rc == 0


def test_k8s_version_must_be_a_supported_minor(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, _, _ = explain(tmp_path, CLAIM, "--simulate", SIMULATE, "--k8s-version", "1.33")
    assert rc == 2
    assert "invalid choice: '1.33'" in capsys.readouterr().err  # argparse writes to sys.stderr


def test_a_selector_over_the_cost_limit_is_an_input_error(tmp_path: Path) -> None:
    nested = (
        "device.attributes.all(d, device.attributes[d].all(k, device.attributes.all(e, "
        "device.attributes[e].all(j, device.attributes[e][j] == device.attributes[d][k]))))"
    )
    text = BIG.replace(
        BIG_SELECTOR,
        nested,
    )
    assert nested in text
    rc, _, err = explain(tmp_path, text, "--simulate", SIMULATE)
    assert rc == 2
    assert "too complex, exceeds cost limit: estimated cost" in err


def test_gpu_dra_explain_simulates_gpus_through_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "claim.yaml"
    path.write_text(CLAIM)
    assert gpu_dra_main(["explain", str(path), "--simulate", SIMULATE, "--node", "n1"]) == 0
    assert "satisfiable on node n1" in capsys.readouterr().out


def test_simulate_without_a_simulated_discovery_is_an_input_error(tmp_path: Path) -> None:
    path = tmp_path / "claim.yaml"
    path.write_text(CLAIM)
    out, err = io.StringIO(), io.StringIO()
    assert explain_command([str(path), "--simulate", SIMULATE], stdout=out, stderr=err) == 2
    assert "--simulate needs simulated GPUs" in err.getvalue()
    assert out.getvalue() == ""


def test_the_scheduling_package_does_not_import_the_simulators() -> None:
    code = (
        "import sys\n"
        "import dra_driver.scheduling.explain\n"
        "print(sorted(m for m in sys.modules if m.startswith('dra_driver.sim')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.strip() == "[]"
