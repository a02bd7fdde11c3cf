"""GPU health taints against a real kube-apiserver: its validation accepts the taints the health
monitor publishes (v1 fields; DRADeviceTaints is beta and on in 1.36, GA in 1.37, turned on by
conftest.py where it is alpha), it sets ``timeAdded`` itself, a restart keeps those times without
writing, and recovery removes the taints."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from dra_driver.devices import Taint, node_devices
from dra_driver.gpus.nvml import discover
from dra_driver.health.decisions import HealthPolicy
from dra_driver.health.monitor import HealthMonitor
from dra_driver.kube import KubeClient
from dra_driver.publish.publisher import Backoff, Publisher
from dra_driver.sim.faults import SimulatedFault
from dra_driver.sim.nvml import SimulatedNode, simulated_nvml
from tests.integration.conftest import RealApiServer

pytestmark = pytest.mark.integration

DRIVER = "gpu.nvidia.com"
NODE = "health-node"


def wait_for(check: Callable[[], Any], timeout_s: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    return check()


def stored_taints(server: RealApiServer) -> dict[str, list[dict[str, Any]]]:
    version = server.resource_api_version
    selector = f"spec.driver%3D{DRIVER}%2Cspec.nodeName%3D{NODE}"
    listing = server.request(
        "GET", f"/apis/resource.k8s.io/{version}/resourceslices?fieldSelector={selector}"
    )
    out: dict[str, list[dict[str, Any]]] = {}
    for item in listing["items"]:
        for device in item["spec"].get("devices") or ():
            # v1beta1 servers (1.32/1.33) keep the device fields under "basic"
            taints = (device.get("basic") or device).get("taints")
            if taints:
                out[device["name"]] = taints
    return out


@pytest.fixture
def simulated(real_apiserver: RealApiServer) -> Iterator[SimulatedNode]:
    real_apiserver.create_node(NODE)
    with simulated_nvml("h100:2", node_name=NODE) as node:
        yield node


class Relay:
    """Hands the monitor's taints to whichever publisher runs now (the agent restarts)."""

    def __init__(self, to: Publisher) -> None:
        self.to = to

    def set_taints(self, taints: Mapping[str, tuple[Taint, ...]]) -> None:
        self.to.set_taints(taints)


def test_the_server_stores_health_taints_with_its_time_and_recovery_removes_them(
    real_apiserver: RealApiServer, simulated: SimulatedNode
) -> None:
    inventory = discover(driver_root=Path("/"), sysfs_root=simulated.sysfs_root)
    devices = node_devices(inventory, driver_name=DRIVER)
    clients: list[KubeClient] = []

    def publisher() -> Publisher:
        clients.append(KubeClient.from_config(kubeconfig=real_apiserver.kubeconfig))
        return Publisher(
            clients[-1],
            driver_name=DRIVER,
            node_name=NODE,
            node_devices=devices,
            backoff=Backoff(initial_s=0.1, max_s=1.0),
        )

    relay = Relay(publisher())
    monitor = HealthMonitor(
        policy=HealthPolicy(
            driver_name=DRIVER, fatal_taint_effect="NoExecute", min_change_interval_s=0
        ),
        inventory=inventory,
        taints=relay,
        check_interval_s=0.2,
    )
    monitor.start()
    relay.to.start()
    try:
        assert relay.to.wait_synced(15), relay.to.status().last_error
        simulated.library.health.inject(SimulatedFault(kind="lost", gpu=1))
        assert wait_for(lambda: len(stored_taints(real_apiserver).get("gpu-1", ())) == 2)
        stored = stored_taints(real_apiserver)
        assert set(stored) == {"gpu-1"}
        assert [(t["key"], t.get("value", ""), t["effect"]) for t in stored["gpu-1"]] == [
            ("gpu.nvidia.com/gpu-lost", "", "NoExecute"),
            ("gpu.nvidia.com/xid", "79", "NoExecute"),
        ]
        for taint in stored["gpu-1"]:  # set by the server, RFC 3339
            datetime.fromisoformat(taint["timeAdded"].replace("Z", "+00:00"))
        assert relay.to.wait_synced(15)
        assert relay.to.status().dropped_gates == ()

        # The agent restarts with the same health: nothing written, the server's times kept.
        relay.to.stop()
        restarted = publisher()
        restarted.set_taints({"gpu-1": monitor.states()["gpu-1"].taints})
        relay.to = restarted
        restarted.start()
        assert restarted.wait_synced(15), restarted.status().last_error
        time.sleep(0.5)
        assert restarted.writes.total == 0
        assert stored_taints(real_apiserver) == stored

        simulated.library.health.inject(SimulatedFault(kind="reset", gpu=1))
        assert wait_for(lambda: stored_taints(real_apiserver) == {}), stored_taints(real_apiserver)
        assert restarted.writes.updates == 1
    finally:
        monitor.stop()
        relay.to.stop()
        for client in clients:
            client.close()
