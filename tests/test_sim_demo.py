"""``make demo`` runs the whole node flow on simulated GPUs, end to end, in real processes, and
ends with ``gpu-dra status`` of the simulated node."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_the_demo_publishes_prepares_and_unprepares_through_the_real_agent() -> None:
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp"}  # no KUBECONFIG: the local API server
    result = subprocess.run(
        [sys.executable, "-m", "dra_driver.sim.demo"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    # The table shows what the API server stored: 4 H100, 4 MIG devices of the A100, an L4.
    table = out.split("ResourceSlices stored by the API server")[1].split("==>")[0]
    assert len(re.findall(r"^gpu-[0-3] +gpu +NVIDIA H100 80GB HBM3 +79\.6 GiB", table, re.M)) == 4
    assert re.search(r"^gpu-4-mig-3g40gb-9-\d +mig +NVIDIA A100-SXM4-80GB .* 3g\.40gb", table, re.M)
    assert len(re.findall(r" 1g\.10gb ", table)) == 2
    assert re.search(r"^gpu-5 +gpu +NVIDIA L4 ", table, re.M)
    # A lost GPU is tainted in the stored slice, and untainted after its reset.
    health = out.split("GPU 0 falls off the bus")[1].split("==> Scheduler")[0]
    assert re.search(
        r'gpu-0 taint: \{"key": "gpu.nvidia.com/gpu-lost", "effect": "NoSchedule"', health
    )
    assert '"key": "gpu.nvidia.com/xid", "value": "79"' in health
    assert "gpu-0 taints: []" in health
    assert "Normal DeviceHealthy: gpu-0: healthy again" in health
    # Registration advertises v1 first; prepare answers a CDI ID; unprepare removes the spec.
    assert "supported_versions=['v1.DRAPlugin', 'v1beta1.DRAPlugin'" in out
    cdi_id = re.search(
        r"cdi_device_ids=\['(k8s\.gpu\.nvidia\.com/claim=[0-9a-f-]{36}-gpu-\d)'\]", out
    )
    assert cdi_id is not None, out
    assert '"cdiVersion": "0.5.0"' in out
    assert "CDI specs left: []" in out
    assert "exit code 0; registration socket exists: False, DRA socket exists: False" in out
    # `gpu-dra status` of the node, read from the agent's /metrics while the claim holds
    # gpu-0: the claim and pod, the simulated readings, MIG devices without utilisation.
    status = out.split("==> gpu-dra status --metrics-url http://127.0.0.1:")[1].split("==> ")[0]
    rows = {
        line.split()[1]: line.split() for line in status.splitlines()[2:] if "demo-node" in line
    }
    assert len(rows) == 10  # 6 GPUs (one in MIG mode) and 4 MIG devices
    assert rows["gpu-0"][4:6] == ["default/demo-gpu", "demo-pod"]
    assert rows["gpu-0"][6].endswith("%") and rows["gpu-0"][-1] == "W"
    assert rows["gpu-4"][2:5] == ["gpu", "(MIG", "mode)"]
    # MIG on demand: a 3g.40gb prepared on an H100 not in MIG mode turns MIG mode on, and its
    # unprepare turns it off again (as NVML reports it at each point).
    on_demand = out.split("==> MIG on demand")[1].split("==> Sharing and dynamic MIG")[0]
    assert "gpu-0 in MIG mode: False (as NVML reports it)" in on_demand
    assert re.search(r"published gpu-0 whole and \d+ MIG placements of it", on_demand)
    assert "demo-mig-on-demand: demo-node/gpu-0-mig-3g40gb-9-0\n" in on_demand
    assert re.search(
        r"prepared; errors: \[\]; gpu-0 in MIG mode: True; MIG devices: "
        r"\['gpu-0-mig-3g40gb-9-0 \(MIG-",
        on_demand,
    )
    assert re.search(r"nvidia-caps/nvidia-cap\d+'\]", on_demand)
    assert "unprepared; errors: []; gpu-0 in MIG mode: False; MIG devices: []" in on_demand
    # It ends with sharing and dynamic MIG (MPS needs root for the daemons' tmpfs).
    sharing = out.split("==> Sharing and dynamic MIG")[1]
    if os.geteuid() != 0:
        assert "skipped: not root" in sharing
        return
    _check_sharing(sharing)


def _check_sharing(out: str) -> None:
    """Two shares of gpu-0 (the scheduler's shareIDs) served by one MPS daemon, each with its
    own limits, and a dynamic MIG device created on prepare; all gone after unprepare."""
    assert "gpu-0 with allowMultipleAllocations" in out
    share_ids = {}
    for claim, compute in (("demo-share-a", "30"), ("demo-share-b", "50")):
        found = re.search(
            rf"{claim}: demo-node/gpu-0 shareID=([0-9a-f-]{{36}}) "
            rf"consumedCapacity={{'memory': '20Gi', 'compute': '{compute}'}}",
            out,
        )
        assert found is not None, out
        share_ids[claim] = found.group(1)
    assert share_ids["demo-share-a"] != share_ids["demo-share-b"]
    assert "demo-mig: demo-node/gpu-1-mig-3g40gb-9-0\n" in out
    prepared, unprepared = out.split("NodePrepareResources of the three")[1].split(
        "NodeUnprepareResources of the three"
    )
    assert re.search(r"3 claims prepared in \d+ ms; errors: \[\]", prepared)
    one_daemon = "['mps-shares-gpu-0']"
    assert f"Deployments: {one_daemon}; daemon processes running: {one_daemon}" in prepared
    for (claim, share_id), compute in zip(share_ids.items(), ("30", "50"), strict=True):
        device = re.search(
            rf"{claim}: CDI device [0-9a-f-]{{36}}-gpu-0-share-{share_id}\n"
            r"        CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=GPU-[0-9a-f-]{36}=20480M\n"
            rf"        CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={compute}\n",
            prepared,
        )
        assert device is not None, prepared
    assert re.search(
        r"demo-mig: CDI device [0-9a-f-]{36}-gpu-1-mig-3g40gb-9-0\n.*MIG capability device "
        r"nodes .*\['/dev/nvidia-caps/nvidia-cap\d+', '/dev/nvidia-caps/nvidia-cap\d+'\]",
        prepared,
    )
    assert "MIG instances now: ['gpu-1-mig-3g40gb-9-0 (MIG-" in prepared
    assert "errors: []; MPS daemon Deployments: []; daemon processes running: []" in unprepared
    assert "MIG instances now: []; CDI specs left: []" in unprepared
    whole = out.split("NodePrepareResources, then NodeUnprepareResources, of the whole gpu-1")[1]
    assert "demo-whole-gpu: demo-node/gpu-1\n" in out
    assert "prepared; errors: []; gpu-1 in MIG mode: False" in whole
    assert re.search(r"CDI device [0-9a-f-]{36}-gpu-1: device nodes \['/dev/nvidia1'", whole)
    assert "unprepared; errors: []; gpu-1 in MIG mode: True" in whole
