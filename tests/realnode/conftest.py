"""The real-node tier's fixture: the test control plane, one real node (the real kubelet with
containerd and runc: tests/realnode/__init__.py), the chart installed with the GPU operator's
driver root, and the node's agent run from the Pod the DaemonSet made for it.

Needs root, runc, the programs ``make kube`` builds (the kubelet among them) and those
``make containerd`` builds; skipped saying which is missing (failed with ``CI=true``: .ci/run
builds both first). ``GPU_DRA_REALNODE=0`` turns it off; ``make realnode`` runs it alone.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from dra_driver.sim.elfdriver import build_libraries
from tests.cluster import Cluster, simulate_value
from tests.cluster.conftest import _missing as cluster_missing
from tests.cluster.gpunode import AgentPod
from tests.kubebins import bin_dir, required_in_ci
from tests.realnode import (
    DRIVER_ROOT,
    IMAGE,
    RealNode,
    containerd_bin_dir,
    missing,
    oci_archive,
)
from tests.test_deployed import PROBE_C, Builds, make_image

NODE = "gpu-real-node"
SIMULATE = "h100:2"
GPUS = 2


@dataclass
class RealCluster:
    cluster: Cluster
    node: RealNode
    agent: AgentPod


@pytest.fixture(scope="session")
def real_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealCluster]:
    if os.environ.get("GPU_DRA_REALNODE", "") == "0":
        pytest.skip("GPU_DRA_REALNODE=0 turns the real-node tier off")
    folder = bin_dir()
    reason = cluster_missing() or missing(folder)
    if reason:
        if required_in_ci():  # .ci/run builds containerd and the kubelet first
            pytest.fail(f"CI=true and the real-node tier needs {reason}")
        pytest.skip(f"the real-node tier needs {reason}")
    work = Path(tmp_path_factory.mktemp("r"))  # short: socket paths stay under 108 bytes
    elf = work / "elf"
    elf.mkdir()
    libraries = build_libraries(elf)
    (elf / "probe.c").write_text(PROBE_C)
    subprocess.run(["cc", "-O1", "-o", elf / "gpuprobe", elf / "probe.c"], check=True)
    builds = Builds(libraries=libraries, probe=elf / "gpuprobe")
    # One image for the Pods and the sandbox: busybox, glibc and the probe (no registry here).
    rootfs = make_image(work, flavour="debian", probe=builds.probe)
    archive = oci_archive(
        rootfs, work / "image.tar", name=IMAGE, cmd=["/bin/busybox", "sleep", "2147483647"]
    )

    cluster = Cluster(bin=folder, work=work, node_names=())
    node = RealNode(NODE, work / "node", cluster.control, folder, containerd_bin_dir())
    try:
        cluster.start()
        node.start(images=[archive])
        cluster.nodes[NODE] = node  # type: ignore[assignment]  # what Cluster reads of it: work
        cluster.install_chart(*simulate_value(SIMULATE), "--set", f"nvidiaDriverRoot={DRIVER_ROOT}")
        agent = AgentPod(node, cluster.agent_pod(NODE), layout="gpu-operator")
        agent.start(builds=builds, simulate=SIMULATE, gpus=GPUS)
        cluster.agents[NODE] = agent
        node.attach_driver_root(node.work / f"pod-{agent.runs}" / "plan.json")
        agent.wait_ready()
    except BaseException as exc:
        logs = node.logs() + "\n" + cluster.logs()
        node.stop()
        cluster.stop()
        raise AssertionError(f"the real node did not come up: {exc}\nlogs:\n{logs}") from exc
    try:
        yield RealCluster(cluster=cluster, node=node, agent=agent)
    finally:
        for agent in cluster.agents.values():
            agent.stop()
        node.stop()
        cluster.agents.clear()
        cluster.nodes.clear()
        cluster.stop()
