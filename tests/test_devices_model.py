"""model.py: the device model's values, and health taints added to a node's devices (a GPU's
taints reach every partition of it)."""

from __future__ import annotations

from dra_driver.devices.model import (
    CounterConsumption,
    CounterSet,
    Device,
    NodeDevices,
    RequestPolicy,
    Taint,
    with_taints,
)

LOST = (Taint(key="gpu.nvidia.com/gpu-lost", value="", effect="NoSchedule"),)
XID = (Taint(key="gpu.nvidia.com/xid", value="79", effect="NoExecute"),)
OLD = (Taint(key="admin/maintenance", value="", effect="None"),)


def placement(name: str, *counter_sets: str, taints: tuple[Taint, ...] = ()) -> Device:
    return Device(
        name=name,
        attributes={"type": "mig"},
        capacity={},
        consumes_counters=tuple(
            CounterConsumption(s, {"memory-slice-0": "1"}) for s in counter_sets
        ),
        taints=taints,
    )


GPU_SET = CounterSet(name="gpu-0-counter-set", counters={"memory-slice-0": "1"})
POOL = NodeDevices(
    devices=(
        placement("gpu-0", "gpu-0-counter-set"),
        placement("gpu-0-mig-1g10gb-19-0", "gpu-0-counter-set"),
        placement("gpu-1"),
        placement("gpu-2-mig-1g10gb-19-0", "other", "gpu-2-counter-set"),
    ),
    counter_sets=(GPU_SET,),
)


def taints_of(pool: NodeDevices) -> dict[str, tuple[Taint, ...]]:
    return {d.name: d.taints for d in pool.devices}


def test_a_device_has_no_counters_taints_or_shares_unless_given() -> None:
    device = Device(name="gpu-0", attributes={}, capacity={})

    assert device.consumes_counters == ()
    assert device.taints == ()
    assert device.allow_multiple_allocations is False
    assert device.request_policies == {}
    assert RequestPolicy() == RequestPolicy(
        default=None, valid_values=(), range_min=None, range_max=None, range_step=None
    )
    assert NodeDevices() == NodeDevices(devices=(), counter_sets=())


def test_nothing_to_add_returns_the_pool_itself() -> None:
    assert with_taints(POOL, {}) is POOL
    assert with_taints(POOL, {"gpu-9": LOST, "gpu-1": ()}) is POOL


def test_a_gpus_taints_reach_every_device_consuming_from_its_counter_set() -> None:
    tainted = with_taints(POOL, {"gpu-0": LOST, "gpu-2": XID})

    assert taints_of(tainted) == {
        "gpu-0": LOST,
        "gpu-0-mig-1g10gb-19-0": LOST,
        "gpu-1": (),
        "gpu-2-mig-1g10gb-19-0": XID,  # its second counter set is its GPU's
    }
    assert tainted.counter_sets == (GPU_SET,)


def test_a_devices_own_taints_win_over_its_gpus_and_add_to_those_it_has() -> None:
    pool = NodeDevices(
        devices=(placement("gpu-0-mig-1g10gb-19-0", "gpu-0-counter-set", taints=OLD),)
    )

    tainted = with_taints(pool, {"gpu-0": LOST, "gpu-0-mig-1g10gb-19-0": XID})

    assert taints_of(tainted) == {"gpu-0-mig-1g10gb-19-0": OLD + XID}
    assert taints_of(with_taints(pool, {"gpu-0": LOST})) == {"gpu-0-mig-1g10gb-19-0": OLD + LOST}


def test_only_a_counter_set_named_for_a_gpu_passes_its_taints_on() -> None:
    pool = NodeDevices(
        devices=(
            placement("a", "gpu-0-counter-set-b"),
            placement("b", "gpu-0"),
            placement("c", "counter-set"),
            placement("d", ""),
        )
    )

    tainted = with_taints(pool, {"gpu-0": LOST, "": XID, "gpu-0-counter-set": OLD, "c": ()})

    assert tainted is pool
