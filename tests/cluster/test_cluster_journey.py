"""The user's journey beyond the examples, on the real cluster: a legacy ``nvidia.com/gpu`` pod, a
claim nothing satisfies (and ``explain`` saying why), explain against a busy cluster, a health
taint in the real API server keeping a pod off a GPU, and the agent killed in the middle of a
batch of prepares."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path
from typing import Any

import yaml

from dra_driver.scheduling.explain import main as explain_main
from dra_driver.sim.faults import SimulatedFault, append_fault
from tests.cluster import DRIVER, Cluster, journey, objects
from tests.cluster.conftest import GPUS, SIMULATE

EXAMPLES = Path(__file__).resolve().parent.parent.parent / "examples" / "resourceclaims"


def _pod(name: str, *, claim: str = "", template: str = "", node: str = "", limits: Any = None,
         tolerations: Any = None) -> dict[str, Any]:  # fmt: skip
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "containers": [{"name": "main", "image": "registry.example/cuda:12", "command": ["true"]}],
    }
    if claim or template:
        ref = {"resourceClaimName": claim} if claim else {"resourceClaimTemplateName": template}
        spec["resourceClaims"] = [{"name": "gpu", **ref}]
        spec["containers"][0]["resources"] = {"claims": [{"name": "gpu"}]}
    if limits:
        spec["containers"][0]["resources"] = {"limits": limits}
    if node:
        spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    if tolerations:
        spec["tolerations"] = tolerations
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
            "spec": spec}  # fmt: skip


def _claim(name: str, selector: str = "") -> dict[str, Any]:
    exactly: dict[str, Any] = {"deviceClassName": "gpu.nvidia.com"}
    if selector:
        exactly["selectors"] = [{"cel": {"expression": selector}}]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}},
    }


def _scheduled_reason(cluster: Cluster, name: str) -> tuple[str, str]:
    pod = objects.get(cluster.control, "Pod", name, "default") or {}
    cond = objects.condition(pod, "PodScheduled") or {}
    return str(cond.get("reason", "")), str(cond.get("message", ""))


def _cleanup(cluster: Cluster, pods: list[str], claims: list[str]) -> None:
    for name in pods:
        objects.delete(cluster.control, "Pod", name)
    for name in claims:
        objects.delete(cluster.control, "ResourceClaim", name)
    for name in pods:
        journey.wait_gone(cluster, "Pod", "default", name)
    for name in claims:
        journey.wait_gone(cluster, "ResourceClaim", "default", name)


def test_a_legacy_pod_asking_for_nvidia_com_gpu_runs_through_the_extended_resource(
    cluster: Cluster,
) -> None:
    objects.create(cluster.control, _pod("legacy-gpu", limits={"nvidia.com/gpu": 1}))
    try:
        pod = journey.wait_running(cluster, "default", "legacy-gpu")
        (claim,) = journey.claim_names(pod)  # the claim the scheduler made for it
        alloc = journey.allocation(cluster, "default", claim)
        assert len(alloc.devices) == 1
        assert alloc.results[0]["driver"] == DRIVER
        assert alloc.devices[0].startswith("gpu-") and "-mig-" not in alloc.devices[0]
        node = pod["spec"]["nodeName"]
        ids = cluster.nodes[node].cdi_devices(pod)
        assert ids and all(i.startswith("k8s.gpu.nvidia.com/") for i in ids), ids
    finally:
        _cleanup(cluster, ["legacy-gpu"], [])


def test_a_claim_nothing_satisfies_stays_pending_and_explain_says_why(
    cluster: Cluster, tmp_path: Path
) -> None:
    selector = "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('4Ti')) >= 0"
    claim, pod = _claim("too-big", selector), _pod("too-big", claim="too-big")
    objects.create(cluster.control, claim)
    objects.create(cluster.control, pod)
    try:
        reason = objects.wait(
            "the scheduler to give up on too-big",
            lambda: (r := _scheduled_reason(cluster, "too-big"))[0] == "Unschedulable" and r,
        )
        assert "cannot allocate all claims" in reason[1] or "resourceclaim" in reason[1].lower()
        time.sleep(2)
        assert objects.pod_phase(cluster.control, "too-big", "default") == "Pending"
        source = tmp_path / "too-big.yaml"
        source.write_text(yaml.safe_dump_all([claim, pod]))
        out, err = io.StringIO(), io.StringIO()
        rc = explain_main(
            [str(source), "--kubeconfig", str(cluster.control.admin_kubeconfig)],
            stdout=out, stderr=err,
        )  # fmt: skip
        assert rc == 1, out.getvalue() + err.getvalue()
        text = out.getvalue()
        for node in cluster.nodes:
            assert node in text, text
        assert "4Ti" in text or "memory" in text, text
    finally:
        _cleanup(cluster, ["too-big"], ["too-big"])


def test_explain_equals_the_scheduler_on_a_busy_cluster(cluster: Cluster) -> None:
    """Devices already held (whole GPUs and a MIG device on both nodes): explain, reading the
    claims in use from the cluster, predicts what the scheduler then allocates."""
    busy_pods, busy_claims = [], []
    try:
        for node in sorted(cluster.nodes):
            for what, selector in (
                ("h100", "device.attributes['gpu.nvidia.com'].productName.contains('H100')"),
                ("mig", ""),
            ):
                name = f"busy-{what}-{node}"
                claim = _claim(name, selector)
                if what == "mig":
                    claim["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] = (
                        "mig.nvidia.com"
                    )
                objects.create(cluster.control, claim)
                objects.create(cluster.control, _pod(name, claim=name, node=node))
                busy_pods.append(name)
                busy_claims.append(name)
        for name in busy_pods:
            journey.wait_running(cluster, "default", name)
        for example in ("whole-gpu.yaml", "mig-1g10gb.yaml", "same-pcie-root.yaml",
                        "gpu-40gib.yaml", "first-available.yaml"):  # fmt: skip
            journey.run_example(cluster, EXAMPLES / example)
    finally:
        _cleanup(cluster, busy_pods, busy_claims)


def _inbox(cluster: Cluster, node: str) -> Path:
    return cluster.nodes[node].work / "k" / "plugins" / DRIVER / "simulated-faults.jsonl"


def _taints(cluster: Cluster, node: str, device: str) -> list[dict[str, Any]]:
    for s in cluster.slices(node):
        for d in s["spec"].get("devices", []):
            if d["name"] == device:
                return list(d.get("taints", []))
    raise AssertionError(f"{device} is not published on {node}")


def test_an_xid_taints_the_gpu_in_the_api_server_and_keeps_a_new_pod_off_it(
    cluster: Cluster, tmp_path: Path
) -> None:
    node = sorted(cluster.nodes)[0]
    uuid = _uuid(cluster, node, "gpu-1")
    selector = f"device.attributes['gpu.nvidia.com'].uuid == '{uuid}'"
    # the GPU falls off the bus (XID 79 and every query lost): a fatal taint, lifted by a reset
    append_fault(_inbox(cluster, node), SimulatedFault(kind="lost", gpu=1))
    try:
        taints = objects.wait(
            "gpu-1's taint in the API server", lambda: _taints(cluster, node, "gpu-1") or None
        )
        assert any(t["effect"] in ("NoSchedule", "NoExecute") for t in taints), taints
        objects.create(cluster.control, _claim("wants-gpu-1", selector))
        objects.create(cluster.control, _pod("wants-gpu-1", claim="wants-gpu-1"))
        objects.wait(
            "the scheduler to refuse the tainted GPU",
            lambda: _scheduled_reason(cluster, "wants-gpu-1")[0] == "Unschedulable",
        )
        assert objects.pod_phase(cluster.control, "wants-gpu-1", "default") == "Pending"
        # explain, reading the same slices, agrees: the taint rules the GPU out
        source = tmp_path / "wants-gpu-1.yaml"
        docs = [_claim("wants-gpu-1", selector), _pod("wants-gpu-1", claim="wants-gpu-1")]
        source.write_text(yaml.safe_dump_all(docs))
        rc, result = journey.explain(cluster, source, node)
        assert rc == 1, result
        assert "taint" in json.dumps(result).lower(), result
        # the GPU comes back: the agent lifts the taint and the scheduler places the pod on it
        append_fault(_inbox(cluster, node), SimulatedFault(kind="reset", gpu=1))
        objects.wait(
            "gpu-1's taint lifted", lambda: not _taints(cluster, node, "gpu-1"), timeout_s=90
        )
        pod = journey.wait_running(cluster, "default", "wants-gpu-1", timeout_s=120)
        assert pod["spec"]["nodeName"] == node
        assert journey.allocation(cluster, "default", "wants-gpu-1").devices == ["gpu-1"]
    finally:
        _cleanup(cluster, ["wants-gpu-1"], ["wants-gpu-1"])


def _uuid(cluster: Cluster, node: str, device: str) -> str:
    for s in cluster.slices(node):
        for d in s["spec"].get("devices", []):
            if d["name"] == device:
                return str(d["attributes"]["uuid"]["string"])
    raise AssertionError(f"{device} not on {node}")


def test_the_agent_killed_in_a_batch_of_prepares_comes_back_and_every_pod_runs(
    cluster: Cluster, cluster_builds: Any
) -> None:
    node = sorted(cluster.nodes)[1]
    names = [f"batch-{i}" for i in range(4)]
    before = journey.cdi_specs(cluster, node)
    for name in names:
        objects.create(cluster.control, _claim(name))
        objects.create(cluster.control, _pod(name, claim=name, node=node))
    try:
        # as soon as the kubelet has started preparing (a claim reserved for its pod), kill -9
        objects.wait(
            "the first claim reserved",
            lambda: any(
                (objects.get(cluster.control, "ResourceClaim", n, "default") or {})
                .get("status", {}).get("reservedFor")
                for n in names
            ),
        )  # fmt: skip
        cluster.agents[node].kill9()
        time.sleep(1)
        cluster.restart_agent(node, builds=cluster_builds, simulate=SIMULATE, gpus=GPUS)
        devices = []
        for name in names:
            journey.wait_running(cluster, "default", name, timeout_s=150)
            devices += journey.allocation(cluster, "default", name).devices
        assert len(set(devices)) == len(names), devices
        specs = journey.cdi_specs(cluster, node)
        assert len(set(specs) - set(before)) == len(names), sorted(specs)
        uids = {
            (objects.get(cluster.control, "ResourceClaim", n, "default") or {})["metadata"]["uid"]
            for n in names
        }
        assert uids <= journey.recorded_claims(cluster, node)
    finally:
        _cleanup(cluster, names, names)
    # nothing leaked: specs, checkpoint records, MPS daemons
    objects.wait(
        f"{node}'s CDI specs back to before the batch",
        lambda: journey.cdi_specs(cluster, node) == before,
        timeout_s=60,
    )
    objects.wait(
        "the batch's records gone from the checkpoint",
        lambda: not uids & journey.recorded_claims(cluster, node),
    )
    assert journey.mps_deployments(cluster) == []
