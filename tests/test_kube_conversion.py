"""kube/conversion.py: ResourceSlices between the served version and the v1 shape."""

from __future__ import annotations

from dra_driver.devices import NodeDevices, Taint
from dra_driver.kube.conversion import convert_slice, slice_to_v1
from dra_driver.publish.slices import to_api_objects
from tests.slicedata import build, gpu


def test_v1beta1_wraps_device_fields_in_basic_and_converts_back() -> None:
    taint = Taint(key="k", value="v", effect="NoSchedule")
    pool = build(NodeDevices(devices=(gpu(0, taints=(taint,)),)))
    (obj,) = to_api_objects(pool, node_uid="node-uid")
    beta1 = convert_slice(obj, api_version="v1beta1")
    assert beta1["apiVersion"] == "resource.k8s.io/v1beta1"
    device = beta1["spec"]["devices"][0]
    assert set(device) == {"name", "basic"}
    assert device["basic"]["capacity"] == {"memory": {"value": "80Gi"}}
    assert device["basic"]["taints"] == [{"key": "k", "value": "v", "effect": "NoSchedule"}]
    assert slice_to_v1(beta1) == obj
    beta2 = convert_slice(obj, api_version="v1beta2")
    assert beta2["spec"] == obj["spec"]
    assert beta2["apiVersion"] == "resource.k8s.io/v1beta2"
