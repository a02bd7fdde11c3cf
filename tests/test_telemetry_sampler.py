"""telemetry/sampler.py: targets, claim holders and the collector with injected readings (pure), the
sampling loop's interval, then the simulated GPUs read through the real pynvml calls and scraped
over real HTTP from the agent's metrics server, parsed with prometheus_client's parser."""

from __future__ import annotations

import itertools
import threading
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from dra_driver.errors import CheckpointError
from dra_driver.gpus import nvml
from dra_driver.gpus.info import Inventory
from dra_driver.gpus.readings import NvmlReader
from dra_driver.gpus.telemetryvalues import Reading, TelemetryTarget
from dra_driver.heartbeat import Heartbeat
from dra_driver.metrics import DriverMetrics, Registry
from dra_driver.node.http_server import metrics_server
from dra_driver.prepare.state.checkpoint import ClaimRecord, PreparedDevice
from dra_driver.sim.fakedriver import simulated_inventory
from dra_driver.sim.nvml import SimulatedNode, simulated_nvml
from dra_driver.telemetry.sampler import (
    DCGM_METRIC_NAMES,
    METRIC_NAMES,
    ClaimHolder,
    Holders,
    Telemetry,
    holders_from_records,
    telemetry_targets,
)
from tests import exposition

NODE = "node1"
REPO = Path(__file__).resolve().parent.parent
SPEC = "h100:2,a100-80gb:1:mig=3g.40gb+2g.20gb"
MIG_3G = "gpu-2-mig-3g40gb-9-0"


@pytest.fixture(scope="module")
def inventory() -> Inventory:
    return simulated_inventory(SPEC, node_name=NODE)


@dataclass
class FakeRead:
    """A telemetry.Read that returns fixed readings and counts its calls."""

    readings: Mapping[str, Reading]
    calls: int = 0

    def __call__(self, targets: Sequence[TelemetryTarget]) -> Mapping[str, Reading]:
        self.calls += 1
        return {t.uuid: self.readings[t.uuid] for t in targets if t.uuid in self.readings}


def uuid_of(inventory: Inventory, name: str) -> str:
    return next(t.uuid for t in telemetry_targets(inventory) if t.name == name)


def scrape_series(telemetry: Telemetry) -> exposition.Series:
    registry = Registry()
    registry.register_formatted(telemetry)
    return exposition.parse(registry.render())


# -- targets and holders ---------------------------------------------------------------------


def test_targets_are_every_gpu_and_mig_device_with_the_published_names(
    inventory: Inventory,
) -> None:
    targets = telemetry_targets(inventory)
    assert [(t.name, t.type, t.profile, t.gpu_minor, t.mig_enabled) for t in targets] == [
        ("gpu-0", "gpu", "", 0, False),
        ("gpu-1", "gpu", "", 1, False),
        ("gpu-2", "gpu", "", 2, True),  # in MIG mode: not published, but has temperature etc.
        (MIG_3G, "mig", "3g.40gb", 2, True),
        ("gpu-2-mig-2g20gb-14-4", "mig", "2g.20gb", 2, True),
    ]
    assert targets[3].uuid.startswith("MIG-")
    assert targets[0].product_name == "NVIDIA H100 80GB HBM3"


def record(
    uid: str, *devices: str, phase: str = "PrepareCompleted", name: str = "c"
) -> ClaimRecord:
    return ClaimRecord(
        uid,
        "team-a" if name else "",
        name,
        phase,  # type: ignore[arg-type]
        tuple(
            PreparedDevice(request_names=("r",), pool=NODE, device=d, cdi_device_ids=())
            for d in devices
        ),
    )


def test_holders_come_from_completed_claims_with_their_pods() -> None:
    holders = holders_from_records(
        [
            record("u1", "gpu-0", "gpu-1", name="train"),
            record("u2", "gpu-0", name="admin"),  # admin access: a second holder of gpu-0
            record("u3", "gpu-3", phase="PrepareStarted"),  # not prepared yet
            record("u4", "gpu-4", name=""),  # rebuilt from its CDI spec: no name yet
        ],
        pods={"u1": ("trainer-0", "trainer-1")},
    )
    assert holders == {
        "gpu-0": (
            ClaimHolder("team-a", "admin", "u2"),
            ClaimHolder("team-a", "train", "u1", ("trainer-0", "trainer-1")),
        ),
        "gpu-1": (ClaimHolder("team-a", "train", "u1", ("trainer-0", "trainer-1")),),
        "gpu-4": (ClaimHolder("", "", "u4"),),
    }


# -- the collector -----------------------------------------------------------------------------


def test_the_metrics_carry_device_labels_and_leave_out_what_a_device_lacks(
    inventory: Inventory,
) -> None:
    gpu0, mig = uuid_of(inventory, "gpu-0"), uuid_of(inventory, MIG_3G)
    read = FakeRead(
        {
            gpu0: Reading(
                utilization_ratio=0.5,
                memory_utilization_ratio=0.25,
                memory_used_bytes=1 << 30,
                memory_total_bytes=80 << 30,
                temperature_celsius=60,
                power_usage_watts=350.5,
                power_limit_watts=700,
                sm_clock_hertz=1.98e9,
                ecc_corrected_errors=3,
                ecc_uncorrected_errors=0,
            ),
            mig: Reading(memory_used_bytes=2 << 30, memory_total_bytes=40 << 30),
        }
    )
    holders = {MIG_3G: (ClaimHolder("team-a", "infer", "u9", ("server-0",)),)}
    telemetry = Telemetry(
        node_name=NODE, inventory=inventory, read=read, holders=lambda: holders, clock=lambda: 1e9
    )
    telemetry.sample()
    series = scrape_series(telemetry)
    gpu0_labels = {"node": NODE, "device": "gpu-0", "uuid": gpu0, "gpu": "0"}
    assert exposition.value(series, "gpu_dra_gpu_utilization_ratio", **gpu0_labels) == 0.5
    assert exposition.value(series, "gpu_dra_gpu_memory_used_bytes", **gpu0_labels) == 1 << 30
    assert exposition.value(series, "gpu_dra_gpu_temperature_celsius", **gpu0_labels) == 60
    assert exposition.value(series, "gpu_dra_gpu_power_usage_watts", **gpu0_labels) == 350.5
    assert exposition.value(series, "gpu_dra_gpu_power_limit_watts", **gpu0_labels) == 700
    assert exposition.value(series, "gpu_dra_gpu_sm_clock_hertz", **gpu0_labels) == 1.98e9
    ecc = "gpu_dra_gpu_ecc_errors_total"
    assert exposition.value(series, ecc, **gpu0_labels, error_type="corrected") == 3
    assert exposition.value(series, ecc, **gpu0_labels, error_type="uncorrected") == 0
    # A MIG device: its profile, no claim label; only what it reported.
    mig_labels = {"node": NODE, "device": MIG_3G, "uuid": mig, "gpu": "2", "profile": "3g.40gb"}
    assert exposition.value(series, "gpu_dra_gpu_memory_total_bytes", **mig_labels) == 40 << 30
    assert exposition.find(series, "gpu_dra_gpu_utilization_ratio", device=MIG_3G) == {}
    assert exposition.find(series, ecc, device=MIG_3G) == {}
    # Who holds it: one info series per (device, claim, pod), the only series with claim labels.
    assert exposition.value(
        series, "gpu_dra_device_claim_info", node=NODE, device=MIG_3G, uuid=mig, gpu="2",
        claim_namespace="team-a", claim_name="infer", claim_uid="u9", pod_namespace="team-a",
        pod_name="server-0",
    ) == 1  # fmt: skip
    with_claims = {name for name, labels in series if "claim_name" in dict(labels)}
    assert with_claims == {"gpu_dra_device_claim_info"}
    # Every device has its info line, even those without a reading.
    info = exposition.find(series, "gpu_dra_gpu_info")
    assert sorted(dict(k)["device"] for k in info) == sorted(
        t.name for t in telemetry_targets(inventory)
    )
    assert exposition.value(
        series, "gpu_dra_gpu_info", **gpu0_labels, type="gpu", product="NVIDIA H100 80GB HBM3",
        mig_enabled="false",
    ) == 1  # fmt: skip
    assert exposition.value(series, "gpu_dra_telemetry_last_sample_timestamp_seconds", node=NODE)
    assert {name for name, _ in series} <= set(METRIC_NAMES)


def test_without_health_providers_there_are_no_health_series_and_with_them_there_are(
    inventory: Inventory,
) -> None:
    telemetry = Telemetry(node_name=NODE, inventory=inventory, read=FakeRead({}))
    telemetry.sample()
    series = scrape_series(telemetry)
    assert exposition.find(series, "gpu_dra_gpu_health") == {}
    assert exposition.find(series, "gpu_dra_gpu_xid_errors_total") == {}
    states = {"gpu-0": "Healthy", "gpu-1": "Unhealthy"}
    counts = {("gpu-1", 79): 1, ("gpu-1", 48): 1}
    telemetry.set_health_providers(states=lambda: states, xid_counts=lambda: counts)
    series = scrape_series(telemetry)
    health = exposition.find(series, "gpu_dra_gpu_health")
    assert {dict(k)["device"]: dict(k)["state"] for k in health} == states
    assert set(health.values()) == {1.0}
    # Every device has its XID counter, at 0 until its first XID.
    xids = exposition.find(series, "gpu_dra_gpu_xid_errors_total")
    assert {dict(k)["device"]: v for k, v in xids.items()} == {
        t.name: 2 if t.name == "gpu-1" else 0 for t in telemetry_targets(inventory)
    }
    states["gpu-1"] = "Healthy"  # read at each scrape, not at the sample
    series = scrape_series(telemetry)
    health = exposition.find(series, "gpu_dra_gpu_health", device="gpu-1")
    assert [dict(k)["state"] for k in health] == ["Healthy"]


def test_the_exposition_is_formatted_once_per_change(inventory: Inventory) -> None:
    gpu0 = uuid_of(inventory, "gpu-0")
    read = FakeRead({gpu0: Reading(temperature_celsius=40)})
    telemetry = Telemetry(node_name=NODE, inventory=inventory, read=read)
    telemetry.sample()
    first = telemetry.exposition()
    assert telemetry.exposition() is first  # nothing changed: the same text, not formatted again
    telemetry.sample()
    assert telemetry.exposition() is not first  # a new sample (its timestamp at least)
    second = telemetry.exposition()
    telemetry.set_health_providers(states=lambda: {"gpu-0": "Healthy"})
    assert 'state="Healthy"' in telemetry.exposition().text()
    assert telemetry.exposition() is not second


def test_a_re_discovery_changes_the_devices_reported(inventory: Inventory) -> None:
    telemetry = Telemetry(node_name=NODE, inventory=inventory, read=FakeRead({}))
    telemetry.sample()
    telemetry.set_inventory(simulated_inventory("l4:1", node_name=NODE))
    info = exposition.find(scrape_series(telemetry), "gpu_dra_gpu_info")
    assert [dict(k)["product"] for k in info] == ["NVIDIA L4"]


def test_claims_the_checkpoint_cannot_give_keep_the_last_answer(inventory: Inventory) -> None:
    answers: list[Holders | Exception] = [
        {"gpu-0": (ClaimHolder("ns", "c", "u"),)},
        CheckpointError("the checkpoint is not open"),
    ]

    def holders() -> Holders:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    telemetry = Telemetry(node_name=NODE, inventory=inventory, read=FakeRead({}), holders=holders)
    telemetry.sample()
    assert telemetry.sample().holders == {"gpu-0": (ClaimHolder("ns", "c", "u"),)}


def test_with_sampling_off_claims_and_info_are_still_served(inventory: Inventory) -> None:
    holders = {"gpu-1": (ClaimHolder("ns", "c", "u", ("p",)),)}
    telemetry = Telemetry(
        node_name=NODE,
        inventory=inventory,
        read=FakeRead({}),
        interval_s=0,
        holders=lambda: holders,
    )
    telemetry.start()  # nothing to start
    with pytest.raises(ValueError, match="off"):
        telemetry.sample()
    series = scrape_series(telemetry)
    assert exposition.find(series, "gpu_dra_device_claim_info", device="gpu-1", pod_name="p")
    assert exposition.find(series, "gpu_dra_gpu_info", device="gpu-1")
    assert exposition.find(series, "gpu_dra_telemetry_last_sample_timestamp_seconds") == {}
    telemetry.stop()


def test_an_interval_below_one_second_is_refused(inventory: Inventory) -> None:
    with pytest.raises(ValueError, match="below"):
        Telemetry(node_name=NODE, inventory=inventory, read=FakeRead({}), interval_s=0.5)


# -- the loop ------------------------------------------------------------------------------------


def test_the_loop_samples_at_once_then_every_interval_and_stops_promptly(
    inventory: Inventory,
) -> None:
    times: list[float] = []
    two_more = threading.Event()

    def read(targets: Sequence[TelemetryTarget]) -> dict[str, Reading]:
        times.append(time.monotonic())
        if len(times) >= 3:
            two_more.set()
        return {}

    beat = Heartbeat("telemetry", stall_s=60)
    telemetry = Telemetry(
        node_name=NODE, inventory=inventory, read=read, interval_s=1, heartbeat=beat
    )
    started = time.monotonic()
    telemetry.start()
    assert two_more.wait(10)
    telemetry.stop()
    stopped = time.monotonic()
    assert times[0] - started < 0.5  # the first pass runs at once
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert all(gap >= 0.99 for gap in gaps), gaps  # never more often than the interval
    assert stopped - times[-1] < 1.5  # stop() does not wait out the interval
    assert beat.passes == len(times) and beat.problem() is None
    count = len(times)
    time.sleep(1.2)
    assert len(times) == count  # stopped for good


# -- simulated GPUs, through pynvml ---------------------------------------------------------


@pytest.fixture
def node() -> Iterator[SimulatedNode]:
    with simulated_nvml(SPEC, node_name=NODE) as simulated:
        yield simulated


def discovered(node: SimulatedNode) -> Inventory:
    return nvml.discover(driver_root=Path("/"), sysfs_root=node.sysfs_root)


def test_simulated_gpus_are_scraped_over_http_with_plausible_moving_values(
    node: SimulatedNode,
) -> None:
    inventory = discovered(node)
    busy = uuid_of(inventory, "gpu-0")
    node.library.workload = lambda uuid: uuid == busy
    now = [1_700_000_000.0]
    node.library.clock = lambda: now[0]
    reader = NvmlReader()
    registry = Registry()
    DriverMetrics(registry, driver_name="gpu.nvidia.com", node_name=NODE)
    telemetry = registry.register_formatted(
        Telemetry(node_name=NODE, inventory=inventory, read=reader)
    )
    server = metrics_server(registry, port=0, host="127.0.0.1")
    server.start()
    try:
        telemetry.sample()
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as r:
            series = exposition.parse(r.read().decode())
        names = {name for name, _ in series}
        assert names >= {
            "gpu_dra_gpu_info", "gpu_dra_gpu_utilization_ratio",
            "gpu_dra_gpu_memory_utilization_ratio", "gpu_dra_gpu_memory_used_bytes",
            "gpu_dra_gpu_memory_total_bytes", "gpu_dra_gpu_temperature_celsius",
            "gpu_dra_gpu_power_usage_watts", "gpu_dra_gpu_power_limit_watts",
            "gpu_dra_gpu_sm_clock_hertz", "gpu_dra_gpu_ecc_errors_total",
            "gpu_dra_telemetry_last_sample_timestamp_seconds",
            "gpu_dra_telemetry_sample_duration_seconds", "nvidia_dra_requests_total",
        }  # fmt: skip

        def one(name: str, device: str) -> float:
            (found,) = exposition.find(series, name, device=device).values()
            return found

        util = "gpu_dra_gpu_utilization_ratio"
        assert 0.6 <= one(util, "gpu-0") <= 1 and 0 <= one(util, "gpu-1") <= 0.15
        assert (
            25
            <= one("gpu_dra_gpu_temperature_celsius", "gpu-1")
            < one("gpu_dra_gpu_temperature_celsius", "gpu-0")
            <= 80
        )
        power, limit = one("gpu_dra_gpu_power_usage_watts", "gpu-0"), 700
        assert one("gpu_dra_gpu_power_limit_watts", "gpu-0") == limit
        assert 0.5 * limit <= power <= limit
        assert 300e6 <= one("gpu_dra_gpu_sm_clock_hertz", "gpu-1") < 2e9
        total = one("gpu_dra_gpu_memory_total_bytes", "gpu-0")
        assert total == 81559 << 20
        assert 0.3 * total < one("gpu_dra_gpu_memory_used_bytes", "gpu-0") < total
        assert one("gpu_dra_gpu_memory_used_bytes", "gpu-1") < 0.05 * total
        assert one("gpu_dra_gpu_memory_total_bytes", MIG_3G) == 40192 << 20
        # NOT_SUPPORTED leaves metrics out: utilisation of MIG devices and of their GPU.
        assert exposition.find(series, util, device=MIG_3G) == {}
        assert exposition.find(series, util, device="gpu-2") == {}
        assert exposition.find(series, "gpu_dra_gpu_temperature_celsius", device="gpu-2")
        # The values move with time, the same way for the same time (but the energy, which
        # only ever adds up).
        first = without_energy(reader.read(telemetry.targets))
        now[0] += 60
        later = without_energy(reader.read(telemetry.targets))
        assert first != later
        now[0] -= 60
        assert without_energy(reader.read(telemetry.targets)) == first
    finally:
        server.stop()
        reader.close()


def without_energy(readings: Mapping[str, Reading]) -> dict[str, Reading]:
    return {uuid: replace(r, energy_millijoules=None) for uuid, r in readings.items()}


def test_ecc_errors_show_as_volatile_counts(node: SimulatedNode) -> None:
    inventory = discovered(node)
    gpu1 = uuid_of(inventory, "gpu-1")
    node.library.add_ecc_errors(gpu1, corrected=5, uncorrected=1)
    reader = NvmlReader()
    try:
        readings = reader.read(telemetry_targets(inventory))
    finally:
        reader.close()
    assert (readings[gpu1].ecc_corrected_errors, readings[gpu1].ecc_uncorrected_errors) == (5, 1)
    gpu0 = readings[uuid_of(inventory, "gpu-0")]
    assert (gpu0.ecc_corrected_errors, gpu0.ecc_uncorrected_errors) == (0, 0)


def test_every_metric_the_agent_exposes_is_documented() -> None:
    docs = (REPO / "docs" / "metrics.md").read_text() + (REPO / "docs" / "plugin.md").read_text()
    registry = Registry()
    DriverMetrics(registry, driver_name="gpu.nvidia.com", node_name=NODE)
    names = set(exposition.types(registry.render())) | set(METRIC_NAMES) | set(DCGM_METRIC_NAMES)
    assert sorted(name for name in names if f"`{name}`" not in docs) == []
