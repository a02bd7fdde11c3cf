"""The error hierarchy of the driver. Third-party exceptions are converted at the boundary
that meets them (NVML in gpus/nvml.py, the API in kube/) with ``raise ... from exc``.

    DraError
    ├── ConfigError               a flag or environment variable is invalid (names the flag)
    ├── SimulationSpecError       a --simulate spec cannot be parsed or names an unknown profile
    ├── DiscoveryError            NVML cannot tell us about the GPUs
    │   ├── NvmlLibraryNotFound   libnvidia-ml.so.1 is not under the driver root
    │   ├── NoGpusFound           NVML works but reports zero GPUs
    │   ├── GpuError              one GPU failed (the others are still published)
    │   └── HealthWatchError      NVML cannot be used for health checks now (gpus/healthwatch.py)
    ├── DeviceModelError          a device would break an API validation rule
    ├── KubeError                 an API call failed (carries verb, resource, status)
    │   ├── KubeForbidden         403: names the RBAC verb and resource that is missing
    │   ├── KubeNotFound          404
    │   ├── KubeConflict          409: resourceVersion conflict or already exists
    │   ├── KubeGone              410: watch resourceVersion too old
    │   └── KubeUnavailable       connection refused, timeouts, 5xx: retried with backoff
    ├── PublishError              the desired pool is invalid (duplicate names, bad counters)
    ├── PrepareError              one claim could not be prepared (becomes a per-claim error)
    │   ├── ClaimNotFound         the ResourceClaim is gone (or was re-created with another UID)
    │   ├── ClaimFetchFailed      the ResourceClaim could not be read from the API
    │   ├── DeviceConflict        a device is already prepared for another claim
    │   ├── ConfigDecodeError     an opaque GpuConfig/MigDeviceConfig is invalid (per claim)
    │   │   └── ConfigNotSupported  a valid config asks for what the agent does not do
    │   ├── TimeSliceFailed       nvidia-smi could not set a GPU's time slice (per claim)
    │   ├── MpsFailed             a claim's MPS control daemon could not be started or stopped
    │   ├── ShareEnforcementFailed  a share's MPS daemon could not be started (per claim)
    │   └── MigFailed             a dynamic MIG instance cannot be created or destroyed now
    │       └── ForeignMigInstances  the GPU has MIG instances this driver did not create
    ├── CdiError                  a CDI spec could not be written or removed
    ├── CheckpointError           the checkpoint cannot be read
    │   └── CheckpointCorrupt     truncated, garbage, wrong checksum or unknown version
    ├── ExplainError              bad input to ``gpu-dra explain`` (file and position)
    │   ├── CelCompileError       an expression does not compile (position in the expression)
    │   └── CelRuntimeError       an expression failed on a device (no such key, type mismatch)
    └── MetricsUnavailable        an agent's /metrics cannot be read (``gpu-dra status``)
"""

from __future__ import annotations


class DraError(Exception):
    """Base of every error this package raises on purpose."""


class ConfigError(DraError):
    """A flag or its environment-variable twin has an invalid value."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(f"{flag}: {message}")
        self.flag = flag


class SimulationSpecError(DraError):
    """A --simulate spec is malformed or names an unknown hardware profile."""


class DiscoveryError(DraError):
    """NVML could not tell us about the node's GPUs."""


class NvmlLibraryNotFound(DiscoveryError):
    """The NVML library (libnvidia-ml.so.1) could not be loaded."""


class NoGpusFound(DiscoveryError):
    """NVML initialised but reported no GPU."""


class HealthWatchError(DiscoveryError):
    """NVML as a whole cannot be used for health checks now (init or the event set failed)."""


class GpuError(DiscoveryError):
    """One GPU could not be queried; the others are still usable."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(f"GPU {index}: {message}")
        self.index = index


class DeviceModelError(DraError):
    """A device, attribute or capacity would be rejected by the API's validation."""


class KubeError(DraError):
    """A Kubernetes API call failed."""

    def __init__(
        self, message: str, *, verb: str = "", resource: str = "", status: int = 0
    ) -> None:
        super().__init__(message)
        self.verb = verb
        self.resource = resource
        self.status = status


class KubeForbidden(KubeError):
    """403 Forbidden: the ServiceAccount lacks an RBAC permission."""


class KubeNotFound(KubeError):
    """404 Not Found."""


class KubeConflict(KubeError):
    """409 Conflict: stale resourceVersion, or the object already exists."""


class KubeGone(KubeError):
    """410 Gone: a watch must be restarted with a fresh list."""


class KubeUnavailable(KubeError):
    """The API server could not be reached or answered 5xx/429; retry with backoff."""


class PublishError(DraError):
    """The desired pool breaks a rule the API server or the scheduler relies on."""


class PrepareError(DraError):
    """One claim could not be prepared or unprepared; reported as that claim's error."""


class LimitExceeded(PrepareError):
    """A request or claim carries more than a limit of prepare/limits.py allows."""


class ClaimNotFound(PrepareError):
    """The ResourceClaim does not exist, or exists with another UID (deleted and re-created)."""


class ClaimFetchFailed(PrepareError):
    """The ResourceClaim could not be read from the API server (the KubeError is the cause)."""


class DeviceConflict(PrepareError):
    """A device of the claim is already prepared for another claim (admin access aside).
    ``holders``: the UIDs of the claims holding them."""

    def __init__(self, message: str, *, holders: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.holders = holders


class ConfigDecodeError(PrepareError):
    """An opaque device configuration of our driver is invalid."""


class ConfigNotSupported(ConfigDecodeError):
    """A valid opaque configuration asks for what the agent does not carry out (time slicing of
    a MIG device, where it has no effect; MPS on an agent started without ``--mps-image``);
    refused for that claim rather than accepted and ignored. Same ``error_type`` (``config``)."""


class TimeSliceFailed(PrepareError):
    """``nvidia-smi compute-policy --set-timeslice`` failed, timed out or could not be run for a
    GPU a claim asked a time-slice interval of (timeslice.py); the claim is rolled back."""


class MpsFailed(PrepareError):
    """A claim's MPS control daemon (mpsdaemon.py) could not be started (compute mode, its
    directories or tmpfs, its Deployment, no answer in time, a limit refused) or stopped; a
    failed start is rolled back."""


class MigFailed(PrepareError):
    """A dynamic MIG device's GPU/compute instance could not be created or destroyed, or a GPU
    could not leave or re-enter MIG mode for a whole-GPU claim (NVML refused, the GPU runs
    processes, or holds instances this driver did not create)."""


class ForeignMigInstances(MigFailed):
    """The GPU has MIG instances no claim record names (``devices``): this driver did not create
    them, never destroys them, and prepares no MIG device on that GPU in dynamic mode."""

    def __init__(self, message: str, *, devices: tuple[str, ...]) -> None:
        super().__init__(message)
        self.devices = devices


class CdiError(DraError):
    """A CDI spec could not be written or removed."""


class CheckpointError(DraError):
    """The checkpoint file cannot be used."""


class CheckpointCorrupt(CheckpointError):
    """The checkpoint is truncated, not JSON, has a wrong checksum or an unknown version."""


class ExplainError(DraError):
    """Bad input to ``gpu-dra explain``; the message names the file and position."""


class CelCompileError(ExplainError):
    """A CEL expression does not compile; the message carries the position."""


class CelRuntimeError(ExplainError):
    """A CEL expression failed while evaluated against a device."""


class KubeInvalid(KubeError):
    """422 Unprocessable: the API server's validation rejected the object we sent."""


class MetricsUnavailable(DraError):
    """An agent's metrics endpoint cannot be reached or does not answer Prometheus text."""


class ShareEnforcementFailed(PrepareError):
    """The shared MPS daemon behind a consumable share could not be started (per claim)."""
