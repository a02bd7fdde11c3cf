"""``gpu-dra explain`` on devices with binding conditions (KEP-5007, ``DRADeviceBindingConditions``:
beta and on by default from Kubernetes 1.36, off in 1.34 and 1.35), which other drivers publish
beside ours, and the WHY NOT table of a pool with a duplicated device name.

What the structured allocator does (``k8s.io/dynamic-resource-allocation/structured``,
``GatherPools`` and ``isSelectable``): with the feature on, pools holding a device with
``bindingConditions`` are tried after every other pool (and such slices after the others of their
pool), a result carries the device's ``bindingConditions`` / ``bindingFailureConditions``, and a
device with ``bindsToNode`` pins the allocation to the node; with it off, such devices are never
selected.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import yaml

from dra_driver.cli import explain_main as main
from dra_driver.devices.classes import default_device_classes

NODE = "node1"
GPU_DRIVER = "gpu.nvidia.com"
# sorts before gpu.nvidia.com: in plain (driver, pool) order its pool would be tried first
FABRIC = "attach.example.com"
ANY_CLASS = {
    "apiVersion": "resource.k8s.io/v1",
    "kind": "DeviceClass",
    "metadata": {"name": "any-accelerator"},
    "spec": {"selectors": [{"cel": {"expression": "device.attributes['type'].kind == 'gpu'"}}]},
}


def device(name: str, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "attributes": {"type": {"string": "gpu"}},
        "capacity": {"memory": {"value": "80Gi"}},
        **extra,
    }


def attached(name: str, **extra: Any) -> dict[str, Any]:
    """A device of the fabric driver that is attached to the node only after allocation."""
    return device(
        name,
        bindingConditions=["dra.example.com/attached"],
        bindingFailureConditions=["dra.example.com/attach-failed"],
        **extra,
    )


def slice_(
    driver: str, devices: list[dict[str, Any]], *, name: str, pool: str = NODE, **spec: Any
) -> dict[str, Any]:
    where = spec or {"nodeName": NODE}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {
            "driver": driver,
            "pool": {"name": pool, "generation": 1, "resourceSliceCount": 1},
            **where,
            "devices": devices,
        },
    }


def claim(name: str = "c", cls: str = "any-accelerator", count: int = 1) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}"},
        "spec": {
            "devices": {
                "requests": [{"name": "acc", "exactly": {"deviceClassName": cls, "count": count}}]
            }
        },
    }


def held(name: str, driver: str, pool: str, *devices: str) -> dict[str, Any]:
    obj = claim(name)
    obj["status"] = {
        "allocation": {
            "devices": {
                "results": [
                    {"request": "acc", "driver": driver, "pool": pool, "device": d} for d in devices
                ]
            }
        }
    }
    return obj


def explain(
    tmp_path: Path,
    slices: list[dict[str, Any]],
    *,
    the_claim: dict[str, Any] | None = None,
    allocated: list[dict[str, Any]] = (),  # type: ignore[assignment]
    args: tuple[str, ...] = (),
    output: str = "table",
) -> tuple[int, str]:
    files = {
        "claim.yaml": [the_claim or claim()],
        "slices.yaml": slices,
        "classes.yaml": [*default_device_classes(GPU_DRIVER), ANY_CLASS],
        "allocated.yaml": list(allocated),
    }
    for file, docs in files.items():
        (tmp_path / file).write_text(yaml.safe_dump_all(docs))
    argv = [
        str(tmp_path / "claim.yaml"),
        "--slices",
        str(tmp_path / "slices.yaml"),
        "--classes",
        str(tmp_path / "classes.yaml"),
        "--allocated",
        str(tmp_path / "allocated.yaml"),
        "-o",
        output,
        *args,
    ]
    out, err = io.StringIO(), io.StringIO()
    code = main(argv, stdout=out, stderr=err)
    assert code in (0, 1), err.getvalue()
    return code, out.getvalue()


# --- the WHY NOT table -------------------------------------------------------------------------


def test_a_duplicated_device_name_shows_its_node_not_a_count(tmp_path: Path) -> None:
    twice = slice_(GPU_DRIVER, [device("gpu-0"), device("gpu-0")], name="s1")
    code, out = explain(tmp_path, [twice], the_claim=claim(cls=GPU_DRIVER))

    assert code == 1
    assert "device name gpu-0 is not unique in the pool" in out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith("gpu-0 ")]
    assert rows and all(row[1] == NODE for row in rows), out
