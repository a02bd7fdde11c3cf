"""A pod's way to Running on a real cluster, with a GPU claim and without (the floor).

The cluster is the real-cluster tier's (tests/cluster: etcd, kube-apiserver, controller-manager,
scheduler built by ``make kube``, two hollow nodes whose kubelets have the real DRA manager, the
chart installed with helm, each node's agent run from its DaemonSet pod). Measured, in alternating
order so both see the same machine phase:

* floor: a pod without a claim, created -> Running (scheduler, kubelet, fake runtime);
* claim: a pod with a claim from a ResourceClaimTemplate for one whole GPU, created -> Running
  (the same, plus the resourceclaim controller making the claim, the scheduler's DRA allocation,
  and the kubelet's NodePrepareResources call to the agent);
* NodePrepareResources / NodeUnprepareResources as the kubelet's DRA manager times them: its
  ``dra_grpc_operations_duration_seconds`` histogram (sum / count) from the kubelet's /metrics.

Each pod is deleted (and, with a claim, unprepared) before the next is made. Short mode
(BENCH_SHORT=1, bench/table.py): 3 pods of each kind, no target judged, for CI. The target:
the claim pod's p50 within 2 s of the floor's p50 (what the DRA path may add on a 2-core
machine); a claim pod's p50
is dominated by the kubelet's pod worker, not by the agent, which the kubelet's own figure shows.

Needs root and the programs of ``make kube``: without them it prints ``skipped: <why>`` and exits
0, or with CI=true (where .ci/run builds them) fails.
"""

from __future__ import annotations

import os
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.table import Row, print_table, scaled
from dra_driver.sim.demo import DEMO_SIMULATE
from dra_driver.sim.elfdriver import build_libraries
from tests.cluster import Cluster, journey, objects, simulate_value
from tests.kubebins import bin_dir, required_in_ci
from tests.test_deployed import Builds

PODS = 15
SHORT_PODS = 3
MAX_EXTRA_S = 2.0


def _pod(name: str, *, gpu: bool) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "nodeSelector": {"nvidia.com/gpu.present": "true"},
        "containers": [{"name": "main", "image": "registry.example/cuda:12", "command": ["true"]}],
    }
    if gpu:
        spec["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "bench-gpu"}]
        spec["containers"][0]["resources"] = {"claims": [{"name": "gpu"}]}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
            "spec": spec}  # fmt: skip


TEMPLATE = {
    "apiVersion": "resource.k8s.io/v1",
    "kind": "ResourceClaimTemplate",
    "metadata": {"name": "bench-gpu", "namespace": "default"},
    "spec": {
        "spec": {
            "devices": {
                "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]
            }
        }
    },
}


def _one(cluster: Any, name: str, *, gpu: bool) -> float:
    start = time.monotonic()
    objects.create(cluster.control, _pod(name, gpu=gpu))
    journey.wait_running(cluster, "default", name, timeout_s=120)
    took = time.monotonic() - start
    objects.delete(cluster.control, "Pod", name)
    journey.wait_gone(cluster, "Pod", "default", name)
    return took


def _kubelet_grpc(cluster: Any) -> dict[str, tuple[float, int]]:
    """method -> (sum of seconds, count) of the kubelets' DRA gRPC histogram, over all nodes."""
    totals: dict[str, tuple[float, int]] = {}
    pattern = re.compile(
        r"^dra_grpc_operations_duration_seconds_(sum|count)"
        r'\{[^}]*method_name="([^"]+)"[^}]*\} (\S+)$'
    )
    for node in cluster.nodes.values():
        url = f"http://127.0.0.1:{node.port}/metrics"  # the hollow kubelet serves plain HTTP
        with urllib.request.urlopen(url, timeout=10) as answer:
            text = answer.read().decode()
        for line in text.splitlines():
            match = pattern.match(line)
            if match:
                kind, method, value = match.groups()
                method = method.rsplit("/", 1)[-1]
                total, count = totals.get(method, (0.0, 0))
                if kind == "sum":
                    totals[method] = (total + float(value), count)
                else:
                    totals[method] = (total, count + int(float(value)))
    return totals


def main() -> int:
    folder = bin_dir()
    if os.geteuid() != 0 or not (folder / "hollownode").exists():
        why = f"needs root and the programs of `make kube` in {folder}"
        if required_in_ci():
            print(f"bench_kube_cluster: CI=true and it {why}", file=sys.stderr)
            return 1
        print(f"skipped: {why}")
        return 0
    pods = scaled(PODS, SHORT_PODS)
    with tempfile.TemporaryDirectory(prefix="bench-cluster-") as tmp:
        work = Path(tmp)
        builds = Builds(libraries=build_libraries(work), probe=work / "unused")
        cluster = Cluster(bin=folder, work=work / "c")
        try:
            cluster.start()
            cluster.install_chart(*simulate_value(DEMO_SIMULATE))
            cluster.start_agents(builds=builds, simulate=DEMO_SIMULATE, gpus=6)
            objects.create(cluster.control, TEMPLATE)
            _one(cluster, "warmup-floor", gpu=False)
            _one(cluster, "warmup-gpu", gpu=True)
            before = _kubelet_grpc(cluster)
            floor, claim = [], []
            for i in range(pods):
                floor.append(_one(cluster, f"floor-{i}", gpu=False))
                claim.append(_one(cluster, f"gpu-{i}", gpu=True))
            after = _kubelet_grpc(cluster)
        finally:
            cluster.stop()
    floor_p50, claim_p50 = statistics.median(floor), statistics.median(claim)
    rows = [
        Row("pod without claim -> Running, p50", floor_p50, "s", ""),
        Row(
            "pod with a GPU claim -> Running, p50",
            claim_p50,
            "s",
            f"<= floor + {MAX_EXTRA_S:.1f} s",
            claim_p50 <= floor_p50 + MAX_EXTRA_S,
            floor=f"no claim p50 {floor_p50:.3f} s",
        ),
        Row("pod with a GPU claim -> Running, max", max(claim), "s", ""),
    ]
    for method in ("NodePrepareResources", "NodeUnprepareResources"):
        total, count = after.get(method, (0.0, 0))
        old_total, old_count = before.get(method, (0.0, 0))
        n = count - old_count
        if n > 0:
            mean_ms = (total - old_total) / n * 1000
            rows.append(Row(f"{method} as the kubelet times it, mean of {n}", mean_ms, "ms", ""))
    ok = print_table(f"pod -> Running on the real cluster ({pods} pods of each kind)", rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
