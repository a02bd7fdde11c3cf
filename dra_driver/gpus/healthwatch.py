"""GPU health from NVML: critical events and periodic checks, as plain observations.

Place in the flow: beside discovery (gpus/nvml.py), for the GPUs it found. health/monitor.py
calls :class:`NvmlHealthWatch` from its one thread; what comes out are gpus/observations.py
values, from which health/decisions.py decides the taints. This module is the NVML boundary of
health checking: pynvml's exceptions are handled here and nowhere else. With ``--simulate`` the
same calls reach sim/nvml.py's stand-in.

* Events: one NVML event set; every GPU is registered (on its full-GPU handle; events on MIG
  devices come with their GPU- and compute-instance ids) for critical XIDs and double-bit ECC
  errors. :meth:`NvmlHealthWatch.wait` waits at most the given time
  (``nvmlEventSetWait_v2``; NVML answers TIMEOUT when nothing happened). A GPU that does not
  support events (NOT_SUPPORTED) is logged once and is only polled: its XIDs are not seen.
* Checks (:meth:`NvmlHealthWatch.check`, every ``--health-check-interval`` and right after an
  event): the GPU answers (GPU_IS_LOST means lost), the volatile uncorrected ECC count, retired
  pages pending (before Ampere) or remapped rows pending/failed (Ampere and later), the
  temperature against the slowdown threshold. A query the GPU does not support gives "unknown".
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import pynvml

from dra_driver.errors import HealthWatchError
from dra_driver.gpus.info import GpuInfo
from dra_driver.gpus.observations import EccObserved, GpuChecked, Observation, XidObserved

logger = logging.getLogger(__name__)

EVENT_TYPES = pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeDoubleBitEccError
_UNSUPPORTED = (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound)
T = TypeVar("T")


class _Lost(Exception):
    """A query answered GPU_IS_LOST (or the GPU is no longer found)."""


class WaitResult:
    """What one wait brought: observations, and the GPUs (UUIDs) to check at once."""

    __slots__ = ("check", "check_all", "observations")

    def __init__(self) -> None:
        self.observations: list[Observation] = []
        self.check: set[str] = set()
        self.check_all = False


class NvmlHealthWatch:
    """The event set and the health queries; every method is called from one thread.

    ``open`` before anything else (NVML stays initialised until ``close``); ``register`` GPUs as
    they become known or come back; ``wait`` and ``check`` in a loop.
    """

    def __init__(self) -> None:
        self._event_set: Any = None
        self._registered: dict[str, int] = {}  # UUID -> handle address
        self._by_address: dict[int, str] = {}
        self._polled: set[str] = set()  # UUIDs without event support (logged once each)
        self._opened = False

    def open(self) -> None:
        """Initialise NVML and create the event set; HealthWatchError when NVML fails.

        An event set NVML does not support leaves every GPU to polling.
        """
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise HealthWatchError(f"NVML could not be initialised: {exc}") from exc
        self._opened = True
        try:
            self._event_set = pynvml.nvmlEventSetCreate()
        except _UNSUPPORTED as exc:
            logger.warning(
                "NVML events are not supported here: GPU health is checked by polling only "
                "(XIDs are not seen)",
                extra={"reason": str(exc)},
            )
        except pynvml.NVMLError as exc:
            self.close()
            raise HealthWatchError(f"cannot create an NVML event set: {exc}") from exc

    def close(self) -> None:
        """Free the event set and shut NVML down (once per ``open``). Never raises."""
        if self._event_set is not None:
            try:
                pynvml.nvmlEventSetFree(self._event_set)
            except pynvml.NVMLError as exc:
                logger.debug("nvmlEventSetFree failed: %s", exc)
            self._event_set = None
        self._registered.clear()
        self._by_address.clear()
        if self._opened:
            self._opened = False
            try:
                pynvml.nvmlShutdown()
            except pynvml.NVMLError as exc:
                logger.debug("nvmlShutdown failed: %s", exc)

    @property
    def has_events(self) -> bool:
        """Whether any GPU is registered for events (otherwise waiting is pointless)."""
        return bool(self._registered)

    def is_registered(self, uuid: str) -> bool:
        return uuid in self._registered

    def register(self, gpu: GpuInfo, *, name: str) -> None:
        """Register ``gpu`` for critical XIDs and double-bit ECC errors; never raises.

        A GPU that does not support them is logged once (``name`` says which) and left to
        polling; a GPU that does not answer is left unregistered (its check finds it lost).
        """
        if self._event_set is None or gpu.uuid in self._registered or gpu.uuid in self._polled:
            return
        try:
            handle = pynvml.nvmlDeviceGetHandleByUUID(gpu.uuid)
            try:
                supported = pynvml.nvmlDeviceGetSupportedEventTypes(handle)
            except _UNSUPPORTED:
                supported = EVENT_TYPES  # try anyway: registering tells for sure
            wanted = EVENT_TYPES & supported
            if not wanted & pynvml.nvmlEventTypeXidCriticalError:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
            pynvml.nvmlDeviceRegisterEvents(handle, wanted, self._event_set)
        except _UNSUPPORTED as exc:
            self._polled.add(gpu.uuid)
            logger.warning(
                "%s does not support NVML events: its XIDs are not seen, its health is checked "
                "by polling",
                name,
                extra={"gpu": name, "uuid": gpu.uuid, "reason": str(exc)},
            )
            return
        except pynvml.NVMLError as exc:  # tried again after its next check
            logger.debug(
                "cannot register %s for NVML events now: %s",
                name,
                exc,
                extra={"gpu": name, "uuid": gpu.uuid},
            )
            return
        address = _address(handle)
        self._registered[gpu.uuid] = address
        self._by_address[address] = gpu.uuid

    def forget(self, uuid: str) -> None:
        """``uuid`` is lost: register it again when it answers."""
        address = self._registered.pop(uuid, None)
        if address is not None:
            self._by_address.pop(address, None)

    def wait(self, timeout_s: float) -> WaitResult:
        """Wait up to ``timeout_s`` for one event. Never raises: NVML trouble asks for a check
        of every GPU (a GPU fell off the bus, or the event set broke)."""
        result = WaitResult()
        if self._event_set is None:
            return result
        try:
            data = pynvml.nvmlEventSetWait_v2(self._event_set, max(0, int(timeout_s * 1000)))
        except pynvml.NVMLError_Timeout:
            return result
        except pynvml.NVMLError as exc:
            logger.info("waiting for NVML events failed: %s; checking every GPU", exc)
            result.check_all = True
            return result
        uuid = self._by_address.get(_address(data.device))
        if uuid is None:
            try:
                uuid = _text(pynvml.nvmlDeviceGetUUID(data.device))
            except pynvml.NVMLError:
                result.check_all = True  # we cannot tell whose event it was
                return result
        if data.eventType & pynvml.nvmlEventTypeXidCriticalError:
            result.observations.append(
                XidObserved(
                    uuid,
                    int(data.eventData),
                    gpu_instance_id=int(data.gpuInstanceId),
                    compute_instance_id=int(data.computeInstanceId),
                )
            )
        elif data.eventType & pynvml.nvmlEventTypeDoubleBitEccError:
            result.observations.append(EccObserved(uuid))
        result.check.add(uuid)
        return result

    def check(self, gpu: GpuInfo) -> GpuChecked:
        """Ask NVML about one GPU's health. A lost GPU is an answer (so is any other failure to
        find it); only NVML no longer being initialised raises HealthWatchError."""
        try:
            handle = _ask(pynvml.nvmlDeviceGetHandleByUUID, gpu.uuid, required=True)
            ecc = _ask(
                pynvml.nvmlDeviceGetTotalEccErrors,
                handle,
                pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                pynvml.NVML_VOLATILE_ECC,
            )
            pages = _ask(pynvml.nvmlDeviceGetRetiredPagesPendingStatus, handle)
            rows = _ask(pynvml.nvmlDeviceGetRemappedRows, handle)
            temperature = _temperature(handle)
            slowdown = _ask(
                pynvml.nvmlDeviceGetTemperatureThreshold,
                handle,
                pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN,
            )
        except _Lost as exc:
            return GpuChecked(gpu_uuid=gpu.uuid, lost=True, lost_reason=str(exc))
        return GpuChecked(
            gpu_uuid=gpu.uuid,
            ecc_uncorrected=None if ecc is None else int(ecc),
            retired_pages_pending=None if pages is None else bool(pages),
            remapped_rows_pending=None if rows is None else bool(rows[2]),
            row_remap_failed=None if rows is None else bool(rows[3]),
            temperature_c=temperature,
            slowdown_c=None if slowdown is None else int(slowdown),
        )


def _ask(fn: Callable[..., T], *args: Any, required: bool = False) -> T | None:
    """One query: its answer; None when the GPU cannot tell (not supported, or an error that
    says nothing about the GPU being there). Raises _Lost when the GPU is gone."""
    try:
        return fn(*args)
    except pynvml.NVMLError_Uninitialized as exc:
        raise HealthWatchError(f"NVML is no longer initialised: {exc}") from exc
    except pynvml.NVMLError_GpuIsLost as exc:
        raise _Lost(str(exc)) from exc
    except pynvml.NVMLError_NotFound as exc:
        if required:
            raise _Lost(f"{exc} (NVML no longer finds the GPU)") from exc
        return None
    except pynvml.NVMLError as exc:
        if required:
            raise _Lost(str(exc)) from exc
        if not isinstance(exc, _UNSUPPORTED):
            logger.debug("%s failed: %s", getattr(fn, "__name__", fn), exc)
        return None


def _temperature(handle: Any) -> int | None:
    """The GPU temperature; the versioned query first, the older one where it is missing."""
    try:
        return int(pynvml.nvmlDeviceGetTemperatureV(handle, pynvml.NVML_TEMPERATURE_GPU))
    except pynvml.NVMLError_FunctionNotFound:
        pass
    except pynvml.NVMLError_GpuIsLost as exc:
        raise _Lost(str(exc)) from exc
    except pynvml.NVMLError:
        return None
    value = _ask(pynvml.nvmlDeviceGetTemperature, handle, pynvml.NVML_TEMPERATURE_GPU)
    return None if value is None else int(value)


def _address(handle: Any) -> int:
    return ctypes.cast(handle, ctypes.c_void_p).value or 0


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
