"""The device table shows what the stored ResourceSlices say, in both API shapes."""

from __future__ import annotations

from typing import Any

from dra_driver.devices.table import device_rows, render


def _slice(name: str, devices: list[dict[str, Any]]) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {"driver": "gpu.nvidia.com", "devices": devices}}


def test_rows_come_from_v1_and_v1beta1_devices_in_slice_name_order() -> None:
    gpu = {
        "name": "gpu-0",
        "attributes": {
            "type": {"string": "gpu"},
            "productName": {"string": "NVIDIA H100 80GB HBM3"},
        },
        "capacity": {"memory": {"value": "81559Mi"}},
    }
    mig = {
        "name": "gpu-1-mig-1g10gb-19-0",
        "basic": {
            "attributes": {"type": {"string": "mig"}, "profile": {"string": "1g.10gb"}},
            "capacity": {"memory": {"value": "9856Mi"}},
        },
    }
    rows = device_rows([_slice("b-slice", [mig]), _slice("a-slice", [gpu])])
    assert rows == [
        ("gpu-0", "gpu", "NVIDIA H100 80GB HBM3", "79.6 GiB", "-", "a-slice"),
        ("gpu-1-mig-1g10gb-19-0", "mig", "-", "9.6 GiB", "1g.10gb", "b-slice"),
    ]


def test_render_aligns_columns_under_the_header() -> None:
    text = render([("gpu-0", "gpu", "L4", "22.5 GiB", "-", "s1")])
    header, row = text.splitlines()
    assert header.split() == ["DEVICE", "TYPE", "PRODUCT", "MEMORY", "PROFILE", "SLICE"]
    assert row.split() == ["gpu-0", "gpu", "L4", "22.5", "GiB", "-", "s1"]
    assert header.index("TYPE") == row.index("gpu ")


def test_an_empty_pool_renders_only_the_header() -> None:
    assert render(device_rows([_slice("s", [])])).split() == [
        "DEVICE",
        "TYPE",
        "PRODUCT",
        "MEMORY",
        "PROFILE",
        "SLICE",
    ]
