"""bench/floorserver.py, the plugin behind bench_grpc_floor, does the work each of its levels
names: the claim GET answers the allocated device, and the record level's record is in the
agent's checkpoint, durable, until the claim is unprepared. bench_prepare measures the floor
levels in the same run, taking turns with the agent, and judges the agent against them: the
prepare p50 against floor(record)'s plus 0.3 ms, the unprepare p50 against floor(grpc)'s plus
0.2 ms, the rate at concurrency 16 against 75% of floor(record)'s."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from bench.bench_grpc_floor import floor_servers
from bench.bench_prepare import ROUNDS, Figures, judge
from bench.kubeletcaller import concurrent_in_turns, sequences_in_turns
from bench.table import print_table
from dra_driver._proto.dra_v1 import api_pb2 as v1
from dra_driver._proto.dra_v1 import api_pb2_grpc as v1_grpc
from dra_driver.prepare.state.checkpoint import PREPARE_COMPLETED, Checkpoint
from dra_driver.sim.localapi import FakeKubeApi
from tests.claimdata import allocated_claim

RATE_ROW = f"prepares/s at concurrency 16 (200 claims, median of {ROUNDS})"

ROOT = Path(__file__).resolve().parents[1]


def _serve(level: str, tmp_path: Path, kubeconfig: Path) -> tuple[subprocess.Popen[str], Path]:
    sock = tmp_path / "dra.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.floorserver", level, str(sock), str(tmp_path),
         str(kubeconfig)],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    return proc, sock


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.communicate(timeout=15)  # closes its standard input: it stops
    assert proc.returncode == 0


@pytest.fixture
def api(tmp_path: Path) -> FakeKubeApi:
    kube = FakeKubeApi(tls_dir=tmp_path / "tls", token="bench-token").start()
    yield kube  # type: ignore[misc]
    kube.stop()


@pytest.mark.parametrize("level", ["get", "record"])
def test_the_floor_answers_the_allocated_device_and_records_it_durably(
    level: str, api: FakeKubeApi, tmp_path: Path
) -> None:
    claim = allocated_claim(name="floor", devices=["gpu-3"])
    api.add_claim(claim)
    meta = claim["metadata"]
    ref = v1.Claim(namespace=meta["namespace"], name=meta["name"], uid=meta["uid"])
    state = tmp_path / "state"
    state.mkdir()
    proc, sock = _serve(level, state, api.write_kubeconfig(tmp_path / "kubeconfig"))
    try:
        with grpc.insecure_channel(f"unix://{sock}") as channel:
            stub = v1_grpc.DRAPluginStub(channel)
            answer = stub.NodePrepareResources(v1.NodePrepareResourcesRequest(claims=[ref]))
            (device,) = answer.claims[ref.uid].devices
            assert (device.pool_name, device.device_name) == ("node1", "gpu-3")
            assert list(device.request_names) == ["gpus"]
            journal = state / "checkpoint.journal"
            if level == "record":
                # another instance of the agent's checkpoint reads the record
                seen = Checkpoint(state / "checkpoint.json")
                seen.open()
                record = seen.get(ref.uid)
                assert record is not None and record.phase == PREPARE_COMPLETED
                assert [d.device for d in record.devices] == ["gpu-3"]
                stub.NodeUnprepareResources(v1.NodeUnprepareResourcesRequest(claims=[ref]))
                assert seen.get(ref.uid) is None
                seen.close()
            else:
                assert not journal.exists()
    finally:
        _stop(proc)
    gets = [r for r in api.requests if r.verb == "get" and r.resource == "resourceclaims"]
    assert [(r.namespace, r.name) for r in gets] == [("default", "floor")]


def test_the_grpc_level_asks_nothing(api: FakeKubeApi, tmp_path: Path) -> None:
    proc, sock = _serve("grpc", tmp_path, api.write_kubeconfig(tmp_path / "kubeconfig"))
    try:
        with grpc.insecure_channel(f"unix://{sock}") as channel:
            stub = v1_grpc.DRAPluginStub(channel)
            ref = v1.Claim(
                namespace="default", name="x", uid="00000000-0000-0000-0000-000000000000"
            )
            answer = stub.NodePrepareResources(v1.NodePrepareResourcesRequest(claims=[ref]))
            assert answer.claims[ref.uid].devices[0].device_name == "gpu-0"
    finally:
        _stop(proc)
    assert not [r for r in api.requests if r.resource == "resourceclaims"]


def test_floor_servers_take_turns_with_the_same_claims(api: FakeKubeApi, tmp_path: Path) -> None:
    """bench_prepare's use of the floor: the levels it asks for, each behind its own caller,
    measured in turns over the same claims, in sequence and at concurrency 16."""
    refs = []
    for i in range(6):
        meta = api.add_claim(allocated_claim(name=f"turn-{i}", devices=[f"gpu-{i}"]))["metadata"]
        refs.append(v1.Claim(namespace=meta["namespace"], name=meta["name"], uid=meta["uid"]))
    with floor_servers(tmp_path, api, ("record", "grpc")) as floors:
        assert list(floors) == ["record", "grpc"]
        times = sequences_in_turns(
            {level: (caller, refs) for level, (caller, _) in floors.items()}, step=4
        )
        runs = concurrent_in_turns(
            {"record": floors["record"]}, refs[:4], rounds=2, api_pid=os.getpid()
        )
    for level in ("record", "grpc"):
        prepared, unprepared = times[level]
        assert len(prepared) == len(unprepared) == 6
        assert all(0 < ms < 10_000 for ms in prepared + unprepared)
    assert list(runs) == ["record"]
    assert len(runs["record"]) == 2
    assert all(rate > 0 and set(cpu) == {"agent", "api"} for rate, cpu in runs["record"])
    # the record level asked the API server for each claim: 6 in sequence, 2 x 4 concurrently
    gets = [r for r in api.requests if r.verb == "get" and r.resource == "resourceclaims"]
    assert len(gets) == 6 + 8


# made-up figures: ms, ms, ms, ms, prepares/s
RECORD = Figures(prepare_p50_ms=2.0, prepare_p99_ms=3.0, unprepare_p50_ms=0.75,
                 unprepare_p99_ms=1.0, rate=800.0)  # fmt: skip
GRPC = Figures(prepare_p50_ms=0.5, prepare_p99_ms=0.75, unprepare_p50_ms=0.5,
               unprepare_p99_ms=0.75, rate=3000.0)  # fmt: skip
AGENT = Figures(prepare_p50_ms=2.25, prepare_p99_ms=9.0, unprepare_p50_ms=0.625,
                unprepare_p99_ms=2.0, rate=600.0)  # fmt: skip


def _verdicts(agent: Figures) -> dict[str, bool | None]:
    return {row.name: row.ok for row in judge(agent, RECORD, GRPC)}


def test_the_agent_is_judged_against_the_floor_of_the_same_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # within 0.3 ms of floor(record)'s prepare p50, within 0.2 ms of floor(grpc)'s unprepare
    # p50, and exactly 75% of floor(record)'s rate: every verdict is ok, though each of issue
    # 15's absolute targets is missed (shown, not judged)
    rows = judge(AGENT, RECORD, GRPC)
    judged = {row.name: row for row in rows if row.ok is not None}
    assert set(judged) == {
        "prepare p50 (192 in sequence)",
        RATE_ROW,
        "unprepare p50",
    }
    assert all(row.ok for row in judged.values())
    prepare = judged["prepare p50 (192 in sequence)"]
    assert (prepare.value, prepare.floor) == (2.25, "record p50 2.000 ms")
    assert prepare.target == "<= 2.300 ms (floor + 0.3 ms)"
    rate = judged[RATE_ROW]
    assert (rate.floor, rate.target) == ("record 800 /s", ">= 600 /s (75% of floor)")
    unprepare = judged["unprepare p50"]
    assert (unprepare.floor, unprepare.target) == (
        "grpc p50 0.500 ms",
        "<= 0.700 ms (floor + 0.2 ms)",
    )
    absolute = [row for row in rows if "issue 15" in row.target]
    assert [row.target.split(" (")[0] for row in absolute] == [
        "<= 1.5 ms", "<= 4 ms", ">= 1,500 /s", "<= 0.5 ms",
    ]  # fmt: skip
    assert all(row.ok is None for row in absolute)
    # the table shows the floor column, and passes
    assert print_table("t", rows)
    out = capsys.readouterr().out
    assert "floor (same run)" in out and "record p50 2.000 ms" in out and "MISSED" not in out


@pytest.mark.parametrize(
    ("change", "missed"),
    [
        ({"prepare_p50_ms": 2.5}, "prepare p50 (192 in sequence)"),
        ({"unprepare_p50_ms": 0.75}, "unprepare p50"),
        ({"rate": 599.0}, RATE_ROW),
    ],
)
def test_an_agent_too_far_above_its_floor_misses_that_target_only(
    change: dict[str, float], missed: str, capsys: pytest.CaptureFixture[str]
) -> None:
    verdicts = _verdicts(replace(AGENT, **change))
    assert [name for name, ok in verdicts.items() if ok is False] == [missed]
    assert not print_table("t", judge(replace(AGENT, **change), RECORD, GRPC))
    assert "MISSED" in capsys.readouterr().out


def test_the_same_agent_figures_pass_or_fail_with_the_floor_they_are_measured_against() -> None:
    """The targets move with the floor: a slower machine raises both together."""
    slow_record = replace(RECORD, prepare_p50_ms=4.0, rate=400.0)
    slow_agent = replace(AGENT, prepare_p50_ms=4.25, rate=300.0)
    assert all(row.ok is not False for row in judge(slow_agent, slow_record, GRPC))
    # the same agent figures on a fast machine's floor miss
    verdicts = {row.name: row.ok for row in judge(slow_agent, RECORD, GRPC)}
    assert verdicts["prepare p50 (192 in sequence)"] is False
    assert verdicts[RATE_ROW] is False


def test_figures_are_the_medians_and_p99_of_what_was_measured() -> None:
    prep = [float(ms) for ms in range(1, 102)]  # 1 .. 101 ms
    figures = Figures.of((prep, [0.5, 0.25, 0.75]), [700.0, 500.0, 600.0])
    assert figures == Figures(
        prepare_p50_ms=51.0,
        prepare_p99_ms=100.0,
        unprepare_p50_ms=0.5,
        unprepare_p99_ms=0.75,
        rate=600.0,
    )
    # a level measured in sequence only (floor(grpc)) has no rate
    assert Figures.of((prep, [0.5]), []).rate == 0.0
