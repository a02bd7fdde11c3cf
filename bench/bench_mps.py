"""MPS sharing: prepare that starts an MPS control daemon, and 8 GPUs shared by 64 claims.

The agent's Preparer in process with real MPS daemons, as the tests run them (bench/mpsnode.py:
a Deployment per daemon through the real Kubernetes client to the local API server, run by the
stand-in kubelet as a process of its own; stand-in nvidia-cuda-mps-control and nvidia-smi; the
shm tmpfs a real mount, so root only), with ``--consumable-shares compute``. Claims come from an
in-memory source.

Rows:
* prepare of one claim whose GpuConfig asks for MPS (with a thread percentage and a memory
  limit), alone on the node: compute mode, directories, tmpfs, Deployment, waiting for the
  daemon to answer, limits, CDI spec, checkpoint: p50 <= 150 ms (20 runs, each unprepared);
* 8 GPUs shared by 64 claims: 8 consumable shares (KEP-5075) per GPU, each with its own
  consumedCapacity (memory and compute), prepared in one batch (the first share of each GPU
  starts its shared daemon through mpsshares.MpsShareEnforcer) and unprepared in one (the last
  share of each GPU stops it). Every claim must succeed, exactly one daemon per GPU must have
  been started and running, and afterwards no daemon process, Deployment, mount, directory or
  EXCLUSIVE_PROCESS compute mode may be left.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from bench.mpsnode import mps_node, need_root, ref
from bench.table import Row, print_table, scaled
from dra_driver.sharing.shares import parse_mode
from tests.claimdata import allocated_claim, new_uid, opaque

SPEC = "h100:8"
GPUS = 8
RUNS = scaled(20, 3)
SHARES_PER_GPU = scaled(8, 2)
TARGET_S = 0.150


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


def _share(name: str, device: str, k: int) -> dict[str, Any]:
    """Share ``k`` of ``device``: (4 + k) GiB and 5 + 2k percent, so 60 GiB and 96 % in all."""
    claim = allocated_claim(name=name, devices=[device])
    result = claim["status"]["allocation"]["devices"]["results"][0]
    result["shareID"] = new_uid()
    result["consumedCapacity"] = {"memory": f"{4 + k}Gi", "compute": str(5 + 2 * k)}
    return claim


def main() -> int:
    if not need_root("bench_mps"):
        return 1
    # A claim's own daemon: sharing off (with it on, a whole-GPU allocation is refused).
    with mps_node(SPEC) as node:
        single: list[float] = []
        for i in range(RUNS):
            claim = node.store.add(
                allocated_claim(name=f"one-{i}", devices=[f"gpu-{i % GPUS}"], configs=[_config()])
            )
            began = time.perf_counter()
            node.preparer.prepare(ref(claim))
            single.append(time.perf_counter() - began)
            node.preparer.unprepare(ref(claim))
        before = node.leftovers()
    with mps_node(SPEC, consumable_shares=parse_mode("compute")) as node:
        claims = [
            node.store.add(_share(f"s{g}-{k}", f"gpu-{g}", k))
            for g in range(GPUS)
            for k in range(SHARES_PER_GPU)
        ]
        began = time.perf_counter()
        outcomes = node.preparer.prepare_batch([ref(c) for c in claims])
        prepare_s = time.perf_counter() - began
        errors = [o.error for o in outcomes.values() if o.error]
        running = len(node.kubelet.running())
        started = node.daemon_starts()
        began = time.perf_counter()
        outcomes = node.preparer.unprepare_batch([ref(c) for c in claims])
        unprepare_s = time.perf_counter() - began
        errors += [o.error for o in outcomes.values() if o.error]
        after = node.leftovers()
    failures = len(errors)
    if errors:
        print(f"first error of {failures}: {errors[0]}")
    left = sum(before.values()) + sum(after.values())
    p50 = statistics.median(single)
    n = GPUS * SHARES_PER_GPU
    rows = [
        Row(f"prepare starting an MPS daemon (p50 of {RUNS})", p50 * 1000, "ms", "<= 150 ms",
            p50 <= TARGET_S),
        Row(f"same, p90 of {RUNS}", statistics.quantiles(single, n=10)[-1] * 1000, "ms", ""),
        Row(f"{n} shares of {GPUS} GPUs prepared in one batch (8 shared daemons started)",
            prepare_s * 1000, "ms", ""),
        Row(f"the same {n} shares unprepared in one batch (8 daemons stopped)", unprepare_s * 1000,
            "ms", ""),
        Row(f"{n} shares: failed prepares or unprepares", failures, "", "== 0", failures == 0),
        Row("shared daemons started / running after the prepares", started, "",
            f"== {GPUS} / {GPUS}", started == GPUS and running == GPUS),
        Row("left after: " + ", ".join(after), left, "", "== 0", left == 0),
    ]  # fmt: skip
    if left:
        print(f"left before the shares: {before}; after: {after}")
    if running != GPUS:
        print(f"daemons running after the prepares: {running}")
    return 0 if print_table(f"MPS: prepare with a daemon, {n} shares of {GPUS} GPUs", rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
