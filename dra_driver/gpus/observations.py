"""What the NVML health watch reports: plain values, no NVML types, no I/O.

Place in the flow: between the NVML boundary and the health wing. gpus/healthwatch.py reports
NVML events and periodic checks as these observations (:class:`XidObserved`,
:class:`EccObserved`, :class:`GpuChecked`); health/decisions.py turns them into taints. They
live here, below both, so that the boundary never imports the wing it serves (telemetry's values
are in gpus/telemetryvalues.py, on the same terms).

They are NamedTuples rather than frozen dataclasses: each dataclass costs the
agent about 11 KiB of memory at import, a NamedTuple 6, and the agent's RSS target has no room
for the difference (bench_publish).
"""

from __future__ import annotations

from typing import NamedTuple

NO_INSTANCE = 0xFFFFFFFF
"""NVML's GPU/compute-instance id in an event that no MIG instance caused."""


class XidObserved(NamedTuple):
    """An ``nvmlEventTypeXidCriticalError`` event."""

    gpu_uuid: str
    xid: int
    gpu_instance_id: int = NO_INSTANCE
    compute_instance_id: int = NO_INSTANCE


class EccObserved(NamedTuple):
    """An ``nvmlEventTypeDoubleBitEccError`` event."""

    gpu_uuid: str


class GpuChecked(NamedTuple):
    """One periodic check of a GPU. None: NVML cannot tell (not supported on this GPU)."""

    gpu_uuid: str
    lost: bool = False
    lost_reason: str = ""
    ecc_uncorrected: int | None = None  # volatile count: since the last reset
    retired_pages_pending: bool | None = None
    remapped_rows_pending: bool | None = None
    row_remap_failed: bool | None = None
    temperature_c: int | None = None
    slowdown_c: int | None = None


Observation = XidObserved | EccObserved | GpuChecked
