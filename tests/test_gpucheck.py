"""gpu-dra gpu-check on simulated GPUs: the same code path a real GPU runs, stand-ins below
pynvml and a fake driver tree of ELF stand-ins (sim/checkmachine.py). The CUDA load needs root
(a private mount namespace); elsewhere that section is skipped, saying why."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pynvml
import pytest

from dra_driver.cli import gpu_dra_main
from dra_driver.gpucheck import compare, nvmlquery, report, runtime
from dra_driver.gpucheck.check import Options, run_check, twin_spec
from dra_driver.sim.checkmachine import SimulatedTwins, simulated_machine

CAN_LOAD = runtime.unavailable() is None and shutil.which("cc") is not None


def run(tmp_path: Path, spec: str) -> tuple[dict, list[str]]:
    """The check on simulated ``spec``; its report and every NVML call it made (the machine's
    and the twins' simulated libraries)."""
    twins = SimulatedTwins()
    (tmp_path / "work").mkdir()
    with simulated_machine(spec, tmp_path / "machine") as machine:
        library = pynvml.nvmlLib
        result = run_check(machine, twins=twins, options=Options(), work=tmp_path / "work")
    calls = list(library.calls) + [c for lib in twins.libraries for c in lib.calls]
    return result, calls


def test_the_check_of_a_simulated_h100_passes_every_section_with_no_difference(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    status = gpu_dra_main(["gpu-check", "--simulate", "h100:1", "--out", str(out)])
    printed = capsys.readouterr().out
    assert status == 0, printed
    body = json.loads((out / report.REPORT_FILE).read_text())
    assert set(body["sections"]) == {"discovery", "comparison", "driver_files", "cuda_load"}
    assert not [s for s in body["sections"].values() if "error" in s], body["sections"]
    (gpu,) = body["gpus"]
    assert gpu["product_name"] == "NVIDIA H100 80GB HBM3"
    assert gpu["twin"] == {"spec": "h100-80gb:1:numa=0", "differences": []}
    assert [d["name"] for d in gpu["facts"]["devices"]["static"]] == ["gpu-0"]
    (resource_slice,) = body["sections"]["discovery"]["resource_slices"]
    assert [d["name"] for d in resource_slice["spec"]["devices"]] == ["gpu-0"]
    scans = body["sections"]["driver_files"]
    (scan,) = [v for v in scans.values() if isinstance(v, dict)]
    assert all(not s["missing_host_paths"] for s in scan["specs"].values())
    assert "simulated twin h100-80gb:1:numa=0: 0 difference(s)" in printed
    assert f"report: {out / report.REPORT_FILE}" in printed
    assert (out / report.SUMMARY_FILE).read_text() in printed


@pytest.mark.skipif(not CAN_LOAD, reason=runtime.unavailable() or "needs cc for the stand-ins")
def test_the_probe_loads_cuda_and_nvml_through_the_spec_in_a_root_without_driver_files(
    tmp_path: Path,
) -> None:
    body, _ = run(tmp_path, "h100:2")
    load = body["sections"]["cuda_load"]
    assert load["ok"], load
    probe = load["steps"]["probe"]["output"]
    assert "load libcuda.so.1 ok /usr/local/nvidia/lib64/libcuda.so.1" in probe
    assert "call cuDeviceGetCount 0 2" in probe
    assert probe.count("call cuDeviceGetName 0 NVIDIA H100 80GB HBM3") == 2
    assert "call nvmlDeviceGetCount_v2 0 2" in probe
    smi = load["steps"]["nvidia-smi"]["output"]
    uuids = [g["facts"]["discovery"]["uuid"] for g in body["gpus"]]
    assert smi == [f"GPU {i}: NVIDIA H100 80GB HBM3 (UUID: {u})" for i, u in enumerate(uuids)]


@pytest.mark.skipif(not CAN_LOAD, reason=runtime.unavailable() or "needs cc for the stand-ins")
def test_a_library_the_spec_does_not_mount_shows_up_in_the_cuda_load(tmp_path: Path) -> None:
    spec = {
        "containerEdits": {"env": ["NVIDIA_VISIBLE_DEVICES=void"], "deviceNodes": [], "mounts": []},
        "devices": [],
    }
    probe = runtime.build_probe(tmp_path)
    (tmp_path / "c").mkdir()
    load = runtime.load_cuda(spec, probe=probe, work=tmp_path / "c")
    assert not load["ok"]
    assert any(
        line.startswith("load libcuda.so.1 fail") for line in load["steps"]["probe"]["output"]
    )


def test_the_check_makes_no_nvml_call_that_changes_a_gpu(tmp_path: Path) -> None:
    _, calls = run(tmp_path, "h100:1,a100-40gb:1:mig=3g.20gb+1g.5gb")
    setters = sorted(n for n in dir(pynvml) if nvmlquery.is_setter(n))
    # pynvml's write functions, as listed in its own names, are what is_setter knows
    assert {"nvmlDeviceSetMigMode", "nvmlDeviceSetComputeMode", "nvmlDeviceResetGpuLockedClocks",
            "nvmlDeviceClearEccErrorCounts", "nvmlDeviceSetPersistenceMode",
            "nvmlDeviceCreateGpuInstance", "nvmlGpuInstanceDestroy"} <= set(setters)  # fmt: skip
    assert calls, "the simulated NVML recorded no call"
    assert {"nvmlDeviceGetMigMode", "nvmlDeviceGetTotalEccErrors"} <= set(calls)
    assert {"nvmlDeviceRegisterEvents", "nvmlDeviceGetGpuInstanceProfileInfoV"} <= set(calls)
    assert [c for c in calls if nvmlquery.is_setter(c)] == []
    assert [c for c in calls if c.split("_v")[0] in setters] == []


def test_the_asker_refuses_a_setter_before_calling_it() -> None:
    called = []

    def nvmlDeviceSetMigMode(*args: object) -> None:
        called.append(args)

    with pytest.raises(nvmlquery.ReadOnlyViolation):
        nvmlquery.Asker()(nvmlDeviceSetMigMode, None, 1)
    assert called == []


def test_a_gpu_in_mig_mode_is_compared_with_a_twin_of_the_same_layout(tmp_path: Path) -> None:
    body, _ = run(tmp_path, "a100-40gb:1:mig=3g.20gb+1g.5gb")
    (gpu,) = body["gpus"]
    assert gpu["twin"]["spec"] == "a100-40gb:1:mig=3g.20gb+1g.5gb:numa=0"
    assert gpu["twin"]["differences"] == []
    profiles = gpu["facts"]["mig"]["profiles"]
    answered = {p["info"]["value"]["id"] for p in profiles.values() if "value" in p["info"]}
    assert answered == {19, 20, 15, 14, 9, 5, 0}
    assert [d["name"] for d in gpu["facts"]["devices"]["static"]] == [
        "gpu-0-mig-3g20gb-9-0",
        "gpu-0-mig-1g5gb-19-4",
    ]


def test_the_comparison_names_a_changed_field_and_ignores_node_state() -> None:
    facts = {
        "discovery": {"uuid": "GPU-a", "memory_bytes": 10, "numa_node": 0},
        "devices": {"static": [{"name": "gpu-3", "attributes": {"uuid": {"string": "GPU-a"}}}]},
        "health": {"ecc_errors": {"volatile_corrected": {"value": 4, "ms": 1.0}}},
    }
    twin = {
        "discovery": {"uuid": "GPU-b", "memory_bytes": 12, "numa_node": 1},
        "devices": {"static": [{"name": "gpu-0", "attributes": {"uuid": {"string": "GPU-b"}}}]},
        "health": {"ecc_errors": {"volatile_corrected": {"value": 0, "ms": 0.1}}},
    }
    assert compare.differences(facts, twin) == [
        compare.Difference("discovery.memory_bytes", 10, 12)
    ]
    twin["health"]["ecc_errors"]["volatile_corrected"] = {"error": "NOT_SUPPORTED", "rc": 3}
    paths = [d.path for d in compare.differences(facts, twin)]
    assert "health.ecc_errors.volatile_corrected.error" in paths


def test_a_reading_the_recording_check_did_not_have_is_no_difference_but_a_refused_one_is() -> None:
    older = {"telemetry": {"reading": {"memory_used_bytes": 5}}}
    newer = {"telemetry": {"reading": {"memory_used_bytes": 7, "memory_reserved_bytes": 9}}}
    assert compare.differences(older, newer) == []
    refused = {"telemetry": {"reading": {"memory_used_bytes": 5, "memory_reserved_bytes": None}}}
    assert compare.differences(refused, newer) == [
        compare.Difference("telemetry.reading.memory_reserved_bytes", None, compare.PRESENT)
    ]
    # outside the readings a field one side lacks is a difference, as ever
    assert [d.path for d in compare.differences({"health": {"y": 1}}, {"health": {"x": 1}})] == [
        "health.x",
        "health.y",
    ]


def test_the_twin_spec_follows_the_mig_mode_and_layout() -> None:
    off = {"mig_enabled": False, "mig_pending": False, "mig_instances": [], "numa_node": None}
    assert twin_spec("h100-80gb", off) == "h100-80gb:1:numa=none"
    assert twin_spec("h100-80gb", {**off, "numa_node": 1}) == "h100-80gb:1:numa=1"
    assert twin_spec("h100-80gb", {**off, "mig_pending": True}) == (
        "h100-80gb:1:mig-pending:numa=none"
    )
    instances = [
        {"profile": {"name": "1g.10gb"}, "placement": {"start": 6}},
        {"profile": {"name": "3g.40gb"}, "placement": {"start": 0}},
    ]
    on = {**off, "mig_enabled": True, "mig_instances": instances}
    assert twin_spec("h100-80gb", on) == "h100-80gb:1:mig=3g.40gb+1g.10gb:numa=none"


def test_without_root_the_cuda_load_is_skipped_saying_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runtime, "unavailable", lambda: "needs root (test)")
    body, _ = run(tmp_path, "l4:1")
    assert body["sections"]["cuda_load"]["skipped"] == "needs root (test)"
    assert "[SKIP] cuda_load" in report.summary(body)


def test_the_container_script_quotes_every_path_of_the_spec(tmp_path: Path) -> None:
    spec = {
        "containerEdits": {
            "env": ["A=b c"],
            "mounts": [{"hostPath": "/x y/lib'1", "containerPath": "/usr/lib/z"}],
            "deviceNodes": [{"path": "/dev/nvidia0", "hostPath": "/d $(reboot)/nvidia0"}],
            "hooks": [{"hookName": "createContainer", "path": "/h", "args": ["h", "a;b"]}],
        }
    }
    script = runtime.container_script(
        spec, root=tmp_path / "r", bundle=tmp_path / "b", probe=Path("/p"), system=[]
    )
    assert "'/x y/lib'\"'\"'1'" in script
    assert "'/d $(reboot)/nvidia0'" in script
    assert "'a;b'" in script
    assert "'A=b c'" in script


def test_the_report_file_name_of_a_product() -> None:
    assert report.product_file_name("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3.json"
    assert os.sep not in report.product_file_name("A/B")


REPO = Path(__file__).resolve().parent.parent


def test_the_check_imports_nothing_beyond_the_standard_library_but_pynvml() -> None:
    """What .gpu-check/ must carry to a lent GPU (hack/gpu-check-wheels.sh): nvidia-ml-py."""
    code = (
        "import sys\n"
        "import dra_driver.cli, dra_driver.gpucheck.command, dra_driver.sim.checkmachine\n"
        "names = {m.split('.')[0] for m in sys.modules} - set(sys.stdlib_module_names)\n"
        "print(' '.join(sorted(n for n in names if not n.startswith(('_', 'dra_driver')))))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO
    )
    assert done.stdout.split() == ["pynvml"]


def test_the_script_runs_the_check_without_make(tmp_path: Path) -> None:
    done = subprocess.run(
        ["bash", str(REPO / "hack/gpu-check.sh"), "--simulate", "l4:1", "--out", str(tmp_path)],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "NVIDIA L4" in (tmp_path / report.SUMMARY_FILE).read_text()


def test_a_gpu_that_does_not_answer_is_reported_and_the_other_sections_still_run(
    tmp_path: Path,
) -> None:
    body, _ = run(tmp_path, "h100:1:fail,l4:1")
    discovery = body["sections"]["discovery"]
    assert [f["index"] for f in discovery["failures"]] == [0]
    assert discovery["failures"][0]["error"].endswith("GPU is lost")
    assert [g["product_name"] for g in body["gpus"]] == ["NVIDIA L4"]
    assert body["gpus"][0]["twin"]["differences"] == []
    assert "error" not in body["sections"]["driver_files"]
    assert "error" not in body["sections"]["cuda_load"]


@pytest.mark.skipif(not CAN_LOAD, reason=runtime.unavailable() or "needs cc for the stand-ins")
def test_a_wrapper_script_as_nvidia_smi_is_named_and_does_not_fail_the_cuda_load(
    tmp_path: Path,
) -> None:
    # as on a real H200 node: /usr/bin/nvidia-smi a shell script, no ELF program beside the libs
    (tmp_path / "work").mkdir()
    with simulated_machine("h100:1", tmp_path / "machine") as machine:
        smi = machine.driver_roots[0] / "usr/bin/nvidia-smi"
        smi.unlink()
        smi.write_text('#!/bin/sh\nexec /opt/nvidia/nvidia-smi "$@"\n')
        body = run_check(machine, twins=SimulatedTwins(), options=Options(), work=tmp_path / "work")
    (files,) = (v for k, v in body["sections"]["driver_files"].items() if k != "seconds")
    assert files["host_paths"][str(smi)] == "script (#!/bin/sh)"
    assert str(smi) in files["scripts"]
    libcuda = next(p for p in files["host_paths"] if p.endswith(".so.570.124.06"))
    assert files["host_paths"][libcuda] == "ELF"
    assert files["host_paths"][files["hook"]] == "ELF"
    assert files["host_paths"][str(machine.driver_roots[0] / "dev/nvidiactl")] in (
        "character device",  # as root
        "file",  # a fake driver's node without root
    )
    load = body["sections"]["cuda_load"]
    assert load["ok"], load
    (note,) = load["steps"]["nvidia-smi"]["output"]
    assert note.startswith(f"not run: the spec mounts {smi}, a script (#!/bin/sh), as nvidia-smi")
    assert "mounts a script as a program: script (#!/bin/sh)" in report.summary(body)
