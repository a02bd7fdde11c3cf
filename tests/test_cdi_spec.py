"""cdi/spec.py: spec content, the lowest cdiVersion, the encoder and its template cache."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from dra_driver.cdi.driverfiles import DEFAULT_CAPABILITIES, DriverFiles, find_driver_files
from dra_driver.cdi.spec import (
    ClaimDevice,
    ClaimSpecEncoder,
    gpu_nodes,
    mig_nodes,
    minimum_version,
)
from dra_driver.errors import CdiError
from dra_driver.sim.fakedriver import make_fake_driver
from dra_driver.sim.profiles import DRIVER_VERSION
from tests.claimdata import new_uid

UID = "6c0e1d2f-0000-4000-8000-00000000abcd"
VENDOR = "k8s.gpu.nvidia.com"


def files_for(tmp: Path) -> DriverFiles:
    fake = make_fake_driver(tmp)
    return find_driver_files(
        driver_root=fake.root, driver_version=DRIVER_VERSION, proc_root=fake.proc_root
    )


def claim_spec(
    *, vendor: str, claim_uid: str, devices: list[ClaimDevice], files: DriverFiles
) -> dict[str, Any]:
    return ClaimSpecEncoder(vendor=vendor, files=files).spec(claim_uid, devices)


def whole_json(spec: dict[str, Any]) -> bytes:
    """The reference encoding: the whole spec as compact JSON, nothing spliced."""
    return json.dumps(spec, separators=(",", ":")).encode() + b"\n"


def test_spec_uses_the_lowest_version_its_fields_need() -> None:
    files = DriverFiles(dev_root=Path("/"))
    node = (files.node("/dev/nvidia0"),)
    plain = claim_spec(vendor=VENDOR, claim_uid="abcdef00-0000-4000-8000-000000000000",
                           devices=[ClaimDevice("gpu-0", node)], files=files)  # fmt: skip
    assert plain["cdiVersion"] == "0.3.0"
    digit = claim_spec(
        vendor=VENDOR, claim_uid=UID, devices=[ClaimDevice("gpu-0", node)], files=files
    )
    assert digit["cdiVersion"] == "0.5.0"  # a device name starting with a digit needs 0.5.0
    host = DriverFiles(dev_root=Path("/run/nvidia/driver"))
    hosted_device = ClaimDevice("gpu-0", (host.node("/dev/nvidia0"),))
    hosted = claim_spec(
        vendor=VENDOR, claim_uid="abcdef00-0000-4000-8000-000000000000",
        devices=[hosted_device], files=host,
    )  # fmt: skip
    assert hosted["cdiVersion"] == "0.5.0"
    assert hosted["devices"][0]["containerEdits"]["deviceNodes"] == [
        {"path": "/dev/nvidia0", "hostPath": "/run/nvidia/driver/dev/nvidia0"}
    ]
    assert minimum_version({"annotations": {}, "devices": []}) == "0.6.0"


def test_spec_content_is_deterministic(tmp_path: Path) -> None:
    files = files_for(tmp_path)
    devices = [ClaimDevice("gpu-1", gpu_nodes(files, minor=1))]
    a = ClaimSpecEncoder(vendor=VENDOR, files=files).encode(UID, devices)
    b = ClaimSpecEncoder(vendor=VENDOR, files=files).encode(UID, devices)
    assert a == b
    spec = json.loads(a)
    assert spec["containerEdits"]["env"] == ["NVIDIA_VISIBLE_DEVICES=void"]
    assert [n["path"] for n in spec["containerEdits"]["deviceNodes"]] == [
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
        "/dev/nvidia-uvm-tools",
    ]
    assert all(
        m["options"] == ["ro", "nosuid", "nodev", "bind"] for m in spec["containerEdits"]["mounts"]
    )


@pytest.mark.parametrize("uid", [UID, "0bcdef00-0000-4000-8000-000000000000"])
def test_the_encoder_gives_the_same_bytes_as_encoding_the_spec(tmp_path: Path, uid: str) -> None:
    files = files_for(tmp_path)
    encoder = ClaimSpecEncoder(vendor=VENDOR, files=files)
    mig = mig_nodes(files, parent_minor=0, gpu_instance_id=1, compute_instance_id=0)
    for devices in (
        [ClaimDevice("gpu-1", gpu_nodes(files, minor=1))],
        [
            ClaimDevice("gpu-0-mig-1g10gb-1", mig),
            ClaimDevice("gpu-2", gpu_nodes(files, minor=2)),
        ],
    ):
        spec = claim_spec(vendor=VENDOR, claim_uid=uid, devices=devices, files=files)
        assert encoder.encode(uid, devices) == whole_json(spec)
        assert json.loads(encoder.encode(uid, devices)) == spec
    with pytest.raises(CdiError, match="needs at least one device"):
        encoder.encode(uid, [])


def test_specs_from_the_template_cache_are_the_specs_built_whole(tmp_path: Path) -> None:
    # device nodes at their own paths (no hostPath), so the UID alone decides the cdiVersion
    files = dataclasses.replace(files_for(tmp_path), dev_root=Path("/"))
    encoder = ClaimSpecEncoder(vendor=VENDOR, files=files)
    encoder.max_templates = 3
    mig = mig_nodes(files, parent_minor=0, gpu_instance_id=1, compute_instance_id=0)
    device_sets = [[ClaimDevice(f"gpu-{i}", gpu_nodes(files, minor=i))] for i in range(4)]
    device_sets.append([ClaimDevice("gpu-0-mig-1g10gb-1", mig), *device_sets[1]])
    # UIDs starting with a letter give cdiVersion 0.3.0, with a digit 0.5.0: both kinds, and
    # more device sets than templates kept, so templates are made, reused and dropped
    uids = ["abcdef00-0000-4000-8000-000000000000", UID] + [new_uid() for _ in range(6)]
    versions = set()
    for _ in range(2):
        for devices in device_sets:
            for uid in uids:
                spec = claim_spec(vendor=VENDOR, claim_uid=uid, devices=devices, files=files)
                assert encoder.encode(uid, devices) == whole_json(spec)
                versions.add(spec["cdiVersion"])
    assert versions == {"0.3.0", "0.5.0"}
    assert len(encoder._templates) == 3
    # a template holds its devices' bytes only: the shared edits are kept once, not per template
    shared = json.dumps(files.edits(DEFAULT_CAPABILITIES), separators=(",", ":")).encode()
    assert len(shared) > 500
    assert all(shared not in b"".join(parts) for parts in encoder._templates.values())
    assert all(sum(map(len, parts)) < len(shared) for parts in encoder._templates.values())
