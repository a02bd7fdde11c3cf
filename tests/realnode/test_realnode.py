"""The real kubelet with containerd 2.x and runc runs a Pod whose ResourceClaim the real
scheduler allocated on our ResourceSlices: the kubelet's DRA manager has our agent prepare it,
hands containerd the CDI device IDs, containerd applies our CDI spec (device nodes, the driver's
libraries, the createContainer hook that refreshes the loader cache), runc starts the container,
and a program in it dlopen()s libcuda.so.1 (the ELF stand-in) through that cache. Deleting the
Pod unprepares the claim and removes its spec.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from dra_driver import cdi
from tests.cluster import DRIVER, objects
from tests.realnode import IMAGE
from tests.realnode.conftest import RealCluster
from tests.test_deployed import found_through_cache

pytestmark = pytest.mark.realnode

LIB = cdi.CONTAINER_LIB_DIR
SCRIPT = (
    "for n in /dev/nvidia0 /dev/nvidia1 /dev/nvidiactl; do [ -c $n ] && echo node $n; done; "
    "LD_DEBUG=libs /bin/gpuprobe libcuda.so.1:cuInit libnvidia-ml.so.1:nvmlInit_v2; "
    # running on: the claim stays allocated (and prepared) until the Pod is deleted
    "echo probe-exit=$?; exec /bin/busybox sleep 2147483647"
)


def claim(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}
        },
    }


def pod(name: str, claim_name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "hostNetwork": True,  # no CNI network on this node
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,  # the shell's sleep ignores SIGTERM as pid 1
            "resourceClaims": [{"name": "gpu", "resourceClaimName": claim_name}],
            "containers": [
                {
                    "name": "probe",
                    "image": IMAGE,
                    "imagePullPolicy": "Never",
                    "command": ["/bin/sh", "-c", SCRIPT],
                    "resources": {"claims": [{"name": "gpu"}]},
                }
            ],
        },
    }


def test_pod_starts_through_cdi_and_dlopens_libcuda(real_cluster: RealCluster) -> None:
    control, node = real_cluster.cluster.control, real_cluster.node
    objects.create(control, claim("real-gpu"))
    created = objects.create(control, pod("real-probe", "real-gpu"))

    def probed() -> str | None:
        log = node.container_log(created["metadata"], "probe")
        return log if "probe-exit=" in log else None

    try:
        log = objects.wait("the probe's output", probed, timeout_s=180)
    except AssertionError as exc:
        raise AssertionError(
            f"{exc}\n{objects.get(control, 'Pod', 'real-probe')}\n"
            f"{node.logs()}\n{real_cluster.cluster.logs()}"
        ) from exc
    where = f"{log[-4000:]}\n{node.logs()}"
    # the container's log is read on the node; the kubelet reports the phase on its own time
    # (a CI run read the log while the API server still said Pending)
    try:
        objects.wait(
            "the pod Running",
            lambda: objects.pod_phase(control, "real-probe", "default") == "Running",
            timeout_s=60,
        )
    except AssertionError as exc:
        raise AssertionError(
            f"{exc}\n{objects.get(control, 'Pod', 'real-probe')}\n{where}"
        ) from exc
    got = objects.get(control, "ResourceClaim", "real-gpu")
    assert got is not None
    (result,) = got["status"]["allocation"]["devices"]["results"]
    assert result["driver"] == DRIVER and result["pool"] == node.name, where
    minor = result["device"].removeprefix("gpu-")
    lines = log.splitlines()
    # the claim's GPU and the control node, not the other GPU
    assert [x for x in lines if x.startswith("node ")] == [
        f"node /dev/nvidia{minor}",
        "node /dev/nvidiactl",
    ], where
    assert f"ok libcuda.so.1 cuInit 0 {LIB}/libcuda.so.1" in lines, where
    assert f"ok libnvidia-ml.so.1 nvmlInit_v2 0 {LIB}/libnvidia-ml.so.1" in lines, where
    assert "probe-exit=0" in lines, where
    # found through the loader cache our CDI hook refreshed, not a default search path
    assert found_through_cache(log, "libcuda.so.1"), where
    # containerd put the device nodes of our spec in the container's OCI spec
    (container,) = node.ctr(
        "containers", "list", "--quiet", 'labels."io.kubernetes.container.name"==probe'
    ).stdout.split()
    spec = json.loads(node.ctr("containers", "info", container).stdout)["Spec"]
    paths = {d["path"] for d in spec["linux"]["devices"]}
    assert {f"/dev/nvidia{minor}", "/dev/nvidiactl"} <= paths, paths

    uid = got["metadata"]["uid"]
    specs = node.work / "cdi"
    assert list(specs.glob(f"*{uid}*")), where
    objects.delete(control, "Pod", "real-probe")
    objects.wait(
        "the claim's CDI spec removed (unprepared)",
        lambda: not list(specs.glob(f"*{uid}*")),
        timeout_s=120,
    )
    objects.delete(control, "ResourceClaim", "real-gpu")
