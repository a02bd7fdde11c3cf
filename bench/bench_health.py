"""GPU health: from a fault in the simulated NVML to the taint stored by the API server, and back.

The agent's pieces, in-process: simulated GPUs (8 H100) through pynvml, the HealthMonitor, the
real Publisher and Kubernetes client over HTTP to dra_driver/sim/localapi/. Each run injects the
fault into the simulated NVML library and polls the stored ResourceSlice until it shows.

Rows (median of 10 each):
* XID 94 injected -> ``gpu.nvidia.com/xid=94`` stored: <= 200 ms. An event wakes the monitor's
  NVML wait at once: this is the whole path (event, decision, publisher, API write); about
  50 ms of it is the publisher letting a burst of changes settle before it writes.
* the GPU fell off the bus and is reset -> its taints gone from the stored slice: <= 200 ms.
  A reset sends no NVML event; it is seen by the next periodic check. The bench checks every
  0.1 s (``--health-check-interval 0.1``), so this includes up to 0.1 s of waiting for the
  check; with the default 10 s a recovery takes up to 10 s longer. The flapping limit is off
  (``--health-min-change-interval 0``), as it would hold the removal back on purpose.
* end of an XID's quiet period -> taint gone, for information (a timer, no NVML involved).
* API writes while nothing changes (2 s, 20 checks): == 0.
"""

from __future__ import annotations

import logging
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.table import Row, print_table, scaled
from dra_driver.devices import node_devices
from dra_driver.gpus import nvml
from dra_driver.health.decisions import HealthPolicy
from dra_driver.health.monitor import HealthMonitor
from dra_driver.kube import KubeClient
from dra_driver.publish.publisher import Backoff, Publisher
from dra_driver.sim.faults import SimulatedFault
from dra_driver.sim.localapi import FakeKubeApi
from dra_driver.sim.nvml import simulated_nvml

DRIVER = "gpu.nvidia.com"
NODE = "bench-node"
SPEC = "h100:8"
RUNS = scaled(10, 2)
IDLE_S = scaled(20, 5) / 10  # seconds of watching for writes while nothing changes
TARGET_S = 0.2
QUIET_S = 0.3


def wait_for(check: Callable[[], bool], timeout_s: float = 5.0) -> float:
    """Seconds until ``check()`` held (polled every 2 ms); inf when it never did."""
    began = time.perf_counter()
    while time.perf_counter() - began < timeout_s:
        if check():
            return time.perf_counter() - began
        time.sleep(0.002)
    return float("inf")


def main() -> int:
    logging.getLogger("dra_driver").setLevel(logging.ERROR)  # one log line per transition
    api = FakeKubeApi().start()
    api.add_node(NODE)

    def taint_keys(device: str) -> set[str]:
        for item in api.slices(node_name=NODE):
            for d in item["spec"].get("devices") or ():
                if d["name"] == device:
                    return {t["key"] for t in d.get("taints") or ()}
        return set()

    with (
        tempfile.TemporaryDirectory(prefix="bench-health-") as tmp,
        simulated_nvml(SPEC, node_name=NODE) as node,
    ):
        kube = KubeClient.from_config(kubeconfig=api.write_kubeconfig(Path(tmp) / "kubeconfig"))
        inventory = nvml.discover(driver_root=Path("/"), sysfs_root=node.sysfs_root)
        publisher = Publisher(
            kube,
            driver_name=DRIVER,
            node_name=NODE,
            node_devices=node_devices(inventory, driver_name=DRIVER),
            backoff=Backoff(initial_s=0.05, max_s=1),
        )
        monitor = HealthMonitor(
            policy=HealthPolicy(
                driver_name=DRIVER, min_change_interval_s=0, xid_quiet_period_s=QUIET_S
            ),
            inventory=inventory,
            taints=publisher,
            check_interval_s=0.1,
        )
        inject = node.library.health.inject
        publisher.start()
        monitor.start()
        taint_s, reset_s, quiet_s = [], [], []
        try:
            assert publisher.wait_synced(10)
            for run in range(RUNS):
                gpu = run % 8
                device = f"gpu-{gpu}"
                began = time.perf_counter()
                inject(SimulatedFault(kind="xid", gpu=gpu, xid=94))
                taint_s.append(wait_for(lambda d=device: f"{DRIVER}/xid" in taint_keys(d)))
                # the quiet period ends QUIET_S after the XID
                ends = began + QUIET_S
                wait_for(lambda d=device: not taint_keys(d))
                quiet_s.append(max(0.0, time.perf_counter() - ends))
                inject(SimulatedFault(kind="lost", gpu=gpu))
                wait_for(lambda d=device: f"{DRIVER}/gpu-lost" in taint_keys(d))
                inject(SimulatedFault(kind="reset", gpu=gpu))
                reset_s.append(wait_for(lambda d=device: not taint_keys(d)))
            assert publisher.wait_synced(5)
            writes = publisher.writes.total
            time.sleep(IDLE_S)
            idle_writes = publisher.writes.total - writes
        finally:
            monitor.stop()
            publisher.stop()
            kube.close()
            api.stop()
    taint_p50, reset_p50 = statistics.median(taint_s), statistics.median(reset_s)
    rows = [
        Row(
            f"XID injected -> taint stored (median of {RUNS})",
            taint_p50 * 1000,
            "ms",
            "<= 200 ms",
            taint_p50 <= TARGET_S,
        ),
        Row(
            f"GPU reset -> taints removed, checks every 0.1 s (median of {RUNS})",
            reset_p50 * 1000,
            "ms",
            "<= 200 ms",
            reset_p50 <= TARGET_S,
        ),
        Row(
            f"quiet period over -> taint removed (median of {RUNS})",
            statistics.median(quiet_s) * 1000,
            "ms",
            "",
        ),
        Row(
            f"API writes while nothing changes ({IDLE_S:g} s)",
            idle_writes,
            "",
            "== 0",
            idle_writes == 0,
        ),
    ]
    return 0 if print_table("GPU health: fault to stored taint and back", rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
