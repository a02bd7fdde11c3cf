"""What a batch answers for one claim: its devices, or its error and the kind of error.

Flow position: the preparer's batches -> here -> plugin/dra.py (the kubelet's answer) and the
error metrics (``error_type``, a short fixed label).
"""

from __future__ import annotations

from dataclasses import dataclass

from dra_driver.errors import (
    CdiError,
    CheckpointError,
    ClaimFetchFailed,
    ClaimNotFound,
    ConfigDecodeError,
    DeviceConflict,
    DraError,
    MigFailed,
    MpsFailed,
    PrepareError,
    ShareEnforcementFailed,
    TimeSliceFailed,
)
from dra_driver.prepare.state.checkpoint import PreparedDevice

# What failed, as a short fixed label (the ``error_type`` of the error metrics); the first
# class that matches wins, so subclasses come before their base.
_ERROR_TYPES: tuple[tuple[type[DraError], str], ...] = (
    (ClaimNotFound, "claim_not_found"),
    (ClaimFetchFailed, "api_error"),
    (DeviceConflict, "device_conflict"),
    (TimeSliceFailed, "timeslice"),
    (ShareEnforcementFailed, "share"),
    (MpsFailed, "mps"),
    (MigFailed, "mig"),
    (ConfigDecodeError, "config"),
    (PrepareError, "invalid_claim"),
    (CdiError, "cdi"),
    (CheckpointError, "checkpoint"),
)
ERROR_TYPES = tuple(label for _, label in _ERROR_TYPES)


def error_type(exc: DraError) -> str:
    """The ``error_type`` of a claim's failure: one of ``ERROR_TYPES``."""
    for cls, label in _ERROR_TYPES:
        if isinstance(exc, cls):
            return label
    raise TypeError(f"no error type for {type(exc).__name__}")  # a new class needs a label


@dataclass(frozen=True)
class Outcome:
    """Result of one claim in a batch: its devices (a prepare's; an unprepare's: those the
    claim held, none when it held nothing), or the error that refused it and what kind of
    error that was (``error_type``, one of ``ERROR_TYPES``)."""

    devices: tuple[PreparedDevice, ...] = ()
    error: str = ""
    error_type: str = ""
