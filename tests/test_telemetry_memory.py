"""Telemetry's memory series read as nvidia-smi and dcgm-exporter read them: NVML memory info v2,
used without the driver's reserved memory, the reservation a series of its own, and free + used
+ reserved = total, in the ``gpu_dra_*`` bytes and in DCGM's whole MiB alike. Simulated GPUs read
through the real pynvml calls and the agent's reader (the H200's reservation is the real one's)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dra_driver.gpus import nvml
from dra_driver.gpus.readings import NvmlReader
from dra_driver.gpus.telemetryvalues import Reading
from dra_driver.sim.fakedriver import simulated_inventory
from dra_driver.sim.nvml import simulated_nvml
from dra_driver.telemetry.sampler import Telemetry, telemetry_targets
from tests import exposition

NODE = "n"
SPEC = "h200:1,a100-80gb:1:mig=3g.40gb+2g.20gb"
MIB = 1 << 20


@pytest.fixture(scope="module")
def series() -> exposition.Series:
    reader = NvmlReader()
    try:
        with simulated_nvml(SPEC, node_name=NODE) as node:
            inventory = nvml.discover(driver_root=Path("/"), sysfs_root=node.sysfs_root)
            busy = {g.uuid for g in inventory.gpus[:1]}
            busy |= {m.uuid for g in inventory.gpus for m in g.mig_instances[:1]}
            node.library.workload = busy.__contains__
            telemetry = Telemetry(node_name=NODE, inventory=inventory, read=reader.read, dcgm=True)
            telemetry.sample()
            text = telemetry.exposition().text()
    finally:
        reader.close()
    return exposition.parse(text)


def per_device(series: exposition.Series, name: str, key: str) -> dict[str, float]:
    return {dict(labels)[key]: v for labels, v in exposition.find(series, name).items()}


def test_the_native_series_add_up_to_the_total_for_every_device(series: exposition.Series) -> None:
    used, free, reserved, total = (
        per_device(series, f"gpu_dra_gpu_memory_{kind}_bytes", "device")
        for kind in ("used", "free", "reserved", "total")
    )
    assert len(total) == 4  # the H200, the A100 in MIG mode, its two MIG devices
    assert used.keys() == free.keys() == reserved.keys() == total.keys()
    for device in total:
        assert used[device] + free[device] + reserved[device] == total[device], device
    assert reserved["gpu-0"] == 614 * MIB  # a whole GPU's, as the real H200's
    assert used["gpu-0"] > 1 << 30  # it works
    assert all(reserved[d] == 0 for d in total if "-mig-" in d)


def test_the_dcgm_series_add_up_to_the_total_in_whole_mib(series: exposition.Series) -> None:
    used, free, reserved = (
        {
            (dict(labels)["gpu"], dict(labels).get("GPU_I_ID")): v
            for labels, v in exposition.find(series, f"DCGM_FI_DEV_FB_{kind}").items()
        }
        for kind in ("USED", "FREE", "RESERVED")
    )
    totals = per_device(series, "gpu_dra_gpu_memory_total_bytes", "device")
    assert used.keys() == free.keys() == reserved.keys() and len(used) == 4
    assert used[("0", None)] + free[("0", None)] + reserved[("0", None)] == totals["gpu-0"] / MIB
    assert reserved[("0", None)] == 614
    native_used = per_device(series, "gpu_dra_gpu_memory_used_bytes", "device")
    assert used[("0", None)] == native_used["gpu-0"] / MIB  # the same v2 reading


def test_fb_reserved_is_the_readings_reservation_in_whole_mib() -> None:
    inventory = simulated_inventory("h100:1", node_name=NODE)
    (target,) = telemetry_targets(inventory)
    read = {target.uuid: Reading(memory_reserved_bytes=(551 << 20) + 7)}
    telemetry = Telemetry(node_name=NODE, inventory=inventory, read=lambda _: read, dcgm=True)
    telemetry.sample()
    text = telemetry.exposition().text()
    assert exposition.types(text)["DCGM_FI_DEV_FB_RESERVED"] == "gauge"
    parsed = exposition.parse(text)
    assert list(exposition.find(parsed, "DCGM_FI_DEV_FB_RESERVED").values()) == [551]
    assert list(exposition.find(parsed, "gpu_dra_gpu_memory_reserved_bytes").values()) == [
        (551 << 20) + 7
    ]
