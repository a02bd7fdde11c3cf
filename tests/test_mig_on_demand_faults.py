"""Crash safety of MIG mode on demand: the plugin (a separate process on live simulated NVML
whose MIG modes and instances are kept in the node's state file) serves two H100 GPUs that are
not in MIG mode and is killed with SIGKILL before and after every NVML call that prepares a MIG
placement (nvmlDeviceSetMigMode turning MIG mode on, creating the GPU and compute instance) and
that unprepares it (destroying them, nvmlDeviceSetMigMode turning MIG mode off). The next
instance must leave a GPU in MIG mode exactly while a prepared claim holds a MIG device of it,
marked exactly then, with every instance named by a prepared claim, complete, and no other."""

from __future__ import annotations

import json
from pathlib import Path

from dra_driver.devices import mig_device_name
from dra_driver.sim.fakedriver import simulated_inventory
from dra_driver.sim.localapi import FakeKubeApi
from tests.claimdata import allocated_claim
from tests.test_plugin_faults import check_node
from tests.test_plugin_faults_dynamic_mig import (
    call,
    died_at_the_crash_point,
    dynamic_plugin,
    prepare_all,
)

SIMULATE = "h100:2"  # neither in MIG mode
INVENTORY = simulated_inventory(SIMULATE, node_name="node1")
PREPARE_POINTS = [
    f"{function}:{when}"
    for function in (
        "nvmlDeviceSetMigMode",
        "nvmlDeviceCreateGpuInstanceWithPlacement",
        "nvmlGpuInstanceCreateComputeInstance",
    )
    for when in ("before", "after")
]
UNPREPARE_POINTS = [
    f"{function}:{when}"
    for function in (
        "nvmlComputeInstanceDestroy",
        "nvmlGpuInstanceDestroy",
        "nvmlDeviceSetMigMode",
    )
    for when in ("before", "after")
]


def placement(minor: int, profile: str, start: int) -> str:
    gpu = next(g for g in INVENTORY.gpus if g.minor == minor)
    found = next(p for p in gpu.mig_profiles if p.name == profile)
    return mig_device_name(
        parent_minor=minor, profile=profile, profile_id=found.profile_id, placement_start=start
    )


BIG = placement(0, "3g.40gb", 4)  # the claim the crashes hit
OTHER = placement(1, "1g.10gb", 0)  # keeps gpu-1 in MIG mode throughout


def node_state(settings: dict[str, str]) -> tuple[dict[str, bool], dict[str, bool]]:
    """(GPU name -> in MIG mode now, MIG device name -> has its compute instance), from the
    node's MIG state file (a GPU it names no mode of has the spec's: off)."""
    path = Path(settings["plugins"]) / "gpu.nvidia.com/simulated-mig.json"
    state = json.loads(path.read_text()) if path.exists() else {}
    modes = state.get("mig_mode", {})
    on = {f"gpu-{g.minor}": bool(modes.get(g.uuid, {}).get("current", 0)) for g in INVENTORY.gpus}
    made = {}
    for uuid, entries in state.get("gpus", {}).items():
        gpu = next(g for g in INVENTORY.gpus if g.uuid == uuid)
        for entry in entries:
            profile = next(p for p in gpu.mig_profiles if p.profile_id == entry["profile_id"])
            name = mig_device_name(
                parent_minor=gpu.minor,
                profile=profile.name,
                profile_id=profile.profile_id,
                placement_start=entry["start"],
            )
            made[name] = bool(entry["compute_instances"])
    return on, made


def marked(settings: dict[str, str], directory: str) -> set[str]:
    marks = Path(settings["plugins"]) / "gpu.nvidia.com" / directory
    uuids = {p.stem for p in marks.glob("*.json")} if marks.exists() else set()
    return {f"gpu-{g.minor}" for g in INVENTORY.gpus if g.uuid in uuids}


def check_mig_on_demand(settings: dict[str, str]) -> set[str]:
    """The invariants; returns the MIG devices prepared claims hold."""
    records = check_node(settings)
    held = {d.device for r in records.values() for d in r.devices}
    on, made = node_state(settings)
    needed = {name.split("-mig-")[0] for name in held}
    in_mig_mode = {gpu for gpu, is_on in on.items() if is_on}
    assert in_mig_mode == needed, f"in MIG mode {sorted(in_mig_mode)}, needed {sorted(needed)}"
    assert marked(settings, "mig-on") == needed, f"marks {marked(settings, 'mig-on')}"
    assert marked(settings, "mig-off") == set()
    assert all(made.values()), f"half-made instances left: {made}"
    assert set(made) == held, f"instances {sorted(made)} but prepared devices {sorted(held)}"
    return held


def test_kill_9_around_every_mig_mode_change_leaves_mig_mode_on_only_while_a_claim_needs_it(
    kubeapi: FakeKubeApi,
) -> None:
    big = kubeapi.add_claim(allocated_claim(name="big", devices=[BIG]))
    other = kubeapi.add_claim(allocated_claim(name="other", devices=[OTHER]))
    with dynamic_plugin(kubeapi, SIMULATE) as plugin:
        plugin.spawn()
        prepare_all(plugin, [other])
        assert check_mig_on_demand(plugin.settings) == {OTHER}
        cases = [(p, False) for p in PREPARE_POINTS] + [(p, True) for p in UNPREPARE_POINTS]
        for point, unprepare in cases:
            plugin.kill()
            if unprepare:  # the claim is prepared, so there is an instance and a mode to undo
                plugin.spawn()
                prepare_all(plugin, [big])
                assert check_mig_on_demand(plugin.settings) == {BIG, OTHER}
                plugin.kill()
            plugin.spawn(crash=point)
            call(plugin, [big], unprepare=unprepare)
            died_at_the_crash_point(plugin, point)
            plugin.spawn()  # its start-up repair runs before it serves
            held = check_mig_on_demand(plugin.settings)
            assert OTHER in held, point
            # the kubelet goes on: the prepare is retried, or the unprepare
            if unprepare:
                call(plugin, [big], unprepare=True)
                assert check_mig_on_demand(plugin.settings) == {OTHER}, point
            else:
                prepare_all(plugin, [big])
                assert check_mig_on_demand(plugin.settings) == {BIG, OTHER}, point
                call(plugin, [big], unprepare=True)
                assert check_mig_on_demand(plugin.settings) == {OTHER}, point
        call(plugin, [other], unprepare=True)
        assert check_mig_on_demand(plugin.settings) == set()
        on, made = node_state(plugin.settings)
        assert not any(on.values()) and made == {}
