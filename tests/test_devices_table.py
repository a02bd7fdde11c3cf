"""The device table shows what the stored ResourceSlices say, in both API shapes."""

from __future__ import annotations

from typing import Any

import pytest

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


def test_attributes_and_memory_qualified_with_the_driver_name_are_found() -> None:
    # An attribute or capacity may be written with the driver's domain (the API accepts both).
    device = {
        "name": "gpu-0",
        "attributes": {
            "gpu.nvidia.com/type": {"string": "gpu"},
            "gpu.nvidia.com/productName": {"string": "NVIDIA L4"},
            "gpu.nvidia.com/profile": {"string": "full"},
            "example.com/type": {"string": "not ours"},
        },
        "capacity": {"gpu.nvidia.com/memory": {"value": "24Gi"}},
    }
    assert device_rows([_slice("s", [device])]) == [
        ("gpu-0", "gpu", "NVIDIA L4", "24.0 GiB", "full", "s")
    ]


def test_an_attribute_of_another_driver_is_not_shown() -> None:
    device = {"name": "gpu-0", "attributes": {"example.com/type": {"string": "gpu"}}}
    assert device_rows([_slice("s", [device])])[0][1] == "-"


def test_every_attribute_type_shows_its_value_and_an_unknown_one_a_dash() -> None:
    device = {
        "name": "gpu-0",
        "attributes": {
            "type": {"bool": True},
            "productName": {"int": 7},
            "profile": {"version": "1.2.3"},
        },
    }
    other = {"name": "gpu-1", "attributes": {"type": {"float": 1.5}, "profile": "bare"}}
    assert device_rows([_slice("s", [device, other])]) == [
        ("gpu-0", "True", "7", "-", "1.2.3", "s"),
        ("gpu-1", "-", "-", "-", "-", "s"),
    ]


def test_memory_that_is_missing_bare_or_no_quantity_is_shown_as_it_is() -> None:
    devices: list[dict[str, Any]] = [
        {"name": "none"},
        {"name": "no-value", "capacity": {"memory": {}}},
        {"name": "bare", "capacity": {"memory": "80Gi"}},
        {"name": "bad", "capacity": {"memory": {"value": "lots"}}},
        {"name": "half", "capacity": {"memory": {"value": "512Mi"}}},
    ]
    assert [r[3] for r in device_rows([_slice("s", devices)])] == ["-", "-", "-", "lots", "0.5 GiB"]


def test_slices_and_devices_without_names_or_specs_still_make_rows() -> None:
    unnamed = {"spec": {"driver": "gpu.nvidia.com", "devices": [{"attributes": {}}]}}
    rows = device_rows([_slice("0-slice", [{"name": "gpu-1"}]), {"metadata": {}}, unnamed])
    # a slice without a name sorts first (as the empty name) and shows as "-"
    assert rows == [
        ("-", "-", "-", "-", "-", "-"),
        ("gpu-1", "-", "-", "-", "-", "0-slice"),
    ]


def test_render_widens_a_column_to_its_longest_value_without_trailing_blanks() -> None:
    text = render(
        [
            ("gpu-1-mig-1g10gb-19-0", "mig", "-", "9.6 GiB", "1g.10gb", "s"),
            ("gpu-0", "gpu", "NVIDIA H100 80GB HBM3", "79.6 GiB", "-", "a-longer-slice"),
        ]
    )
    assert text.splitlines() == [
        "DEVICE                 TYPE  PRODUCT                MEMORY    PROFILE  SLICE",
        "gpu-1-mig-1g10gb-19-0  mig   -                      9.6 GiB   1g.10gb  s",
        "gpu-0                  gpu   NVIDIA H100 80GB HBM3  79.6 GiB  -        a-longer-slice",
    ]


def test_render_refuses_a_row_with_more_values_than_columns() -> None:
    with pytest.raises(ValueError, match="zip"):
        render([("gpu-0", "gpu", "L4", "22.5 GiB", "-", "s1", "extra")])
