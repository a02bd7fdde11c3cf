"""gpu-dra gpu-check --mps on simulated GPUs: the check's own MPS control daemon is the simulated
driver's stand-in (sim/fakedriver.py MPS_CONTROL), its client the real probe (probe.c, ``mps``)
on the stand-in libcuda (sim/elfdriver.py MPS_CLIENT_C), which applies the pinned memory limit
the environment names only while a daemon serves the pipe directory, as the real H200 did. What
this proves and leaves out: docs/gpu-check.md, "MPS enforcement"."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dra_driver.cli import gpu_dra_main
from dra_driver.gpucheck import mpscheck, report
from dra_driver.gpucheck.check import Options, run_check
from dra_driver.sharing import mps
from dra_driver.sim.checkmachine import SimulatedTwins, simulated_machine
from dra_driver.sim.fakedriver import make_fake_driver, read_mps_control_calls

SHARE = mpscheck.Share(memory_mib=20480, thread_percentage=25)
NEEDS_CC = pytest.mark.skipif(shutil.which("cc") is None, reason="needs cc for the stand-ins")


@NEEDS_CC
def test_the_share_is_given_to_a_daemon_of_the_checks_own_and_found_enforced(
    tmp_path: Path,
) -> None:
    (tmp_path / "work").mkdir()
    options = Options(mps=True, mps_share=SHARE)
    with simulated_machine("h200:1", tmp_path / "machine") as machine:
        body = run_check(machine, twins=SimulatedTwins(), options=options, work=tmp_path / "work")
        recorded = read_mps_control_calls(machine.driver_roots[0] / "usr/bin")
    entry = body["sections"]["mps"]
    assert entry["ok"], entry
    uuid = body["gpus"][0]["facts"]["discovery"]["uuid"]
    # what the agent's MPS step would send for a 20Gi, 25 % share, read back from the daemon
    assert [c["command"] for c in entry["commands"]] == [
        "set_default_active_thread_percentage 25",
        f"set_default_device_pinned_mem_limit {uuid} 20480M",
    ]
    assert [c["reply"] for c in entry["read_back"]] == ["25.0", "20480M"]
    assert entry["client_env"] == [
        f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={uuid}=20480M",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25",
    ]
    # the client reached its limit, the same environment without a daemon did not
    assert entry["reached"]["allocated_bytes"] == 20 << 30
    assert entry["reached"]["memory_free_seen_bytes"] == 20 << 30
    assert entry["reached"]["without_mps"]["allocated_bytes"] > 100 << 30
    assert entry["enforced"] == {"memory": True, "threads": None}  # the stand-in runs no kernel
    assert entry["environment_alone_limits"] is False
    assert entry["probe"]["client"]["calls"]["cuMemAlloc"] == 2  # out of memory ends the steps
    assert entry["probe"]["client"]["calls"]["cuModuleLoadData"] == 801  # not supported here
    # the daemon served its own pipe directory, for the GPU alone, and quit
    assert entry["quit"] == "quit"
    pipe = entry["pipe_dir"]
    assert recorded[0] == f"{pipe} start {uuid}"
    assert recorded[-1] == f"{pipe} exit 0"
    assert not Path(pipe).exists()  # its directory is gone with the section
    assert "enforced: True" in report.summary(body)


def test_a_daemon_that_never_answers_is_stopped_and_the_section_fails(tmp_path: Path) -> None:
    driver = make_fake_driver(tmp_path, gpu_minors=range(1))
    control = driver.root / "usr/bin" / mps.CONTROL
    (control.parent / "nvidia-cuda-mps-control.hang").write_text("")
    entry = mpscheck.run_mps(
        control=control,
        probe=tmp_path / "no-probe",
        gpu_uuid="GPU-0",
        memory_bytes=80 << 30,
        share=SHARE,
        library_dir=None,
        work=tmp_path / "mps",
        ready_timeout_s=0.5,
    )
    assert entry["daemon"]["ready"] is False
    assert entry["quit"] == "terminated"  # quit found no daemon listening: SIGTERM did it
    assert "cannot run the probe" in entry["probe"]["without_mps"]["error"]
    assert entry["ok"] is False
    assert entry["enforced"] == {"memory": None, "threads": None}


def test_a_daemon_that_fails_to_start_is_reported_with_its_log(tmp_path: Path) -> None:
    driver = make_fake_driver(tmp_path, gpu_minors=range(1))
    control = driver.root / "usr/bin" / mps.CONTROL
    (control.parent / "nvidia-cuda-mps-control.fail").write_text("GPU in use by another daemon")
    entry = mpscheck.run_mps(
        control=control,
        probe=tmp_path / "no-probe",
        gpu_uuid="GPU-0",
        memory_bytes=80 << 30,
        share=SHARE,
        library_dir=None,
        work=tmp_path / "mps",
        ready_timeout_s=5,
    )
    assert entry["daemon"] == {"ready": False, "why": "exited with 1"}
    assert entry["quit"] == "had exited (1)"
    assert entry["daemon_log"][-1].endswith("GPU in use by another daemon")
    assert entry["ok"] is False


@pytest.mark.parametrize(
    ("allocated", "client_ms", "alone_ms", "memory", "threads"),
    [
        (20 << 30, 10.0, 2.5, True, True),  # at the limit; 4x the time at 25 %
        ((20 << 30) + (256 << 20), 10.0, 2.5, False, True),  # one step past the limit
        (0, 2.6, 2.5, False, False),  # nothing allocated; the thread limit did nothing
        (None, None, 2.5, None, None),  # the client did not run
    ],
)
def test_the_verdict_holds_what_was_reached_to_what_was_allowed(
    allocated: int | None,
    client_ms: float | None,
    alone_ms: float,
    memory: bool | None,
    threads: bool | None,
) -> None:
    client = {
        "values": {
            k: v for k, v in (("allocated", allocated), ("kernel_ms", client_ms)) if v is not None
        }
    }
    alone = {"values": {"allocated": 140 << 30, "kernel_ms": alone_ms}}  # fmt: skip
    found = mpscheck.verdict(SHARE, client, alone)
    assert found["enforced"] == {"memory": memory, "threads": threads}
    assert found["allowed"] == {"memory_bytes": 20 << 30, "thread_percentage": 25}
    assert found["environment_alone_limits"] is False


def test_a_share_is_read_as_memory_and_percent_and_a_bad_one_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert mpscheck.parse_share("20Gi,25") == SHARE
    assert mpscheck.parse_share("512Mi") == mpscheck.Share(memory_mib=512, thread_percentage=25)
    assert mpscheck.default_share(143771 << 20) == mpscheck.Share(35 << 10, 25)
    with pytest.raises(SystemExit) as exited:
        gpu_dra_main(["gpu-check", "--simulate", "h100:1", "--mps", "20Gi,0"])
    assert exited.value.code == 2
    assert (
        "--mps 20Gi,0: an MPS share's thread percentage must be 1..100" in capsys.readouterr().err
    )
