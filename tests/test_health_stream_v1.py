"""The health stream in both versions the kubelet speaks (spec B.4): ``v1.DRAResourceHealth``
(kubelet >= 1.37, preferred) beside ``v1alpha1.DRAResourceHealth`` on the same dra.sock, over
real gRPC on real Unix sockets, read by the stand-in kubelet (sim/kubelethealth.py) the way the
kubelet reads it: pick the service from GetInfo, stamp each report on arrival, show a device
Unknown once its timeout passed without one."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from itertools import pairwise
from pathlib import Path
from typing import Any

import grpc
import pytest

from dra_driver import cli
from dra_driver._proto.health_v1 import api_pb2 as health_v1
from dra_driver._proto.health_v1 import api_pb2_grpc as health_v1_grpc
from dra_driver._proto.health_v1alpha1 import api_pb2 as health_v1alpha1
from dra_driver._proto.health_v1alpha1 import api_pb2_grpc as health_v1alpha1_grpc
from dra_driver._proto.pluginregistration_v1 import api_pb2 as reg
from dra_driver._proto.pluginregistration_v1 import api_pb2_grpc as reg_grpc
from dra_driver.errors import ConfigError
from dra_driver.health.decisions import DeviceHealth
from dra_driver.kube import KubeClient
from dra_driver.node.nodeplugin import NodePlugin
from dra_driver.node.wiring import kubelet_plugin
from dra_driver.plugin.health_stream import V1alpha1HealthServicer, V1HealthServicer
from dra_driver.sim.kubelethealth import (
    KUBELET_1_36,
    V1,
    V1ALPHA1,
    KubeletHealthWatch,
    pick_health_service,
)
from tests.test_health_monitor import Rig, rig_factory  # noqa: F401 - shared fixture
from tests.test_plugin_server import (  # noqa: F401 - kube: shared fixture
    channel,
    inventory,
    kube,
    make_config,
    start_plugin,
)

CHANGED_S = 1_700_000_000.0
STATES = {
    "gpu-0": DeviceHealth("Unhealthy", (), "XID 79 (GPU has fallen off the bus)", CHANGED_S),
    **{f"gpu-{i}": DeviceHealth("Healthy", (), "", CHANGED_S + i) for i in range(1, 8)},
}


@pytest.fixture
def watched(tmp_path: Path, kube: KubeClient) -> Iterator[NodePlugin]:  # noqa: F811
    plugin = start_plugin(tmp_path, kube, health_interval_s=0.2, health=lambda: STATES)
    yield plugin
    plugin.stop()


@pytest.fixture
def watches() -> Iterator[list[KubeletHealthWatch]]:
    started: list[KubeletHealthWatch] = []
    yield started
    for watch in started:
        watch.stop()


def watch(plugin: NodePlugin, started: list[KubeletHealthWatch], **kw: Any) -> KubeletHealthWatch:
    w = KubeletHealthWatch(plugin.paths.registration, **kw).start()
    started.append(w)
    return w


def shows(kubelet: KubeletHealthWatch, device: str, status: str) -> Callable[[], bool]:
    """Whether ``kubelet`` shows ``device`` of pool node1 with ``status`` (for wait_for)."""
    return lambda: kubelet.health("node1", device).status == status


def entries(report: Any) -> list[tuple[str, str, str, int, int, str]]:
    """A report's devices, version-neutral: pool, device, status name, times, message."""
    status = type(report).DESCRIPTOR.file.enum_types_by_name["HealthStatus"]
    return [
        (
            d.device.pool_name,
            d.device.device_name,
            status.values_by_number[d.health].name,
            d.last_updated_time,
            d.health_check_timeout_seconds,
            d.message,
        )
        for d in report.devices
    ]


def test_the_kubelet_prefers_v1_whatever_the_plugins_order() -> None:
    """kubelet's TestPickHealthService cases (pkg/kubelet/cm/dra/plugin), and a 1.36 kubelet."""
    assert pick_health_service(["v1beta1.DRAPlugin"]) == ""
    assert pick_health_service([]) == ""
    assert pick_health_service(["v1beta1.DRAPlugin", V1ALPHA1]) == V1ALPHA1
    assert pick_health_service(["v1beta1.DRAPlugin", V1]) == V1
    assert pick_health_service([V1ALPHA1, V1]) == V1
    assert pick_health_service([V1, V1ALPHA1], KUBELET_1_36) == V1ALPHA1
    assert pick_health_service([V1], KUBELET_1_36) == ""


def test_get_info_advertises_both_versions_and_each_kubelet_gets_its_own(
    watched: NodePlugin, watches: list[KubeletHealthWatch]
) -> None:
    with channel(watched.paths.registration) as ch:
        info = reg_grpc.RegistrationStub(ch).GetInfo(reg.InfoRequest(), timeout=1)
    assert list(info.supported_versions) == [
        "v1.DRAPlugin",
        "v1beta1.DRAPlugin",
        "v1.DRAResourceHealth",
        "v1alpha1.DRAResourceHealth",
    ]
    assert (V1HealthServicer.service, V1alpha1HealthServicer.service) == (V1, V1ALPHA1)
    new, old = watch(watched, watches), watch(watched, watches, known=KUBELET_1_36)
    for kubelet in (new, old):
        assert kubelet.wait_for(shows(kubelet, "gpu-7", "HEALTHY"))
        assert kubelet.health("node1", "gpu-0").status == "UNHEALTHY"
    assert (new.service, old.service) == (V1, V1ALPHA1)


def test_both_versions_stream_the_same_states_with_the_timeout_set(
    watched: NodePlugin,
) -> None:
    with channel(watched.paths.dra) as ch:
        v1_stream = health_v1_grpc.DRAResourceHealthStub(ch).NodeWatchResources(
            health_v1.NodeWatchResourcesRequest(), timeout=5
        )
        alpha_stream = health_v1alpha1_grpc.DRAResourceHealthStub(ch).NodeWatchResources(
            health_v1alpha1.NodeWatchResourcesRequest(), timeout=5
        )
        v1_report, alpha_report = next(v1_stream), next(alpha_stream)
        v1_stream.cancel()
        alpha_stream.cancel()
    assert isinstance(v1_report, health_v1.NodeWatchResourcesResponse)
    assert isinstance(alpha_report, health_v1alpha1.NodeWatchResourcesResponse)
    assert entries(v1_report) == entries(alpha_report)
    assert entries(v1_report)[:2] == [
        ("node1", "gpu-0", "UNHEALTHY", 1_700_000_000, 30, "XID 79 (GPU has fallen off the bus)"),
        ("node1", "gpu-1", "HEALTHY", 1_700_000_001, 30, ""),
    ]
    assert [e[1] for e in entries(v1_report)] == [f"gpu-{i}" for i in range(8)]
    assert all(d.health_check_timeout_seconds == 30 for d in v1_report.devices)


def test_a_healthy_device_is_re_sent_every_interval_and_never_goes_unknown(
    watched: NodePlugin, watches: list[KubeletHealthWatch]
) -> None:
    kubelet = watch(watched, watches)
    assert kubelet.wait_for(lambda: len(kubelet.arrivals) >= 6, 5)
    gaps = [b - a for a, b in pairwise(kubelet.arrivals)][:5]
    # every 0.2 s (the interval), not faster, with scheduling slack on a loaded machine
    assert all(0.15 <= gap <= 1.0 for gap in gaps), gaps
    seen = kubelet.health("node1", "gpu-3")
    assert seen.status == "HEALTHY" and seen.timeout_s == 30
    assert time.monotonic() - seen.received_s < 1.0  # refreshed, though it never changed
    assert seen.last_updated_time == 1_700_000_003  # ... and still says when it last changed


def test_a_device_not_re_sent_within_its_timeout_reads_unknown(
    tmp_path: Path,
    kube: KubeClient,  # noqa: F811 - the fixture imported above
    watches: list[KubeletHealthWatch],
) -> None:
    """What the periodic re-send prevents: with reports only on changes (a 60 s interval), the
    kubelet's clock passing the announced 30 s turns a healthy device Unknown; the next report
    brings it back."""
    plugin = start_plugin(tmp_path, kube, health_interval_s=60, health=lambda: STATES)
    try:
        skew = [0.0]
        kubelet = watch(plugin, watches, clock=lambda: time.monotonic() + skew[0])
        assert kubelet.wait_for(shows(kubelet, "gpu-1", "HEALTHY"))
        skew[0] = 29.0
        assert kubelet.health("node1", "gpu-1").status == "HEALTHY"
        skew[0] = 31.0
        assert kubelet.health("node1", "gpu-1").status == "UNKNOWN"
        plugin.health_changed()
        assert kubelet.wait_for(shows(kubelet, "gpu-1", "HEALTHY"))
    finally:
        plugin.stop()


def test_an_unhealthy_gpu_reaches_a_1_37_kubelet_over_v1_at_once(
    tmp_path: Path,
    rig_factory: Callable[..., Rig],  # noqa: F811 - the fixture imported above
    watches: list[KubeletHealthWatch],
) -> None:
    """The real monitor with simulated GPUs through pynvml: an XID makes the device UNHEALTHY
    on the v1 stream at once (not at the next periodic report), with its reason."""
    rig = rig_factory(check_interval_s=0.05)
    plugin = start_plugin(
        tmp_path, rig.kube, gpus=rig.inventory, health_interval_s=10, health=rig.monitor.states
    )
    rig.monitor.subscribe(plugin.health_changed)
    try:
        kubelet = watch(plugin, watches)
        assert kubelet.wait_for(shows(kubelet, "gpu-0", "HEALTHY"))
        assert kubelet.service == V1
        rig.inject(kind="xid", gpu=0, xid=79)
        began = time.monotonic()
        assert kubelet.wait_for(shows(kubelet, "gpu-0", "UNHEALTHY"))
        assert time.monotonic() - began < 2  # pushed by the change, not the 10 s interval
        seen = kubelet.health("node1", "gpu-0")
        assert "XID 79" in seen.message
        assert abs(seen.last_updated_time - time.time()) <= 2
        assert kubelet.health("node1", "gpu-1").status == "HEALTHY"
    finally:
        plugin.stop()


def test_the_stream_ends_at_stop_and_the_kubelet_forgets_the_health(
    tmp_path: Path,
    kube: KubeClient,  # noqa: F811 - the fixture imported above
    watches: list[KubeletHealthWatch],
) -> None:
    plugin = start_plugin(tmp_path, kube, health_interval_s=60, health=lambda: STATES)
    kubelet = watch(plugin, watches, retry_s=60)
    assert kubelet.wait_for(shows(kubelet, "gpu-1", "HEALTHY"))
    began = time.monotonic()
    plugin.stop()  # ends open streams now, not at their next report 60 s later
    assert kubelet.wait_for(shows(kubelet, "gpu-1", "UNKNOWN"), 3)
    assert time.monotonic() - began < 3


def test_a_plugin_without_v1_is_still_watched_over_v1alpha1(
    tmp_path: Path, watches: list[KubeletHealthWatch]
) -> None:
    """An older plugin (v1alpha1 only, as gpu-dra before 1.37 support) with a 1.37 kubelet."""

    class OldPlugin(health_v1alpha1_grpc.DRAResourceHealthServicer):
        def NodeWatchResources(self, request: object, context: object) -> Iterator[Any]:
            device = health_v1alpha1.DeviceIdentifier(pool_name="node1", device_name="gpu-0")
            yield health_v1alpha1.NodeWatchResourcesResponse(
                devices=[
                    health_v1alpha1.DeviceHealth(device=device, health=health_v1alpha1.HEALTHY)
                ]
            )
            time.sleep(1)

    class Registration(reg_grpc.RegistrationServicer):
        def GetInfo(self, request: object, context: object) -> reg.PluginInfo:
            return reg.PluginInfo(
                type="DRAPlugin",
                name="gpu.nvidia.com",
                endpoint=str(tmp_path / "dra.sock"),
                supported_versions=["v1.DRAPlugin", V1ALPHA1],
            )

        def NotifyRegistrationStatus(
            self, request: object, context: object
        ) -> reg.RegistrationStatusResponse:
            return reg.RegistrationStatusResponse()

    server = grpc.server(ThreadPoolExecutor(max_workers=4))
    health_v1alpha1_grpc.add_DRAResourceHealthServicer_to_server(OldPlugin(), server)
    reg_grpc.add_RegistrationServicer_to_server(Registration(), server)
    server.add_insecure_port(f"unix://{tmp_path / 'dra.sock'}")
    server.add_insecure_port(f"unix://{tmp_path / 'reg.sock'}")
    server.start()
    try:
        kubelet = KubeletHealthWatch(tmp_path / "reg.sock").start()
        watches.append(kubelet)
        assert kubelet.wait_for(shows(kubelet, "gpu-0", "HEALTHY"))
        assert kubelet.service == V1ALPHA1
    finally:
        server.stop(0).wait()


@pytest.mark.parametrize(("seconds", "ok"), [(10, True), (0.1, True), (15, True), (0.05, False),
                                             (16, False), (30, False)])  # fmt: skip
def test_the_report_interval_stays_under_half_the_kubelets_timeout(
    tmp_path: Path, seconds: float, ok: bool
) -> None:
    base = make_config(tmp_path)
    if ok:
        assert replace(base, health_report_interval_s=seconds).health_report_interval_s == seconds
        return
    with pytest.raises(ConfigError, match=r"--health-report-interval \(HEALTH_REPORT_INTERVAL\)"):
        replace(base, health_report_interval_s=seconds)


def test_the_flag_and_its_environment_twin_set_the_interval() -> None:
    assert cli.build_config([], {"NODE_NAME": "n1"}).health_report_interval_s == 10
    flag = cli.build_config(["--health-report-interval", "2.5"], {"NODE_NAME": "n1"})
    env = cli.build_config([], {"NODE_NAME": "n1", "HEALTH_REPORT_INTERVAL": "5"})
    assert (flag.health_report_interval_s, env.health_report_interval_s) == (2.5, 5)


def test_the_configured_interval_is_the_one_the_stream_keeps(
    tmp_path: Path,
    kube: KubeClient,  # noqa: F811 - the fixture imported above
    watches: list[KubeletHealthWatch],
) -> None:
    """node/wiring.py hands --health-report-interval to the plugin (no test override here)."""
    config = replace(make_config(tmp_path), health_report_interval_s=0.3)
    plugin = kubelet_plugin(config=config, inventory=inventory(), claims=kube)
    plugin.start()
    try:
        kubelet = watch(plugin, watches)
        assert kubelet.wait_for(lambda: len(kubelet.arrivals) >= 4, 5)
        gaps = [b - a for a, b in pairwise(kubelet.arrivals)][:3]
        assert all(0.25 <= gap <= 1.2 for gap in gaps), gaps
    finally:
        plugin.stop()
