"""The health monitor with the agent's real pieces: simulated GPUs through pynvml, the real
Publisher and Kubernetes client against the local API server (taints stored in the slices,
Events on the Node), and the kubelet's health stream over real gRPC on a Unix socket."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from dra_driver._proto.health_v1alpha1 import api_pb2 as health
from dra_driver._proto.health_v1alpha1 import api_pb2_grpc as health_grpc
from dra_driver.devices import node_devices
from dra_driver.gpus import nvml
from dra_driver.gpus.info import Inventory
from dra_driver.health.decisions import HealthPolicy
from dra_driver.health.monitor import HealthMonitor
from dra_driver.kube import KubeClient
from dra_driver.kube.events import node_event_reporter
from dra_driver.publish.publisher import Backoff, Publisher
from dra_driver.sim.faults import SimulatedFault
from dra_driver.sim.localapi import FakeKubeApi
from dra_driver.sim.nvml import SimulatedNode, simulated_nvml
from tests.test_plugin_server import start_plugin

NODE = "node1"
DRIVER = "gpu.nvidia.com"
FAST = Backoff(initial_s=0.05, max_s=0.2)


def wait_for(check: Callable[[], Any], timeout_s: float = 5.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.01)
    return check()


@dataclass
class Rig:
    api: FakeKubeApi
    node: SimulatedNode
    inventory: Inventory
    kube: KubeClient
    publisher: Publisher
    monitor: HealthMonitor

    def inject(self, kind: str, gpu: int = 0, **kw: Any) -> None:
        self.node.library.health.inject(SimulatedFault(kind=kind, gpu=gpu, **kw))

    def taints(self) -> dict[str, list[str]]:
        """Device -> its stored taints as key[=value]:effect, each with a server-set time."""
        out = {}
        for item in self.api.slices(node_name=NODE):
            for device in item["spec"].get("devices") or ():
                if device.get("taints"):
                    assert all(t.get("timeAdded") for t in device["taints"])
                    out[device["name"]] = [
                        t["key"] + (f"={t['value']}" if t.get("value") else "") + f":{t['effect']}"
                        for t in device["taints"]
                    ]
        return out

    def events(self) -> list[tuple[str, str, str]]:
        """(type, reason, message) of the Events recorded, in the order they were created."""
        found = sorted(
            self.api.objects("events"), key=lambda e: int(e["metadata"]["resourceVersion"])
        )
        return [(e["type"], e["reason"], e["message"]) for e in found]


@pytest.fixture
def rig_factory(kubeapi: FakeKubeApi) -> Iterator[Callable[..., Rig]]:
    kubeapi.add_node(NODE)
    stack: list[Callable[[], None]] = []

    def make(spec: str = "h100:2", *, check_interval_s: float = 0.2, **policy: Any) -> Rig:
        assert kubeapi.kubeconfig_path is not None
        context = simulated_nvml(spec, node_name=NODE)
        simulated = context.__enter__()
        stack.append(lambda: context.__exit__(None, None, None))
        inventory = nvml.discover(driver_root=Path("/"), sysfs_root=simulated.sysfs_root)
        kube = KubeClient.from_config(kubeconfig=kubeapi.kubeconfig_path, timeout_s=1)
        stack.append(kube.close)
        publisher = Publisher(
            kube,
            driver_name=DRIVER,
            node_name=NODE,
            node_devices=node_devices(inventory, driver_name=DRIVER),
            backoff=FAST,
        )
        policy.setdefault("min_change_interval_s", 0)
        monitor = HealthMonitor(
            policy=HealthPolicy(driver_name=DRIVER, **policy),
            inventory=inventory,
            taints=publisher,
            events=node_event_reporter(kube, node_name=NODE),
            check_interval_s=check_interval_s,
            stall_s=0.3,
        )
        monitor.start()
        stack.append(monitor.stop)
        publisher.start()
        stack.append(publisher.stop)
        assert publisher.wait_synced(5)
        assert wait_for(lambda: all(s.status == "Healthy" for s in monitor.states().values()))
        return Rig(kubeapi, simulated, inventory, kube, publisher, monitor)

    yield make
    for undo in reversed(stack):
        undo()


@pytest.mark.parametrize(
    ("fault", "taints", "recovery"),
    [
        (
            {"kind": "xid", "xid": 94},
            ["gpu.nvidia.com/xid=94:NoSchedule"],
            None,  # the quiet period
        ),
        (
            {"kind": "lost"},
            ["gpu.nvidia.com/gpu-lost:NoExecute", "gpu.nvidia.com/xid=79:NoExecute"],
            {"kind": "reset"},
        ),
        (
            {"kind": "ecc"},
            [
                "gpu.nvidia.com/ecc-double-bit:NoExecute",
                "gpu.nvidia.com/remapped-rows-pending:NoSchedule",
                "gpu.nvidia.com/xid=48:NoExecute",
            ],
            {"kind": "reset"},
        ),
        (
            {"kind": "temperature", "celsius": 95},
            ["gpu.nvidia.com/thermal-slowdown:NoSchedule"],
            {"kind": "temperature", "celsius": 60},
        ),
    ],
    ids=["xid", "lost", "ecc", "thermal"],
)
def test_each_fault_taints_the_slice_and_recovery_untaints_it_with_node_events(
    rig_factory: Callable[..., Rig],
    fault: dict[str, Any],
    taints: list[str],
    recovery: dict[str, Any] | None,
) -> None:
    rig = rig_factory(xid_quiet_period_s=1.0, fatal_taint_effect="NoExecute")
    rig.inject(gpu=1, **fault)
    assert wait_for(lambda: rig.taints() == {"gpu-1": taints}), rig.taints()
    state = rig.monitor.states()["gpu-1"]
    assert state.status == "Unhealthy" and abs(state.changed_s - time.time()) < 2
    assert rig.monitor.states()["gpu-0"].status == "Healthy"
    if recovery is not None:
        rig.inject(gpu=1, **recovery)
    assert wait_for(lambda: rig.taints() == {}, 5), rig.taints()
    assert rig.monitor.states()["gpu-1"].status == "Healthy"
    # An event is published before the check it triggers (a lost GPU: XID 79 first).
    events = wait_for(
        lambda: rig.events() and rig.events()[-1][1] == "DeviceHealthy" and rig.events()
    )
    *warnings, (kind, reason, message) = events
    assert {(k, r) for k, r, _ in warnings} == {("Warning", "DeviceUnhealthy")}
    assert warnings[-1][2].startswith(f"gpu-1: tainted {', '.join(taints)} (")
    assert (kind, reason) == ("Normal", "DeviceHealthy")
    assert message.startswith("gpu-1: healthy again, taints removed (cleared gpu.nvidia.com/")


def test_ignored_xids_and_a_quiet_node_write_nothing(rig_factory: Callable[..., Rig]) -> None:
    rig = rig_factory(check_interval_s=0.05)
    writes = rig.publisher.writes.total
    for xid in (13, 31, 43, 45, 68, 109):
        rig.inject(kind="xid", gpu=0, xid=xid)
    assert wait_for(lambda: rig.monitor.xid_counts().get(("gpu-0", 109)) == 1)
    time.sleep(0.5)  # ten checks
    assert rig.publisher.writes.total == writes
    assert rig.taints() == {} and rig.events() == []


def test_a_gpu_event_marks_its_mig_devices_and_an_instance_event_only_that_device(
    rig_factory: Callable[..., Rig],
) -> None:
    rig = rig_factory("a100-40gb:1:mig=3g.20gb+2g.10gb")
    rig.inject(kind="xid", gpu=0, xid=94, gpu_instance_id=5, compute_instance_id=0)
    assert wait_for(
        lambda: rig.taints() == {"gpu-0-mig-2g10gb-14-4": ["gpu.nvidia.com/xid=94:NoSchedule"]}
    )
    rig.inject(kind="lost", gpu=0)
    assert wait_for(
        lambda: (
            set(rig.taints()) == {"gpu-0-mig-3g20gb-9-0", "gpu-0-mig-2g10gb-14-4"}
            and all("gpu.nvidia.com/gpu-lost:NoSchedule" in t for t in rig.taints().values())
        )
    ), rig.taints()


def test_a_gpu_without_event_support_is_polled(
    rig_factory: Callable[..., Rig], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="dra_driver.gpus.healthwatch"):
        rig = rig_factory("l4:1:no-events", check_interval_s=0.1)
    assert any("gpu-0 does not support NVML events" in r.getMessage() for r in caplog.records)
    rig.inject(kind="xid", gpu=0, xid=94)  # not seen: no event set delivers it
    rig.inject(kind="lost", gpu=0)  # seen by the next check
    assert wait_for(lambda: rig.taints() == {"gpu-0": ["gpu.nvidia.com/gpu-lost:NoSchedule"]})
    rig.inject(kind="reset", gpu=0)
    assert wait_for(lambda: rig.taints() == {})
    assert sum("does not support NVML events" in r.getMessage() for r in caplog.records) == 1


def test_a_hanging_nvml_call_makes_health_unknown_and_the_agent_unready_not_dead(
    rig_factory: Callable[..., Rig],
) -> None:
    rig = rig_factory(check_interval_s=0.05)
    rig.inject(kind="hang", gpu=1, seconds=1.5)
    problems = wait_for(rig.monitor.readiness_problems, 3)
    assert problems and "GPU health: an NVML call has not returned for" in problems[0]
    assert {s.status for s in rig.monitor.states().values()} == {"Unknown"}
    assert rig.monitor.heartbeat.problem() is None  # alive: /healthz stays ok
    assert wait_for(lambda: not rig.monitor.readiness_problems(), 5)
    assert wait_for(lambda: {s.status for s in rig.monitor.states().values()} == {"Healthy"})


def test_taint_changes_of_a_flapping_device_are_rate_limited(
    rig_factory: Callable[..., Rig],
) -> None:
    rig = rig_factory(check_interval_s=0.02, min_change_interval_s=1.0)
    began = time.monotonic()
    rig.inject(kind="temperature", gpu=0, celsius=95)
    assert wait_for(lambda: "gpu-0" in rig.taints())
    tainted = time.monotonic()
    # the write is counted after the API server answers it, which a reader may see first
    assert rig.publisher.wait_synced(5)
    writes = rig.publisher.writes.total
    for _ in range(10):  # a GPU hovering around its slowdown threshold
        rig.inject(kind="temperature", gpu=0, celsius=60)
        time.sleep(0.03)
        rig.inject(kind="temperature", gpu=0, celsius=95)
        time.sleep(0.03)
    rig.inject(kind="temperature", gpu=0, celsius=60)
    assert wait_for(lambda: rig.taints() == {}, 3)
    assert time.monotonic() - began >= 1.0
    assert time.monotonic() - tainted >= 0.9
    assert rig.publisher.wait_synced(5)
    assert rig.publisher.writes.total == writes + 1  # the one removal


def test_a_change_while_the_api_server_is_down_is_stored_when_it_returns(
    rig_factory: Callable[..., Rig],
) -> None:
    rig = rig_factory()
    rig.api.stop()
    try:
        rig.inject(kind="xid", gpu=0, xid=94)
        assert wait_for(lambda: rig.monitor.states()["gpu-0"].status == "Unhealthy")
        assert wait_for(lambda: rig.publisher.status().last_error)
    finally:
        rig.api.start()
    assert wait_for(lambda: rig.taints() == {"gpu-0": ["gpu.nvidia.com/xid=94:NoSchedule"]}, 10)
    assert rig.publisher.wait_synced(5)


def test_gpus_that_re_discovery_drops_or_adds_are_forgotten_or_watched(
    rig_factory: Callable[..., Rig],
) -> None:
    rig = rig_factory("h100:2")
    one = Inventory(gpus=rig.inventory.gpus[:1])
    rig.publisher.set_devices(node_devices(one, driver_name=DRIVER))
    rig.monitor.set_inventory(one)
    assert wait_for(lambda: set(rig.monitor.states()) == {"gpu-0"}, 3)
    rig.inject(kind="xid", gpu=1, xid=94)  # not ours any more
    time.sleep(0.3)
    assert rig.taints() == {}
    rig.publisher.set_devices(node_devices(rig.inventory, driver_name=DRIVER))
    rig.monitor.set_inventory(rig.inventory)
    assert wait_for(lambda: rig.monitor.states().get("gpu-1"), 3)
    assert wait_for(lambda: rig.monitor.states()["gpu-1"].status == "Healthy", 3)
    rig.inject(kind="xid", gpu=1, xid=94)
    assert wait_for(lambda: rig.taints() == {"gpu-1": ["gpu.nvidia.com/xid=94:NoSchedule"]})


def test_the_health_stream_reports_each_transition_at_once_with_its_time(
    tmp_path: Path, rig_factory: Callable[..., Rig]
) -> None:
    rig = rig_factory(check_interval_s=0.05, xid_quiet_period_s=0.5)
    plugin = start_plugin(
        tmp_path, rig.kube, gpus=rig.inventory, health_interval_s=60, health=rig.monitor.states
    )
    rig.monitor.subscribe(plugin.health_changed)
    try:
        with grpc.insecure_channel(f"unix://{plugin.paths.dra}") as channel:
            stream = health_grpc.DRAResourceHealthStub(channel).NodeWatchResources(
                health.NodeWatchResourcesRequest(), timeout=20
            )
            reports: list[health.NodeWatchResourcesResponse] = []

            def read() -> None:
                with contextlib.suppress(grpc.RpcError):  # cancelled at the end
                    reports.extend(stream)

            reader = threading.Thread(target=read, daemon=True)
            reader.start()

            def latest(device: str) -> Any:
                if not reports:
                    return None
                return next(d for d in reports[-1].devices if d.device.device_name == device)

            assert wait_for(lambda: latest("gpu-0") and latest("gpu-0").health == health.HEALTHY)
            healthy_since = latest("gpu-0").last_updated_time
            rig.inject(kind="xid", gpu=0, xid=94)
            began = time.monotonic()
            unhealthy = wait_for(
                lambda: latest("gpu-0").health == health.UNHEALTHY and latest("gpu-0"), 2
            )
            assert time.monotonic() - began < 0.5  # not the 60 s interval
            assert unhealthy.message == "XID 94"
            assert abs(unhealthy.last_updated_time - time.time()) <= 2
            assert latest("gpu-1").health == health.HEALTHY
            assert latest("gpu-1").last_updated_time == healthy_since  # unchanged: its old time
            # the quiet period ends: healthy again, at once
            assert wait_for(lambda: latest("gpu-0").health == health.HEALTHY, 3)
            assert latest("gpu-0").last_updated_time >= unhealthy.last_updated_time
            rig.inject(kind="hang", gpu=1, seconds=1.0)
            assert wait_for(lambda: latest("gpu-1").health == health.UNKNOWN, 3)
            assert latest("gpu-1").message.startswith("NVML has not answered for")
            assert wait_for(lambda: latest("gpu-1").health == health.HEALTHY, 3)
            stream.cancel()
    finally:
        plugin.stop()
