"""gpus/readings.py: telemetry's NVML queries, through the real pynvml calls against simulated
GPUs: what NOT_SUPPORTED and failing GPUs cost, and that each is logged once."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pynvml
import pytest

from dra_driver.gpus import nvml
from dra_driver.gpus.readings import QUERIES, NvmlReader
from dra_driver.gpus.telemetryvalues import TelemetryTarget
from dra_driver.sim.nvml import SimulatedNode, simulated_nvml
from dra_driver.telemetry.sampler import READING_FIELDS, telemetry_targets

NODE = "node1"


@pytest.fixture
def reader() -> Iterator[NvmlReader]:
    reading = NvmlReader()
    yield reading
    reading.close()


def targets_of(node: SimulatedNode) -> tuple[TelemetryTarget, ...]:
    inventory = nvml.discover(driver_root=Path("/"), sysfs_root=node.sysfs_root)
    return telemetry_targets(inventory)


def telemetry_calls(node: SimulatedNode) -> Counter[str]:
    return Counter(c for c in node.library.calls if not c.startswith("nvmlInit"))


def test_a_full_gpu_answers_every_query_with_sixteen_calls(reader: NvmlReader) -> None:
    with simulated_nvml("h100:1", node_name=NODE) as node:
        targets = targets_of(node)
        node.library.calls.clear()
        (reading,) = reader.read(targets).values()
        assert all(getattr(reading, field) is not None for field in READING_FIELDS)
        calls = telemetry_calls(node)
        assert calls.pop("nvmlDeviceGetHandleByUUID") == 1
        assert sum(calls.values()) == len(QUERIES) == 16
        node.library.calls.clear()
        reader.read(targets)
        assert sum(telemetry_calls(node).values()) == 16  # the handle is kept


def test_not_supported_queries_are_left_out_logged_once_and_not_asked_again(
    reader: NvmlReader, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="dra_driver.gpus.readings")
    with simulated_nvml("a100-80gb:1:mig=3g.40gb", node_name=NODE) as node:
        gpu, mig = targets_of(node)
        readings = reader.read([gpu, mig])
        # The GPU in MIG mode has no utilisation; the MIG device is asked only for memory.
        assert readings[gpu.uuid].utilization_ratio is None
        assert readings[gpu.uuid].temperature_celsius is not None
        assert readings[mig.uuid].memory_total_bytes == 40192 << 20
        assert readings[mig.uuid].memory_used_bytes is not None
        assert readings[mig.uuid].temperature_celsius is None
        assert readings[mig.uuid].ecc_corrected_errors is None
        unsupported = {
            r.device: r.queries  # type: ignore[attr-defined]
            for r in caplog.records
            if "does not support" in r.getMessage()
        }
        assert unsupported == {
            gpu.name: [  # a GPU in MIG mode
                "nvmlDeviceGetUtilizationRates",
                "nvmlDeviceGetEncoderUtilization",
                "nvmlDeviceGetDecoderUtilization",
            ],
        }
        node.library.calls.clear()
        caplog.clear()
        reader.read([gpu, mig])
        calls = telemetry_calls(node)
        assert sum(calls.values()) == (len(QUERIES) - 3) + 1  # each asks only what it answers
        assert calls["nvmlDeviceGetUtilizationRates"] == 0
        assert not caplog.records


def test_a_lost_gpu_costs_one_call_per_pass_and_one_warning(
    reader: NvmlReader, caplog: pytest.LogCaptureFixture
) -> None:
    with simulated_nvml("l4:1", node_name=NODE) as node:
        (target,) = targets_of(node)
    with simulated_nvml("l4:1:fail", node_name=NODE) as node:
        for _ in range(3):
            node.library.calls.clear()
            assert reader.read([target]) == {}
            calls = telemetry_calls(node)
            # the handle lookup answers GPU_IS_LOST (as for a GPU off the bus): the round ends
            assert calls == {"nvmlDeviceGetHandleByUUID": 1}, calls
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage() for r in warnings] == [
        "telemetry: the device cannot be read; its metrics are left out"
    ]


def test_a_device_nvml_does_not_know_is_left_out(reader: NvmlReader) -> None:
    with simulated_nvml("l4:1", node_name=NODE) as node:
        (real,) = targets_of(node)
        ghost = TelemetryTarget(name="gpu-9", uuid="GPU-00000000-0000-0000-0000-000000000000",
                                gpu_minor=9, type="gpu")  # fmt: skip
        readings = reader.read([real, ghost])
    assert list(readings) == [real.uuid]


def test_a_library_without_a_symbol_counts_as_not_supported(reader: NvmlReader) -> None:
    with simulated_nvml("t4:1", node_name=NODE) as node:
        (target,) = targets_of(node)
        del node.library._functions["nvmlDeviceGetEnforcedPowerLimit"]  # an older driver
        (reading,) = reader.read([target]).values()
        assert reading.power_limit_watts is None
        assert reading.power_usage_watts is not None
        assert reading.memory_temperature_celsius is None  # GDDR: per field NOT_SUPPORTED
        assert reading.remapped_rows_uncorrected is None  # Turing: page retirement, not rows
        node.library.calls.clear()
        reader.read([target])
        assert sum(telemetry_calls(node).values()) == len(QUERIES) - 3


def test_nvml_stays_initialised_across_discovery_passes_until_closed() -> None:
    with simulated_nvml("l4:1", node_name=NODE) as node:
        reader = NvmlReader()
        (target,) = targets_of(node)
        assert reader.read([target])
        targets_of(node)  # discovery inits and shuts down NVML once more
        assert reader.read([target])
        reader.close()
        assert node.library._initialised == 0
        reader.close()  # twice is fine


def test_memory_is_read_as_nvidia_smi_reads_it_with_the_reservation_apart(
    reader: NvmlReader,
) -> None:
    with simulated_nvml("h200:1,a100-80gb:1:mig=3g.40gb", node_name=NODE) as node:
        targets = targets_of(node)
        node.library.workload = lambda uuid: uuid == targets[0].uuid  # the H200 works
        node.library.clock = lambda: 1000.0  # the readings stand still
        readings = reader.read(targets)
        pynvml.nvmlInit()
        try:
            v1 = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByUUID(targets[0].uuid))
        finally:
            pynvml.nvmlShutdown()
    h200 = readings[targets[0].uuid]
    assert h200.memory_reserved_bytes == 614 << 20  # what the real H200 reserved
    assert h200.memory_used_bytes is not None and h200.memory_used_bytes > 1 << 30
    # the v1 call counts the reservation as used; v2 (nvidia-smi's) does not
    assert v1.used == h200.memory_used_bytes + h200.memory_reserved_bytes
    assert v1.free == h200.memory_free_bytes
    for target in targets:  # the whole H200, the A100 in MIG mode and its MIG device
        r = readings[target.uuid]
        assert r.memory_free_bytes is not None and r.memory_used_bytes is not None
        assert r.memory_reserved_bytes is not None and r.memory_total_bytes is not None
        assert (
            r.memory_free_bytes + r.memory_used_bytes + r.memory_reserved_bytes
            == r.memory_total_bytes
        ), target.name


def test_a_driver_without_the_v2_memory_call_is_read_with_v1_and_no_reservation(
    reader: NvmlReader,
) -> None:
    with simulated_nvml("h100:1", node_name=NODE) as node:
        targets = targets_of(node)
        del node.library._functions["nvmlDeviceGetMemoryInfo_v2"]  # as before R510
        (reading,) = reader.read(targets).values()
    assert reading.memory_reserved_bytes is None
    assert reading.memory_used_bytes is not None and reading.memory_free_bytes is not None
    assert reading.memory_used_bytes + reading.memory_free_bytes == reading.memory_total_bytes
    assert reading.memory_used_bytes >= 614 << 20  # v1: the reservation counted as used
