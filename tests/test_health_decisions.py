"""Health decisions without any fake: observations in, taints and states out, time passed in."""

from __future__ import annotations

import pytest

from dra_driver.devices import Taint, node_devices, with_taints
from dra_driver.gpus.observations import EccObserved, GpuChecked, XidObserved
from dra_driver.health.decisions import (
    DEFAULT_IGNORED_XIDS,
    MAX_HEALTH_TAINTS,
    GpuTarget,
    HealthBook,
    HealthPolicy,
    format_xids,
    gpu_targets,
    parse_xids,
)
from dra_driver.sim.fakedriver import simulated_inventory

GPU = GpuTarget(0, "GPU-0", "gpu-0", ("gpu-0",))
MIG = GpuTarget(
    1,
    "GPU-1",
    "gpu-1",
    ("gpu-1-mig-3g40gb-9-0", "gpu-1-mig-3g40gb-9-4"),
    {(1, 0): "gpu-1-mig-3g40gb-9-0", (2, 0): "gpu-1-mig-3g40gb-9-4"},
)
POLICY = HealthPolicy(driver_name="gpu.nvidia.com", min_change_interval_s=0)


def book(policy: HealthPolicy = POLICY, *targets: GpuTarget) -> HealthBook:
    b = HealthBook(policy, targets or (GPU, MIG), now_s=0.0)
    for t in targets or (GPU, MIG):
        b.record(GpuChecked(gpu_uuid=t.uuid), now_s=0.0)
    b.settle(now_s=0.0)
    return b


def healthy_check(uuid: str = "GPU-0", **kw: object) -> GpuChecked:
    fields: dict[str, object] = {
        "ecc_uncorrected": 0,
        "remapped_rows_pending": False,
        "row_remap_failed": False,
        "temperature_c": 40,
        "slowdown_c": 87,
    }
    return GpuChecked(gpu_uuid=uuid, **{**fields, **kw})  # type: ignore[arg-type]


def taint(kind: str, value: str = "", effect: str = "NoSchedule") -> Taint:
    return Taint(key=f"gpu.nvidia.com/{kind}", value=value, effect=effect)  # type: ignore[arg-type]


def test_targets_name_the_gpu_or_its_mig_devices_as_devices_py_publishes_them() -> None:
    inventory = simulated_inventory("h100:1,a100-40gb:1:mig=3g.20gb+2g.10gb", node_name="n")
    plain, mig = gpu_targets(inventory)
    assert (plain.name, plain.devices, dict(plain.migs)) == ("gpu-0", ("gpu-0",), {})
    assert mig.name == "gpu-1"
    assert mig.devices == ("gpu-1-mig-3g20gb-9-0", "gpu-1-mig-2g10gb-14-4")
    assert dict(mig.migs) == {(2, 0): "gpu-1-mig-3g20gb-9-0", (5, 0): "gpu-1-mig-2g10gb-14-4"}


def test_in_dynamic_mig_mode_a_gpu_in_mig_mode_is_watched_under_its_own_name_too() -> None:
    inventory = simulated_inventory("h100:1,a100-40gb:1:mig=3g.20gb", node_name="n")
    plain, mig = gpu_targets(inventory, mig_mode="dynamic")
    assert plain.devices == ("gpu-0",)
    assert mig.devices == ("gpu-1", "gpu-1-mig-3g20gb-9-0")


def test_a_lost_partitionable_gpu_taints_every_placement() -> None:
    inventory = simulated_inventory("h100:1:mig=3g.40gb,h100:1:mig", node_name="n")
    lost, healthy = inventory.gpus
    managed = frozenset({"gpu-0-mig-3g40gb-9-0"})
    published = node_devices(
        inventory, driver_name="gpu.nvidia.com", mig_mode="dynamic", managed_mig=managed
    )
    b = HealthBook(POLICY, gpu_targets(inventory, mig_mode="dynamic"), now_s=0.0)
    b.record(GpuChecked(gpu_uuid=lost.uuid, lost=True, lost_reason="GPU is lost"), now_s=1.0)
    b.record(healthy_check(healthy.uuid), now_s=1.0)
    b.settle(now_s=1.0)

    tainted = with_taints(published, b.taints())

    on_lost = [d for d in tainted.devices if d.name.startswith("gpu-0")]
    assert len(on_lost) == 26  # the whole GPU and 25 placements, one of them created
    assert all(d.taints and d.taints[0] == taint("gpu-lost") for d in on_lost)
    assert all(not d.taints for d in tainted.devices if d.name.startswith("gpu-1"))


def test_devices_are_unknown_until_their_gpu_was_checked() -> None:
    b = HealthBook(POLICY, (GPU,), now_s=0.0)
    assert b.states()["gpu-0"].status == "Unknown"
    b.record(healthy_check(), now_s=1.0)
    b.settle(now_s=1.0)
    assert b.states()["gpu-0"].status == "Healthy"


def test_an_application_xid_taints_nothing_but_is_counted() -> None:
    b = book()
    for xid in sorted(DEFAULT_IGNORED_XIDS):
        b.record(XidObserved("GPU-0", xid), now_s=1.0)
    assert b.settle(now_s=1.0) == []
    assert b.taints() == {}
    assert b.xid_counts() == {("gpu-0", xid): 1 for xid in DEFAULT_IGNORED_XIDS}


def test_a_critical_xid_taints_the_gpu_and_goes_after_the_quiet_period() -> None:
    b = book(HealthPolicy(driver_name="gpu.nvidia.com", xid_quiet_period_s=60))
    b.record(XidObserved("GPU-0", 94), now_s=10.0)
    (change,) = b.settle(now_s=10.0)
    assert (change.device, change.after, change.healthy) == ("gpu-0", (taint("xid", "94"),), False)
    state = b.states()["gpu-0"]
    assert (state.status, state.message, state.changed_s) == ("Unhealthy", "XID 94", 10.0)
    assert b.next_deadline(now_s=10.0) == 70.0
    b.record(XidObserved("GPU-0", 94), now_s=50.0)  # the quiet period starts again
    assert b.settle(now_s=69.0) == []
    assert b.settle(now_s=109.0) == []
    (gone,) = b.settle(now_s=110.0)
    assert gone.healthy and gone.message == "cleared gpu.nvidia.com/xid=94"
    assert b.states()["gpu-0"].status == "Healthy"
    assert b.states()["gpu-0"].changed_s == 110.0


def test_a_fatal_xid_gets_the_fatal_effect_and_stays_until_the_gpu_is_reset() -> None:
    policy = HealthPolicy(
        driver_name="gpu.nvidia.com", fatal_taint_effect="NoExecute", xid_quiet_period_s=1
    )
    b = book(policy)
    b.record(XidObserved("GPU-0", 48), now_s=1.0)
    b.record(EccObserved("GPU-0"), now_s=1.0)
    b.record(healthy_check(ecc_uncorrected=1, remapped_rows_pending=True), now_s=1.0)
    b.settle(now_s=1.0)
    assert b.taints()["gpu-0"] == (
        taint("ecc-double-bit", effect="NoExecute"),
        taint("remapped-rows-pending"),
        taint("xid", "48", "NoExecute"),
    )
    b.settle(now_s=1000.0)
    assert len(b.taints()["gpu-0"]) == 3  # no quiet period for fatal conditions
    b.record(healthy_check(), now_s=1001.0)  # counts back at 0: the GPU was reset
    (change,) = b.settle(now_s=1001.0)
    assert change.healthy
    assert b.taints() == {}


def test_the_xid_taint_names_the_latest_fatal_xid_over_later_normal_ones() -> None:
    b = book()
    b.record(XidObserved("GPU-0", 94), now_s=1.0)
    b.record(XidObserved("GPU-0", 79), now_s=2.0)
    b.record(XidObserved("GPU-0", 94), now_s=3.0)
    b.settle(now_s=3.0)
    assert b.taints()["gpu-0"] == (taint("xid", "79"),)
    assert b.states()["gpu-0"].message == "XID 79 (3 XIDs)"


def test_a_lost_gpu_is_tainted_and_untainted_with_its_xids_when_it_answers_again() -> None:
    b = book()
    b.record(XidObserved("GPU-0", 79), now_s=1.0)
    b.record(GpuChecked(gpu_uuid="GPU-0", lost=True, lost_reason="GPU is lost"), now_s=1.0)
    b.settle(now_s=1.0)
    assert b.taints()["gpu-0"] == (taint("gpu-lost"), taint("xid", "79"))
    assert b.states()["gpu-0"].message == "NVML: GPU is lost; XID 79"
    b.record(GpuChecked(gpu_uuid="GPU-0", lost=True), now_s=30.0)
    assert b.settle(now_s=30.0) == []
    b.record(healthy_check(), now_s=31.0)
    (change,) = b.settle(now_s=31.0)
    assert change.healthy
    assert change.message == "cleared gpu.nvidia.com/gpu-lost; gpu.nvidia.com/xid=79"


def test_gpu_conditions_mark_every_mig_device_and_an_instance_xid_only_its_device() -> None:
    b = book()
    b.record(XidObserved("GPU-1", 94, gpu_instance_id=2, compute_instance_id=0), now_s=1.0)
    b.settle(now_s=1.0)
    assert b.taints() == {"gpu-1-mig-3g40gb-9-4": (taint("xid", "94"),)}
    b.record(healthy_check("GPU-1", temperature_c=90), now_s=2.0)
    b.settle(now_s=2.0)
    assert b.taints() == {
        "gpu-1-mig-3g40gb-9-0": (taint("thermal-slowdown"),),
        "gpu-1-mig-3g40gb-9-4": (taint("xid", "94"), taint("thermal-slowdown")),
    }


def test_an_xid_of_an_unknown_gpu_instance_marks_the_whole_gpu() -> None:
    b = book()
    b.record(XidObserved("GPU-1", 94, gpu_instance_id=7, compute_instance_id=0), now_s=1.0)
    b.settle(now_s=1.0)
    assert set(b.taints()) == set(MIG.devices)


def test_an_instance_xid_without_a_compute_instance_marks_that_gpu_instance() -> None:
    b = book()
    b.record(XidObserved("GPU-1", 94, gpu_instance_id=1), now_s=1.0)
    b.settle(now_s=1.0)
    assert set(b.taints()) == {"gpu-1-mig-3g40gb-9-0"}


@pytest.mark.parametrize(
    ("check", "kind", "effect"),
    [
        (healthy_check(ecc_uncorrected=2), "ecc-double-bit", "NoExecute"),
        (healthy_check(remapped_rows_pending=True), "remapped-rows-pending", "NoSchedule"),
        (healthy_check(row_remap_failed=True), "row-remap-failed", "NoExecute"),
        (healthy_check(retired_pages_pending=True), "retired-pages-pending", "NoSchedule"),
        (healthy_check(temperature_c=87), "thermal-slowdown", "NoSchedule"),
    ],
)
def test_each_polled_condition_taints_while_it_holds(
    check: GpuChecked, kind: str, effect: str
) -> None:
    b = book(HealthPolicy(driver_name="gpu.nvidia.com", fatal_taint_effect="NoExecute"))
    b.record(check, now_s=1.0)
    b.settle(now_s=1.0)
    assert b.taints() == {"gpu-0": (taint(kind, effect=effect),)}
    b.record(healthy_check(retired_pages_pending=False), now_s=20.0)
    b.settle(now_s=20.0)
    assert b.taints() == {}


def test_what_a_gpu_cannot_tell_keeps_its_condition() -> None:
    b = book()
    b.record(EccObserved("GPU-0"), now_s=1.0)
    b.record(GpuChecked(gpu_uuid="GPU-0"), now_s=2.0)  # every query unsupported
    b.settle(now_s=2.0)
    assert b.taints() == {"gpu-0": (taint("ecc-double-bit"),)}


def test_a_device_carries_at_most_four_health_taints_most_severe_first() -> None:
    b = book()
    b.record(XidObserved("GPU-0", 94), now_s=1.0)
    b.record(
        healthy_check(
            ecc_uncorrected=1, row_remap_failed=True, remapped_rows_pending=True, temperature_c=99
        ),
        now_s=1.0,
    )
    b.settle(now_s=1.0)
    assert [t.key.split("/")[1] for t in b.taints()["gpu-0"]] == [
        "ecc-double-bit",
        "row-remap-failed",
        "remapped-rows-pending",
        "xid",
    ]
    assert len(b.taints()["gpu-0"]) == MAX_HEALTH_TAINTS
    assert "temperature 99 C" in b.states()["gpu-0"].message  # the stream still says it


def test_a_new_taint_is_published_at_once_and_removals_wait_for_the_interval() -> None:
    b = book(HealthPolicy(driver_name="gpu.nvidia.com", min_change_interval_s=10))
    hot, cool = healthy_check(temperature_c=90), healthy_check()
    b.record(hot, now_s=100.0)
    assert [c.after for c in b.settle(now_s=100.0)] == [(taint("thermal-slowdown"),)]
    b.record(cool, now_s=101.0)
    assert b.settle(now_s=101.0) == []  # held back
    assert b.states()["gpu-0"].status == "Unhealthy"  # the stream agrees with the slice
    assert b.next_deadline(now_s=101.0) == 110.0
    b.record(hot, now_s=105.0)
    b.record(cool, now_s=106.0)  # flapping inside the interval: no change at all
    assert b.settle(now_s=106.0) == []
    (change,) = b.settle(now_s=110.0)
    assert change.healthy
    b.record(hot, now_s=111.0)  # a new problem is never held back
    assert len(b.settle(now_s=111.0)) == 1


def test_a_changed_value_is_rate_limited_like_a_removal() -> None:
    b = book(HealthPolicy(driver_name="gpu.nvidia.com", min_change_interval_s=10))
    b.record(XidObserved("GPU-0", 94), now_s=0.0)
    b.settle(now_s=0.0)
    b.record(XidObserved("GPU-0", 79), now_s=1.0)
    assert b.settle(now_s=1.0) == []
    (change,) = b.settle(now_s=10.0)
    assert change.after == (taint("xid", "79"),)


def test_new_targets_keep_the_conditions_of_gpus_that_stay() -> None:
    b = book()
    b.record(GpuChecked(gpu_uuid="GPU-1", lost=True), now_s=1.0)
    b.settle(now_s=1.0)
    relaid = GpuTarget(1, "GPU-1", "gpu-1", ("gpu-1-mig-7g80gb-0-0",), {(0, 0): "x"})
    b.set_targets((relaid,), now_s=2.0)
    (change,) = b.settle(now_s=2.0)
    assert change.device == "gpu-1-mig-7g80gb-0-0" and change.after == (taint("gpu-lost"),)
    assert b.states()["gpu-1-mig-7g80gb-0-0"].status == "Unhealthy"
    assert set(b.states()) == {"gpu-1-mig-7g80gb-0-0"}  # gpu-0 is gone, with its state


def test_observations_of_unknown_gpus_are_ignored() -> None:
    b = book()
    b.record(XidObserved("GPU-9", 94), now_s=1.0)
    assert b.settle(now_s=1.0) == [] and b.xid_counts() == {}


@pytest.mark.parametrize(
    ("text", "xids"),
    [("13,31, 43", {13, 31, 43}), ("none", set()), ("NONE", set()), ("79,", {79})],
)
def test_xid_lists_parse(text: str, xids: set[int]) -> None:
    assert parse_xids(text) == xids


@pytest.mark.parametrize("text", ["13,abc", "-1", "0", "", " , ", "1.5", "99999999999"])
def test_bad_xid_lists_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="XID"):
        parse_xids(text)


def test_xid_lists_format_back() -> None:
    assert format_xids({79, 13}) == "13,79"
    assert format_xids(()) == "none"
