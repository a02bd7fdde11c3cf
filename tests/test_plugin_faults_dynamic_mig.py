"""Crash safety of dynamic MIG: the plugin (a separate process on live simulated NVML whose MIG
instances are kept in the node's state file) is killed with SIGKILL at every NVML step of
creating and destroying an instance, and at random points of concurrent prepares and
unprepares; the next instance must leave every instance named by a prepared claim, complete,
and no other (nothing leaked, nothing half-made)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from dra_driver._proto.dra_v1 import api_pb2 as v1
from dra_driver._proto.dra_v1 import api_pb2_grpc as v1_grpc
from dra_driver.devices import mig_device_name
from dra_driver.sim.fakedriver import make_fake_driver, simulated_inventory
from dra_driver.sim.localapi import FakeKubeApi
from tests.claimdata import allocated_claim
from tests.test_plugin_faults import PluginProcess, check_node, claim_ref, kill_mid_calls, send

SIMULATE = "a100-40gb:2:mig"
INVENTORY = simulated_inventory(SIMULATE, node_name="node1")
DEVICES = {
    # claim name -> (GPU minor, profile, placement start); none overlap, and both GPUs fit theirs
    "c0": (0, "3g.20gb", 0),
    "c1": (0, "3g.20gb", 4),
    "c2": (1, "1g.5gb", 0),
    "c3": (1, "2g.10gb", 2),
    "c4": (1, "1g.10gb", 6),
}
CRASH_POINTS = [
    f"{function}:{when}"
    for function in (
        "nvmlDeviceCreateGpuInstanceWithPlacement",
        "nvmlGpuInstanceCreateComputeInstance",
        "nvmlComputeInstanceDestroy",
        "nvmlGpuInstanceDestroy",
    )
    for when in ("before", "after")
]


def device(claim: str) -> str:
    minor, profile, start = DEVICES[claim]
    gpu = next(g for g in INVENTORY.gpus if g.minor == minor)
    profile_id = next(p.profile_id for p in gpu.mig_profiles if p.name == profile)
    return mig_device_name(
        parent_minor=minor, profile=profile, profile_id=profile_id, placement_start=start
    )


@contextlib.contextmanager
def dynamic_plugin(kubeapi: FakeKubeApi, simulate: str) -> Iterator[PluginProcess]:
    import tempfile  # noqa: PLC0415

    with tempfile.TemporaryDirectory(prefix="dra-dynmig-", dir="/tmp") as d:
        tmp = Path(d)
        inventory = simulated_inventory(simulate, node_name="node1")
        fake = make_fake_driver(tmp, gpu_uuids=[g.uuid for g in inventory.gpus])
        (tmp / "boot_id").write_text("boot-1\n")
        assert kubeapi.kubeconfig_path is not None
        settings = {
            "simulate": simulate,
            "mig_mode": "dynamic",
            "kubeconfig": str(kubeapi.kubeconfig_path),
            "driver_root": str(fake.root),
            "proc_root": str(fake.proc_root),
            "boot_id": str(tmp / "boot_id"),
            "registry": str(tmp / "registry"),
            "plugins": str(tmp / "plugins"),
            "cdi": str(tmp / "cdi"),
        }
        process = PluginProcess(settings, tmp)
        try:
            yield process
        finally:
            process.close()


@pytest.fixture
def plugin_process(kubeapi: FakeKubeApi) -> Iterator[PluginProcess]:
    with dynamic_plugin(kubeapi, SIMULATE) as process:
        yield process


def instances(settings: dict[str, str]) -> dict[str, bool]:
    """Device name -> whether it has its compute instance, from the node's MIG state file."""
    path = Path(settings["plugins"]) / "gpu.nvidia.com/simulated-mig.json"
    if not path.exists():
        return {}
    by_uuid = {g.uuid: g for g in INVENTORY.gpus}
    found = {}
    for uuid, entries in json.loads(path.read_text())["gpus"].items():
        gpu = by_uuid[uuid]
        for entry in entries:
            profile = next(p for p in gpu.mig_profiles if p.profile_id == entry["profile_id"])
            name = mig_device_name(
                parent_minor=gpu.minor,
                profile=profile.name,
                profile_id=profile.profile_id,
                placement_start=entry["start"],
            )
            found[name] = bool(entry["compute_instances"])
    return found


def check_instances(settings: dict[str, str]) -> set[str]:
    """The node's invariants, the MIG instances included: every instance is named by a prepared
    claim and complete, every prepared claim's instance exists. Returns the prepared claims'
    devices."""
    records = check_node(settings)
    held = {d.device for r in records.values() for d in r.devices}
    made = instances(settings)
    assert all(made.values()), f"half-made instances left: {made}"
    assert set(made) == held, f"instances {sorted(made)} but prepared devices {sorted(held)}"
    return held


def call(plugin_process: PluginProcess, claims: list[dict[str, Any]], *, unprepare: bool) -> None:
    """One gRPC call that may be cut short by the plugin's death."""
    with (
        grpc.insecure_channel(f"unix://{plugin_process.dra_socket}") as ch,
        contextlib.suppress(grpc.RpcError),
    ):
        send(v1_grpc.DRAPluginStub(ch), claims, unprepare=unprepare)


def died_at_the_crash_point(plugin_process: PluginProcess, point: str) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(plugin_process.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.005)
    raise AssertionError(f"the plugin did not reach the crash point {point}")


def prepare_all(plugin_process: PluginProcess, claims: list[dict[str, Any]]) -> None:
    with grpc.insecure_channel(f"unix://{plugin_process.dra_socket}") as ch:
        answer = v1_grpc.DRAPluginStub(ch).NodePrepareResources(
            v1.NodePrepareResourcesRequest(claims=[claim_ref(c) for c in claims]), timeout=20
        )
    assert {uid: e.error for uid, e in answer.claims.items()} == {
        c["metadata"]["uid"]: "" for c in claims
    }


def test_kill_9_at_every_step_of_creating_and_destroying_an_instance_leaks_nothing(
    plugin_process: PluginProcess, kubeapi: FakeKubeApi
) -> None:
    claims = [kubeapi.add_claim(allocated_claim(name=n, devices=[device(n)])) for n in DEVICES]
    target = claims[1]  # its neighbour c0 stays prepared on the same GPU throughout
    plugin_process.spawn()
    prepare_all(plugin_process, claims[:1])
    for point in CRASH_POINTS:
        unprepare = "Destroy" in point
        plugin_process.kill()
        if unprepare:  # the claim is prepared, so its instance is there to destroy
            plugin_process.spawn()
            prepare_all(plugin_process, [target])
            plugin_process.kill()
        plugin_process.spawn(crash=point)
        call(plugin_process, [target], unprepare=unprepare)
        died_at_the_crash_point(plugin_process, point)
        plugin_process.spawn()
        held = check_instances(plugin_process.settings)
        assert device("c0") in held, point
        # the kubelet goes on: the prepare is retried, or the unprepare
        if unprepare:
            call(plugin_process, [target], unprepare=True)
            assert check_instances(plugin_process.settings) == {device("c0")}, point
        else:
            prepare_all(plugin_process, [target])
            assert check_instances(plugin_process.settings) == {device("c0"), device("c1")}
            call(plugin_process, [target], unprepare=True)
    prepare_all(plugin_process, claims)
    assert check_instances(plugin_process.settings) == {device(n) for n in DEVICES}


def test_kill_9_during_concurrent_dynamic_mig_prepares_and_unprepares_leaks_nothing(
    plugin_process: PluginProcess, kubeapi: FakeKubeApi
) -> None:
    rng = random.Random(2024)
    claims = [kubeapi.add_claim(allocated_claim(name=n, devices=[device(n)])) for n in DEVICES]
    plugin_process.spawn()
    started = time.monotonic()
    for _ in range(20):
        kill_mid_calls(
            plugin_process, claims, rng, callers=3, most_per_call=3, longest_s=0.05, join_s=10
        )
        check_instances(plugin_process.settings)
    prepare_all(plugin_process, claims)
    assert check_instances(plugin_process.settings) == {device(n) for n in DEVICES}
    assert time.monotonic() - started < 120


# --- the whole GPU: out of MIG mode on prepare, back on unprepare ------------------------------

WHOLE_GPU_SIMULATE = "h100:2:mig"
WHOLE_GPU_INVENTORY = simulated_inventory(WHOLE_GPU_SIMULATE, node_name="node1")


def mig_modes(settings: dict[str, str]) -> dict[str, bool]:
    """GPU device name -> whether it is in MIG mode now, from the node's MIG state file."""
    path = Path(settings["plugins"]) / "gpu.nvidia.com/simulated-mig.json"
    modes = json.loads(path.read_text()).get("mig_mode", {}) if path.exists() else {}
    return {
        f"gpu-{g.minor}": bool(modes.get(g.uuid, {}).get("current", True))
        for g in WHOLE_GPU_INVENTORY.gpus
    }


def check_mig_modes(settings: dict[str, str]) -> set[str]:
    """A GPU is out of MIG mode exactly while a prepared claim holds it whole, and marked exactly
    then; returns the whole GPUs prepared claims hold."""
    records = check_node(settings)
    held = {d.device for r in records.values() for d in r.devices if "-mig-" not in d.device}
    off = {name for name, on in mig_modes(settings).items() if not on}
    assert off == held, f"GPUs out of MIG mode {sorted(off)}, held whole {sorted(held)}"
    marks = Path(settings["plugins"]) / "gpu.nvidia.com/mig-off"
    marked = {p.stem for p in marks.glob("*.json")} if marks.exists() else set()
    by_uuid = {g.uuid: f"gpu-{g.minor}" for g in WHOLE_GPU_INVENTORY.gpus}
    assert {by_uuid[u] for u in marked} == off, f"marks {sorted(marked)}, out of MIG mode {off}"
    return held


def test_kill_9_around_every_mig_mode_change_leaves_a_gpu_out_of_mig_mode_only_for_its_claim(
    kubeapi: FakeKubeApi,
) -> None:
    whole = kubeapi.add_claim(allocated_claim(name="whole", devices=["gpu-0"]))
    other = kubeapi.add_claim(allocated_claim(name="other", devices=["gpu-1"]))
    with dynamic_plugin(kubeapi, WHOLE_GPU_SIMULATE) as plugin:
        plugin.spawn()
        prepare_all(plugin, [other])  # gpu-1 stays out of MIG mode throughout
        for when in ("before", "after"):
            point = f"nvmlDeviceSetMigMode:{when}"
            for unprepare in (False, True):
                plugin.kill()
                if unprepare:
                    plugin.spawn()
                    prepare_all(plugin, [whole])
                    plugin.kill()
                plugin.spawn(crash=point)
                call(plugin, [whole], unprepare=unprepare)
                died_at_the_crash_point(plugin, point)
                plugin.spawn()  # its start-up repair runs before it serves
                held = check_mig_modes(plugin.settings)
                assert "gpu-1" in held, (point, unprepare)
                # the kubelet goes on: the prepare is retried, or the unprepare
                if unprepare:
                    call(plugin, [whole], unprepare=True)
                    assert check_mig_modes(plugin.settings) == {"gpu-1"}, point
                else:
                    prepare_all(plugin, [whole])
                    assert check_mig_modes(plugin.settings) == {"gpu-0", "gpu-1"}, point
                    call(plugin, [whole], unprepare=True)
                    assert check_mig_modes(plugin.settings) == {"gpu-1"}, point
        call(plugin, [other], unprepare=True)
        assert check_mig_modes(plugin.settings) == set()
        assert all(mig_modes(plugin.settings).values())
