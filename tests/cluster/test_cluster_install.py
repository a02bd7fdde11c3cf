"""``helm install`` into a real API server: what the chart makes, the agents the DaemonSet runs,
the slices they publish, and the admission policy judging a real node-bound token."""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from typing import Any

from tests.cluster import DRIVER, NAMESPACE, Cluster, objects
from tests.cluster.gpunode import bound_token


def test_helm_install_makes_the_classes_and_one_agent_pod_per_gpu_node(cluster: Cluster) -> None:
    classes = {c["metadata"]["name"] for c in objects.items(cluster.control, "DeviceClass")}
    assert {"gpu.nvidia.com", "mig.nvidia.com"} <= classes
    gpu_class = objects.get(cluster.control, "DeviceClass", "gpu.nvidia.com")
    assert gpu_class is not None
    assert gpu_class["spec"].get("extendedResourceName") == "nvidia.com/gpu"
    pods = [
        p
        for p in objects.items(cluster.control, "Pod", NAMESPACE)
        if any(o["kind"] == "DaemonSet" for o in p["metadata"].get("ownerReferences", []))
    ]
    assert sorted(p["spec"]["nodeName"] for p in pods) == sorted(cluster.nodes)
    assert all(p["status"]["phase"] == "Running" for p in pods), [p["status"] for p in pods]


def test_each_agent_publishes_its_nodes_gpus_and_the_kubelet_registered_it(
    cluster: Cluster,
) -> None:
    for name in cluster.nodes:
        slices = cluster.slices(name)
        devices = sorted(d["name"] for s in slices for d in s["spec"].get("devices", []))
        assert {"gpu-0", "gpu-1", "gpu-2", "gpu-3", "gpu-5"} <= set(devices), devices
        # the slices are the agent's own (written with its pod-bound token: the admission
        # policy let them through), one pool per node
        assert {s["spec"]["pool"]["name"] for s in slices} == {name}
    # the kubelet's DRA manager registered the plugin, connected to the DRA socket the
    # registration named, and opened the health stream (its log says so)
    for name, node in cluster.nodes.items():
        log = (node.work / "kubelet.log").read_text(errors="replace")
        assert 'driverName="gpu.nvidia.com"' in log and "connected=true" in log, (name, log[-3000:])
        assert "Successfully started WatchResources health stream" in log, name


def _as_agent(cluster: Cluster, token: str, method: str, path: str, body: Any) -> tuple[int, str]:
    context = ssl.create_default_context(cafile=str(cluster.control.pki.ca))
    request = urllib.request.Request(
        cluster.control.url + path,
        data=json.dumps(body).encode(),
        method=method,
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, context=context, timeout=30) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read().decode()


def _slice(node: str, name: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {
            "driver": DRIVER,
            "nodeName": node,
            # a pool of its own: the agent's pool (named after the node) stays consistent
            "pool": {"name": f"{name}-pool", "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": "stolen-gpu"}],
        },
    }


def test_the_admission_policy_refuses_a_token_bound_to_another_nodes_pod(cluster: Cluster) -> None:
    node_a, node_b = sorted(cluster.nodes)
    token_a = bound_token(cluster.control, cluster.agent_pod(node_a), seconds=600)
    status, body = _as_agent(
        cluster, token_a, "POST", "/apis/resource.k8s.io/v1/resourceslices",
        _slice(node_b, "forged-by-a"),
    )  # fmt: skip
    assert status == 403, body
    message = json.loads(body)["message"]
    assert (
        f'agent on node {node_a} may only write ResourceSlices of that node, not of node "{node_b}"'
        in message
    )
    # deleting node b's real slice with node a's token: refused the same way
    (victim, *_) = cluster.slices(node_b)
    status, body = _as_agent(
        cluster, token_a, "DELETE",
        f"/apis/resource.k8s.io/v1/resourceslices/{victim['metadata']['name']}", {},
    )  # fmt: skip
    assert status == 403, body
    assert "may only write ResourceSlices of that node" in json.loads(body)["message"]
    assert objects.get(cluster.control, "ResourceSlice", victim["metadata"]["name"]) is not None
    # the same token may write its own node's slices (RBAC and the policy both allow it)
    status, body = _as_agent(
        cluster, token_a, "POST", "/apis/resource.k8s.io/v1/resourceslices",
        _slice(node_a, "own-node-slice-check"),
    )  # fmt: skip
    assert status == 201, body
    objects.delete(cluster.control, "ResourceSlice", "own-node-slice-check")


def test_each_hollow_kubelet_says_where_its_scratch_directory_is(cluster: Cluster) -> None:
    """kubemark makes a scratch directory in /tmp whatever TMPDIR says; the node finds it in the
    kubelet's log and removes it when it stops, so the run leaves nothing in /tmp."""
    for node in cluster.nodes.values():
        (scratch,) = node.scratch_dirs()
        assert scratch.is_dir() and scratch.name.startswith("hollow-kubelet.")
