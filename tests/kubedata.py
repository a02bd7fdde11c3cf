"""A KubeClient (or the tools' ClusterClient) on the stand-in API server, and the objects the
kube tests send it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dra_driver.devices.model import Device, NodeDevices, Taint
from dra_driver.kube import KubeClient
from dra_driver.kube.clusterreads import ClusterClient
from dra_driver.publish.slices import build_slices, to_api_objects
from dra_driver.sim.localapi import FakeKubeApi

DRIVER = "gpu.nvidia.com"


def client(api: FakeKubeApi, tmp_path: Path) -> KubeClient:
    return KubeClient.from_config(
        kubeconfig=api.write_kubeconfig(tmp_path / "kc"), timeout_s=2, connect_timeout_s=1
    )


def cluster_client(api: FakeKubeApi, tmp_path: Path) -> ClusterClient:
    return ClusterClient.from_config(
        kubeconfig=api.write_kubeconfig(tmp_path / "kc"), timeout_s=2, connect_timeout_s=1
    )


def slice_body(node: str = "node1", *, devices: int = 2, driver: str = DRIVER) -> dict[str, Any]:
    taint = Taint(key="gpu.nvidia.com/xid", value="79", effect="NoSchedule")
    pool = build_slices(
        NodeDevices(
            devices=tuple(
                Device(
                    name=f"gpu-{i}",
                    attributes={"type": "gpu"},
                    capacity={"memory": "80Gi"},
                    taints=(taint,) if i == 0 else (),
                )
                for i in range(devices)
            )
        ),
        driver_name=driver,
        node_name=node,
    )
    return to_api_objects(pool, node_uid="node-uid")[0]


def claim(namespace: str = "ns1") -> dict[str, Any]:
    return {
        "metadata": {"name": "claim-a", "namespace": namespace},
        "spec": {
            "devices": {
                "requests": [
                    {"name": "gpus", "exactly": {"deviceClassName": "gpu.nvidia.com", "count": 2}},
                    {
                        "name": "any",
                        "firstAvailable": [{"name": "big", "deviceClassName": "gpu.nvidia.com"}],
                    },
                ]
            }
        },
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {"request": "gpus", "driver": DRIVER, "pool": "node1", "device": "gpu-0"}
                    ]
                }
            }
        },
    }
