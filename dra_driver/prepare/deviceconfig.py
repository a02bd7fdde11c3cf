"""Opaque device configuration of our driver (``resource.nvidia.com/v1beta1``). Pure.

Claims and DeviceClasses carry ``opaque: {driver: gpu.nvidia.com, parameters: {...}}``; the
scheduler copies them into ``status.allocation.devices.config``. prepare/ picks the entries
that apply to a device (class configs first, then claim configs, later wins) and this module
decodes them strictly, with the same kinds and field names as NVIDIA's driver
(nvidia-compat.md "Opaque configuration"): an unknown kind or field is an error for that claim,
never silently ignored, and a GpuConfig on a MIG device (or the reverse) is refused.

Decoding is complete, so a mistake anywhere in a config is reported precisely; carrying a config
out is a separate question (``check_supported``): a config that asks for what the agent does not
do is refused for that claim, never accepted and ignored, except where NVIDIA's driver accepts
it the same way: time slicing of a MIG device, which has no effect on one. Time slicing of a
full GPU and MPS (full GPU or MIG device) are carried out by prepare/.

``driverCapabilities`` is an extension of ours (NVIDIA's driver does not know the field): the
NVIDIA container runtime's ``NVIDIA_DRIVER_CAPABILITIES`` names, which select the driver
libraries a claim's CDI spec mounts (``driver_capabilities``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Annotated, Any, Final, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

from dra_driver.cdi import DEFAULT_CAPABILITIES, DRIVER_CAPABILITIES
from dra_driver.errors import ConfigDecodeError, ConfigNotSupported
from dra_driver.quantity import QuantityError, parse_quantity

API_VERSION: Literal["resource.nvidia.com/v1beta1"] = "resource.nvidia.com/v1beta1"
DeviceType = Literal["gpu", "mig"]

# The NVIDIA container runtime's NVIDIA_DRIVER_CAPABILITIES names that a claim may ask for; "all"
# stands for every one of them.
ALL_DRIVER_CAPABILITIES: Final = DRIVER_CAPABILITIES
# What a device gets when no config names any: the container runtime's own default.
DEFAULT_DRIVER_CAPABILITIES: Final = DEFAULT_CAPABILITIES
_ALL: Final = "all"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class TimeSlicingConfig(_Strict):
    interval: Literal["Default", "Short", "Medium", "Long"] = "Default"


def _quantity(value: object) -> str:
    """A Kubernetes quantity as NVIDIA's driver reads it (``resource.Quantity``, which takes a
    JSON string or a JSON number: its UnmarshalJSON parses the number's text as a quantity),
    normalized to the canonical string the API server writes (``1024Mi`` -> ``1Gi``).

    A JSON number arrives here as int or float. A float is read back from its shortest
    round-trip text, which has the value of the JSON text whenever that has at most 15
    significant digits; only the format may then differ from Go's (``1.5e9`` becomes ``1500M``,
    Go writes ``1500e6``).
    """
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ValueError(
            f"a quantity must be a string such as '10Gi' or a number, not {type(value).__name__}"
        )
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{value!r} is not a valid quantity")
    text = value if isinstance(value, str) else repr(value)
    try:
        return parse_quantity(text).canonical()
    except QuantityError as exc:
        raise ValueError(str(exc)) from exc


QuantityText = Annotated[str, BeforeValidator(_quantity)]


class MpsConfig(_Strict):
    """NVIDIA's MpsConfig: the percentage NVIDIA's driver validates (0..100; 0 decodes, and
    ``check_supported`` refuses it), the pinned memory limits, and ``multiUser`` (the control
    daemon runs in multi-user mode, ``-M``; sharing/mps.py refuses it below Volta)."""

    defaultActiveThreadPercentage: Annotated[int, Field(ge=0, le=100)] | None = None  # noqa: N815
    defaultPinnedDeviceMemoryLimit: QuantityText | None = None  # noqa: N815
    defaultPerDevicePinnedMemoryLimit: dict[str, QuantityText] | None = None  # noqa: N815
    multiUser: bool | None = None  # noqa: N815


class GpuSharing(_Strict):
    strategy: Literal["TimeSlicing", "MPS"]
    timeSlicingConfig: TimeSlicingConfig | None = None  # noqa: N815
    mpsConfig: MpsConfig | None = None  # noqa: N815

    @model_validator(mode="after")
    def _config_matches_strategy(self) -> GpuSharing:
        if self.strategy == "TimeSlicing" and self.mpsConfig is not None:
            raise ValueError("mpsConfig cannot be set with strategy TimeSlicing")
        if self.strategy == "MPS" and self.timeSlicingConfig is not None:
            raise ValueError("timeSlicingConfig cannot be set with strategy MPS")
        return self


class MigSharing(_Strict):
    strategy: Literal["TimeSlicing", "MPS"]
    mpsConfig: MpsConfig | None = None  # noqa: N815

    @model_validator(mode="after")
    def _config_matches_strategy(self) -> MigSharing:
        if self.strategy == "TimeSlicing" and self.mpsConfig is not None:
            raise ValueError("mpsConfig cannot be set with strategy TimeSlicing")
        return self


def _check_capabilities(names: list[str]) -> list[str]:
    allowed = (*ALL_DRIVER_CAPABILITIES, _ALL)
    if not names:
        raise ValueError(f"must name at least one capability (allowed: {', '.join(allowed)})")
    seen: set[str] = set()  # one pass: list.count per name was quadratic (issue 37)
    for name in names:
        if name not in allowed:
            raise ValueError(f"unknown driver capability {name!r} (allowed: {', '.join(allowed)})")
        if name in seen:
            raise ValueError(f"driver capability {name!r} is listed more than once")
        seen.add(name)
    return names


DriverCapabilities = Annotated[list[str], AfterValidator(_check_capabilities)]


class GpuConfig(_Strict):
    apiVersion: Literal["resource.nvidia.com/v1beta1"] = API_VERSION  # noqa: N815
    kind: Literal["GpuConfig"] = "GpuConfig"
    sharing: GpuSharing | None = None
    driverCapabilities: DriverCapabilities | None = None  # noqa: N815


class MigDeviceConfig(_Strict):
    apiVersion: Literal["resource.nvidia.com/v1beta1"] = API_VERSION  # noqa: N815
    kind: Literal["MigDeviceConfig"] = "MigDeviceConfig"
    sharing: MigSharing | None = None
    driverCapabilities: DriverCapabilities | None = None  # noqa: N815


DeviceConfig = GpuConfig | MigDeviceConfig
_KINDS: dict[str, type[GpuConfig] | type[MigDeviceConfig]] = {
    "GpuConfig": GpuConfig,
    "MigDeviceConfig": MigDeviceConfig,
}
_KIND_FOR_TYPE: dict[DeviceType, str] = {"gpu": "GpuConfig", "mig": "MigDeviceConfig"}
# How many of a config's problems an error names: the claim's status and the kubelet's event
# carry the message, and a config with thousands of bad entries would otherwise fill them.
_PROBLEMS_SHOWN = 5


def decode(parameters: Any) -> DeviceConfig:
    """Decode one opaque ``parameters`` object; ConfigDecodeError names what is wrong."""
    if not isinstance(parameters, Mapping):
        raise ConfigDecodeError(
            f"opaque parameters must be a JSON object, got {type(parameters).__name__}"
        )
    api_version = parameters.get("apiVersion")
    kind = parameters.get("kind")
    if api_version != API_VERSION:
        raise ConfigDecodeError(
            f"opaque config apiVersion {api_version!r} is not supported (use {API_VERSION!r})"
        )
    model = _KINDS.get(str(kind))
    if model is None:
        raise ConfigDecodeError(
            f"opaque config kind {kind!r} is unknown (known: {', '.join(sorted(_KINDS))})"
        )
    try:
        return model.model_validate(dict(parameters))
    except ValidationError as exc:
        errors = exc.errors()
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}"
            for err in errors[:_PROBLEMS_SHOWN]
        )
        if len(errors) > _PROBLEMS_SHOWN:
            problems += f"; and {len(errors) - _PROBLEMS_SHOWN} more"
        raise ConfigDecodeError(f"invalid {kind}: {problems}") from exc


def default_for(device_type: DeviceType) -> DeviceConfig:
    """The configuration a device gets when no config applies: exclusive, no sharing."""
    return GpuConfig() if device_type == "gpu" else MigDeviceConfig()


def check_fits(config: DeviceConfig, *, device_type: DeviceType, device_name: str) -> None:
    """Refuse a config kind that does not fit the device (GpuConfig on a MIG device)."""
    want = _KIND_FOR_TYPE[device_type]
    if config.kind != want:
        raise ConfigDecodeError(
            f"device {device_name} is a {device_type} device: {config.kind} does not apply "
            f"to it (use {want})"
        )


def check_supported(config: DeviceConfig, *, device_name: str, request: str) -> None:
    """Refuse a valid config that asks for what this agent does not carry out.

    Time slicing of a full GPU (prepare/, timeslice.py) and MPS on a GPU or a MIG device
    (prepare/, mps.py, mpsdaemon.py: whether the agent can run daemons, whether the limits
    fit the devices and whether they can run a multi-user daemon is checked there) are carried
    out; time slicing of a MIG device is accepted with no effect, as NVIDIA's driver accepts it.
    Refused: ``defaultActiveThreadPercentage: 0``.
    """
    sharing = config.sharing
    if sharing is None:
        return
    where = f"the config of request {request} (device {device_name})"
    if sharing.strategy == "MPS":
        if sharing.mpsConfig is not None and sharing.mpsConfig.defaultActiveThreadPercentage == 0:
            # NVIDIA's driver hands 0 to the daemon unchanged; the MPS documentation gives the
            # percentage a default (100) but 0 no meaning, so it is not carried out blind.
            raise ConfigNotSupported(
                f"{where}: mpsConfig.defaultActiveThreadPercentage 0 is refused: NVIDIA's driver "
                "passes 0 to the MPS control daemon (set_default_active_thread_percentage 0), "
                "whose documentation gives 0 no meaning; use 1..100, or leave the field out "
                "for MPS's default (100)"
            )
        return
    # Time slicing of a MIG device: accepted with no effect, as NVIDIA's driver accepts it (a
    # MIG device has no time slice of its own; the time-slice step acts on full GPUs only).


def driver_capabilities(config: DeviceConfig) -> frozenset[str]:
    """The driver capabilities a device's container gets: ``all`` expanded, and
    ``DEFAULT_DRIVER_CAPABILITIES`` when the config does not name any."""
    names = config.driverCapabilities
    if names is None:
        return DEFAULT_DRIVER_CAPABILITIES
    if _ALL in names:
        return frozenset(ALL_DRIVER_CAPABILITIES)
    return frozenset(names)


def to_json(config: DeviceConfig) -> dict[str, Any]:
    """The effective config as JSON for the checkpoint (fields left at default omitted);
    ``decode`` of it gives the same config back."""
    return config.model_dump(mode="json", exclude_none=True)
