"""A stop that always completes (node/shutdown.py): the deadline ends a process whose threads
are stuck, naming them; the agent with a prepare stuck in a hung GPU's NVML call ends within
--shutdown-timeout after SIGTERM, and the next start finishes the claim (issue 37)."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import threading
import time
from pathlib import Path

import grpc
import pytest
import yaml

from dra_driver._proto.dra_v1 import api_pb2 as v1
from dra_driver._proto.dra_v1 import api_pb2_grpc as v1_grpc
from dra_driver.node.shutdown import DEFAULT_SHUTDOWN_TIMEOUT_S, EXIT_STATUS, ShutdownDeadline
from dra_driver.paths import simulated_faults_path
from dra_driver.sim.faults import SimulatedFault, append_fault
from dra_driver.sim.localapi import FakeKubeApi
from tests.claimdata import allocated_claim
from tests.test_agent import _in_cluster, as_a_pod

CHART = Path(__file__).parents[1] / "charts" / "gpu-dra"


def test_the_deadline_ends_the_process_naming_the_threads_still_stuck(
    caplog: pytest.LogCaptureFixture,
) -> None:
    release = threading.Event()
    stuck = threading.Thread(target=release.wait, name="claim_0", daemon=True)
    stuck.start()
    exits: list[int] = []
    exited = threading.Event()

    def exit(status: int) -> None:
        exits.append(status)
        exited.set()

    deadline = ShutdownDeadline(0.2, exit=exit)
    started = time.monotonic()
    with caplog.at_level(logging.ERROR):
        deadline.arm()
        deadline.arm()  # a second signal changes nothing
        assert exited.wait(5)
    took = time.monotonic() - started
    release.set()
    assert exits == [EXIT_STATUS]
    assert 0.2 <= took < 2
    (record,) = [r for r in caplog.records if "did not complete within 0.2 s" in r.getMessage()]
    threads: list[str] = record.threads  # type: ignore[attr-defined]
    (claim,) = [t for t in threads if t.startswith("claim_0: ")]
    assert "threading.py" in claim and claim.endswith(" in wait")


def test_the_chart_gives_the_pod_longer_than_the_agent_takes() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = json.loads((CHART / "values.schema.json").read_text())
    grace = values["kubeletPlugin"]["terminationGracePeriodSeconds"]
    minimum = schema["properties"]["kubeletPlugin"]["properties"]["terminationGracePeriodSeconds"][
        "minimum"
    ]
    assert DEFAULT_SHUTDOWN_TIMEOUT_S + 5 <= minimum <= grace


@as_a_pod
def test_sigterm_ends_the_agent_in_time_with_a_prepare_stuck_and_the_next_start_finishes_it(
    tmp_path: Path,
) -> None:
    """A prepare that creates a MIG device on a GPU whose NVML calls hang for an hour: SIGTERM
    ends the agent within --shutdown-timeout (plus its start-up's worth of slack), status 1,
    the log naming the stuck thread; the restarted agent prepares the claim."""
    api = FakeKubeApi(tls_dir=tmp_path / "tls", token="sa-token").start()
    try:
        api.add_node("gpu-node-1")
        command, env = _in_cluster(
            api, tmp_path, simulate="h100:1:mig", extra=("--shutdown-timeout", "2"),
            env={"MIG_MODE": "dynamic"},
        )  # fmt: skip
        plugins = tmp_path / "plugins" / "gpu.nvidia.com"
        dra = plugins / "dra.sock"
        claim = api.add_claim(
            allocated_claim(name="dyn", node="gpu-node-1", devices=["gpu-0-mig-3g40gb-9-4"])
        )
        ref = v1.Claim(namespace="default", name="dyn", uid=claim["metadata"]["uid"])

        def start() -> subprocess.Popen[str]:
            agent = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
            deadline = time.monotonic() + 30
            while not (dra.is_socket() and api.slices(node_name="gpu-node-1")):
                assert time.monotonic() < deadline, "the agent did not start"
                assert agent.poll() is None, agent.stderr.read() if agent.stderr else ""
                time.sleep(0.05)
            return agent

        def prepare(timeout_s: float) -> str:
            with grpc.insecure_channel(f"unix://{dra}") as channel:
                answer = v1_grpc.DRAPluginStub(channel).NodePrepareResources(
                    v1.NodePrepareResourcesRequest(claims=[ref]), timeout=timeout_s
                )
            return str(answer.claims[ref.uid].error)

        agent = start()
        try:
            append_fault(
                simulated_faults_path(plugins),
                SimulatedFault(kind="hang", gpu=0, seconds=3600),
            )
            time.sleep(0.5)  # the simulated NVML reads its inbox every 20 ms
            with pytest.raises(grpc.RpcError) as info:
                prepare(timeout_s=1)
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED  # type: ignore[attr-defined]
            stopped_at = time.monotonic()
            agent.send_signal(signal.SIGTERM)
            _, stderr = agent.communicate(timeout=20)
            took = time.monotonic() - stopped_at
        finally:
            if agent.poll() is None:
                agent.kill()
                agent.communicate()
        assert agent.returncode == EXIT_STATUS, stderr
        assert 2 <= took < 6, stderr
        (line,) = [json.loads(x) for x in stderr.splitlines() if "did not complete" in x]
        # the gRPC thread that runs the one claim's prepare, stuck in the hung GPU's NVML call
        assert any(
            "sim/nvml/health.py:" in t and t.endswith(" in answers") for t in line["threads"]
        )

        assert not dra.exists()  # the sockets went first, as in every stop
        agent = start()
        try:
            assert prepare(timeout_s=10) == ""
        finally:
            agent.send_signal(signal.SIGTERM)
            _, stderr = agent.communicate(timeout=20)
        assert agent.returncode == 0, stderr
    finally:
        api.stop()
