"""A node whose MPS daemons run, for the MPS benchmarks (bench_mps, bench_shares).

As tests/test_mps.py sets it up: the agent's Preparer in process with real mpsdaemon.MpsDaemons
(so consumable shares get the real mpsshares.MpsShareEnforcer), each daemon a Deployment created
through the real Kubernetes client over HTTP to dra_driver/sim/localapi/ and run by the stand-in
kubelet (dra_driver/sim/localkubelet.py) as a process of its own; the fake driver root's stand-in
nvidia-cuda-mps-control (-f and the client) and nvidia-smi (compute mode); the shm tmpfs a real
mount, so root only. Claims come from an in-memory source (no API latency in a prepare).
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dra_driver import cdi
from dra_driver.kube import KubeClient
from dra_driver.node.wiring import prepare_steps
from dra_driver.prepare import ClaimRef, Preparer, device_targets
from dra_driver.sharing.mpsdaemon import MpsDaemons
from dra_driver.sharing.shares import DISABLED, SharesMode
from dra_driver.sharing.timeslice import NvidiaSmi
from dra_driver.sim.fakedriver import FakeDriver, make_fake_driver, simulated_inventory
from dra_driver.sim.localapi import FakeKubeApi
from dra_driver.sim.localkubelet import DeploymentKubelet
from tests.claimdata import ClaimStore
from tests.nodestorage import open_node_storage

VENDOR = "k8s.gpu.nvidia.com"
NAMESPACE = "gpu-dra"


def need_root(bench: str) -> bool:
    """True when running as root; else say why the bench cannot run (the caller exits 1)."""
    if os.geteuid() == 0:
        return True
    print(
        f"{bench}: needs root: every MPS daemon gets a tmpfs mounted on its shm directory, as "
        "the agent does on a node (run it as root, as CI's `make bench` does)"
    )
    return False


def ref(claim: dict[str, Any]) -> ClaimRef:
    meta = claim["metadata"]
    return ClaimRef(namespace=meta["namespace"], name=meta["name"], uid=meta["uid"])


def mounts_under(path: Path) -> list[str]:
    prefix = str(path) + "/"
    lines = Path("/proc/self/mountinfo").read_text().splitlines()
    return [line.split(" ")[4] for line in lines if line.split(" ")[4].startswith(prefix)]


@dataclass
class MpsNode:
    tmp: Path
    fake: FakeDriver
    api: FakeKubeApi
    kubelet: DeploymentKubelet
    store: ClaimStore
    preparer: Preparer

    @property
    def mps_base(self) -> Path:
        return self.tmp / "plugin/mps"

    def deployments(self) -> list[str]:
        return [d["metadata"]["name"] for d in self.api.objects("deployments")]

    def daemon_starts(self) -> int:
        """How many daemon processes the stand-in kubelet has started."""
        return sum(self.kubelet.starts.values())

    def leftovers(self, *, timeout_s: float = 10.0) -> dict[str, int]:
        """What is left after every claim went: daemon processes (waited for up to
        ``timeout_s``), Deployments, mounts, MPS directories, GPUs not in DEFAULT compute mode."""
        deadline = time.monotonic() + timeout_s
        while self.kubelet.running() and time.monotonic() < deadline:
            time.sleep(0.02)
        base = self.mps_base
        return {
            "daemons": len(self.kubelet.running()),
            "Deployments": len(self.deployments()),
            "mounts": len(mounts_under(self.tmp)),
            "directories": len(list(base.iterdir())) if base.exists() else 0,
            "exclusive GPUs": sum(1 for m in self.fake.compute_modes().values() if m != "DEFAULT"),
        }


@contextlib.contextmanager
def mps_node(spec: str, *, consumable_shares: SharesMode = DISABLED) -> Iterator[MpsNode]:
    """A node of simulated GPUs ``spec`` whose Preparer runs real MPS daemons."""
    logging.getLogger("dra_driver").setLevel(logging.CRITICAL)
    inventory = simulated_inventory(spec, node_name="node1")
    # a short path: a Unix socket's path has at most 107 bytes
    with tempfile.TemporaryDirectory(prefix="bmps-", dir="/tmp") as d:
        tmp = Path(d)
        fake = make_fake_driver(tmp, gpu_uuids=[g.uuid for g in inventory.gpus])
        (tmp / "boot").write_text("boot-1\n")
        api = FakeKubeApi().start()
        kube = KubeClient.from_config(kubeconfig=api.write_kubeconfig(tmp / "kubeconfig"))
        kubelet = DeploymentKubelet(api, node_name="node1", log_dir=tmp / "pods").start()
        specs, checkpoint, locks = open_node_storage(tmp, vendor=VENDOR, boot_id_path=tmp / "boot")
        store = ClaimStore()
        preparer = Preparer(
            driver_name="gpu.nvidia.com",
            node_name="node1",
            cdi_vendor=VENDOR,
            targets=device_targets(inventory),
            files=cdi.find_driver_files(
                driver_root=fake.root,
                driver_version=inventory.gpus[0].driver_version,
                proc_root=fake.proc_root,
            ),
            specs=specs,
            checkpoint=checkpoint,
            locks=locks,
            claims=store,
            steps=prepare_steps(
                timeslicer=NvidiaSmi(fake.root),
                mps_daemons=MpsDaemons(
                    api=kube,
                    namespace=NAMESPACE,
                    node_name="node1",
                    driver_name="gpu.nvidia.com",
                    image="gpu-dra:bench",
                    base=tmp / "plugin/mps",
                    driver_root=fake.root,
                    host_driver_root=fake.root,
                ),
                consumable_shares=consumable_shares,
            ),
        )
        try:
            yield MpsNode(tmp, fake, api, kubelet, store, preparer)
        finally:
            preparer.close()
            kubelet.stop()
            for mount in reversed(mounts_under(tmp)):
                subprocess.run(["umount", "--lazy", mount], check=False)
            kube.close()
            api.stop()
