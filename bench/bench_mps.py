"""MPS sharing: prepare that starts an MPS control daemon, and 8 GPUs used by 64 MPS claims.

The agent's Preparer in-process, with real MPS daemons as the tests run them: a Deployment
created through the real Kubernetes client over HTTP to dra_driver/localapi.py, run by the
stand-in kubelet (dra_driver/localkubelet.py) as a process of its own; the fake driver root's
stand-in nvidia-cuda-mps-control (-f and the client) and nvidia-smi (compute mode); the shm
tmpfs a real mount (root only). Claims come from an in-memory source.

Rows:
* prepare of one claim whose GpuConfig asks for MPS (with a thread percentage and a memory
  limit), alone on the node: compute mode, directories, tmpfs, Deployment, waiting for the
  daemon to answer, limits, CDI spec, checkpoint: p50 <= 150 ms (20 runs, each unprepared);
* 8 GPUs used by 64 MPS claims: 8 rounds of 8 claims (one per GPU: until consumable-capacity
  shares land, an MPS claim holds its GPU), each round prepared in one batch and unprepared in
  one; every claim must succeed, and afterwards no daemon process, Deployment, mount, directory
  or EXCLUSIVE_PROCESS compute mode may be left.
"""

from __future__ import annotations

import logging
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.table import Row, print_table
from dra_driver import cdi
from dra_driver.checkpoint import Checkpoint, ClaimLocks
from dra_driver.gpus.fakedriver import make_fake_driver, simulated_inventory
from dra_driver.kube import KubeClient
from dra_driver.localapi import FakeKubeApi
from dra_driver.localkubelet import DeploymentKubelet
from dra_driver.mpsdaemon import MpsDaemons
from dra_driver.prepare import ClaimRef, Preparer, device_targets
from dra_driver.timeslice import NvidiaSmi
from tests.claimdata import ClaimStore, allocated_claim, opaque

SPEC = "h100:8"
RUNS = 20
ROUNDS = 8
TARGET_S = 0.150
VENDOR = "k8s.gpu.nvidia.com"


def _config() -> dict[str, Any]:
    return opaque(
        {
            "apiVersion": "resource.nvidia.com/v1beta1",
            "kind": "GpuConfig",
            "sharing": {
                "strategy": "MPS",
                "mpsConfig": {
                    "defaultActiveThreadPercentage": 50,
                    "defaultPinnedDeviceMemoryLimit": "10Gi",
                },
            },
        }
    )


def _ref(claim: dict[str, Any]) -> ClaimRef:
    meta = claim["metadata"]
    return ClaimRef(namespace=meta["namespace"], name=meta["name"], uid=meta["uid"])


def _mounts_under(path: Path) -> list[str]:
    prefix = str(path) + "/"
    lines = Path("/proc/self/mountinfo").read_text().splitlines()
    return [line.split(" ")[4] for line in lines if line.split(" ")[4].startswith(prefix)]


def main() -> int:
    if os.geteuid() != 0:
        print("bench_mps: needs root (it mounts a tmpfs per daemon)")
        return 1
    logging.getLogger("dra_driver").setLevel(logging.CRITICAL)
    inventory = simulated_inventory(SPEC, node_name="node1")
    with tempfile.TemporaryDirectory(prefix="bmps-", dir="/tmp") as d:
        tmp = Path(d)
        fake = make_fake_driver(tmp, gpu_uuids=[g.uuid for g in inventory.gpus])
        (tmp / "boot").write_text("boot-1\n")
        api = FakeKubeApi().start()
        kube = KubeClient.from_config(kubeconfig=api.write_kubeconfig(tmp / "kubeconfig"))
        kubelet = DeploymentKubelet(api, node_name="node1", log_dir=tmp / "pods").start()
        specs = cdi.CdiSpecDir(tmp / "cdi", vendor=VENDOR)
        specs.ensure()
        checkpoint = Checkpoint(tmp / "plugin/checkpoint.json", boot_id_path=tmp / "boot")
        checkpoint.open()
        locks = ClaimLocks(tmp / "plugin/claims.lock")
        locks.open()
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
            timeslicer=NvidiaSmi(fake.root),
            mps_daemons=MpsDaemons(
                api=kube,
                namespace="gpu-dra",
                node_name="node1",
                driver_name="gpu.nvidia.com",
                image="gpu-dra:bench",
                base=tmp / "plugin/mps",
                driver_root=fake.root,
                host_driver_root=fake.root,
            ),
        )
        try:
            single: list[float] = []
            for i in range(RUNS):
                claim = store.add(
                    allocated_claim(name=f"one-{i}", devices=[f"gpu-{i % 8}"], configs=[_config()])
                )
                began = time.perf_counter()
                preparer.prepare(_ref(claim))
                single.append(time.perf_counter() - began)
                preparer.unprepare(_ref(claim))
            failures = 0
            batch_s: list[float] = []
            for r in range(ROUNDS):
                claims = [
                    store.add(
                        allocated_claim(name=f"r{r}-{g}", devices=[f"gpu-{g}"], configs=[_config()])
                    )
                    for g in range(8)
                ]
                began = time.perf_counter()
                outcomes = preparer.prepare_batch([_ref(c) for c in claims])
                batch_s.append(time.perf_counter() - began)
                failures += sum(1 for o in outcomes.values() if o.error)
                running = len(kubelet.running())
                failures += 8 - running if running < 8 else 0
                outcomes = preparer.unprepare_batch([_ref(c) for c in claims])
                failures += sum(1 for o in outcomes.values() if o.error)
            deadline = time.monotonic() + 10
            while kubelet.running() and time.monotonic() < deadline:
                time.sleep(0.02)
            leftover = (
                len(kubelet.running())
                + len(api.objects("deployments"))
                + len(_mounts_under(tmp))
                + len(list((tmp / "plugin/mps").iterdir()))
                + sum(1 for m in fake.compute_modes().values() if m != "DEFAULT")
            )
        finally:
            preparer.close()
            kubelet.stop()
            kube.close()
            api.stop()
    p50 = statistics.median(single)
    rows = [
        Row(f"prepare starting an MPS daemon (p50 of {RUNS})", p50 * 1000, "ms", "<= 150 ms",
            p50 <= TARGET_S),
        Row(f"same, p90 of {RUNS}", statistics.quantiles(single, n=10)[-1] * 1000, "ms", ""),
        Row("8 claims on 8 GPUs prepared in one batch (median of 8 rounds)",
            statistics.median(batch_s) * 1000, "ms", ""),
        Row("64 MPS claims on 8 GPUs: failed prepares, unprepares or daemons", failures, "",
            "== 0", failures == 0),
        Row("left after: daemons, Deployments, mounts, directories, exclusive GPUs", leftover,
            "", "== 0", leftover == 0),
    ]  # fmt: skip
    return 0 if print_table("MPS: prepare with a daemon, 64 claims on 8 GPUs", rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
