"""mig/dynamic.py: the MIG devices the agent counts as its own before and after the plugin opens
the checkpoint, and the GPUs dynamic mode leaves static."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from dra_driver.devices import node_devices
from dra_driver.mig.dynamic import ManagedMig
from dra_driver.mig.targets import is_placement, leaves_mig
from dra_driver.prepare import device_targets
from dra_driver.prepare.state.checkpoint import Checkpoint
from dra_driver.prepare.state.nodestate import recorded_device_names_on_disk
from dra_driver.sim.nvml import discover_simulated
from tests.claimdata import checkpoint_record

DRIVER = "gpu.nvidia.com"


def test_names_recorded_in_the_checkpoint_are_read_without_opening_it(tmp_path: Path) -> None:
    (tmp_path / "boot_id").write_text("boot-1\n")
    path = tmp_path / "plugin" / "checkpoint.json"
    assert recorded_device_names_on_disk(path, boot_id_path=tmp_path / "boot_id") == frozenset()
    checkpoint = Checkpoint(path, boot_id_path=tmp_path / "boot_id")
    checkpoint.open()
    for r in (
        checkpoint_record("a", "gpu-0-mig-3g40gb-9-0"),
        checkpoint_record("b", "gpu-1", "gpu-2-mig-7g80gb-0-0"),
    ):
        checkpoint.transact(lambda claims, r=r: claims.__setitem__(r.uid, r))  # type: ignore[misc]
    boot = tmp_path / "boot_id"
    # the journal holds the records: a read-only read applies it, as the plugin would
    assert recorded_device_names_on_disk(path, boot_id_path=boot) == {
        "gpu-0-mig-3g40gb-9-0",
        "gpu-1",
        "gpu-2-mig-7g80gb-0-0",
    }
    checkpoint.close()
    assert recorded_device_names_on_disk(path, boot_id_path=boot) == {
        "gpu-0-mig-3g40gb-9-0",
        "gpu-1",
        "gpu-2-mig-7g80gb-0-0",
    }
    # after a reboot no MIG device of the old records exists: one that does now is foreign
    boot.write_text("boot-2\n")
    assert recorded_device_names_on_disk(path, boot_id_path=boot) == frozenset()


def test_a_damaged_checkpoint_counts_as_recording_nothing_and_is_left_alone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "checkpoint.json"
    path.write_text('{"version": 2, "checksum": "0", "data": {')
    (tmp_path / "boot_id").write_text("boot-1\n")
    with caplog.at_level(logging.WARNING):
        assert recorded_device_names_on_disk(path, boot_id_path=tmp_path / "boot_id") == frozenset()
    assert "cannot read the checkpoint" in caplog.text
    assert path.read_text() == '{"version": 2, "checksum": "0", "data": {'  # for the plugin


def test_static_mode_publishes_what_node_devices_publishes_and_reads_nothing() -> None:
    inventory = discover_simulated("h100:1:mig=3g.40gb,h100:1", node_name="n")
    mig = ManagedMig(mig_mode="static", driver_name=DRIVER)
    assert mig.node_devices(inventory, recorded=frozenset({"x"})) == node_devices(
        inventory, driver_name=DRIVER
    )
    assert mig.left_static() == {}


def test_the_gpus_left_static_are_named_with_their_foreign_mig_devices() -> None:
    inventory = discover_simulated("h100:1:mig=3g.40gb+1g.10gb,h100:1:mig", node_name="n")
    mig = ManagedMig(mig_mode="dynamic", driver_name=DRIVER, warn=False)

    published = mig.node_devices(inventory, recorded=frozenset({"gpu-0-mig-1g10gb-19-4"}))

    assert mig.left_static() == {"gpu-0": ("gpu-0-mig-3g40gb-9-0",)}
    assert [cs.name for cs in published.counter_sets] == ["gpu-1-counter-set"]


def test_prepare_accepts_what_each_pass_publishes() -> None:
    """ManagedMig.targets, prepare's TargetsOf: a GPU left static offers its existing MIG
    devices as static ones; a partitionable GPU offers its placements and its whole self, all
    partitioned, the same names as published."""
    inventory = discover_simulated("h100:1:mig=3g.40gb,h100:1:mig", node_name="n")
    mig = ManagedMig(mig_mode="dynamic", driver_name=DRIVER, warn=False)
    published = mig.node_devices(inventory, recorded=frozenset())

    targets = mig.targets(inventory)

    assert sorted(targets) == sorted(d.name for d in published.devices)
    assert not targets["gpu-0-mig-3g40gb-9-0"].partitioned  # foreign: gpu-0 stays static
    assert targets["gpu-0-mig-3g40gb-9-0"].mig is not None
    assert is_placement(targets["gpu-1-mig-3g40gb-9-0"])
    assert leaves_mig(targets["gpu-1"])
    # once the foreign MIG device counts as the driver's own, gpu-0 is partitionable too
    mig.node_devices(inventory, recorded=frozenset({"gpu-0-mig-3g40gb-9-0"}))
    assert is_placement(mig.targets(inventory)["gpu-0-mig-3g40gb-9-0"])
    assert ManagedMig(mig_mode="static", driver_name=DRIVER).targets(inventory) == device_targets(
        inventory
    )
