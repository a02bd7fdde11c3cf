"""Publishing a node of 8 H100 in dynamic MIG mode (``--mig-mode dynamic``, no MIG device yet).

The inventory comes from the simulated NVML library through the real discovery code; the devices
from ``devices.node_devices`` (26 per GPU: the whole GPU and 25 placements, and 8 counter sets).

Rows:
* slice build + diff (``slices.build_slices`` + ``slices.plan_sync`` against the slices stored
  for the same devices: the path every re-discovery and every watch event takes), median of 30:
  <= 20 ms;
* the device model (``node_devices`` with every placement), and the device model, build and diff
  together (what a re-discovery pass costs), medians of 30, for information;
* how many slices and devices, and the bytes of the slice objects as JSON (what a create sends),
  for information.
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

from bench.table import Row, print_table, scaled
from dra_driver.devices import NodeDevices, node_devices
from dra_driver.publish.slices import build_slices
from dra_driver.publish.syncplan import plan_sync
from dra_driver.sim.nvml import discover_simulated

DRIVER = "gpu.nvidia.com"
NODE = "bench-node"
SPEC = "h100:8:mig"
RUNS = scaled(30, 3)
TARGET_MS = 20.0


def stored_form(bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The slices as the server returns them: a name, uid and resourceVersion each."""
    out = []
    for i, body in enumerate(bodies):
        meta = dict(body["metadata"])
        meta.update(name=f"{meta['generateName']}b{i:04d}", uid=f"uid-{i}", resourceVersion=str(i))
        out.append({**body, "metadata": meta})
    return out


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1000


def main() -> int:
    inventory = discover_simulated(SPEC, node_name=NODE)
    model_s: list[float] = []
    devices: NodeDevices | None = None
    for _ in range(RUNS):
        began = time.perf_counter()
        devices = node_devices(inventory, driver_name=DRIVER, mig_mode="dynamic")
        model_s.append(time.perf_counter() - began)
    assert devices is not None
    first = plan_sync(build_slices(devices, driver_name=DRIVER, node_name=NODE), [], node_uid="u")
    bodies = [w.body for w in first.creates]
    existing = stored_form(bodies)
    publish_s: list[float] = []
    for _ in range(RUNS):
        began = time.perf_counter()
        plan = plan_sync(
            build_slices(devices, driver_name=DRIVER, node_name=NODE), existing, node_uid="u"
        )
        publish_s.append(time.perf_counter() - began)
        assert plan.write_count == 0, "unchanged devices must plan no writes"
    whole_s: list[float] = []
    for _ in range(RUNS):
        began = time.perf_counter()
        fresh = node_devices(inventory, driver_name=DRIVER, mig_mode="dynamic")
        plan_sync(build_slices(fresh, driver_name=DRIVER, node_name=NODE), existing, node_uid="u")
        whole_s.append(time.perf_counter() - began)
    sizes = [len(json.dumps(b, separators=(",", ":")).encode()) for b in bodies]
    build_ms = median_ms(publish_s)
    rows = [
        Row(
            f"8 x H100 dynamic: slice build + diff (median of {RUNS})",
            build_ms,
            "ms",
            f"<= {TARGET_MS:g} ms",
            build_ms <= TARGET_MS,
        ),
        Row(f"8 x H100 dynamic: device model (median of {RUNS})", median_ms(model_s), "ms", ""),
        Row(
            f"8 x H100 dynamic: device model + build + diff (median of {RUNS})",
            median_ms(whole_s),
            "ms",
            "",
        ),
        Row("slices (counter sets in their own)", len(bodies), "", ""),
        Row("devices", len(devices.devices), "", ""),
        Row("counter sets", len(devices.counter_sets), "", ""),
        Row("slice objects, JSON bytes in all", sum(sizes), "B", ""),
        Row("largest slice object, JSON bytes", max(sizes), "B", ""),
    ]
    return 0 if print_table("Dynamic MIG publishing (8 x H100)", rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
