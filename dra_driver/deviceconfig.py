"""Opaque device configuration of our driver (``resource.nvidia.com/v1beta1``). Pure.

Claims and DeviceClasses carry ``opaque: {driver: gpu.nvidia.com, parameters: {...}}``; the
scheduler copies them into ``status.allocation.devices.config``. prepare.py picks the entries
that apply to a device (class configs first, then claim configs, later wins) and this module
decodes them strictly, with the same kinds and field names as NVIDIA's driver
(nvidia-compat.md "Opaque configuration"): an unknown kind or field is an error for that claim,
never silently ignored, and a GpuConfig on a MIG device (or the reverse) is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from dra_driver.errors import ConfigDecodeError
from dra_driver.quantity import QuantityError, parse_quantity

API_VERSION: Literal["resource.nvidia.com/v1beta1"] = "resource.nvidia.com/v1beta1"
DeviceType = Literal["gpu", "mig"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class TimeSlicingConfig(_Strict):
    interval: Literal["Default", "Short", "Medium", "Long"] = "Default"


def _check_quantity(value: str) -> str:
    try:
        parse_quantity(value)
    except QuantityError as exc:
        raise ValueError(str(exc)) from exc
    return value


class MpsConfig(_Strict):
    defaultActiveThreadPercentage: Annotated[int, Field(ge=0, le=100)] | None = None  # noqa: N815
    defaultPinnedDeviceMemoryLimit: str | None = None  # noqa: N815
    defaultPerDevicePinnedMemoryLimit: dict[str, str] | None = None  # noqa: N815

    @field_validator("defaultPinnedDeviceMemoryLimit")
    @classmethod
    def _limit_is_quantity(cls, value: str | None) -> str | None:
        return None if value is None else _check_quantity(value)

    @field_validator("defaultPerDevicePinnedMemoryLimit")
    @classmethod
    def _limits_are_quantities(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is not None:
            for limit in value.values():
                _check_quantity(limit)
        return value


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


class GpuConfig(_Strict):
    apiVersion: Literal["resource.nvidia.com/v1beta1"] = API_VERSION  # noqa: N815
    kind: Literal["GpuConfig"] = "GpuConfig"
    sharing: GpuSharing | None = None


class MigDeviceConfig(_Strict):
    apiVersion: Literal["resource.nvidia.com/v1beta1"] = API_VERSION  # noqa: N815
    kind: Literal["MigDeviceConfig"] = "MigDeviceConfig"
    sharing: MigSharing | None = None


DeviceConfig = GpuConfig | MigDeviceConfig
_KINDS: dict[str, type[GpuConfig] | type[MigDeviceConfig]] = {
    "GpuConfig": GpuConfig,
    "MigDeviceConfig": MigDeviceConfig,
}
_KIND_FOR_TYPE: dict[DeviceType, str] = {"gpu": "GpuConfig", "mig": "MigDeviceConfig"}


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
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}"
            for err in exc.errors()
        )
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


def to_json(config: DeviceConfig) -> dict[str, Any]:
    """The effective config as JSON for the checkpoint (fields left at default omitted)."""
    return config.model_dump(mode="json", exclude_none=True)
