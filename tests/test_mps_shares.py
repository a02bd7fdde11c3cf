"""Consumable shares enforced by real MPS daemons: prepare.Preparer with mpsshares.MpsShareEnforcer.

The node of tests/test_mps.py (local API server, stand-in kubelet running the fake driver root's
nvidia-cuda-mps-control -f, stand-in nvidia-smi, a real tmpfs) with ``--consumable-shares``:
each device with shares runs one shared daemon, started by its first share and stopped after its
last; each share's CDI device makes its container a client of that daemon with the share's own
memory and compute limits.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from dra_driver.errors import ConfigNotSupported
from dra_driver.prepare.repair import Repair
from dra_driver.sharing.shares import parse_mode
from tests.claimdata import allocated_claim, new_uid
from tests.test_mps import NAMESPACE, Env, mounts_under, mps_config, mps_node

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs (root only)")


@pytest.fixture
def env() -> Iterator[Env]:
    with mps_node() as e:
        e.consumable_shares = parse_mode("compute")
        e.restart()
        yield e


def share_claim(name: str, device: str, **consumed: str) -> dict[str, Any]:
    claim = allocated_claim(name=name, devices=[device])
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    result["shareID"] = new_uid()
    result["consumedCapacity"] = consumed
    return claim


def share_edits(env: Env, claim: dict[str, Any]) -> dict[str, Any]:
    uid = claim["metadata"]["uid"]
    (device,) = json.loads(env.preparer.specs.path_for(uid).read_bytes())["devices"]
    share = claim["status"]["allocation"]["devices"]["results"][0]["shareID"]
    assert device["name"].endswith(f"-share-{share}")
    edits: dict[str, Any] = device["containerEdits"]
    return edits


def test_shares_of_a_gpu_run_one_daemon_each_container_a_client_with_its_own_limits(
    env: Env,
) -> None:
    gpu = env.uuid("gpu-0")
    owner = "shares-gpu-0"
    a = env.store.add(share_claim("a", "gpu-0", memory="20Gi", compute="30"))
    b = env.store.add(share_claim("b", "gpu-0", memory="10Gi", compute="50"))
    outcomes = env.preparer.prepare_batch([env.ref(a), env.ref(b)])
    assert [o.error for o in outcomes.values()] == ["", ""]
    # one Deployment and one daemon process for the GPU, started once
    assert env.deployments() == [f"mps-{owner}"]
    assert list(env.kubelet.running()) == [(NAMESPACE, f"mps-{owner}")]
    assert env.kubelet.starts[(NAMESPACE, f"mps-{owner}")] == 1
    assert env.daemon_calls(owner) == [f"start {gpu}", "get_server_list"]  # no default limits
    assert env.fake.compute_modes() == {gpu: "EXCLUSIVE_PROCESS"}
    assert mounts_under(env.tmp) == [str(env.mps_base / owner / "shm")]
    pipe = str(env.mps_base / owner / "pipe")
    for claim, memory, compute in ((a, "20480M", "30"), (b, "10240M", "50")):
        edits = share_edits(env, claim)
        assert sorted(edits["env"]) == sorted(
            [
                f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={gpu}={memory}",
                f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={compute}",
                "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps",
            ]
        )
        assert [m["hostPath"] for m in edits["mounts"]] == [pipe, str(env.mps_base / owner / "shm")]
    # the pipe directory the specs mount reaches the running daemon
    client = subprocess.run(
        [str(env.fake.root / "usr/bin/nvidia-cuda-mps-control")],
        input="get_server_list\n",
        env={**os.environ, "CUDA_MPS_PIPE_DIRECTORY": pipe},
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert client.returncode == 0, client.stderr
    # the first share goes: the daemon stays for the other
    env.preparer.unprepare(env.ref(a))
    assert list(env.kubelet.running()) == [(NAMESPACE, f"mps-{owner}")]
    assert env.fake.compute_modes() == {gpu: "EXCLUSIVE_PROCESS"}
    # the last share goes: daemon, Deployment, tmpfs, directories and compute mode with it
    env.preparer.unprepare(env.ref(b))
    assert env.daemon_calls(owner)[-2:] == ["quit", "exit 0"]
    env.assert_nothing_left()
    assert env.fake.compute_modes() == {gpu: "DEFAULT"}


def test_a_restarted_agent_adopts_a_shared_daemon_and_reconcile_keeps_it(env: Env) -> None:
    owner = "shares-gpu-1"
    claim = env.store.add(share_claim("s", "gpu-1", memory="8Gi", compute="25"))
    env.preparer.prepare(env.ref(claim))
    pid = env.kubelet.running()[(NAMESPACE, f"mps-{owner}")]
    restarted = env.restart()
    done = Repair(restarted).reconcile()
    # kept (not an orphan of no claim), adopted (asked to answer), not started again
    assert done["mps_daemons_removed"] == 0
    assert done["share_daemons_acquired"] == 1
    assert env.kubelet.running() == {(NAMESPACE, f"mps-{owner}"): pid}
    assert [r.verb for r in env.api.writes() if r.resource == "deployments"] == ["create"]
    # another share of the device after the restart needs no new daemon
    more = env.store.add(share_claim("t", "gpu-1", memory="8Gi", compute="25"))
    restarted.prepare(env.ref(more))
    assert env.kubelet.starts[(NAMESPACE, f"mps-{owner}")] == 1
    restarted.unprepare(env.ref(claim))
    restarted.unprepare(env.ref(more))
    env.assert_nothing_left()


def test_reconcile_removes_a_shared_daemon_whose_last_share_is_gone(env: Env) -> None:
    claim = env.store.add(share_claim("s", "gpu-2", memory="8Gi"))
    uid = claim["metadata"]["uid"]
    env.preparer.prepare(env.ref(claim))
    # the record goes (an unprepare killed before it released the daemon)
    env.preparer.checkpoint.transact(lambda claims: claims.discard(uid))
    done = Repair(env.restart()).reconcile()
    assert done["mps_daemons_removed"] == 1
    env.assert_nothing_left()


def test_a_sharing_config_on_a_share_is_refused_with_nothing_started(env: Env) -> None:
    claim = allocated_claim(name="c", devices=["gpu-3"], configs=[mps_config()])
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    result["shareID"], result["consumedCapacity"] = new_uid(), {"memory": "1Gi"}
    env.store.add(claim)
    with pytest.raises(ConfigNotSupported, match=r"is a consumable share.*strategy MPS"):
        env.preparer.prepare(env.ref(claim))
    assert env.preparer.checkpoint.get(claim["metadata"]["uid"]) is None
    env.assert_nothing_left()
