"""Crash safety of prepare/unprepare: the plugin runs as a separate process and is killed with
SIGKILL at random points; the next instance must find a consistent node. Also concurrency:
duplicate and conflicting prepares over gRPC."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest

from dra_driver._proto.dra_v1 import api_pb2 as v1
from dra_driver._proto.dra_v1 import api_pb2_grpc as v1_grpc
from dra_driver._proto.pluginregistration_v1 import api_pb2 as reg
from dra_driver._proto.pluginregistration_v1 import api_pb2_grpc as reg_grpc
from dra_driver.prepare.state import checkpoint
from dra_driver.sim.fakedriver import (
    NVIDIA_SMI_HANG,
    NVIDIA_SMI_HANGING,
    make_fake_driver,
    read_nvidia_smi_calls,
    read_time_slices,
    simulated_inventory,
)
from dra_driver.sim.localapi import FakeKubeApi
from tests.claimdata import allocated_claim, opaque
from tests.spares import held, spares_in

ITERATIONS = 100
GPUS = 8
ROOT = Path(__file__).resolve().parent.parent


class PluginProcess:
    """A zygote (tests/plugin_process.py) that forks plugin instances on demand."""

    def __init__(self, settings: dict[str, str], tmp: Path) -> None:
        (tmp / "settings.json").write_text(json.dumps(settings))
        self.settings = settings
        self.zygote = subprocess.Popen(
            [sys.executable, "-m", "tests.plugin_process", str(tmp / "settings.json")],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,  # one process group: close() ends it all
        )
        self.pid = 0
        self.reg_socket = Path(settings["registry"]) / "gpu.nvidia.com-reg.sock"
        self.dra_socket = Path(settings["plugins"]) / "gpu.nvidia.com/dra.sock"

    def spawn(self, crash: str = "") -> None:
        """Start an instance; ``crash``: it kills itself there (tests/plugin_process.py)."""
        assert self.zygote.stdin is not None and self.zygote.stdout is not None
        self.zygote.stdin.write(f"spawn {crash}\n")
        self.zygote.stdin.flush()
        self.pid = int(self.zygote.stdout.readline())
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # registered = both sockets serve
            try:
                with grpc.insecure_channel(f"unix://{self.reg_socket}") as ch:
                    reg_grpc.RegistrationStub(ch).GetInfo(reg.InfoRequest(), timeout=0.5)
                return
            except grpc.RpcError:
                time.sleep(0.005)
        raise AssertionError("plugin did not start")

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        # wait until the process is gone (its sockets stop answering)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.001)

    def close(self) -> None:
        try:
            if self.pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGTERM)
            if self.zygote.stdin is not None:
                self.zygote.stdin.close()
            self.zygote.wait(timeout=10)
            if self.zygote.stdout is not None:
                self.zygote.stdout.close()
        finally:
            # Every instance, and what it started (a hanging nvidia-smi), is in the zygote's
            # process group: none outlives the test or races the removal of its directory.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.zygote.pid, signal.SIGKILL)
            self.zygote.wait(timeout=10)
            deadline = time.monotonic() + 10
            while _group_alive(self.zygote.pid) and time.monotonic() < deadline:
                time.sleep(0.01)


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` is alive (zombies are dead: init reaps them)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            state, _, group = stat.read_text().rsplit(")", 1)[1].split()[:3]
            if state != "Z" and int(group) == pgid:
                return True
    return False


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="dra-faults-", dir="/tmp") as d:
        yield Path(d)


@pytest.fixture
def plugin_process(short_tmp: Path, kubeapi: FakeKubeApi) -> Iterator[PluginProcess]:
    fake = make_fake_driver(short_tmp)
    (short_tmp / "boot_id").write_text("boot-1\n")
    assert kubeapi.kubeconfig_path is not None
    settings = {
        "simulate": f"h100:{GPUS}",
        "kubeconfig": str(kubeapi.kubeconfig_path),
        "driver_root": str(fake.root),
        "proc_root": str(fake.proc_root),
        "boot_id": str(short_tmp / "boot_id"),
        "registry": str(short_tmp / "registry"),
        "plugins": str(short_tmp / "plugins"),
        "cdi": str(short_tmp / "cdi"),
    }
    process = PluginProcess(settings, short_tmp)
    yield process
    process.close()


def claim_ref(claim: dict[str, Any]) -> v1.Claim:
    meta = claim["metadata"]
    return v1.Claim(namespace=meta["namespace"], name=meta["name"], uid=meta["uid"])


def answer_of(entry: v1.NodePrepareResourceResponse) -> list[tuple[Any, ...]]:
    return [
        (tuple(d.request_names), d.pool_name, d.device_name, tuple(d.cdi_device_ids))
        for d in entry.devices
    ]


def send(stub: v1_grpc.DRAPluginStub, claims: list[dict[str, Any]], *, unprepare: bool) -> None:
    """One NodePrepareResources or NodeUnprepareResources call for ``claims``."""
    refs = [claim_ref(c) for c in claims]
    if unprepare:
        stub.NodeUnprepareResources(v1.NodeUnprepareResourcesRequest(claims=refs), timeout=5)
    else:
        stub.NodePrepareResources(v1.NodePrepareResourcesRequest(claims=refs), timeout=5)


def kill_mid_calls(
    process: PluginProcess,
    claims: list[dict[str, Any]],
    rng: random.Random,
    *,
    callers: int,
    most_per_call: int,
    longest_s: float,
    join_s: float,
) -> None:
    """Kill -9 the plugin while ``callers`` threads prepare and unprepare random batches of
    ``claims`` (1 to ``most_per_call`` each) as fast as they can, after 2 ms to ``longest_s``;
    then spawn it again."""
    stop_calls = threading.Event()

    def caller(seed: float) -> None:
        own = random.Random(seed)
        with grpc.insecure_channel(f"unix://{process.dra_socket}") as ch:
            stub = v1_grpc.DRAPluginStub(ch)
            while not stop_calls.is_set():
                batch = own.sample(claims, own.randint(1, most_per_call))
                try:
                    send(stub, batch, unprepare=own.random() < 0.5)
                except grpc.RpcError:
                    return  # killed mid-call

    threads = [threading.Thread(target=caller, args=(rng.random(),)) for _ in range(callers)]
    for t in threads:
        t.start()
    time.sleep(rng.uniform(0.002, longest_s))
    process.kill()
    stop_calls.set()
    for t in threads:
        t.join(join_s)
    process.spawn()


def check_node(settings: dict[str, str]) -> dict[str, checkpoint.ClaimRecord]:
    """The invariants a freshly started plugin must have established."""
    cdi_dir = Path(settings["cdi"])
    spares = spares_in(cdi_dir)
    files = sorted(p.name for p in cdi_dir.iterdir() if p not in spares)
    # never damaged by a kill (a torn last journal line is what the plugin itself ignores)
    _, records = checkpoint.read_state(
        Path(settings["plugins"]) / "gpu.nvidia.com/gpu-dra-checkpoint.json"
    )
    specs = {n.removeprefix("k8s.gpu.nvidia.com-claim_").removesuffix(".json") for n in files}
    assert all(n.endswith(".json") for n in files), f"temp files left: {files}"
    # spare files the killed instance kept are adopted by the new one (or deleted): none is
    # left that no live plugin holds
    assert all(held(p) for p in spares), f"spares nobody owns: {spares}"
    assert all(r.phase == checkpoint.PREPARE_COMPLETED for r in records.values())
    assert specs == set(records), "every spec belongs to a recorded claim and vice versa"
    return records


def test_kill_9_during_prepare_and_unprepare_leaves_a_consistent_node(
    plugin_process: PluginProcess, kubeapi: FakeKubeApi
) -> None:
    rng = random.Random(1234)
    claims = [
        kubeapi.add_claim(allocated_claim(name=f"c{i}", devices=[f"gpu-{i}"])) for i in range(GPUS)
    ]
    expected: dict[str, list[tuple[Any, ...]]] = {}
    clean_start = time.monotonic()
    plugin_process.spawn()
    clean_s = time.monotonic() - clean_start  # a start with nothing to repair: the floor
    with grpc.insecure_channel(f"unix://{plugin_process.dra_socket}") as ch:  # clean answers
        stub = v1_grpc.DRAPluginStub(ch)
        refs = [claim_ref(c) for c in claims]
        first = stub.NodePrepareResources(v1.NodePrepareResourcesRequest(claims=refs), timeout=10)
        expected = {uid: answer_of(e) for uid, e in first.claims.items()}
        spec_bytes = {
            p.name: p.read_bytes() for p in Path(plugin_process.settings["cdi"]).glob("*.json")
        }
        stub.NodeUnprepareResources(v1.NodeUnprepareResourcesRequest(claims=refs), timeout=10)
    recoveries: list[float] = []
    for iteration in range(ITERATIONS):
        batch = rng.sample(claims, rng.randint(1, 4))
        unprepare = rng.random() < 0.5
        done = threading.Event()

        def call(
            batch: list[dict[str, Any]] = batch,
            unprepare: bool = unprepare,
            done: threading.Event = done,
        ) -> None:
            try:
                with grpc.insecure_channel(f"unix://{plugin_process.dra_socket}") as ch:
                    send(v1_grpc.DRAPluginStub(ch), batch, unprepare=unprepare)
            except grpc.RpcError:
                pass  # killed mid-call
            finally:
                done.set()

        caller = threading.Thread(target=call)
        caller.start()
        time.sleep(rng.uniform(0, 0.004))
        plugin_process.kill()
        caller.join(5)
        recovery_start = time.monotonic()
        plugin_process.spawn()
        recoveries.append(time.monotonic() - recovery_start)
        check_node(plugin_process.settings)
        if iteration % 10 == 9:  # every claim prepares again, with the same answer and spec
            with grpc.insecure_channel(f"unix://{plugin_process.dra_socket}") as ch:
                stub = v1_grpc.DRAPluginStub(ch)
                refs = [claim_ref(c) for c in claims]
                again = stub.NodePrepareResources(
                    v1.NodePrepareResourcesRequest(claims=refs), timeout=10
                )
                assert {uid: answer_of(e) for uid, e in again.claims.items()} == expected
                assert all(e.error == "" for e in again.claims.values())
                assert {
                    p.name: p.read_bytes()
                    for p in Path(plugin_process.settings["cdi"]).glob("*.json")
                } == spec_bytes
    # A start after a kill -9 (rolling back half-done claims, rewriting specs) costs no more
    # than the first, clean one: judged against that start measured in this run, as this
    # machine's pace changes by half from hour to hour (median 0.41 s against 0.90 s here; the
    # 100 cycles used to be held to 60 s in all, which a slow hour broke at 73 s).
    typical = statistics.median(recoveries)
    assert typical < 1.5 * clean_s, (typical, clean_s)


@pytest.fixture
def grpc_stub(plugin_process: PluginProcess) -> Iterator[v1_grpc.DRAPluginStub]:
    plugin_process.spawn()
    with grpc.insecure_channel(f"unix://{plugin_process.dra_socket}") as ch:
        yield v1_grpc.DRAPluginStub(ch)


def test_64_concurrent_prepares_with_duplicates_prepare_each_claim_once(
    grpc_stub: v1_grpc.DRAPluginStub, kubeapi: FakeKubeApi, plugin_process: PluginProcess
) -> None:
    claims = []
    for i in range(16):
        claim = allocated_claim(name=f"dup{i}", devices=[f"gpu-{i % GPUS}"])
        claim["status"]["allocation"]["devices"]["results"][0]["adminAccess"] = True
        claims.append(kubeapi.add_claim(claim))
    calls = [claims[i % 16] for i in range(64)]
    random.Random(7).shuffle(calls)

    def prepare(claim: dict[str, Any]) -> list[tuple[Any, ...]]:
        answer = grpc_stub.NodePrepareResources(
            v1.NodePrepareResourcesRequest(claims=[claim_ref(claim)]), timeout=10
        )
        entry = answer.claims[claim["metadata"]["uid"]]
        assert entry.error == ""
        return answer_of(entry)

    with ThreadPoolExecutor(64) as pool:
        answers = list(pool.map(prepare, calls))
    by_uid: dict[str, set[str]] = {}
    for claim, answer in zip(calls, answers, strict=True):
        by_uid.setdefault(claim["metadata"]["uid"], set()).add(repr(answer))
    assert all(len(a) == 1 for a in by_uid.values()) and len(by_uid) == 16
    gets = [r for r in kubeapi.requests if r.verb == "get" and r.resource == "resourceclaims"]
    assert sorted(r.name for r in gets) == sorted(
        c["metadata"]["name"] for c in claims
    )  # once each
    assert len(list(Path(plugin_process.settings["cdi"]).glob("*.json"))) == 16


def test_two_claims_allocated_the_same_device_the_second_is_refused(
    grpc_stub: v1_grpc.DRAPluginStub, kubeapi: FakeKubeApi
) -> None:
    first = kubeapi.add_claim(allocated_claim(name="first", devices=["gpu-3"]))
    second = kubeapi.add_claim(allocated_claim(name="second", devices=["gpu-3"]))
    a = grpc_stub.NodePrepareResources(
        v1.NodePrepareResourcesRequest(claims=[claim_ref(first)]), timeout=5
    )
    b = grpc_stub.NodePrepareResources(
        v1.NodePrepareResourcesRequest(claims=[claim_ref(second)]), timeout=5
    )
    assert a.claims[first["metadata"]["uid"]].error == ""
    assert (
        "gpu-3 is already prepared for claim default/first"
        in b.claims[second["metadata"]["uid"]].error
    )


def test_kill_9_during_concurrent_callers_leaves_a_consistent_node(
    plugin_process: PluginProcess, kubeapi: FakeKubeApi
) -> None:
    """The group-commit path: several callers at once (their records share appends and syncs,
    their specs are synced in their own threads), killed at random points."""
    rng = random.Random(4321)
    claims = [
        kubeapi.add_claim(allocated_claim(name=f"c{i}", devices=[f"gpu-{i}"])) for i in range(GPUS)
    ]
    plugin_process.spawn()
    for _ in range(ITERATIONS // 4):
        kill_mid_calls(
            plugin_process, claims, rng, callers=4, most_per_call=2, longest_s=0.03, join_s=5
        )
        records = check_node(plugin_process.settings)
        # no device is held twice (records of racing claims were checked in one step)
        held_devices = [d.device for r in records.values() for d in r.devices]
        assert len(held_devices) == len(set(held_devices))
    with grpc.insecure_channel(f"unix://{plugin_process.dra_socket}") as ch:
        stub = v1_grpc.DRAPluginStub(ch)
        again = stub.NodePrepareResources(
            v1.NodePrepareResourcesRequest(claims=[claim_ref(c) for c in claims]), timeout=10
        )
        assert all(e.error == "" for e in again.claims.values())


def _time_slicing_claim(name: str, device: str, interval: str) -> dict[str, Any]:
    sharing = {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": interval}}
    return allocated_claim(
        name=name,
        devices=[device],
        configs=[
            opaque({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
                    "sharing": sharing})
        ],
    )  # fmt: skip


def _kill_while_nvidia_smi_hangs(
    plugin_process: PluginProcess, call: Any, *, calls_before: int
) -> str:
    """Make the stand-in nvidia-smi hang, run ``call`` (a gRPC call) in a thread, kill the
    plugin with SIGKILL once nvidia-smi was run, then end the hanging nvidia-smi (the dead
    plugin's child: a real one would have finished) and let the next one work. Returns the
    argument line nvidia-smi was given."""
    smi_dir = Path(plugin_process.settings["driver_root"]) / "usr/bin"
    (smi_dir / NVIDIA_SMI_HANG).touch()
    caller = threading.Thread(target=call)
    caller.start()
    deadline = time.monotonic() + 10
    while (
        len(read_nvidia_smi_calls(smi_dir)) <= calls_before
        or not (smi_dir / NVIDIA_SMI_HANGING).exists()
    ):
        assert time.monotonic() < deadline, "nvidia-smi was not run"
        time.sleep(0.005)
    plugin_process.kill()
    caller.join(10)
    (smi_dir / NVIDIA_SMI_HANG).unlink()
    hanging = smi_dir / NVIDIA_SMI_HANGING
    while not hanging.read_text().endswith("\n"):
        time.sleep(0.001)
    for pid in hanging.read_text().split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
    hanging.unlink()
    return read_nvidia_smi_calls(smi_dir)[calls_before]


def test_kill_9_while_a_time_slice_is_set_or_restored_leaves_the_gpu_as_the_claims_ask(
    plugin_process: PluginProcess, kubeapi: FakeKubeApi
) -> None:
    smi_dir = Path(plugin_process.settings["driver_root"]) / "usr/bin"
    uuid = simulated_inventory(f"h100:{GPUS}", node_name="node1").gpus[2].uuid
    claim = kubeapi.add_claim(_time_slicing_claim("sliced", "gpu-2", "Long"))
    uid = claim["metadata"]["uid"]

    def prepare() -> None:
        with (
            grpc.insecure_channel(f"unix://{plugin_process.dra_socket}") as ch,
            contextlib.suppress(grpc.RpcError),
        ):
            v1_grpc.DRAPluginStub(ch).NodePrepareResources(
                v1.NodePrepareResourcesRequest(claims=[claim_ref(claim)]), timeout=20
            )

    def unprepare() -> None:
        with (
            grpc.insecure_channel(f"unix://{plugin_process.dra_socket}") as ch,
            contextlib.suppress(grpc.RpcError),
        ):
            v1_grpc.DRAPluginStub(ch).NodeUnprepareResources(
                v1.NodeUnprepareResourcesRequest(claims=[claim_ref(claim)]), timeout=20
            )

    # 1. killed while nvidia-smi sets Long: the claim was recorded PrepareStarted first, so the
    # next instance rolls it back and sets the GPU back to Default
    plugin_process.spawn()
    told = _kill_while_nvidia_smi_hangs(plugin_process, prepare, calls_before=0)
    assert told == f"compute-policy -i {uuid} --set-timeslice 3"
    plugin_process.spawn()
    assert check_node(plugin_process.settings) == {}
    assert read_nvidia_smi_calls(smi_dir)[-1] == f"compute-policy -i {uuid} --set-timeslice 0"
    assert read_time_slices(smi_dir) == {uuid: 0}
    # 2. the claim prepares again and gets its interval
    prepare()
    assert set(check_node(plugin_process.settings)) == {uid}
    assert read_time_slices(smi_dir) == {uuid: 3}
    # 3. killed while unprepare restores Default (the record is already gone): the next
    # instance sees the GPU marked as maybe not Default and sets it back
    calls = len(read_nvidia_smi_calls(smi_dir))
    told = _kill_while_nvidia_smi_hangs(plugin_process, unprepare, calls_before=calls)
    assert told == f"compute-policy -i {uuid} --set-timeslice 0"
    plugin_process.spawn()
    assert check_node(plugin_process.settings) == {}
    assert read_time_slices(smi_dir) == {uuid: 0}
    assert len(read_nvidia_smi_calls(smi_dir)) == calls + 2
    # 4. a restart with a prepared claim sets its interval again, once
    prepare()
    plugin_process.kill()
    calls = len(read_nvidia_smi_calls(smi_dir))
    plugin_process.spawn()
    assert read_nvidia_smi_calls(smi_dir)[calls:] == [f"compute-policy -i {uuid} --set-timeslice 3"]
