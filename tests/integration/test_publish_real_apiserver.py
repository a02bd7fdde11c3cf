"""Publishing against a real kube-apiserver: its validation accepts our slices, it stores them
as we sent them (restart writes nothing), and slices deleted behind our back come back in 2 s."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dra_driver.devices import NodeDevices, node_devices
from dra_driver.gpus.nvml import discover
from dra_driver.kube import KubeClient
from dra_driver.publish.publisher import Backoff, Publisher
from dra_driver.publish.slices import build_slices, content_of
from dra_driver.sharing.shares import parse_mode, shareable
from dra_driver.sim.nvml import simulated_nvml
from tests.integration.conftest import RealApiServer

pytestmark = pytest.mark.integration

DRIVER = "gpu.nvidia.com"
NODES = {
    "h100-node": "h100:8",
    "mixed-node": "a100-80gb:1:mig=3g.40gb+2g.20gb+1g.10gb,l4:1",
}


def simulated(spec: str, node_name: str) -> NodeDevices:
    """The devices the agent would publish for ``spec``, through the real discovery code."""
    with simulated_nvml(spec, node_name=node_name) as node:
        inventory = discover(driver_root=Path("/"), sysfs_root=node.sysfs_root)
    return node_devices(inventory, driver_name=DRIVER)


def stored_slices(server: RealApiServer, node_name: str) -> list[dict[str, Any]]:
    version = server.resource_api_version
    selector = f"spec.driver%3D{DRIVER}%2Cspec.nodeName%3D{node_name}"
    listing = server.request(
        "GET", f"/apis/resource.k8s.io/{version}/resourceslices?fieldSelector={selector}"
    )
    items: list[dict[str, Any]] = listing["items"]
    return items


def device_names(server: RealApiServer, node_name: str) -> list[str]:
    names = []
    for item in stored_slices(server, node_name):
        for device in item["spec"].get("devices") or ():
            names.append(device["name"])
    return sorted(names)


@pytest.fixture(scope="module")
def nodes(real_apiserver: RealApiServer) -> dict[str, str]:
    """Node name -> uid, created once for the module."""
    return {name: real_apiserver.create_node(name)["metadata"]["uid"] for name in NODES}


@pytest.fixture
def publishers(real_apiserver: RealApiServer) -> Iterator[list[tuple[Publisher, KubeClient]]]:
    started: list[tuple[Publisher, KubeClient]] = []
    yield started
    for publisher, client in started:
        publisher.stop()
        client.close()


def start(
    server: RealApiServer, node_name: str, started: list[tuple[Publisher, KubeClient]]
) -> Publisher:
    client = KubeClient.from_config(kubeconfig=server.kubeconfig)
    publisher = Publisher(
        client,
        driver_name=DRIVER,
        node_name=node_name,
        node_devices=simulated(NODES[node_name], node_name),
        backoff=Backoff(initial_s=0.1, max_s=1.0),
    )
    publisher.start()
    started.append((publisher, client))
    return publisher


@pytest.mark.parametrize("node_name", list(NODES))
def test_the_server_accepts_and_stores_the_slices(
    real_apiserver: RealApiServer,
    nodes: dict[str, str],
    publishers: list[tuple[Publisher, KubeClient]],
    node_name: str,
) -> None:
    publisher = start(real_apiserver, node_name, publishers)
    assert publisher.wait_synced(15), publisher.status().last_error
    status = publisher.status()
    assert status.last_error is None
    assert status.dropped_gates == ()
    expected = sorted(d.name for d in simulated(NODES[node_name], node_name).devices)
    assert device_names(real_apiserver, node_name) == expected
    for item in stored_slices(real_apiserver, node_name):
        assert item["spec"]["nodeName"] == node_name
        assert item["spec"]["pool"]["name"] == node_name
        assert item["metadata"]["ownerReferences"][0]["uid"] == nodes[node_name]
        assert item["metadata"]["name"].startswith(f"00000-{DRIVER}-{node_name}-")


@pytest.mark.parametrize("node_name", list(NODES))
def test_a_restart_with_unchanged_devices_writes_nothing(
    real_apiserver: RealApiServer,
    nodes: dict[str, str],
    publishers: list[tuple[Publisher, KubeClient]],
    node_name: str,
) -> None:
    first = start(real_apiserver, node_name, publishers)
    assert first.wait_synced(15), first.status().last_error
    first.stop()
    before = stored_slices(real_apiserver, node_name)
    second = start(real_apiserver, node_name, publishers)
    assert second.wait_synced(15), second.status().last_error
    time.sleep(0.5)
    assert second.writes.total == 0
    after = stored_slices(real_apiserver, node_name)
    assert [s["metadata"]["resourceVersion"] for s in after] == [
        s["metadata"]["resourceVersion"] for s in before
    ]


def test_slices_deleted_like_the_kubelet_does_come_back_within_two_seconds(
    real_apiserver: RealApiServer,
    nodes: dict[str, str],
    publishers: list[tuple[Publisher, KubeClient]],
) -> None:
    node_name = "h100-node"
    publisher = start(real_apiserver, node_name, publishers)
    assert publisher.wait_synced(15), publisher.status().last_error
    expected = device_names(real_apiserver, node_name)
    version = real_apiserver.resource_api_version
    began = time.monotonic()
    real_apiserver.request(
        "DELETE",
        f"/apis/resource.k8s.io/{version}/resourceslices?fieldSelector=spec.nodeName%3D{node_name}",
    )
    while time.monotonic() - began < 5 and device_names(real_apiserver, node_name) != expected:
        time.sleep(0.02)
    elapsed_s = time.monotonic() - began
    assert device_names(real_apiserver, node_name) == expected
    assert elapsed_s <= 2.0, f"slices took {elapsed_s:.2f} s to come back"


@pytest.mark.parametrize("mode", ["unlimited", "memory", "compute", "4"])
def test_the_server_accepts_and_stores_shareable_devices_as_sent(
    real_apiserver: RealApiServer,
    publishers: list[tuple[Publisher, KubeClient]],
    mode: str,
) -> None:
    """--consumable-shares: allowMultipleAllocations and every requestPolicy pass the server's
    validation (the rules the strict schemas cannot check) and are stored as sent."""
    if real_apiserver.minor < 34:
        pytest.skip(
            f"DRAConsumableCapacity needs kube-apiserver 1.34+, this is 1.{real_apiserver.minor}"
        )
    node_name = f"shared-{mode}-node"
    real_apiserver.create_node(node_name)
    devices = shareable(simulated(NODES["mixed-node"], node_name), parse_mode(mode))
    client = KubeClient.from_config(kubeconfig=real_apiserver.kubeconfig)
    publisher = Publisher(
        client,
        driver_name=DRIVER,
        node_name=node_name,
        node_devices=devices,
        backoff=Backoff(initial_s=0.1, max_s=1.0),
    )
    publisher.start()
    publishers.append((publisher, client))
    assert publisher.wait_synced(15), publisher.status().last_error
    assert publisher.status().dropped_gates == ()
    sent = build_slices(devices, driver_name=DRIVER, node_name=node_name).slices
    stored = [content_of(item) for item in stored_slices(real_apiserver, node_name)]
    assert sorted(d["name"] for s in stored for d in s.devices) == sorted(
        d.name for d in devices.devices
    )
    by_name = {d["name"]: d for s in stored for d in s.devices}
    for content in sent:
        for device in content.devices:
            assert by_name[device["name"]] == device
            assert by_name[device["name"]]["allowMultipleAllocations"] is True


# -- dynamic MIG -----------------------------------------------------------------------------

DYNAMIC_NODE = "h100-dynamic-node"


def test_a_dynamic_mig_node_is_stored_as_sent_and_a_restart_writes_nothing(
    real_apiserver: RealApiServer, publishers: list[tuple[Publisher, KubeClient]]
) -> None:
    if real_apiserver.minor < 35:
        pytest.skip("shared counters in slices of their own are the 1.35+ model (spec D.1)")
    real_apiserver.create_node(DYNAMIC_NODE)
    with simulated_nvml("h100:8:mig", node_name=DYNAMIC_NODE) as node:
        inventory = discover(driver_root=Path("/"), sysfs_root=node.sysfs_root)
    published = node_devices(inventory, driver_name=DRIVER, mig_mode="dynamic")

    def publish() -> Publisher:
        client = KubeClient.from_config(kubeconfig=real_apiserver.kubeconfig)
        publisher = Publisher(
            client,
            driver_name=DRIVER,
            node_name=DYNAMIC_NODE,
            node_devices=published,
            backoff=Backoff(initial_s=0.1, max_s=1.0),
        )
        publisher.start()
        publishers.append((publisher, client))
        assert publisher.wait_synced(15), publisher.status().last_error
        return publisher

    first = publish()
    assert first.status().last_error is None
    assert first.status().dropped_gates == ()  # counters and consumption stored as sent
    stored = stored_slices(real_apiserver, DYNAMIC_NODE)
    assert sorted(len(s["spec"].get("sharedCounters") or ()) for s in stored) == [0, 0, 0, 0, 8]
    assert device_names(real_apiserver, DYNAMIC_NODE) == sorted(d.name for d in published.devices)
    first.stop()
    second = publish()
    time.sleep(0.5)
    assert second.writes.total == 0
