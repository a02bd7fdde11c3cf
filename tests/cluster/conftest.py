"""The real-cluster tier's fixtures: one cluster for the session (tests/cluster/__init__.py).

The tier needs the programs ``make kube`` builds (tests/kubebins.py: skipped without them, failed
with CI=true), root (mount namespaces for the nodes), helm, openssl and a C compiler (the ELF
stand-in driver libraries).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from dra_driver.sim.demo import DEMO_SIMULATE
from dra_driver.sim.elfdriver import build_libraries
from tests.cluster import Cluster, helm_binary, simulate_value
from tests.kubebins import kube_bin, required_in_ci
from tests.test_deployed import PROBE_C, Builds

PROGRAMS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "hollownode")
SIMULATE = DEMO_SIMULATE  # each node is the demo node: 4 H100, an A100 in MIG mode, an L4
GPUS = 6


def _missing() -> str:
    if os.geteuid() != 0:
        return "root (mount namespaces for the nodes)"
    for tool in ("unshare", "nsenter", "openssl", "cc", "mount"):
        if shutil.which(tool) is None:
            return tool
    if helm_binary() is None:
        return "helm (make helm)"
    return ""


@pytest.fixture(scope="session")
def cluster_builds(tmp_path_factory: pytest.TempPathFactory) -> Builds:
    out = tmp_path_factory.mktemp("cluster-elf")
    libraries = build_libraries(out)
    (out / "probe.c").write_text(PROBE_C)
    probe = out / "gpuprobe"
    subprocess.run(["cc", "-O1", "-o", probe, out / "probe.c"], check=True)
    return Builds(libraries=libraries, probe=probe)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory, cluster_builds: Builds) -> Iterator[Cluster]:
    bin_dir = kube_bin(*PROGRAMS)
    missing = _missing()
    if missing:
        if required_in_ci():
            pytest.fail(f"CI=true and the real-cluster tier needs {missing}")
        pytest.skip(f"the real-cluster tier needs {missing}")
    # short: socket paths under the nodes' folders must stay under 108 bytes
    work = Path(tmp_path_factory.mktemp("c"))
    cluster = Cluster(bin=bin_dir, work=work)
    try:
        cluster.start()
        cluster.install_chart(*simulate_value(SIMULATE))
        cluster.start_agents(builds=cluster_builds, simulate=SIMULATE, gpus=GPUS)
    except Exception as exc:
        logs = cluster.logs()
        cluster.stop()
        raise AssertionError(f"the cluster did not come up: {exc}\nlogs:\n{logs}") from exc
    try:
        yield cluster
    finally:
        cluster.stop()
