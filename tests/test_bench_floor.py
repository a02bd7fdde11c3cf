"""bench/floorserver.py, the plugin behind bench_grpc_floor, does the work each of its levels
names: the claim GET answers the allocated device, and the record level's record is in the
agent's checkpoint, durable, until the claim is unprepared."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from dra_driver._proto.dra_v1 import api_pb2 as v1
from dra_driver._proto.dra_v1 import api_pb2_grpc as v1_grpc
from dra_driver.prepare.checkpoint import PREPARE_COMPLETED, Checkpoint
from dra_driver.sim.localapi import FakeKubeApi
from tests.claimdata import allocated_claim

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
