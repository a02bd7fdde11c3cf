"""The DeviceClasses the chart ships, in one place (nvidia-compat.md "Names").

``gpu-dra explain`` and the demo use them when no ``--classes`` file is given; the chart's tests
check that ``charts/gpu-dra/templates/deviceclasses.yaml`` renders exactly these classes in
resource.k8s.io/v1, ``extendedResourceName`` included: the whole-GPU class answers the extended
resource ``nvidia.com/gpu`` (KEP-5004), as NVIDIA's chart sets it wherever v1 is served.
"""

from __future__ import annotations

from typing import Any, Final

from dra_driver.resourceapi import DEVICE_CLASS, GROUP

DEFAULT_DRIVER_NAME: Final = "gpu.nvidia.com"
GPU_CLASS: Final = "gpu.nvidia.com"
MIG_CLASS: Final = "mig.nvidia.com"
# The chart's deviceClasses.gpuExtendedResourceName default: the device plugin's resource name.
GPU_EXTENDED_RESOURCE_NAME: Final = "nvidia.com/gpu"


def class_expression(driver_name: str, device_type: str) -> str:
    """The CEL selector of a class: devices of ``driver_name`` whose ``type`` attribute matches."""
    return (
        f"device.driver == '{driver_name}' && "
        f"device.attributes['{driver_name}'].type == '{device_type}'"
    )


def gpu_class_name(driver_name: str = DEFAULT_DRIVER_NAME) -> str:
    """The whole-GPU class is named after the driver: ``gpu.nvidia.com``."""
    return driver_name


def mig_class_name(driver_name: str = DEFAULT_DRIVER_NAME) -> str:
    """``gpu.nvidia.com`` -> ``mig.nvidia.com``; another driver name gets a ``mig.`` prefix
    (the chart's ``gpu-dra.migClassName`` helper computes the same)."""
    if driver_name.startswith("gpu."):
        return f"mig.{driver_name.removeprefix('gpu.')}"
    return f"mig.{driver_name}"[:253]


def default_device_classes(
    driver_name: str = DEFAULT_DRIVER_NAME,
    *,
    gpu_extended_resource_name: str | None = GPU_EXTENDED_RESOURCE_NAME,
) -> list[dict[str, Any]]:
    """The chart's classes as resource.k8s.io/v1 DeviceClass objects: the whole-GPU class with
    ``extendedResourceName: gpu_extended_resource_name`` (None or empty: without, as the chart
    renders them with the value turned off)."""
    classes = []
    for name, kind in ((gpu_class_name(driver_name), "gpu"), (mig_class_name(driver_name), "mig")):
        spec: dict[str, Any] = {
            "selectors": [{"cel": {"expression": class_expression(driver_name, kind)}}]
        }
        if kind == "gpu" and gpu_extended_resource_name:
            spec["extendedResourceName"] = gpu_extended_resource_name
        classes.append(
            {
                "apiVersion": f"{GROUP}/v1",
                "kind": DEVICE_CLASS,
                "metadata": {"name": name},
                "spec": spec,
            }
        )
    return classes
