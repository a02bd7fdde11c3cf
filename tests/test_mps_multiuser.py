"""MPS ``multiUser`` (the control daemon in multi-user mode, ``-M``) and the bounds of
``defaultActiveThreadPercentage``, as NVIDIA's MpsConfig has them.

The daemons run as in tests/test_mps.py: a Deployment through the real Kubernetes client against
the local API server, its command run by the stand-in kubelet (the fake driver root's stand-in
nvidia-cuda-mps-control), on simulated GPUs: an H100 (Hopper, 9.0) and a P100 (Pascal, 6.0,
below the Volta minimum of multi-user mode).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import pytest

from dra_driver.errors import ConfigDecodeError, ConfigNotSupported
from dra_driver.prepare.repair import Repair
from dra_driver.sharing import mps
from tests.claimdata import allocated_claim
from tests.test_mps import NAMESPACE, Env, mps_config, mps_node

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs (root only)")

# gpu-0: a Pascal GPU (compute capability 6.0); gpu-1, gpu-2: Hopper (9.0)
SPEC = "p100:1,h100:2"
PASCAL = mps.MpsDevice(
    uuid="GPU-p", memory_bytes=16 * 2**30, exclusive_gpu="GPU-p", compute_capability=(6, 0)
)
VOLTA = mps.MpsDevice(
    uuid="GPU-v", memory_bytes=32 * 2**30, exclusive_gpu="GPU-v", compute_capability=(7, 0)
)
HOPPER = mps.MpsDevice(
    uuid="GPU-h", memory_bytes=80 * 2**30, exclusive_gpu="GPU-h", compute_capability=(9, 0)
)


@pytest.fixture
def env() -> Iterator[Env]:
    with mps_node(SPEC) as e:
        yield e


def command(env: Env, uid: str) -> list[str]:
    """The command of the claim's daemon Deployment, as the API server holds it."""
    (deployment,) = [
        d for d in env.api.objects("deployments") if d["metadata"]["name"] == f"mps-{uid}"
    ]
    containers = deployment["spec"]["template"]["spec"]["containers"]
    return list(containers[0]["command"])


# -- pure parts ---------------------------------------------------------------------------------


def test_multi_user_is_asked_for_only_by_true_and_refused_below_volta() -> None:
    assert mps.multi_user({"multiUser": True}, [VOLTA, HOPPER]) is True
    assert mps.multi_user({"multiUser": False}, [PASCAL]) is False
    assert mps.multi_user({}, [PASCAL]) is False
    with pytest.raises(mps.MpsNotSupported) as info:
        mps.multi_user({"multiUser": True}, [HOPPER, PASCAL])
    assert str(info.value) == (
        "mpsConfig.multiUser: device GPU-p has CUDA compute capability 6.0; the MPS control "
        "daemon's multi-user mode (-M) needs Volta or newer (7.0): below that the daemon takes "
        "-M but its clients other than root cannot initialize CUDA"
    )
    unknown = mps.MpsDevice(uuid="GPU-u", memory_bytes=2**30, exclusive_gpu=None)
    with pytest.raises(mps.MpsNotSupported, match="GPU-u has CUDA compute capability unknown"):
        mps.multi_user({"multiUser": True}, [unknown])


def test_a_multi_user_daemon_runs_with_the_flag_and_is_not_adopted_for_a_single_user_one() -> None:
    def body(multi_user: bool) -> dict[str, Any]:
        daemon = mps.MpsDaemon(
            owner="abc", devices=(HOPPER,), base=Path("/plugins/d/mps"), multi_user=multi_user
        )
        return mps.deployment(
            daemon,
            namespace="ns",
            node_name="n1",
            driver_name="gpu.nvidia.com",
            image="img:1",
            host_driver_root=Path("/"),
            control=PurePosixPath("usr/bin/nvidia-cuda-mps-control"),
        )

    multi, single = body(multi_user=True), body(multi_user=False)
    assert multi["spec"]["template"]["spec"]["containers"][0]["command"] == [
        "/driver-root/usr/bin/nvidia-cuda-mps-control",
        "-f",
        "-M",
    ]
    assert single["spec"]["template"]["spec"]["containers"][0]["command"] == [
        "/driver-root/usr/bin/nvidia-cuda-mps-control",
        "-f",
    ]
    assert mps.adoptable(multi, body(multi_user=True))
    assert not mps.adoptable(single, multi)
    assert not mps.adoptable(multi, single)


@pytest.mark.parametrize("percentage", [1, 50, 100])
def test_percentages_from_1_to_100_are_told_to_the_daemon(percentage: int) -> None:
    limits = mps.limits({"defaultActiveThreadPercentage": percentage}, [HOPPER])
    assert limits.commands() == [f"set_default_active_thread_percentage {percentage}"]


@pytest.mark.parametrize("percentage", [0, 101, -1, True])
def test_percentages_outside_1_to_100_never_reach_the_daemon(percentage: object) -> None:
    with pytest.raises(mps.MpsConfigError, match=r"is outside 1\.\.100"):
        mps.limits({"defaultActiveThreadPercentage": percentage}, [HOPPER])


# -- prepare ------------------------------------------------------------------------------------


def test_a_multi_user_claim_runs_its_daemon_with_the_flag_and_unprepares_cleanly(env: Env) -> None:
    claim = env.store.add(
        allocated_claim(
            name="multi",
            devices=["gpu-1", "gpu-2"],
            configs=[mps_config(multiUser=True, defaultActiveThreadPercentage=100)],
        )
    )
    uid = claim["metadata"]["uid"]
    h1, h2 = env.uuid("gpu-1"), env.uuid("gpu-2")
    env.preparer.prepare(env.ref(claim))
    assert command(env, uid)[1:] == ["-f", "-M"]
    assert list(env.kubelet.running()) == [(NAMESPACE, f"mps-{uid}")]
    # the stand-in records how it was started: the kubelet ran the Deployment's command
    assert env.daemon_calls(uid) == [
        f"start -M {h1},{h2}",
        "get_server_list",
        "set_default_active_thread_percentage 100",
    ]
    record = env.preparer.checkpoint.get(uid)
    assert record is not None
    assert record.devices[0].config["sharing"]["mpsConfig"]["multiUser"] is True
    # a restarted agent adopts the multi-user daemon: no second start
    preparer = env.restart()
    Repair(preparer).reconcile()
    assert [c for c in env.daemon_calls(uid) if c.startswith("start")] == [f"start -M {h1},{h2}"]
    preparer.unprepare(env.ref(claim))
    env.assert_nothing_left()


def test_a_claim_without_multi_user_runs_a_single_user_daemon(env: Env) -> None:
    claim = env.store.add(
        allocated_claim(name="single", devices=["gpu-0"], configs=[mps_config(multiUser=False)])
    )
    uid = claim["metadata"]["uid"]
    env.preparer.prepare(env.ref(claim))  # MPS itself runs on Pascal: only -M needs Volta
    assert command(env, uid)[1:] == ["-f"]
    assert env.daemon_calls(uid)[0] == f"start {env.uuid('gpu-0')}"
    env.preparer.unprepare(env.ref(claim))
    env.assert_nothing_left()


def test_multi_user_on_a_pre_volta_gpu_fails_only_that_claim_of_the_batch(env: Env) -> None:
    pascal = env.store.add(
        allocated_claim(name="pascal", devices=["gpu-0"], configs=[mps_config(multiUser=True)])
    )
    hopper = env.store.add(
        allocated_claim(name="hopper", devices=["gpu-1"], configs=[mps_config(multiUser=True)])
    )
    plain = env.store.add(allocated_claim(name="plain", devices=["gpu-2"]))
    outcomes = env.preparer.prepare_batch([env.ref(pascal), env.ref(hopper), env.ref(plain)])
    refused = outcomes[pascal["metadata"]["uid"]]
    assert refused.error == (
        "ResourceClaim default/pascal: mpsConfig.multiUser: device "
        f"{env.uuid('gpu-0')} has CUDA compute capability 6.0; the MPS control daemon's "
        "multi-user mode (-M) needs Volta or newer (7.0): below that the daemon takes -M but its "
        "clients other than root cannot initialize CUDA"
    )
    assert refused.error_type == "config"
    assert outcomes[hopper["metadata"]["uid"]].error == ""
    assert outcomes[plain["metadata"]["uid"]].error == ""
    assert set(env.preparer.checkpoint.snapshot()) == {
        hopper["metadata"]["uid"],
        plain["metadata"]["uid"],
    }
    # nothing was started for the refused claim; the other claim's daemon runs with -M
    assert env.deployments() == [f"mps-{hopper['metadata']['uid']}"]
    assert command(env, hopper["metadata"]["uid"])[1:] == ["-f", "-M"]
    assert env.uuid("gpu-0") not in env.fake.compute_modes()


@pytest.mark.parametrize(
    ("percentage", "error", "message"),
    [
        (0, ConfigNotSupported, "mpsConfig.defaultActiveThreadPercentage 0 is refused"),
        (101, ConfigDecodeError, "Input should be less than or equal to 100"),
        (-5, ConfigDecodeError, "Input should be greater than or equal to 0"),
    ],
)
def test_a_percentage_the_agent_does_not_carry_out_starts_nothing(
    env: Env, percentage: int, error: type[Exception], message: str
) -> None:
    claim = env.store.add(
        allocated_claim(
            name="pct",
            devices=["gpu-1"],
            configs=[mps_config(defaultActiveThreadPercentage=percentage)],
        )
    )
    with pytest.raises(error, match=message):
        env.preparer.prepare(env.ref(claim))
    assert env.deployments() == []
    assert env.preparer.checkpoint.get(claim["metadata"]["uid"]) is None
