"""The simulated NVML's health side, through pynvml's own functions: event sets with real wait
semantics, the health queries, and faults injected in-process or through the inbox file."""

from __future__ import annotations

import ctypes
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pynvml
import pytest

from dra_driver.errors import SimulationSpecError
from dra_driver.sim.faults import SimulatedFault, append_fault
from dra_driver.sim.nvml import (
    SHUTDOWN_C,
    SLOWDOWN_C,
    SimulatedNode,
    parse_spec,
    simulated_nvml,
)

XID = pynvml.nvmlEventTypeXidCriticalError
DBE = pynvml.nvmlEventTypeDoubleBitEccError


@pytest.fixture
def node() -> Iterator[SimulatedNode]:
    with simulated_nvml("h100:1,t4:1,a100-40gb:1:mig=3g.20gb,l4:1:no-events", node_name="n") as n:
        pynvml.nvmlInit()
        try:
            yield n
        finally:
            pynvml.nvmlShutdown()


def handle(index: int) -> object:
    return pynvml.nvmlDeviceGetHandleByIndex(index)


def registered(*indices: int, mask: int = XID | DBE) -> object:
    event_set = pynvml.nvmlEventSetCreate()
    for index in indices:
        pynvml.nvmlDeviceRegisterEvents(handle(index), mask, event_set)
    return event_set


def address(h: object) -> int:
    return ctypes.cast(h, ctypes.c_void_p).value or 0


def test_a_wait_with_nothing_to_report_times_out_after_its_timeout(node: SimulatedNode) -> None:
    event_set = registered(0)
    began = time.monotonic()
    with pytest.raises(pynvml.NVMLError_Timeout):
        pynvml.nvmlEventSetWait_v2(event_set, 150)
    assert 0.14 <= time.monotonic() - began < 1.0
    pynvml.nvmlEventSetFree(event_set)


def test_an_injected_xid_wakes_a_waiting_thread_with_the_event_data(node: SimulatedNode) -> None:
    event_set = registered(0, 2)
    timer = threading.Timer(
        0.05, node.library.health.inject, [SimulatedFault(kind="xid", gpu=0, xid=79)]
    )
    timer.start()
    began = time.monotonic()
    data = pynvml.nvmlEventSetWait_v2(event_set, 5000)
    assert time.monotonic() - began < 1.0
    assert isinstance(data, pynvml.c_nvmlEventData_t)
    assert address(data.device) == address(handle(0))
    assert (data.eventType, data.eventData) == (XID, 79)
    assert (data.gpuInstanceId, data.computeInstanceId) == (0xFFFFFFFF, 0xFFFFFFFF)
    node.library.health.inject(
        SimulatedFault(kind="xid", gpu=2, xid=94, gpu_instance_id=2, compute_instance_id=0)
    )
    data = pynvml.nvmlEventSetWait_v2(event_set, 0)
    assert (data.eventData, data.gpuInstanceId, data.computeInstanceId) == (94, 2, 0)
    assert address(data.device) == address(handle(2))


def test_events_reach_only_sets_that_registered_the_gpu_and_the_type(node: SimulatedNode) -> None:
    xids_only, other_gpu = registered(0, mask=XID), registered(1)
    node.library.health.inject(SimulatedFault(kind="ecc", gpu=0))
    assert pynvml.nvmlEventSetWait_v2(xids_only, 0).eventData == 48  # the XID, not the ECC event
    with pytest.raises(pynvml.NVMLError_Timeout):
        pynvml.nvmlEventSetWait_v2(xids_only, 0)
    with pytest.raises(pynvml.NVMLError_Timeout):
        pynvml.nvmlEventSetWait_v2(other_gpu, 0)


def test_events_before_registration_are_not_delivered(node: SimulatedNode) -> None:
    event_set = pynvml.nvmlEventSetCreate()
    node.library.health.inject(SimulatedFault(kind="xid", gpu=0, xid=94))
    pynvml.nvmlDeviceRegisterEvents(handle(0), XID, event_set)
    with pytest.raises(pynvml.NVMLError_Timeout):
        pynvml.nvmlEventSetWait_v2(event_set, 0)


def test_a_gpu_without_event_support_refuses_registration(node: SimulatedNode) -> None:
    event_set = pynvml.nvmlEventSetCreate()
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetSupportedEventTypes(handle(3))
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceRegisterEvents(handle(3), XID, event_set)
    assert pynvml.nvmlDeviceGetSupportedEventTypes(handle(0)) & (XID | DBE) == XID | DBE
    assert pynvml.nvmlDeviceGetSupportedEventTypes(handle(0)) == 0xFF9F  # as a real H200's
    pynvml.nvmlDeviceRegisterEvents(handle(0), pynvml.nvmlEventTypeGpuRecoveryAction, event_set)
    with pytest.raises(pynvml.NVMLError_NotSupported):  # a bit outside nvmlEventTypeAll
        pynvml.nvmlDeviceRegisterEvents(handle(0), 0x20, event_set)


def test_a_double_bit_ecc_error_counts_and_leaves_rows_or_pages_pending(
    node: SimulatedNode,
) -> None:
    event_set = registered(0, 1)
    for gpu in (0, 1):
        node.library.health.inject(SimulatedFault(kind="ecc", gpu=gpu))
    seen = [pynvml.nvmlEventSetWait_v2(event_set, 0) for _ in range(4)]
    assert [(e.eventType, e.eventData) for e in seen] == [(DBE, 0), (XID, 48)] * 2
    unc, volatile = pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC
    for gpu in (0, 1):
        assert pynvml.nvmlDeviceGetTotalEccErrors(handle(gpu), unc, volatile) == 1
    # H100 (Hopper) remaps rows; T4 (Turing) retires pages; each refuses the other query.
    assert pynvml.nvmlDeviceGetRemappedRows(handle(0)) == (0, 1, 1, 0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetRetiredPagesPendingStatus(handle(0))
    assert pynvml.nvmlDeviceGetRetiredPagesPendingStatus(handle(1)) == 1
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetRemappedRows(handle(1))
    node.library.health.inject(SimulatedFault(kind="reset", gpu=0))
    assert pynvml.nvmlDeviceGetTotalEccErrors(handle(0), unc, volatile) == 0
    assert pynvml.nvmlDeviceGetTotalEccErrors(handle(0), unc, pynvml.NVML_AGGREGATE_ECC) == 1
    assert pynvml.nvmlDeviceGetRemappedRows(handle(0))[2] == 0


def test_a_lost_gpu_reports_xid_79_then_gpu_is_lost_until_it_is_reset(
    node: SimulatedNode,
) -> None:
    event_set = registered(0)
    uuid = pynvml.nvmlDeviceGetUUID(handle(0))
    node.library.health.inject(SimulatedFault(kind="lost", gpu=0))
    assert pynvml.nvmlEventSetWait_v2(event_set, 0).eventData == 79
    with pytest.raises(pynvml.NVMLError_GpuIsLost):  # once: a registered GPU fell off the bus
        pynvml.nvmlEventSetWait_v2(event_set, 0)
    with pytest.raises(pynvml.NVMLError_Timeout):
        pynvml.nvmlEventSetWait_v2(event_set, 0)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        pynvml.nvmlDeviceGetTemperature(handle(0), pynvml.NVML_TEMPERATURE_GPU)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        pynvml.nvmlDeviceGetHandleByUUID(uuid)
    node.library.health.inject(SimulatedFault(kind="reset", gpu=0))
    assert address(pynvml.nvmlDeviceGetHandleByUUID(uuid)) == address(handle(0))
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlDeviceGetHandleByUUID("GPU-00000000-0000-0000-0000-000000000000")


def test_temperature_and_thresholds_answer_both_query_versions(node: SimulatedNode) -> None:
    h = handle(0)
    node.library.health.inject(SimulatedFault(kind="temperature", gpu=0, celsius=91))
    assert pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU) == 91
    assert pynvml.nvmlDeviceGetTemperatureV(h, pynvml.NVML_TEMPERATURE_GPU) == 91
    slowdown = pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN
    assert pynvml.nvmlDeviceGetTemperatureThreshold(h, slowdown) == SLOWDOWN_C
    shutdown = pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN
    assert pynvml.nvmlDeviceGetTemperatureThreshold(h, shutdown) == SHUTDOWN_C
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetTemperatureThreshold(h, pynvml.NVML_TEMPERATURE_THRESHOLD_ACOUSTIC_MIN)


def test_a_hang_blocks_every_call_on_that_gpu_for_its_time(node: SimulatedNode) -> None:
    node.library.health.inject(SimulatedFault(kind="hang", gpu=0, seconds=0.8))
    began = time.monotonic()
    pynvml.nvmlDeviceGetTemperature(handle(1), pynvml.NVML_TEMPERATURE_GPU)
    assert time.monotonic() - began < 0.4  # other GPUs answer (bound loose for a busy machine)
    pynvml.nvmlDeviceGetTemperature(handle(0), pynvml.NVML_TEMPERATURE_GPU)
    assert time.monotonic() - began >= 0.78


def test_faults_appended_to_the_inbox_are_injected_by_the_node(tmp_path: Path) -> None:
    inbox = tmp_path / "plugin" / "simulated-faults.jsonl"
    append_fault(inbox, SimulatedFault(kind="lost", gpu=0))  # before the node: history, skipped
    with simulated_nvml("h100:2", node_name="n", inbox=inbox):
        pynvml.nvmlInit()
        try:
            event_set = registered(1)
            append_fault(inbox, SimulatedFault(kind="xid", gpu=1, xid=31))
            with inbox.open("a") as f:
                f.write('{"kind": "meltdown", "gpu": 1}\nnot json\n{"kind": "xid", "gpu": 1, ')
            began = time.monotonic()
            assert pynvml.nvmlEventSetWait_v2(event_set, 2000).eventData == 31
            assert time.monotonic() - began < 0.5
            with inbox.open("a") as f:
                f.write('"xid": 13}\n')  # the half line, completed
            assert pynvml.nvmlEventSetWait_v2(event_set, 2000).eventData == 13
            assert pynvml.nvmlDeviceGetTemperature(handle(0), pynvml.NVML_TEMPERATURE_GPU) > 0
        finally:
            pynvml.nvmlShutdown()


@pytest.mark.parametrize(
    ("fields", "complaint"),
    [
        ({"kind": "boom", "gpu": 0}, "unknown fault 'boom'"),
        ({"kind": "xid", "gpu": 0}, "positive XID"),
        ({"kind": "hang", "gpu": 0}, "seconds > 0"),
        ({"kind": "lost", "gpu": -1}, "negative"),
        ({"kind": "lost", "gpu": 0, "when": "now"}, "unknown fault fields"),
        ({"kind": "lost", "gpu": "zero"}, "bad fault"),
    ],
)
def test_bad_faults_are_refused_with_the_reason(fields: dict[str, object], complaint: str) -> None:
    with pytest.raises(SimulationSpecError, match=complaint):
        SimulatedFault.from_json(fields)


def test_a_fault_for_a_gpu_the_node_does_not_have_is_refused(node: SimulatedNode) -> None:
    with pytest.raises(SimulationSpecError, match="no simulated GPU 9"):
        node.library.health.inject(SimulatedFault(kind="lost", gpu=9))


def test_faults_round_trip_through_their_inbox_line() -> None:
    fault = SimulatedFault(kind="xid", gpu=1, xid=94, gpu_instance_id=2, compute_instance_id=0)
    assert fault.to_json() == (
        '{"kind":"xid","gpu":1,"xid":94,"gpu_instance_id":2,"compute_instance_id":0}'
    )
    assert SimulatedFault.from_json(json.loads(fault.to_json())) == fault


def test_no_events_is_a_spec_option() -> None:
    (gpu,) = parse_spec("l4:1:no-events").gpus
    assert gpu.events is False
    assert parse_spec("l4:1").gpus[0].events is True
