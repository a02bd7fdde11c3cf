"""The publisher against dra_driver/sim/localapi/, through kube.KubeClient and the real client."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from dra_driver.devices import (
    CounterConsumption,
    CounterSet,
    Device,
    NodeDevices,
    Taint,
    node_devices,
)
from dra_driver.kube import KubeClient
from dra_driver.publish.publisher import Backoff, Publisher
from dra_driver.sim.localapi import FakeKubeApi
from dra_driver.sim.nvml import discover_simulated

DRIVER = "gpu.nvidia.com"
NODE = "node1"
FAST = Backoff(initial_s=0.05, max_s=0.4)


def gpu(minor: int, *, memory: str = "80Gi", taints: tuple[Taint, ...] = ()) -> Device:
    return Device(
        name=f"gpu-{minor}",
        attributes={"type": "gpu", "uuid": f"GPU-{minor:04d}"},
        capacity={"memory": memory},
        taints=taints,
    )


def partitionable_node(gpus: int, *, partitions: int) -> NodeDevices:
    """Per GPU a counter set, the full GPU and ``partitions`` devices consuming from it."""
    devices: list[Device] = []
    sets: list[CounterSet] = []
    for g in range(gpus):
        cs = f"gpu-{g}-counter-set"
        sets.append(CounterSet(name=cs, counters={"memory": "80Gi", "multiprocessors": "132"}))
        devices.append(
            Device(
                name=f"gpu-{g}",
                attributes={"type": "gpu"},
                capacity={"memory": "80Gi"},
                consumes_counters=(
                    CounterConsumption(cs, {"memory": "80Gi", "multiprocessors": "132"}),
                ),
            )
        )
        devices.extend(
            Device(
                name=f"gpu-{g}-mig-1g10gb-19-{p}",
                attributes={"type": "mig", "profile": "1g.10gb"},
                capacity={"memory": "10Gi"},
                consumes_counters=(
                    CounterConsumption(cs, {"memory": "10Gi", "multiprocessors": "16"}),
                ),
            )
            for p in range(partitions)
        )
    return NodeDevices(devices=tuple(devices), counter_sets=tuple(sets))


def wait_for(check: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.01)
    return check()


@pytest.fixture
def start(kubeapi: FakeKubeApi) -> Iterator[Callable[..., Publisher]]:
    started: list[Publisher] = []
    kubeapi.add_node(NODE)

    def start(node_devices: NodeDevices, **kw: Any) -> Publisher:
        assert kubeapi.kubeconfig_path is not None
        kube = KubeClient.from_config(kubeconfig=kubeapi.kubeconfig_path, timeout_s=2)
        kw.setdefault("backoff", FAST)
        kw.setdefault("forbidden_retry_s", 0.3)
        publisher = Publisher(
            kube, driver_name=DRIVER, node_name=NODE, node_devices=node_devices, **kw
        )
        publisher.start()
        started.append(publisher)
        return publisher

    yield start
    for publisher in started:
        publisher.stop()


def device_names(api: FakeKubeApi) -> list[str]:
    return sorted(
        d["name"] for s in api.slices(node_name=NODE) for d in s["spec"].get("devices", ())
    )


def test_first_publish_creates_slices_owned_by_the_node(
    kubeapi: FakeKubeApi, start: Callable[..., Publisher]
) -> None:
    publisher = start(NodeDevices(devices=(gpu(0), gpu(1))))
    assert publisher.wait_synced(5)
    (stored,) = kubeapi.slices()
    node_uid = kubeapi.objects("nodes")[0]["metadata"]["uid"]
    assert stored["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": node_uid, "controller": True}
    ]
    assert stored["metadata"]["name"].startswith("00000-gpu.nvidia.com-node1-")
    assert stored["spec"]["nodeName"] == NODE
    assert stored["spec"]["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": 1}
    assert device_names(kubeapi) == ["gpu-0", "gpu-1"]
    assert publisher.writes.creates == 1
    assert publisher.writes.total == 1
    assert publisher.status().slice_names == (stored["metadata"]["name"],)


def test_restart_with_unchanged_devices_writes_nothing(
    kubeapi: FakeKubeApi, start: Callable[..., Publisher]
) -> None:
    taint = Taint(key="gpu.nvidia.com/xid", value="79", effect="NoSchedule")
    devices = partitionable_node(4, partitions=20)
    devices = NodeDevices(
        devices=(*devices.devices, gpu(99, taints=(taint,))), counter_sets=devices.counter_sets
    )
    first = start(devices)
    assert first.wait_synced(5)
    first.stop()
    before = list(kubeapi.slices())
    writes_before = len(kubeapi.writes())

    second = start(devices)
    assert second.wait_synced(5)
    time.sleep(0.3)  # room for any late write to show up
    assert second.writes.total == 0
    assert len(kubeapi.writes()) == writes_before
    assert kubeapi.slices() == before


def test_slices_deleted_by_the_kubelet_are_recreated_within_two_seconds(
    kubeapi: FakeKubeApi, start: Callable[..., Publisher]
) -> None:
    publisher = start(partitionable_node(2, partitions=40))
    assert publisher.wait_synced(5)
    expected = device_names(kubeapi)
    deleted_at = time.monotonic()
    assert kubeapi.delete_slices(node_name=NODE) == 3
    assert wait_for(lambda: device_names(kubeapi) == expected, timeout_s=2.0)
    elapsed_s = time.monotonic() - deleted_at
    assert elapsed_s < 2.0
    assert {s["spec"]["pool"]["generation"] for s in kubeapi.slices()} == {1}


def test_a_device_change_updates_the_slice_in_place(
    kubeapi: FakeKubeApi, start: Callable[..., Publisher]
) -> None:
    publisher = start(NodeDevices(devices=(gpu(0), gpu(1))))
    assert publisher.wait_synced(5)
    (before,) = kubeapi.slices()
    publisher.set_devices(NodeDevices(devices=(gpu(0), gpu(1, memory="40Gi"))))
    assert publisher.wait_synced(5)
    (after,) = kubeapi.slices()
    assert after["metadata"]["name"] == before["metadata"]["name"]
    assert after["spec"]["devices"][1]["capacity"]["memory"] == {"value": "40Gi"}
    assert after["spec"]["pool"]["generation"] == 1
    assert (publisher.writes.creates, publisher.writes.updates) == (1, 1)


def test_a_node_with_nine_partitionable_gpus_gets_several_valid_slices(
    kubeapi: FakeKubeApi, start: Callable[..., Publisher]
) -> None:
    devices = partitionable_node(9, partitions=19)  # 180 devices, 9 counter sets
    publisher = start(devices)
    assert publisher.wait_synced(5), publisher.status().last_error
    slices = kubeapi.slices()
    # The fake server applies the API's limits (422 otherwise); check the split too.
    counts = sorted(
        (len(s["spec"].get("devices", ())), len(s["spec"].get("sharedCounters", ())))
        for s in slices
    )
    assert counts == [(0, 1), (0, 8), (52, 0), (64, 0), (64, 0)]
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in slices} == {5}
    assert len(device_names(kubeapi)) == 180


def test_eight_h100_in_dynamic_mig_mode_are_published_and_a_restart_writes_nothing(
    kubeapi: FakeKubeApi, start: Callable[..., Publisher]
) -> None:
    inventory = discover_simulated("h100:8:mig", node_name=NODE)
    devices = node_devices(inventory, driver_name=DRIVER, mig_mode="dynamic")
    first = start(devices)
    assert first.wait_synced(5), first.status().last_error
    assert len(device_names(kubeapi)) == 8 * (1 + 25)  # each whole GPU and its placements
    assert sorted(len(s["spec"].get("sharedCounters", ())) for s in kubeapi.slices()) == [
        0,
        0,
        0,
        0,
        8,
    ]
    first.stop()
    second = start(devices)
    assert second.wait_synced(5)
    time.sleep(0.3)
    assert second.writes.total == 0


def test_an_unreachable_api_server_is_retried_until_it_comes_up(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    api = FakeKubeApi()  # not started yet
    api.add_node(NODE)
    kube = KubeClient.from_config(kubeconfig=api.write_kubeconfig(tmp_path / "kc"), timeout_s=1)
    publisher = Publisher(
        kube,
        driver_name=DRIVER,
        node_name=NODE,
        node_devices=NodeDevices(devices=(gpu(0),)),
        backoff=FAST,
    )
    caplog.set_level(logging.WARNING, logger="dra_driver.publish.publisher")
    publisher.start()
    try:
        assert wait_for(lambda: "unreachable" in (publisher.status().last_error or ""), 3)
        assert not publisher.wait_synced(0.3)
        api.start()
        assert publisher.wait_synced(5)
        assert device_names(api) == ["gpu-0"]
        assert publisher.status().last_error is None
        assert any("retrying in" in r.getMessage() for r in caplog.records)
    finally:
        publisher.stop()
        api.stop()


def test_a_missing_rbac_permission_is_named_and_retried(
    kubeapi: FakeKubeApi, start: Callable[..., Publisher], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="dra_driver.publish.publisher")
    kubeapi.forbid("create", "resourceslices")
    publisher = start(NodeDevices(devices=(gpu(0),)))
    expected = "forbidden: the ServiceAccount may not 'create' resourceslices.resource.k8s.io"
    assert wait_for(lambda: expected in (publisher.status().last_error or ""), 3)
    assert any(expected in r.getMessage() and r.levelno == logging.ERROR for r in caplog.records)
    kubeapi.clear_faults()
    assert publisher.wait_synced(5)
    assert device_names(kubeapi) == ["gpu-0"]


def test_fields_dropped_by_a_disabled_gate_are_logged_once_without_an_update_loop(
    kubeapi: FakeKubeApi, start: Callable[..., Publisher], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="dra_driver.publish.publisher")
    kubeapi.drop_fields(device_fields=["taints"])
    taint = Taint(key="gpu.nvidia.com/gpu-lost", value="", effect="NoSchedule")
    publisher = start(NodeDevices(devices=(gpu(0, taints=(taint,)), gpu(1))))
    assert publisher.wait_synced(5)
    time.sleep(0.3)
    assert publisher.writes.total == 1
    assert "taints" not in kubeapi.slices()[0]["spec"]["devices"][0]
    kubeapi.delete_slices(node_name=NODE)
    assert wait_for(lambda: len(kubeapi.slices()) == 1)
    assert publisher.wait_synced(5)
    time.sleep(0.3)
    assert (publisher.writes.creates, publisher.writes.updates) == (2, 0)
    warnings = [r.getMessage() for r in caplog.records if "DRADeviceTaints" in r.getMessage()]
    assert len(warnings) == 1
    assert "devices[].taints" in warnings[0]
    assert publisher.status().dropped_gates == ("DRADeviceTaints",)


def test_a_watch_that_expired_is_relisted_and_keeps_working(
    kubeapi: FakeKubeApi, start: Callable[..., Publisher]
) -> None:
    kubeapi.fail("watch", "resourceslices", 410, times=1)
    publisher = start(NodeDevices(devices=(gpu(0),)))
    assert publisher.wait_synced(5)
    watches = lambda: [r for r in kubeapi.requests if r.verb == "watch"]  # noqa: E731
    assert wait_for(lambda: len(watches()) >= 2)
    verbs = [r.verb for r in kubeapi.requests if r.resource == "resourceslices"]
    first_watch = verbs.index("watch")
    assert "list" in verbs[first_watch + 1 : verbs.index("watch", first_watch + 1)]
    kubeapi.delete_slices(node_name=NODE)
    assert wait_for(lambda: device_names(kubeapi) == ["gpu-0"], timeout_s=2)


def test_a_watch_cut_by_the_api_server_is_reopened_and_keeps_working(
    kubeapi: FakeKubeApi, start: Callable[..., Publisher]
) -> None:
    publisher = start(NodeDevices(devices=(gpu(0),)))
    assert publisher.wait_synced(5)
    watches = lambda: [r for r in kubeapi.requests if r.verb == "watch"]  # noqa: E731
    assert wait_for(lambda: len(watches()) == 1)
    kubeapi.kill_connections()  # mid-stream, no final chunk
    assert wait_for(lambda: len(watches()) >= 2)
    kubeapi.delete_slices(node_name=NODE)
    assert wait_for(lambda: device_names(kubeapi) == ["gpu-0"], timeout_s=2)


class _Buggy:
    """The real client, but the first watch and the first create raise what no KubeError
    covers (as a library bug or an unforeseen failure would)."""

    def __init__(self, kube: KubeClient) -> None:
        self._kube = kube
        self.raised: list[str] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._kube, name)
        if name in ("watch_slices", "create_slice") and name not in self.raised:
            self.raised.append(name)

            def boom(*args: Any, **kwargs: Any) -> Any:
                raise RuntimeError(f"unforeseen failure in {name}")

            return boom
        return attr


def test_unexpected_errors_are_logged_and_retried_instead_of_ending_the_threads(
    kubeapi: FakeKubeApi, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    kubeapi.add_node(NODE)
    api = _Buggy(KubeClient.from_config(kubeconfig=kubeapi.write_kubeconfig(tmp_path / "kc")))
    publisher = Publisher(
        api,
        driver_name=DRIVER,
        node_name=NODE,
        node_devices=NodeDevices(devices=(gpu(0),)),
        backoff=FAST,
    )
    caplog.set_level(logging.ERROR, logger="dra_driver.publish.publisher")
    publisher.start()
    try:
        assert publisher.wait_synced(5), publisher.status().last_error
        assert sorted(api.raised) == ["create_slice", "watch_slices"]
        assert wait_for(lambda: any(r.verb == "watch" for r in kubeapi.requests))
        # Both threads are alive: the syncer published, the watcher still sees deletions.
        kubeapi.delete_slices(node_name=NODE)
        assert wait_for(lambda: device_names(kubeapi) == ["gpu-0"], timeout_s=2)
    finally:
        publisher.stop()
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("publishing ResourceSlices failed unexpectedly") for m in messages)
    assert any(m.startswith("watching ResourceSlices failed unexpectedly") for m in messages)
    assert all(r.exc_info is not None for r in caplog.records if "unexpectedly" in r.msg)


def test_stop_ends_the_threads_promptly(start: Callable[..., Publisher]) -> None:
    publisher = start(NodeDevices(devices=(gpu(0),)))
    assert publisher.wait_synced(5)
    began = time.monotonic()
    publisher.stop()
    assert time.monotonic() - began < 1.0
    assert not publisher.wait_synced(0.1)


# -- what the probes read ----------------------------------------------------------------------


def test_readiness_needs_the_current_devices_written_and_the_last_sync_to_succeed(
    tmp_path: Path,
) -> None:
    api = FakeKubeApi()  # not started yet
    api.add_node(NODE)
    kube = KubeClient.from_config(kubeconfig=api.write_kubeconfig(tmp_path / "kc"), timeout_s=1)
    publisher = Publisher(
        kube,
        driver_name=DRIVER,
        node_name=NODE,
        node_devices=NodeDevices(devices=(gpu(0),)),
        backoff=FAST,
        forbidden_retry_s=0.3,
    )
    assert publisher.readiness_problems() == ["ResourceSlices: not published yet"]
    publisher.start()
    try:
        assert wait_for(lambda: len(publisher.readiness_problems()) == 2, 3)
        not_yet, failed = publisher.readiness_problems()
        assert not_yet == "ResourceSlices: not published yet"
        assert (
            failed.startswith("ResourceSlices: the last sync failed: ") and "unreachable" in failed
        )
        api.start()
        assert wait_for(lambda: publisher.readiness_problems() == [], 5)
        assert publisher.status().desired_written
        # new devices that cannot be written: not current any more, and why
        api.forbid("update", "resourceslices")
        publisher.set_devices(NodeDevices(devices=(gpu(0), gpu(1))))
        assert wait_for(lambda: len(publisher.readiness_problems()) == 2, 3)
        stale, forbidden = publisher.readiness_problems()
        assert stale == "ResourceSlices: the current devices are not published yet"
        assert "forbidden" in forbidden
        api.clear_faults()
        assert wait_for(lambda: publisher.readiness_problems() == [], 5)
        # slices deleted behind our back (the kubelet starting): re-created without a pause
        # in readiness, which needs the desired slices written once and no failed sync since
        api.delete_slices(node_name=NODE)
        assert publisher.readiness_problems() == []
        assert wait_for(lambda: device_names(api) == ["gpu-0", "gpu-1"], 2)
    finally:
        publisher.stop()
        api.stop()


class _Stuck:
    """The real client, but reading the Node (the first call of a sync) hangs until released."""

    def __init__(self, kube: KubeClient) -> None:
        self._kube = kube
        self.release = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kube, name)

    def get_node(self, name: str) -> Any:
        self.release.wait(10)
        return self._kube.get_node(name)


def test_the_heartbeats_show_a_stuck_sync_and_live_threads(
    kubeapi: FakeKubeApi, tmp_path: Path
) -> None:
    kubeapi.add_node(NODE)
    api = _Stuck(KubeClient.from_config(kubeconfig=kubeapi.write_kubeconfig(tmp_path / "kc")))
    publisher = Publisher(
        api, driver_name=DRIVER, node_name=NODE, node_devices=NodeDevices(devices=(gpu(0),))
    )
    sync, watch = publisher.heartbeats
    assert (sync.name, watch.name) == ("slice-sync", "slice-watch")
    sync.stall_s = 0.2
    publisher.start()
    try:
        assert wait_for(lambda: sync.problem() is not None, 3)
        assert (sync.problem() or "").startswith("loop slice-sync is stuck: no progress for")
        assert watch.problem() is None  # the watch is open and fine
        api.release.set()
        assert publisher.wait_synced(5)
        assert sync.problem() is None and sync.passes >= 1
    finally:
        api.release.set()
        publisher.stop()
    assert sync.problem() is None and watch.problem() is None  # stopped is not dead
