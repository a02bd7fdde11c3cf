"""The committed generated code matches proto/dra, and the wire identities match spec B.5."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from dra_driver._proto.dra_v1 import api_pb2 as v1
from dra_driver._proto.dra_v1beta1 import api_pb2 as v1beta1
from dra_driver._proto.health_v1 import api_pb2 as health_v1
from dra_driver._proto.health_v1alpha1 import api_pb2 as health
from dra_driver._proto.pluginregistration_v1 import api_pb2 as registration

REPO = Path(__file__).resolve().parent.parent


def test_committed_generated_code_is_what_make_proto_produces(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(REPO / "hack/genproto.py"), str(tmp_path)], check=True)
    fresh = sorted(p.relative_to(tmp_path) for p in (tmp_path / "dra_driver/_proto").rglob("*.py*"))
    committed = sorted(
        p.relative_to(REPO)
        for p in (REPO / "dra_driver/_proto").rglob("*.py*")
        if "__pycache__" not in p.parts
    )
    assert fresh == committed
    stale = [str(p) for p in fresh if (tmp_path / p).read_bytes() != (REPO / p).read_bytes()]
    assert stale == [], f"run 'make proto': stale generated files {stale}"


def test_service_names_are_the_ones_the_kubelet_dials() -> None:
    assert v1.DESCRIPTOR.services_by_name["DRAPlugin"].full_name == (
        "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin"
    )
    assert v1beta1.DESCRIPTOR.services_by_name["DRAPlugin"].full_name == (
        "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin"
    )
    assert registration.DESCRIPTOR.services_by_name["Registration"].full_name == (
        "pluginregistration.Registration"
    )
    assert health.DESCRIPTOR.services_by_name["DRAResourceHealth"].full_name == (
        "v1alpha1.DRAResourceHealth"
    )
    # kubelet >= 1.37 (k8s.io/kubelet/pkg/apis/dra-health/v1 DRAResourceHealthService)
    assert health_v1.DESCRIPTOR.services_by_name["DRAResourceHealth"].full_name == (
        "v1.DRAResourceHealth"
    )


def _fields(message: object) -> dict[str, int]:
    descriptor = message.DESCRIPTOR  # type: ignore[attr-defined]
    return {f.name: f.number for f in descriptor.fields}


def test_field_numbers_match_the_kubelet_protos() -> None:
    assert _fields(v1.Device) == {
        "request_names": 1,
        "pool_name": 2,
        "device_name": 3,
        "cdi_device_ids": 4,
        "share_id": 5,
    }
    assert "share_id" not in _fields(v1beta1.Device)
    assert _fields(v1.Claim) == {"namespace": 1, "uid": 2, "name": 3}
    assert _fields(v1.NodePrepareResourceResponse) == {"devices": 1, "error": 2}
    assert _fields(v1.NodeUnprepareResourceResponse) == {"error": 1}
    assert _fields(registration.PluginInfo) == {
        "type": 1,
        "name": 2,
        "endpoint": 3,
        "supported_versions": 4,
    }
    assert _fields(registration.RegistrationStatus) == {"plugin_registered": 1, "error": 2}
    for version in (health, health_v1):
        assert _fields(version.DeviceHealth) == {
            "device": 1,
            "health": 2,
            "last_updated_time": 3,
            "health_check_timeout_seconds": 4,
            "message": 5,
        }
        assert _fields(version.DeviceIdentifier) == {"pool_name": 1, "device_name": 2}
        assert _fields(version.NodeWatchResourcesResponse) == {"devices": 1}
        assert _fields(version.NodeWatchResourcesRequest) == {}
        assert dict(version.HealthStatus.items()) == {"UNKNOWN": 0, "HEALTHY": 1, "UNHEALTHY": 2}


def test_share_id_has_explicit_presence() -> None:
    device = v1.Device(pool_name="node1", device_name="gpu-0")
    assert not device.HasField("share_id")
    device.share_id = ""
    assert device.HasField("share_id")


def test_a_v1_message_decodes_as_v1beta1_except_share_id() -> None:
    wire = v1.NodePrepareResourcesResponse(
        claims={"uid-1": v1.NodePrepareResourceResponse(devices=[v1.Device(device_name="gpu-0")])}
    ).SerializeToString()
    decoded = v1beta1.NodePrepareResourcesResponse.FromString(wire)
    assert decoded.claims["uid-1"].devices[0].device_name == "gpu-0"


def test_a_v1_health_report_decodes_as_v1alpha1() -> None:
    """v1 keeps v1alpha1's wire format (spec B.4): one report, either version."""
    wire = health_v1.NodeWatchResourcesResponse(
        devices=[
            health_v1.DeviceHealth(
                device=health_v1.DeviceIdentifier(pool_name="node1", device_name="gpu-0"),
                health=health_v1.UNHEALTHY,
                last_updated_time=1700000000,
                health_check_timeout_seconds=30,
                message="XID 79",
            )
        ]
    ).SerializeToString()
    decoded = health.NodeWatchResourcesResponse.FromString(wire).devices[0]
    assert (decoded.device.device_name, decoded.health) == ("gpu-0", health.UNHEALTHY)
    assert (decoded.health_check_timeout_seconds, decoded.message) == (30, "XID 79")
