"""node/discovery.py: the first publication's devices, and re-discovery: one change, applied to
prepare, the health stream, the health monitor and the slices, or to none of them."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import replace
from functools import partial
from pathlib import Path

import grpc
import pytest

from dra_driver._proto.dra_v1 import api_pb2 as v1
from dra_driver._proto.dra_v1 import api_pb2_grpc as v1_grpc
from dra_driver.devices import NodeDevices, node_devices
from dra_driver.errors import CdiError, DiscoveryError, DraError, PublishError
from dra_driver.gpus import nvml
from dra_driver.gpus.info import Inventory
from dra_driver.kube import KubeClient
from dra_driver.mig.dynamic import ManagedMig
from dra_driver.node.config import Config
from dra_driver.node.discovery import NodeGpus, keep_unanswering_gpus, rediscover
from dra_driver.publish.publisher import Publisher
from dra_driver.sim.fakedriver import simulated_inventory
from dra_driver.sim.faults import SimulatedFault
from dra_driver.sim.localapi import FakeKubeApi
from dra_driver.sim.nvml import simulated_nvml
from tests.claimdata import allocated_claim
from tests.test_plugin_server import start_plugin


class Rediscovered:
    """A Discovery that reports the inventories it is given, in turn (or raises them)."""

    def __init__(self, *found: Inventory | DraError) -> None:
        self._found = list(found)

    def discover(self) -> Inventory:
        found = self._found.pop(0)
        if isinstance(found, DraError):
            raise found
        return found


class Recorder:
    """Stands in for the plugin and the publisher: records calls in one list, in order."""

    def __init__(self, calls: list[tuple[str, object]], name: str, fail: DraError | None) -> None:
        self._calls, self._name, self._fail = calls, name, fail

    def set_inventory(self, inventory: Inventory) -> None:
        self._calls.append((self._name, inventory))
        if self._fail is not None and len(self._calls) == 1:
            raise self._fail

    def set_devices(self, node_devices: NodeDevices) -> None:
        self._calls.append((self._name, node_devices))
        if self._fail is not None:
            raise self._fail


def state(spec: str) -> NodeGpus:
    found = simulated_inventory(spec, node_name="node1")
    return NodeGpus(found, node_devices(found, driver_name="gpu.nvidia.com"))


CONFIG = Config(node_name="node1")


@pytest.fixture
def kube(kubeapi: FakeKubeApi) -> Iterator[KubeClient]:
    kubeapi.add_node("node1")
    client = KubeClient.from_config(kubeconfig=kubeapi.kubeconfig_path)
    yield client
    client.close()


def test_rediscovery_updates_prepare_the_health_stream_and_the_slices(
    tmp_path: Path, kube: KubeClient, kubeapi: FakeKubeApi
) -> None:
    before, after = state("h100:4"), state("h100:8")
    plugin = start_plugin(tmp_path, kube, gpus=before.inventory)
    publisher = Publisher(
        kube, driver_name="gpu.nvidia.com", node_name="node1", node_devices=before.node_devices
    )
    publisher.start()
    try:
        assert publisher.wait_synced(5)
        now = rediscover(
            Rediscovered(after.inventory),  # type: ignore[arg-type]
            CONFIG,
            before,
            publisher=publisher,
            plugin=plugin,
        )
        assert now == after
        assert plugin.preparer is not None and sorted(plugin.preparer.targets) == sorted(
            d.name for d in after.node_devices.devices
        )
        assert publisher.wait_synced(5)
        (stored,) = kubeapi.slices(node_name="node1")
        assert len(stored["spec"]["devices"]) == 8
        claim = kubeapi.add_claim(allocated_claim(name="c1", devices=["gpu-7"]))
        with grpc.insecure_channel(f"unix://{plugin.paths.dra}") as channel:
            answer = v1_grpc.DRAPluginStub(channel).NodePrepareResources(
                v1.NodePrepareResourcesRequest(
                    claims=[v1.Claim(namespace="default", name="c1", uid=claim["metadata"]["uid"])]
                ),
                timeout=5,
            )
        assert answer.claims[claim["metadata"]["uid"]].error == ""
    finally:
        publisher.stop()
        plugin.stop()


def test_prepare_changes_before_the_slices_and_unchanged_gpus_change_nothing() -> None:
    before, after = state("h100:1"), state("h100:2")
    calls: list[tuple[str, object]] = []
    now = rediscover(
        Rediscovered(before.inventory, after.inventory),  # type: ignore[arg-type]
        CONFIG,
        before,
        publisher=Recorder(calls, "publisher", None),  # type: ignore[arg-type]
        plugin=Recorder(calls, "plugin", None),  # type: ignore[arg-type]
    )
    assert now is before and calls == []
    now = rediscover(
        Rediscovered(after.inventory),  # type: ignore[arg-type]
        CONFIG,
        before,
        publisher=Recorder(calls, "publisher", None),  # type: ignore[arg-type]
        plugin=Recorder(calls, "plugin", None),  # type: ignore[arg-type]
    )
    assert now == after
    assert calls == [("plugin", after.inventory), ("publisher", after.node_devices)]


def test_a_mig_device_re_created_under_its_name_reaches_prepare() -> None:
    before = state("a100-40gb:1:mig=3g.20gb")
    (gpu,) = before.inventory.gpus
    mig = replace(gpu.mig_instances[0], gpu_instance_id=5, compute_instance_id=1)
    inventory = replace(before.inventory, gpus=(replace(gpu, mig_instances=(mig,)),))
    calls: list[tuple[str, object]] = []
    now = rediscover(
        Rediscovered(inventory),  # type: ignore[arg-type]
        CONFIG,
        before,
        publisher=Recorder(calls, "publisher", None),  # type: ignore[arg-type]
        plugin=Recorder(calls, "plugin", None),  # type: ignore[arg-type]
    )
    assert now.inventory == inventory
    # the published devices are the same; prepare's device nodes are not
    assert now.node_devices == before.node_devices
    assert calls == [("plugin", inventory)]


class PluginWithCheckpoint(Recorder):
    """Stands in for the NodePlugin: the device names its state records now."""

    def __init__(self, calls: list[tuple[str, object]]) -> None:
        super().__init__(calls, "plugin", None)
        self.names: frozenset[str] = frozenset()

    def recorded_device_names(self) -> frozenset[str]:
        return self.names


def test_dynamic_mig_devices_the_driver_creates_and_destroys_write_no_slice(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = Config(node_name="node1", mig_mode="dynamic")
    mig = ManagedMig(mig_mode="dynamic", driver_name="gpu.nvidia.com")
    empty = simulated_inventory("h100:1:mig", node_name="node1")
    one = simulated_inventory("h100:1:mig=3g.40gb", node_name="node1")
    two = simulated_inventory("h100:1:mig=3g.40gb+1g.10gb", node_name="node1")
    current = NodeGpus(empty, mig.node_devices(empty, recorded=frozenset()))
    calls: list[tuple[str, object]] = []
    plugin = PluginWithCheckpoint(calls)
    publisher = Recorder(calls, "publisher", None)

    def a_pass(found: Inventory, recorded: set[str]) -> NodeGpus:
        plugin.names = frozenset(recorded)
        return rediscover(
            Rediscovered(found),  # type: ignore[arg-type]
            config,
            current,
            publisher=publisher,  # type: ignore[arg-type]
            plugin=plugin,  # type: ignore[arg-type]
            mig=mig,
        )

    with caplog.at_level(logging.WARNING):
        # a claim recorded, then its MIG device created
        current = a_pass(one, {"gpu-0-mig-3g40gb-9-0"})
        # a second one; the first claim's record is dropped before its MIG device is gone
        current = a_pass(two, {"gpu-0-mig-1g10gb-19-4"})
        # both MIG devices destroyed, both records gone
        current = a_pass(empty, set())
    assert calls == [("plugin", one), ("plugin", two), ("plugin", empty)]  # no slice written
    assert current.node_devices.counter_sets[0].name == "gpu-0-counter-set"
    assert "did not create" not in caplog.text

    # a MIG device made behind the driver's back: the GPU goes static, once, and says why
    with caplog.at_level(logging.WARNING):
        current = a_pass(one, set())
    assert calls[-1] == ("publisher", current.node_devices)
    assert current.node_devices.counter_sets == ()
    assert [d.name for d in current.node_devices.devices] == ["gpu-0-mig-3g40gb-9-0"]
    (warning,) = [r for r in caplog.records if "did not create" in r.getMessage()]
    assert warning.gpu == "gpu-0"  # type: ignore[attr-defined]
    assert warning.mig_devices == ["gpu-0-mig-3g40gb-9-0"]  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("failing", "expected"),
    [
        ("discovery", []),
        ("plugin", ["plugin"]),  # capability table unreadable: nothing changes
        ("publisher", ["plugin", "publisher", "plugin"]),  # prepare goes back
    ],
)
def test_a_failed_rediscovery_keeps_the_current_state_everywhere(
    failing: str, expected: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    before, after = state("h100:1"), state("h100:2")
    calls: list[tuple[str, object]] = []
    found: Inventory | DraError = (
        DiscoveryError("GPU is lost") if failing == "discovery" else after.inventory
    )
    with caplog.at_level(logging.ERROR, logger="dra_driver.node.discovery"):
        now = rediscover(
            Rediscovered(found),  # type: ignore[arg-type]
            CONFIG,
            before,
            publisher=Recorder(  # type: ignore[arg-type]
                calls, "publisher", PublishError("bad") if failing == "publisher" else None
            ),
            plugin=Recorder(  # type: ignore[arg-type]
                calls, "plugin", CdiError("unreadable") if failing == "plugin" else None
            ),
        )
    assert now is before
    assert [who for who, _ in calls] == expected
    if failing == "publisher":
        assert calls[-1] == ("plugin", before.inventory)
    assert caplog.records  # logged as an error, not raised


# -- a lost GPU stays published ------------------------------------------------------------


def test_a_known_gpu_that_stops_answering_stays_while_an_unknown_one_is_left_out() -> None:
    with simulated_nvml("h100:3", node_name="node1") as node:
        discover = partial(nvml.discover, driver_root=Path("/"), sysfs_root=node.sysfs_root)
        known = discover()
        node.library.health.inject(SimulatedFault(kind="lost", gpu=1))
        fresh = discover()
    assert [g.index for g in fresh.gpus] == [0, 2] and [f.index for f in fresh.failures] == [1]
    kept = keep_unanswering_gpus(known, fresh)
    assert kept.gpus == known.gpus and kept.failures == ()
    assert keep_unanswering_gpus(Inventory(gpus=known.gpus[:1]), fresh) == fresh
