"""classes.py: the DeviceClasses the chart ships (explain and the demo use them without a
``--classes`` file): names, selectors that pick this driver's whole GPUs or MIG devices, and the
whole-GPU class's extended resource. The chart's tests (test_chart_classes.py, with helm) check
that the chart renders the same classes."""

from __future__ import annotations

from typing import Any

import pytest

from dra_driver.devices.classes import (
    class_expression,
    default_device_classes,
    gpu_class_name,
    mig_class_name,
)
from dra_driver.scheduling.cel import compile_selector, device_variable


def test_the_default_classes_are_the_charts() -> None:
    def expression(kind: str) -> str:
        return (
            "device.driver == 'gpu.nvidia.com' && "
            f"device.attributes['gpu.nvidia.com'].type == '{kind}'"
        )

    assert default_device_classes() == [
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceClass",
            "metadata": {"name": "gpu.nvidia.com"},
            "spec": {
                "selectors": [{"cel": {"expression": expression("gpu")}}],
                "extendedResourceName": "nvidia.com/gpu",
            },
        },
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceClass",
            "metadata": {"name": "mig.nvidia.com"},
            "spec": {"selectors": [{"cel": {"expression": expression("mig")}}]},
        },
    ]


@pytest.mark.parametrize("off", [None, ""])
def test_without_an_extended_resource_name_no_class_maps_one(off: str | None) -> None:
    classes = default_device_classes(gpu_extended_resource_name=off)
    assert [c["metadata"]["name"] for c in classes] == ["gpu.nvidia.com", "mig.nvidia.com"]
    assert all("extendedResourceName" not in c["spec"] for c in classes)


def test_another_driver_name_names_the_classes_and_their_selectors() -> None:
    classes = default_device_classes(
        "gpu.example.com", gpu_extended_resource_name="example.com/gpu"
    )
    assert [c["metadata"]["name"] for c in classes] == ["gpu.example.com", "mig.example.com"]
    assert classes[0]["spec"]["extendedResourceName"] == "example.com/gpu"
    assert [c["spec"]["selectors"] for c in classes] == [
        [{"cel": {"expression": class_expression("gpu.example.com", "gpu")}}],
        [{"cel": {"expression": class_expression("gpu.example.com", "mig")}}],
    ]


@pytest.mark.parametrize(
    ("driver", "gpu_class", "mig_class"),
    [
        ("gpu.nvidia.com", "gpu.nvidia.com", "mig.nvidia.com"),
        ("gpu.example.com", "gpu.example.com", "mig.example.com"),
        ("accel.example.com", "accel.example.com", "mig.accel.example.com"),
        ("example.gpu.com", "example.gpu.com", "mig.example.gpu.com"),
    ],
)
def test_class_names_follow_the_driver_name(driver: str, gpu_class: str, mig_class: str) -> None:
    assert (gpu_class_name(driver), mig_class_name(driver)) == (gpu_class, mig_class)


def test_defaults_name_the_nvidia_classes() -> None:
    assert (gpu_class_name(), mig_class_name()) == ("gpu.nvidia.com", "mig.nvidia.com")


def test_a_mig_class_name_is_cut_to_the_longest_name_the_api_takes() -> None:
    driver = "a" * 60 + "." + "b" * 60 + "." + "c" * 60 + "." + "d" * 70  # 253 characters
    name = mig_class_name(driver)
    assert len(driver) == 253
    assert name == f"mig.{driver}"[:253]
    assert len(name) == 253 and name.startswith("mig.aaa")


def _device(driver: str, kind: str) -> Any:
    return device_variable(driver=driver, attributes={f"{driver}/type": kind}, capacity={})


@pytest.mark.parametrize("driver", ["gpu.nvidia.com", "gpu.example.com"])
def test_each_class_selects_only_its_kind_of_device_of_its_driver(driver: str) -> None:
    gpu = compile_selector(class_expression(driver, "gpu"))
    mig = compile_selector(class_expression(driver, "mig"))
    assert gpu.matches(_device(driver, "gpu"))
    assert not gpu.matches(_device(driver, "mig"))
    assert mig.matches(_device(driver, "mig"))
    assert not mig.matches(_device(driver, "gpu"))
    assert not gpu.matches(_device("other.example.com", "gpu"))
