"""``gpu-dra explain`` on devices with binding conditions (KEP-5007, ``DRADeviceBindingConditions``:
beta and on by default from Kubernetes 1.36, off in 1.34 and 1.35), which other drivers publish
beside ours, and the WHY NOT table of a pool with a duplicated device name.

What the structured allocator does (``k8s.io/dynamic-resource-allocation/structured``,
``GatherPools`` and ``isSelectable``): with the feature on, pools holding a device with
``bindingConditions`` are tried after every other pool (within a pool, slices stay in name
order: the oracle tier, tests/test_oracle_allocator.py, showed the scheduler does not move them),
a result carries the device's ``bindingConditions`` / ``bindingFailureConditions``, and a
device with ``bindsToNode`` pins the allocation to the node; with it off, such devices are never
selected.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
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
    "spec": {},  # every device of every driver
}


def device(name: str, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "attributes": {"type": {"string": "gpu"}, "bus": {"string": "pci"}},
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


# --- binding conditions ------------------------------------------------------------------------


def gpus(*names: str) -> dict[str, Any]:
    return slice_(GPU_DRIVER, [device(n) for n in names], name="gpus")


def fabric(*devices: dict[str, Any], name: str = "fabric", **spec: Any) -> dict[str, Any]:
    return slice_(FABRIC, list(devices), name=name, pool="fabric-pool", **spec)


def results(out: str) -> list[dict[str, Any]]:
    doc = json.loads(out)
    if doc["allocation"] is None:
        return []
    (claim_out,) = doc["allocation"]["claims"]
    return list(claim_out["allocation"]["devices"]["results"])


def picked(out: str) -> list[str]:
    return [f"{r['driver']}/{r['device']}" for r in results(out)]


def test_without_binding_conditions_the_other_drivers_pool_comes_first(tmp_path: Path) -> None:
    # the control: plain (driver, pool) order, attach.example.com before gpu.nvidia.com
    code, out = explain(tmp_path, [gpus("gpu-0"), fabric(device("nic-0"))], output="json")
    assert code == 0
    assert picked(out) == [f"{FABRIC}/nic-0"]


@pytest.mark.parametrize("version", ["1.36", "1.37"])
def test_an_idle_node_gives_the_device_without_binding_conditions(
    tmp_path: Path, version: str
) -> None:
    slices = [gpus("gpu-0"), fabric(attached("nic-0"))]
    code, out = explain(tmp_path, slices, args=("--k8s-version", version), output="json")

    assert code == 0
    assert picked(out) == [f"{GPU_DRIVER}/gpu-0"]
    (result,) = results(out)
    assert "bindingConditions" not in result and "bindingFailureConditions" not in result
    assert any("tried after all other pools" in n for n in json.loads(out)["notes"])


@pytest.mark.parametrize("version", ["1.36", "1.37"])
def test_a_busy_node_gives_the_device_with_binding_conditions_and_carries_them(
    tmp_path: Path, version: str
) -> None:
    slices = [gpus("gpu-0"), fabric(attached("nic-0"))]
    busy = [held("train", GPU_DRIVER, NODE, "gpu-0")]
    args = ("--k8s-version", version)

    code, out = explain(tmp_path, slices, allocated=busy, args=args, output="json")
    assert code == 0
    (result,) = results(out)
    assert result["device"] == "nic-0" and result["driver"] == FABRIC
    assert result["bindingConditions"] == ["dra.example.com/attached"]
    assert result["bindingFailureConditions"] == ["dra.example.com/attach-failed"]

    code, table = explain(tmp_path, slices, allocated=busy, args=args)
    assert code == 0
    (row,) = [line for line in table.splitlines() if "nic-0" in line]
    assert "bindingConditions dra.example.com/attached" in row
    assert "bindingFailureConditions dra.example.com/attach-failed" in row


def test_two_devices_take_the_plain_one_first_then_the_one_with_binding_conditions(
    tmp_path: Path,
) -> None:
    slices = [fabric(attached("nic-0")), gpus("gpu-0", "gpu-1")]
    code, out = explain(tmp_path, slices, the_claim=claim(count=3), output="json")
    assert code == 0
    assert picked(out) == [f"{GPU_DRIVER}/gpu-0", f"{GPU_DRIVER}/gpu-1", f"{FABRIC}/nic-0"]
    assert [bool(r.get("bindingConditions")) for r in results(out)] == [False, False, True]


def test_within_a_pool_slices_stay_in_name_order_with_binding_conditions(tmp_path: Path) -> None:
    # slice "a-..." sorts first by name; its device has binding conditions. The scheduler's
    # buildPool sorts a pool's slices by name only: the device is taken first.
    slices = [fabric(device("nic-1"), name="b-plain"), fabric(attached("nic-0"), name="a-attached")]
    for s in slices:
        s["spec"]["pool"]["resourceSliceCount"] = 2
    code, out = explain(tmp_path, slices, output="json")
    assert code == 0
    assert picked(out) == [f"{FABRIC}/nic-0"]
    code, out = explain(tmp_path, slices, the_claim=claim(count=2), output="json")
    assert picked(out) == [f"{FABRIC}/nic-0", f"{FABRIC}/nic-1"]


@pytest.mark.parametrize("version", ["1.34", "1.35"])
def test_with_the_feature_off_such_devices_are_never_selected(tmp_path: Path, version: str) -> None:
    slices = [gpus("gpu-0"), fabric(attached("nic-0"), device("nic-1"))]
    args = ("--k8s-version", version)

    # idle: the plain order (the other driver's pool first), its plain device
    code, out = explain(tmp_path, slices, args=args, output="json")
    assert code == 0
    assert picked(out) == [f"{FABRIC}/nic-1"]

    # busy: nic-0 is left, and not selectable
    busy = [held("train", GPU_DRIVER, NODE, "gpu-0"), held("web", FABRIC, "fabric-pool", "nic-1")]
    code, table = explain(tmp_path, slices, allocated=busy, args=args)
    assert code == 1
    (row,) = [line for line in table.splitlines() if "nic-0" in line and "WHY" not in line]
    assert "has bindingConditions (dra.example.com/attached): not selectable" in row
    assert f"DRADeviceBindingConditions is off by default in Kubernetes {version}" in table
    # the same inputs with the feature on (1.36 default) give nic-0
    code, out = explain(tmp_path, slices, allocated=busy, output="json")
    assert code == 0 and picked(out) == [f"{FABRIC}/nic-0"]


def test_an_unselectable_device_is_skipped_before_its_selectors_run(tmp_path: Path) -> None:
    # nic-0 lacks the "bus" attribute: evaluating the selector on it is a CEL runtime error
    nic = attached("nic-0")
    del nic["attributes"]["bus"]
    slices = [gpus("gpu-0"), fabric(nic)]
    the_claim = claim()
    the_claim["spec"]["devices"]["requests"][0]["exactly"]["selectors"] = [
        {"cel": {"expression": "device.attributes[device.driver].bus == 'pci'"}}
    ]
    busy = [held("train", GPU_DRIVER, NODE, "gpu-0")]

    code, out = explain(
        tmp_path, slices, the_claim=the_claim, allocated=busy, args=("--k8s-version", "1.35")
    )
    assert code == 1 and "CEL runtime error" not in out
    code, out = explain(tmp_path, slices, the_claim=the_claim, allocated=busy)
    assert code == 1 and "CEL runtime error" in out and "nic-0" in out


@pytest.mark.parametrize(("binds", "pinned"), [(True, True), (False, False)])
def test_binds_to_node_pins_the_allocation_to_the_node(
    tmp_path: Path, binds: bool, pinned: bool
) -> None:
    nic = attached("nic-0", **({"bindsToNode": True} if binds else {}))
    slices = [gpus("gpu-0"), fabric(nic, allNodes=True)]
    busy = [held("train", GPU_DRIVER, NODE, "gpu-0")]

    code, out = explain(tmp_path, slices, allocated=busy, output="json")
    assert code == 0
    (claim_out,) = json.loads(out)["allocation"]["claims"]
    expected = {
        "nodeSelectorTerms": [
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [NODE]}]}
        ]
    }
    assert claim_out["allocation"].get("nodeSelector") == (expected if pinned else None)
