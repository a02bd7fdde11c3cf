"""The series the chart's alerts read (node/healthmetrics.py), from a real HealthBook: conditions
per device with their XID and fatality, health taint counts, readiness."""

from __future__ import annotations

from dra_driver.gpus.observations import GpuChecked, XidObserved
from dra_driver.health.decisions import ActiveCondition, HealthBook, HealthPolicy
from dra_driver.metrics import Registry
from dra_driver.node.healthmetrics import HealthMetrics
from tests.exposition import Series, find, parse
from tests.test_health_decisions import GPU, MIG, book, healthy_check

POLICY = HealthPolicy(driver_name="gpu.nvidia.com", min_change_interval_s=0)


def served(health: HealthBook, problems: list[str]) -> Series:
    registry = Registry()
    registry.register_formatted(
        HealthMetrics(
            node_name="n1",
            conditions=health.conditions,
            states=health.states,
            readiness=[lambda: problems],
        )
    )
    return parse(registry.render())


def test_conditions_carry_the_xid_and_whether_it_is_fatal() -> None:
    health = book(POLICY, GPU, MIG)
    health.record(XidObserved("GPU-0", 62), now_s=1.0)  # not fatal
    health.record(XidObserved("GPU-0", 79), now_s=2.0)  # fatal: the kind's value is 79
    health.record(XidObserved("GPU-1", 62, gpu_instance_id=2, compute_instance_id=0), now_s=2.0)
    health.record(healthy_check("GPU-1", temperature_c=90), now_s=3.0)
    health.settle(now_s=3.0)
    assert health.conditions() == {
        "gpu-0": (ActiveCondition("xid", "79", True),),
        "gpu-1-mig-3g40gb-9-0": (ActiveCondition("thermal-slowdown", "", False),),
        "gpu-1-mig-3g40gb-9-4": (
            ActiveCondition("xid", "62", False),
            ActiveCondition("thermal-slowdown", "", False),
        ),
    }
    series = served(health, [])
    conditions = find(series, "gpu_dra_gpu_condition")
    assert sorted(
        (d["device"], d["condition"], d["value"], d["fatal"], v)
        for d, v in ((dict(k), v) for k, v in conditions.items())
    ) == [
        ("gpu-0", "xid", "79", "true", 1.0),
        ("gpu-1-mig-3g40gb-9-0", "thermal-slowdown", "", "false", 1.0),
        ("gpu-1-mig-3g40gb-9-4", "thermal-slowdown", "", "false", 1.0),
        ("gpu-1-mig-3g40gb-9-4", "xid", "62", "false", 1.0),
    ]
    assert all(dict(k)["node"] == "n1" for k in conditions)
    taints = {dict(k)["device"]: v for k, v in find(series, "gpu_dra_device_health_taints").items()}
    assert taints == {"gpu-0": 1.0, "gpu-1-mig-3g40gb-9-0": 1.0, "gpu-1-mig-3g40gb-9-4": 2.0}


def test_a_reset_clears_the_conditions_and_healthy_devices_read_zero_taints() -> None:
    health = book(POLICY, GPU)
    health.record(GpuChecked("GPU-0", lost=True), now_s=1.0)
    health.settle(now_s=1.0)
    assert [c.kind for c in health.conditions()["gpu-0"]] == ["gpu-lost"]
    health.record(healthy_check("GPU-0"), now_s=2.0)
    health.settle(now_s=2.0)
    assert health.conditions() == {}
    series = served(health, [])
    assert find(series, "gpu_dra_gpu_condition") == {}
    assert list(find(series, "gpu_dra_device_health_taints").values()) == [0.0]


def test_readiness_is_one_only_while_no_check_has_a_problem() -> None:
    problems: list[str] = []
    health = book(POLICY, GPU)
    assert list(find(served(health, problems), "gpu_dra_agent_ready").values()) == [1.0]
    problems.append("kubelet has not registered the plugin yet")
    ready = find(served(health, problems), "gpu_dra_agent_ready")
    assert [(dict(k), v) for k, v in ready.items()] == [({"node": "n1"}, 0.0)]


def test_the_exposition_is_formatted_again_only_when_an_input_changed() -> None:
    health = book(POLICY, GPU)
    problems: list[str] = []
    metrics = HealthMetrics(
        node_name="n1",
        conditions=health.conditions,
        states=health.states,
        readiness=[lambda: problems],
    )
    first = metrics.exposition()
    assert metrics.exposition() is first  # nothing changed: the same text, not formatted again
    problems.append("NVML does not answer")
    not_ready = metrics.exposition()
    assert list(find(parse(not_ready), "gpu_dra_agent_ready").values()) == [0.0]
    health.record(XidObserved("GPU-0", 48), now_s=1.0)
    health.settle(now_s=1.0)
    tainted = parse(metrics.exposition())
    assert list(find(tainted, "gpu_dra_gpu_condition", value="48", fatal="true").values()) == [1.0]
    assert list(find(tainted, "gpu_dra_device_health_taints", device="gpu-0").values()) == [1.0]
