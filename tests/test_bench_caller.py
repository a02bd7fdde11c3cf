"""bench/caller: the benchmark's native gRPC caller (the kubelet's side, driven by
bench/kubeletcaller.py) answers what a Python gRPC client gets, call by call and in parallel,
against a real plugin over its socket."""

from __future__ import annotations

import subprocess
from pathlib import Path

import grpc
import pytest

from bench.kubeletcaller import (
    PREPARE,
    UNPREPARE,
    _NativeCaller,
    _prepare_request,
    _unprepare_request,
)
from dra_driver._proto.dra_v1 import api_pb2 as v1
from dra_driver._proto.dra_v1 import api_pb2_grpc as v1_grpc
from dra_driver.node.nodeplugin import NodePlugin
from dra_driver.sim.localapi import FakeKubeApi
from tests.claimdata import allocated_claim
from tests.test_plugin_server import kube, plugin, v1_claim  # noqa: F401 - shared fixtures

ROOT = Path(__file__).resolve().parents[1]
NO_TOOLCHAIN = 2  # hack/build-bench-caller.sh: no g++ or libgrpc++-dev, and none installable


@pytest.fixture(scope="module")
def binary(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("caller") / "dra-kubelet-caller"
    built = subprocess.run(
        ["bash", str(ROOT / "hack/build-bench-caller.sh"), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if built.returncode == NO_TOOLCHAIN:
        pytest.skip(f"the native caller cannot be built here: {built.stderr.strip()}")
    # with the toolchain there, a build that fails is a broken caller, not a missing tool
    assert built.returncode == 0, built.stderr
    return out


def test_native_calls_get_the_answers_a_python_client_gets(
    binary: Path,
    kubeapi: FakeKubeApi,
    plugin: NodePlugin,  # noqa: F811 - the fixture imported above
) -> None:
    claims = [
        v1_claim(kubeapi.add_claim(allocated_claim(name=f"c{i}", devices=[f"gpu-{i}"])))
        for i in range(2)
    ]
    caller = _NativeCaller(binary, str(plugin.paths.dra))
    channel = grpc.insecure_channel(f"unix://{plugin.paths.dra}")
    stub = v1_grpc.DRAPluginStub(channel)
    try:
        elapsed, raw = caller.call(*_prepare_request(claims[0]))
        assert 0 < elapsed < 10
        native = v1.NodePrepareResourcesResponse.FromString(raw)
        (device,) = native.claims[claims[0].uid].devices
        assert (device.pool_name, device.device_name) == ("node1", "gpu-0")
        # prepare is idempotent: the Python client gets the very same answer for the claim
        assert (
            stub.NodePrepareResources(
                v1.NodePrepareResourcesRequest(claims=[claims[0]]), timeout=10
            )
            == native
        )

        # in parallel, one answer per request, in request order
        requests = [_prepare_request(c) for c in claims] + [_unprepare_request(claims[0])]
        elapsed, answers = caller.parallel(3, requests)
        assert 0 < elapsed < 10
        prepared = [v1.NodePrepareResourcesResponse.FromString(a) for a in answers[:2]]
        assert [list(p.claims) for p in prepared] == [[c.uid] for c in claims]
        assert prepared[1].claims[claims[1].uid].devices[0].device_name == "gpu-1"
        unprepared = v1.NodeUnprepareResourcesResponse.FromString(answers[2])
        assert list(unprepared.claims) == [claims[0].uid]
        assert not unprepared.claims[claims[0].uid].error
    finally:
        caller.close()
        channel.close()


def test_a_failed_call_stops_the_bench_with_the_grpc_status(
    binary: Path,
    plugin: NodePlugin,  # noqa: F811 - the fixture imported above
) -> None:
    caller = _NativeCaller(binary, str(plugin.paths.dra))
    try:
        with pytest.raises(SystemExit, match="gRPC status 12"):  # UNIMPLEMENTED
            caller.call("/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NoSuchMethod", b"")
        # the caller goes on after an error: an empty request gets an empty answer
        _, raw = caller.call(PREPARE, b"")
        assert v1.NodePrepareResourcesResponse.FromString(raw) == v1.NodePrepareResourcesResponse()
        _, raw = caller.call(UNPREPARE, b"")
        assert not v1.NodeUnprepareResourcesResponse.FromString(raw).claims
    finally:
        caller.close()
