"""Prepare of a consumable share (KEP-5075) on a GPU whose MPS daemon already runs, against an
exclusive prepare of a whole GPU, through the same Preparer.

Target (issue 11): p50 of a share's prepare within 1 ms of an exclusive prepare's.

In process, not through the agent's sockets: the agent's Preparer with the real share enforcer
(mpsshares.MpsShareEnforcer over mpsdaemon.MpsDaemons), whose daemons run as the tests run them
(bench/mpsnode.py: a Deployment per daemon through the real Kubernetes client to the local API
server, run by the stand-in kubelet as a process of its own, the stand-in
nvidia-cuda-mps-control, a real tmpfs: root only), with ``--consumable-shares memory``.
Everything else is the real prepare path: simulated GPUs and the fake driver root, the claim read
from an in-memory source (no API latency: what is compared is the agent's own work), the CDI spec
and the checkpoint written with fsync under a temporary directory. The exclusive prepares go to a
preparer with sharing off over a directory of its own, in the same process. Each GPU's shared
daemon is started by a claim holding a share of it for the whole run, so the measured shares take
the fast path (no PrepareStarted record, no enforcer call; checked: no daemon is started or
stopped while they run). Exclusive and share prepares alternate, each followed by its unprepare,
so both see the same disk and the same load.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.mpsnode import mps_node, need_root, ref
from bench.table import Row, print_table, scaled
from dra_driver import cdi
from dra_driver.prepare import Preparer, device_targets
from dra_driver.sharing.shares import parse_mode
from dra_driver.sim.fakedriver import make_fake_driver, simulated_inventory
from tests.claimdata import ClaimStore, allocated_claim, new_uid
from tests.nodestorage import open_node_storage

SIMULATE = "h100:8"
TARGET_MS = 1.0


def _share(name: str, device: str, memory: str) -> dict[str, Any]:
    claim = allocated_claim(name=name, devices=[device])
    result = claim["status"]["allocation"]["devices"]["results"][0]
    result["shareID"] = new_uid()
    result["consumedCapacity"] = {"memory": memory}
    return claim


def _exclusive_preparer(tmp: Path, store: ClaimStore) -> Preparer:
    """A Preparer over ``tmp`` with sharing off: whole GPUs only."""
    inventory = simulated_inventory(SIMULATE, node_name="node1")
    make_fake_driver(tmp, gpu_uuids=[g.uuid for g in inventory.gpus])
    (tmp / "boot_id").write_text("boot-1\n")
    files = cdi.find_driver_files(
        driver_root=tmp / "driver-root",
        driver_version=inventory.gpus[0].driver_version,
        proc_root=tmp / "proc",
    )
    specs, checkpoint, locks = open_node_storage(
        tmp, vendor="k8s.gpu.nvidia.com", boot_id_path=tmp / "boot_id"
    )
    return Preparer(
        driver_name="gpu.nvidia.com",
        node_name="node1",
        cdi_vendor="k8s.gpu.nvidia.com",
        targets=device_targets(inventory),
        files=files,
        specs=specs,
        checkpoint=checkpoint,
        locks=locks,
        claims=store,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_shares", description=__doc__)
    parser.add_argument("--rounds", type=int, default=scaled(300, 10), help="prepares of each kind")
    args = parser.parse_args(argv)
    if not need_root("bench_shares"):
        return 1
    # Two agents' state side by side in one process: sharing off (whole GPUs) and on.
    with (
        tempfile.TemporaryDirectory(prefix="bench-whole-") as whole_tmp,
        mps_node(SIMULATE, consumable_shares=parse_mode("memory")) as node,
    ):
        store = node.store
        exclusive = _exclusive_preparer(Path(whole_tmp), store)
        shared = node.preparer
        try:
            # One long-lived share per GPU: every GPU's shared daemon runs from now on.
            holders = [store.add(_share(f"holder-{i}", f"gpu-{i}", "1Gi")) for i in range(8)]
            for holder in holders:
                shared.prepare(ref(holder))
            daemons = node.kubelet.running()
            starts = node.daemon_starts()
            if len(daemons) != 8:
                print(f"bench_shares: {len(daemons)} shared daemons run, not 8")
                return 1
            whole_ms: list[float] = []
            share_ms: list[float] = []
            for n in range(args.rounds):
                whole = store.add(allocated_claim(name=f"w{n}", devices=[f"gpu-{n % 8}"]))
                share = store.add(_share(f"s{n}", f"gpu-{n % 8}", "20Gi"))
                for preparer, claim, times in (
                    (exclusive, whole, whole_ms),
                    (shared, share, share_ms),
                ):
                    began = time.perf_counter()
                    preparer.prepare(ref(claim))
                    times.append((time.perf_counter() - began) * 1000)
                    preparer.unprepare(ref(claim))
            # the same daemons (same PIDs), none started again: the measured shares took the
            # fast path and none stopped a daemon another share still had
            now = node.kubelet.running()
            churn = node.daemon_starts() - starts + sum(now.get(k) != p for k, p in daemons.items())
            for holder in holders:
                shared.unprepare(ref(holder))
        finally:
            exclusive.close()
        left = node.leftovers()
    whole_p50 = statistics.median(whole_ms)
    share_p50 = statistics.median(share_ms)
    difference = share_p50 - whole_p50
    ok = print_table(
        f"prepare of a share on a GPU whose daemon runs vs an exclusive prepare "
        f"({args.rounds} each, in process, real MPS daemons; noisy on a shared machine)",
        [
            Row("exclusive prepare p50", whole_p50, "ms", ""),
            Row("share prepare p50", share_p50, "ms", ""),
            Row(
                "shared daemons started or stopped while the shares were measured",
                churn,
                "",
                "== 0",
                churn == 0,
            ),
            Row(
                "left after: " + ", ".join(left),
                sum(left.values()),
                "",
                "== 0",
                sum(left.values()) == 0,
            ),
            Row(
                "share p50 - exclusive p50",
                difference,
                "ms",
                f"<= {TARGET_MS:g} ms",
                difference <= TARGET_MS,
            ),
        ],
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
