"""The NVML side of health checking, against simulated GPUs through pynvml: what events and
checks turn into, and GPUs without event support left to polling (logged once)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pynvml
import pytest

from dra_driver.errors import HealthWatchError
from dra_driver.gpus import nvml
from dra_driver.gpus.healthwatch import NvmlHealthWatch
from dra_driver.gpus.info import Inventory
from dra_driver.gpus.observations import EccObserved, GpuChecked, XidObserved
from dra_driver.sim.faults import SimulatedFault
from dra_driver.sim.nvml import SimulatedNode, simulated_nvml

SPEC = "h100:1,t4:1,a100-40gb:1:mig=3g.20gb+2g.10gb,l4:1:no-events"


@pytest.fixture
def node() -> Iterator[tuple[SimulatedNode, Inventory, NvmlHealthWatch]]:
    with simulated_nvml(SPEC, node_name="n") as simulated:
        inventory = nvml.discover(driver_root=Path("/"), sysfs_root=simulated.sysfs_root)
        watch = NvmlHealthWatch()
        watch.open()
        try:
            yield simulated, inventory, watch
        finally:
            watch.close()


def test_every_gpu_with_events_is_registered_and_the_others_are_logged_once(
    node: tuple[SimulatedNode, Inventory, NvmlHealthWatch], caplog: pytest.LogCaptureFixture
) -> None:
    _, inventory, watch = node
    with caplog.at_level(logging.WARNING, logger="dra_driver.gpus.healthwatch"):
        for _ in range(2):
            for gpu in inventory.gpus:
                watch.register(gpu, name=f"gpu-{gpu.minor}")
    assert [watch.is_registered(g.uuid) for g in inventory.gpus] == [True, True, True, False]
    (record,) = caplog.records
    assert record.getMessage() == (
        "gpu-3 does not support NVML events: its XIDs are not seen, its health is checked by "
        "polling"
    )


def test_events_become_observations_with_their_mig_instance(
    node: tuple[SimulatedNode, Inventory, NvmlHealthWatch],
) -> None:
    simulated, inventory, watch = node
    for gpu in inventory.gpus:
        watch.register(gpu, name=f"gpu-{gpu.minor}")
    _, t4, a100, _ = inventory.gpus
    assert watch.wait(0.01).observations == []
    simulated.library.health.inject(
        SimulatedFault(kind="xid", gpu=2, xid=94, gpu_instance_id=5, compute_instance_id=0)
    )
    result = watch.wait(1.0)
    assert result.observations == [XidObserved(a100.uuid, 94, 5, 0)]
    assert result.check == {a100.uuid}
    simulated.library.health.inject(SimulatedFault(kind="ecc", gpu=1))
    assert watch.wait(1.0).observations == [EccObserved(t4.uuid)]
    assert watch.wait(1.0).observations == [XidObserved(t4.uuid, 48)]


def test_checks_read_what_each_architecture_supports(
    node: tuple[SimulatedNode, Inventory, NvmlHealthWatch],
) -> None:
    simulated, inventory, watch = node
    h100, t4, *_ = inventory.gpus
    simulated.library.health.inject(SimulatedFault(kind="temperature", gpu=0, celsius=38))
    assert watch.check(h100) == GpuChecked(
        gpu_uuid=h100.uuid,
        ecc_uncorrected=0,
        retired_pages_pending=None,
        remapped_rows_pending=False,
        row_remap_failed=False,
        temperature_c=38,
        slowdown_c=87,
    )
    simulated.library.health.inject(SimulatedFault(kind="ecc", gpu=1))
    checked = watch.check(t4)
    assert (checked.ecc_uncorrected, checked.retired_pages_pending) == (1, True)
    assert checked.remapped_rows_pending is None


def test_a_lost_gpu_is_an_answer_not_an_error_and_a_wait_asks_to_check_every_gpu(
    node: tuple[SimulatedNode, Inventory, NvmlHealthWatch],
) -> None:
    simulated, inventory, watch = node
    h100 = inventory.gpus[0]
    watch.register(h100, name="gpu-0")
    simulated.library.health.inject(SimulatedFault(kind="lost", gpu=0))
    assert watch.check(h100) == GpuChecked(gpu_uuid=h100.uuid, lost=True, lost_reason="GPU is lost")
    assert watch.wait(1.0).observations == [XidObserved(h100.uuid, 79)]
    assert watch.wait(1.0).check_all
    watch.forget(h100.uuid)
    assert not watch.has_events
    simulated.library.health.inject(SimulatedFault(kind="reset", gpu=0))
    watch.register(h100, name="gpu-0")
    assert watch.is_registered(h100.uuid)


def test_nvml_that_cannot_start_is_a_health_watch_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse() -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)

    monkeypatch.setattr(pynvml, "nvmlInit", refuse)
    with pytest.raises(HealthWatchError, match="NVML could not be initialised: Driver Not Loaded"):
        NvmlHealthWatch().open()
