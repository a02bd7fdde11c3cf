"""The DeviceClasses the chart ships, in one place (nvidia-compat.md "Names").

``gpu-dra explain`` uses them when no ``--classes`` file is given; the chart's tests check that
``charts/gpu-dra/templates/deviceclasses.yaml`` renders exactly these selectors.
"""

from __future__ import annotations

from typing import Any, Final

DEFAULT_DRIVER_NAME: Final = "gpu.nvidia.com"
GPU_CLASS: Final = "gpu.nvidia.com"
MIG_CLASS: Final = "mig.nvidia.com"


def class_expression(driver_name: str, device_type: str) -> str:
    """The CEL selector of a class: devices of ``driver_name`` whose ``type`` attribute matches."""
    return (
        f"device.driver == '{driver_name}' && "
        f"device.attributes['{driver_name}'].type == '{device_type}'"
    )


def default_device_classes(driver_name: str = DEFAULT_DRIVER_NAME) -> list[dict[str, Any]]:
    """The chart's classes as resource.k8s.io/v1 DeviceClass objects."""
    return [
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceClass",
            "metadata": {"name": name},
            "spec": {"selectors": [{"cel": {"expression": class_expression(driver_name, kind)}}]},
        }
        for name, kind in ((GPU_CLASS, "gpu"), (MIG_CLASS, "mig"))
    ]
