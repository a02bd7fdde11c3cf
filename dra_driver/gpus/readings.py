"""NVML readings for telemetry (telemetry/sampler.py): one round of queries per device, at
bounded cost.

This is the NVML boundary of telemetry, as gpus/nvml.py is the one of discovery: pynvml's errors
are handled here and never leave it. Devices are looked up by UUID
(``nvmlDeviceGetHandleByUUID``, which takes MIG device UUIDs too), so NVML index changes between
re-discoveries do not matter; handles are kept between passes and looked up again after an
error. With ``--simulate`` the same pynvml calls reach sim/nvml.py.

Cost per pass: at most ``len(QUERIES)`` (16) NVML calls per device, fewer for MIG devices:

- MIG devices are asked only for memory info, the one query NVML answers for them (nvml.h);
- a query a device answers NOT_SUPPORTED (or a library without the symbol) is logged once (one
  line per device naming its queries) and not asked again of that device (GPUs in MIG mode
  answer no utilisation, GDDR boards no memory temperature);
- any other error (GPU lost, a timeout) ends that device's round for this pass: one failing call,
  not sixteen. It is logged once per device and error until the device answers again, and its
  handle is looked up again next pass.

Not thread-safe: one sampling loop calls ``read``. NVML stays initialised from the first read to
``close()`` (NVML counts initialisations, so discovery's own init and shutdown do not affect it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pynvml

from dra_driver.gpus.telemetryvalues import Reading, TelemetryTarget

log = logging.getLogger(__name__)


def _utilization(handle: Any) -> dict[str, Any]:
    rates = pynvml.nvmlDeviceGetUtilizationRates(handle)
    return {"utilization_ratio": rates.gpu / 100, "memory_utilization_ratio": rates.memory / 100}


def _memory(handle: Any) -> dict[str, Any]:
    """``nvmlDeviceGetMemoryInfo_v2``, as nvidia-smi and dcgm-exporter read it: used without the
    driver's reserved memory, which v1 counts as used (on an H200 614 MiB). A driver without the
    v2 call (before R510) gets v1, and no reserved reading."""
    try:
        info = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
    except pynvml.NVMLError_FunctionNotFound:
        info = pynvml.nvmlDeviceGetMemoryInfo(handle)
        return {
            "memory_used_bytes": int(info.used),
            "memory_total_bytes": int(info.total),
            "memory_free_bytes": int(info.free),
        }
    return {
        "memory_used_bytes": int(info.used),
        "memory_total_bytes": int(info.total),
        "memory_free_bytes": int(info.free),
        "memory_reserved_bytes": int(info.reserved),
    }


def _temperature(handle: Any) -> dict[str, Any]:
    celsius = pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)
    return {"temperature_celsius": float(celsius)}


def _power_usage(handle: Any) -> dict[str, Any]:
    return {"power_usage_watts": pynvml.nvmlDeviceGetPowerUsage(handle) / 1000}  # mW


def _power_limit(handle: Any) -> dict[str, Any]:
    return {"power_limit_watts": pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000}  # mW


def _sm_clock(handle: Any) -> dict[str, Any]:
    return {"sm_clock_hertz": pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM) * 1e6}


def _memory_clock(handle: Any) -> dict[str, Any]:
    return {
        "memory_clock_hertz": pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_MEM) * 1e6
    }


def _memory_temperature(handle: Any) -> dict[str, Any]:
    (value,) = pynvml.nvmlDeviceGetFieldValues(handle, [pynvml.NVML_FI_DEV_MEMORY_TEMP])
    if value.nvmlReturn != pynvml.NVML_SUCCESS:  # per field: GDDR boards have no such sensor
        raise pynvml.NVMLError(value.nvmlReturn)
    return {"memory_temperature_celsius": float(value.value.uiVal)}


def _energy(handle: Any) -> dict[str, Any]:
    return {"energy_millijoules": int(pynvml.nvmlDeviceGetTotalEnergyConsumption(handle))}


def _encoder(handle: Any) -> dict[str, Any]:
    percent, _period_us = pynvml.nvmlDeviceGetEncoderUtilization(handle)
    return {"encoder_utilization_ratio": percent / 100}


def _decoder(handle: Any) -> dict[str, Any]:
    percent, _period_us = pynvml.nvmlDeviceGetDecoderUtilization(handle)
    return {"decoder_utilization_ratio": percent / 100}


def _pcie_replays(handle: Any) -> dict[str, Any]:
    return {"pcie_replays": int(pynvml.nvmlDeviceGetPcieReplayCounter(handle))}


def _remapped_rows(handle: Any) -> dict[str, Any]:
    corrected, uncorrected, pending, failure = pynvml.nvmlDeviceGetRemappedRows(handle)
    return {
        "remapped_rows_corrected": int(corrected),
        "remapped_rows_uncorrected": int(uncorrected),
        "row_remap_pending": bool(pending),
        "row_remap_failure": bool(failure),
    }


def _clock_event_reasons(handle: Any) -> dict[str, Any]:
    return {"clock_event_reasons": int(pynvml.nvmlDeviceGetCurrentClocksEventReasons(handle))}


def _ecc(field: str, error_type: int) -> Callable[[Any], dict[str, Any]]:
    def query(handle: Any) -> dict[str, Any]:
        count = pynvml.nvmlDeviceGetTotalEccErrors(handle, error_type, pynvml.NVML_VOLATILE_ECC)
        return {field: int(count)}

    return query


@dataclass(frozen=True)
class Query:
    """One NVML call of a round and the Reading fields it fills."""

    name: str  # for logs: the NVML function
    call: Callable[[Any], dict[str, Any]]
    mig: bool = False  # asked of MIG devices too (else of GPUs only)


QUERIES = (
    Query("nvmlDeviceGetUtilizationRates", _utilization),
    Query("nvmlDeviceGetMemoryInfo_v2", _memory, mig=True),
    Query("nvmlDeviceGetTemperature", _temperature),
    Query("nvmlDeviceGetPowerUsage", _power_usage),
    Query("nvmlDeviceGetEnforcedPowerLimit", _power_limit),
    Query("nvmlDeviceGetClockInfo(SM)", _sm_clock),
    Query("nvmlDeviceGetClockInfo(MEM)", _memory_clock),
    Query("nvmlDeviceGetFieldValues(MEMORY_TEMP)", _memory_temperature),
    Query("nvmlDeviceGetTotalEnergyConsumption", _energy),
    Query("nvmlDeviceGetEncoderUtilization", _encoder),
    Query("nvmlDeviceGetDecoderUtilization", _decoder),
    Query("nvmlDeviceGetPcieReplayCounter", _pcie_replays),
    Query("nvmlDeviceGetRemappedRows", _remapped_rows),
    Query("nvmlDeviceGetCurrentClocksEventReasons", _clock_event_reasons),
    Query(
        "nvmlDeviceGetTotalEccErrors(corrected)",
        _ecc("ecc_corrected_errors", pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED),
    ),
    Query(
        "nvmlDeviceGetTotalEccErrors(uncorrected)",
        _ecc("ecc_uncorrected_errors", pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED),
    ),
)

_UNSUPPORTED = (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound)


class NvmlReader:
    """Reads telemetry from NVML; a ``telemetry.Read``. Call ``close()`` when done."""

    def __init__(self, queries: Sequence[Query] = QUERIES) -> None:
        self._queries = tuple(queries)
        self._initialised = False
        self._init_error: str | None = None
        self._handles: dict[str, Any] = {}
        self._unsupported: set[tuple[str, str]] = set()  # (uuid, query name)
        self._failing: dict[str, str] = {}  # uuid -> the error logged for it

    def __call__(self, targets: Sequence[TelemetryTarget]) -> dict[str, Reading]:
        return self.read(targets)

    def read(self, targets: Sequence[TelemetryTarget]) -> dict[str, Reading]:
        """One round of queries for every target: UUID -> Reading. Devices that cannot be read
        now are left out; nothing is raised."""
        if not self._init():
            return {}
        readings: dict[str, Reading] = {}
        for target in targets:
            reading = self._read_device(target)
            if reading is not None:
                readings[target.uuid] = reading
        return readings

    def close(self) -> None:
        """Give NVML back (nvmlShutdown); the next read initialises it again."""
        if self._initialised:
            self._initialised = False
            self._handles.clear()
            try:
                pynvml.nvmlShutdown()
            except pynvml.NVMLError as exc:
                log.warning("telemetry: nvmlShutdown failed", extra={"error": str(exc)})

    def _init(self) -> bool:
        if self._initialised:
            return True
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            if self._init_error != str(exc):
                log.warning("telemetry: NVML cannot be initialised", extra={"error": str(exc)})
            self._init_error = str(exc)
            return False
        self._initialised = True
        self._init_error = None
        return True

    def _read_device(self, target: TelemetryTarget) -> Reading | None:
        uuid = target.uuid
        is_mig = target.type == "mig"
        values: dict[str, Any] = {}
        unsupported: list[str] = []
        try:
            handle = self._handles.get(uuid)
            if handle is None:
                handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
                self._handles[uuid] = handle
            for query in self._queries:
                if (uuid, query.name) in self._unsupported or (is_mig and not query.mig):
                    continue
                try:
                    values.update(query.call(handle))
                except _UNSUPPORTED:
                    self._unsupported.add((uuid, query.name))
                    unsupported.append(query.name)
        except pynvml.NVMLError as exc:
            self._handles.pop(uuid, None)
            if isinstance(exc, pynvml.NVMLError_Uninitialized):
                self._initialised = False  # NVML was shut down under us: initialise it again
            if self._failing.get(uuid) != str(exc):
                log.warning(
                    "telemetry: the device cannot be read; its metrics are left out",
                    extra={"device": target.name, "uuid": uuid, "error": str(exc)},
                )
            self._failing[uuid] = str(exc)
            return None
        finally:
            if unsupported:
                log.info(
                    "telemetry: the device does not support these queries; not asked again",
                    extra={"device": target.name, "uuid": uuid, "queries": unsupported},
                )
        if self._failing.pop(uuid, None) is not None:
            log.info("telemetry: the device can be read again", extra={"device": target.name})
        return Reading(**values)


__all__ = ["QUERIES", "NvmlReader", "Query"]
