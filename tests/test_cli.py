"""Flags and their environment twins become a validated Config; errors name the flag."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dra_driver.cli import FLAGS, build_config, gpu_dra_main
from dra_driver.errors import ConfigError
from dra_driver.node.config import Config
from dra_driver.prepare import PREPARE_STARTED, Checkpoint, ClaimRecord, PreparedDevice


def test_environment_variables_fill_in_for_flags() -> None:
    config = build_config(
        [],
        {
            "NODE_NAME": "gpu-node-1",
            "DRIVER_NAME": "gpu.example.com",
            "NVIDIA_DRIVER_ROOT": "/run/nvidia/driver",
            "CONTAINER_DRIVER_ROOT": "/driver-root",
            "POD_NAMESPACE": "gpu-dra",
            "NVIDIA_NAMESPACE": "nvidia-dra",
            "KUBELET_REGISTRAR_DIRECTORY_PATH": "/k/registry",
            "KUBELET_PLUGINS_DIRECTORY_PATH": "/k/plugins",
            "CDI_ROOT": "/etc/cdi",
            "HEALTHCHECK_PORT": "8080",
            "POD_UID": "5b3c0e4e-3f0a-4a52-9d7c-0d1f2f8b9a10",
        },
    )
    assert config.node_name == "gpu-node-1"
    assert config.driver_name == "gpu.example.com"
    assert config.nvidia_driver_root == Path("/run/nvidia/driver")
    assert config.driver_root_in_container == Path("/driver-root")
    assert config.pod_namespace == "gpu-dra"
    assert config.nvidia_namespace == "nvidia-dra"
    assert config.plugin_data_dir == Path("/k/plugins/gpu.example.com")
    assert config.checkpoint_path == Path("/k/plugins/gpu.example.com/gpu-dra-checkpoint.json")
    assert config.cdi_root == Path("/etc/cdi")
    assert config.cdi_vendor == "k8s.gpu.example.com"
    assert config.healthcheck_port == 8080
    assert config.pod_uid == "5b3c0e4e-3f0a-4a52-9d7c-0d1f2f8b9a10"


def test_a_flag_wins_over_its_environment_variable() -> None:
    config = build_config(["--node-name", "from-flag"], {"NODE_NAME": "from-env"})
    assert config.node_name == "from-flag"


def test_defaults_are_the_nvidia_compatible_paths() -> None:
    config = build_config(["--node-name", "n1"], {})
    assert config.driver_name == "gpu.nvidia.com"
    assert config.kubelet_registrar_directory_path == Path("/var/lib/kubelet/plugins_registry")
    assert config.plugin_data_dir == Path("/var/lib/kubelet/plugins/gpu.nvidia.com")
    assert config.cdi_root == Path("/var/run/cdi")
    assert config.driver_root_in_container == Path("/")
    assert config.nvidia_namespace == "nvidia-dra-driver-gpu"  # NVIDIA chart's namespace


def test_every_flag_has_a_distinct_environment_twin() -> None:
    envs = [f.env for f in FLAGS]
    assert len(envs) == len(set(envs))
    assert {"NODE_NAME", "DRIVER_NAME", "NVIDIA_DRIVER_ROOT", "CDI_ROOT"} <= set(envs)
    assert {"KUBELET_REGISTRAR_DIRECTORY_PATH", "KUBELET_PLUGINS_DIRECTORY_PATH"} <= set(envs)


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        ([], {}, r"--node-name \(NODE_NAME\): is required"),
        (["--node-name", "Node_1"], {}, r"--node-name \(NODE_NAME\): 'Node_1' is not a valid DNS"),
        (["--node-name", "n" * 254], {}, r"--node-name \(NODE_NAME\): .* longer than 253"),
        (["--node-name", "n1", "--driver-name", "GPU"], {}, r"--driver-name \(DRIVER_NAME\)"),
        (["--node-name", "n1", "--cdi-root", "cdi"], {}, r"--cdi-root \(CDI_ROOT\): 'cdi' must"),
        (["--node-name", "n1"], {"HEALTHCHECK_PORT": "http"}, r"--healthcheck-port"),
        (["--node-name", "n1", "--metrics-port", "70000"], {}, r"--metrics-port .*70000"),
        (["--node-name", "n1", "--pod-uid", "../x"], {}, r"--pod-uid \(POD_UID\)"),
        (["--node-name", "n1"], {"NVIDIA_NAMESPACE": "NV_1"}, r"--nvidia-namespace \(NVIDIA_NAME"),
        (["--node-name", "n1", "--nvidia-namespace", "n" * 64], {}, r"--nvidia-namespace .*63"),
        (["--node-name", "n1", "--log-format", "xml"], {}, r"--log-format"),
        (["--node-name", "n1", "--rediscover-interval", "0"], {}, r"--rediscover-interval"),
        (["--node-name", "n1", "--simulate", "h100:two"], {}, r"--simulate \(SIMULATE\): .*two"),
        (["--node-name", "n1"], {"SIMULATE": "b200:1"}, r"--simulate \(SIMULATE\): .*a100-40gb"),
        (
            ["--node-name", "n1", "--consumable-shares", "half"],
            {},
            r"--consumable-shares \(CONSUMABLE_SHARES\): 'half': use disabled, unlimited",
        ),
        (
            ["--node-name", "n1"],
            {"CONSUMABLE_SHARES": "1"},
            r"CONSUMABLE_SHARES\): '1': .*at least 2",
        ),
        (["--node-name", "n1", "--mig-mode", "auto"], {}, r"--mig-mode \(MIG_MODE\): 'auto'"),
        (["--node-name", "n1"], {"MIG_MODE": "Dynamic"}, r"--mig-mode \(MIG_MODE\): 'Dynamic'"),
        (
            ["--node-name", "n1"],
            {"CPU_AFFINITY": "2"},
            r"--cpu-affinity \(CPU_AFFINITY\): '2': use all or one",
        ),
        (
            ["--node-name", "n1"],
            {"MPS_IMAGE_PULL_SECRETS": "regcred,Bad_Name"},
            r"--mps-image-pull-secrets \(MPS_IMAGE_PULL_SECRETS\): 'Bad_Name'",
        ),
        (
            ["--node-name", "n1", "--mps-image-pull-policy", "always"],
            {},
            r"--mps-image-pull-policy \(MPS_IMAGE_PULL_POLICY\): 'always' is not one of Always",
        ),
    ],
)
def test_invalid_values_are_rejected_naming_the_flag(
    argv: list[str], env: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        build_config(argv, env)


def test_mig_mode_is_static_unless_the_flag_or_its_twin_says_dynamic() -> None:
    assert build_config(["--node-name", "n1"], {}).mig_mode == "static"
    assert build_config(["--node-name", "n1"], {"MIG_MODE": "dynamic"}).mig_mode == "dynamic"
    assert (
        build_config(
            ["--node-name", "n1", "--mig-mode", "static"], {"MIG_MODE": "dynamic"}
        ).mig_mode
        == "static"
    )


def test_the_console_script_reports_bad_configuration_with_exit_code_2() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "dra_driver", "--node-name", "BAD_NAME"],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert result.returncode == 2
    assert "--node-name (NODE_NAME): 'BAD_NAME' is not a valid DNS subdomain" in result.stderr


@pytest.mark.parametrize(
    ("value", "hook"),
    [
        ("builtin", "builtin"),
        ("none", "none"),
        ("/usr/bin/nvidia-cdi-hook", "/usr/bin/nvidia-cdi-hook"),
    ],
)
def test_the_cdi_hook_is_builtin_none_or_a_host_path(value: str, hook: str) -> None:
    assert build_config(["--node-name", "n1", "--cdi-hook", value], {}).cdi_hook == hook
    assert build_config(["--node-name", "n1"], {"CDI_HOOK": value}).cdi_hook == hook
    assert build_config(["--node-name", "n1"], {}).cdi_hook == "builtin"
    assert build_config(["--node-name", "n1"], {}).hook_dir == Path(
        "/var/lib/kubelet/plugins/gpu.nvidia.com/bin"
    )


def test_a_relative_cdi_hook_is_refused_naming_the_flag() -> None:
    with pytest.raises(ConfigError, match=r"--cdi-hook \(CDI_HOOK\).*'nvidia-cdi-hook'"):
        build_config(["--node-name", "n1", "--cdi-hook", "nvidia-cdi-hook"], {})


def test_health_flags_and_their_environment_twins() -> None:
    config = build_config(
        ["--node-name", "n1", "--health-ignored-xids", "13,31", "--health-fatal-xids", "none"],
        {
            "HEALTH_TAINT_EFFECT": "None",
            "HEALTH_FATAL_TAINT_EFFECT": "NoExecute",
            "HEALTH_CHECK_INTERVAL": "2.5",
            "HEALTH_XID_QUIET_PERIOD": "0",
            "HEALTH_MIN_CHANGE_INTERVAL": "30",
        },
    )
    assert config.health_ignored_xids == {13, 31}
    assert config.health_fatal_xids == frozenset()
    assert (config.health_taint_effect, config.health_fatal_taint_effect) == ("None", "NoExecute")
    assert config.health_check_interval_s == 2.5
    assert config.health_xid_quiet_period_s == 0
    assert config.health_min_change_interval_s == 30
    defaults = build_config(["--node-name", "n1"], {})
    assert defaults.health_ignored_xids == {13, 31, 43, 45, 68, 109}
    assert defaults.health_fatal_xids == {48, 79, 95}
    assert defaults.health_taint_effect == defaults.health_fatal_taint_effect == "NoSchedule"


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (
            ["--health-ignored-xids", "13,abc"],
            {},
            r"--health-ignored-xids \(HEALTH_IGNORED_XIDS\): '13,abc' is not valid: 'abc' is "
            r"not an XID number",
        ),
        (
            [],
            {"HEALTH_FATAL_XIDS": "79;48"},
            r"--health-fatal-xids \(HEALTH_FATAL_XIDS\): .*'79;48'",
        ),
        (
            ["--health-taint-effect", "NoSchedul"],
            {},
            r"--health-taint-effect \(HEALTH_TAINT_EFFECT\): 'NoSchedul' is not a taint effect: "
            r"use None, NoSchedule, NoExecute",
        ),
        ([], {"HEALTH_FATAL_TAINT_EFFECT": "noexecute"}, r"--health-fatal-taint-effect"),
        (["--health-check-interval", "0"], {}, r"--health-check-interval"),
        (["--health-xid-quiet-period", "-5"], {}, r"--health-xid-quiet-period .*negative"),
        ([], {"HEALTH_MIN_CHANGE_INTERVAL": "soon"}, r"--health-min-change-interval"),
    ],
)
def test_bad_health_settings_are_refused_naming_the_flag(
    argv: list[str], env: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        build_config(["--node-name", "n1", *argv], env)


def test_simulate_event_appends_a_fault_where_the_simulated_agent_reads_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "gpu.nvidia.com").mkdir()
    plugins = ["--kubelet-plugins-directory-path", str(tmp_path)]
    assert gpu_dra_main(["simulate-event", "--gpu", "0", "--xid", "79", *plugins]) == 0
    assert gpu_dra_main(["simulate-event", "--gpu", "1", "--reset", *plugins]) == 0
    inbox = tmp_path / "gpu.nvidia.com" / "simulated-faults.jsonl"
    assert inbox.read_text().splitlines() == [
        '{"kind":"xid","gpu":0,"xid":79}',
        '{"kind":"reset","gpu":1}',
    ]
    assert f"-> {inbox}" in capsys.readouterr().out


def test_simulate_event_says_when_no_simulated_agent_runs_there(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["simulate-event", "--gpu", "0", "--lost", "--kubelet-plugins-directory-path"]
    assert gpu_dra_main([*argv, str(tmp_path)]) == 2
    assert "is an agent running with --simulate" in capsys.readouterr().err
    (tmp_path / "gpu.nvidia.com").mkdir()
    assert (
        gpu_dra_main(
            [
                "simulate-event",
                "--gpu",
                "0",
                "--xid",
                "0",
                "--inbox",
                str(tmp_path / "gpu.nvidia.com" / "x"),
            ]
        )
        == 2
    )
    assert "positive XID" in capsys.readouterr().err


def test_consumable_shares_parse_from_flag_or_environment() -> None:
    assert build_config(["--node-name", "n1"], {}).shares_mode.enabled is False
    flag = build_config(["--node-name", "n1", "--consumable-shares", "8"], {})
    assert (flag.shares_mode.kind, flag.shares_mode.count) == ("shares", 8)
    env = build_config(["--node-name", "n1"], {"CONSUMABLE_SHARES": "compute"})
    assert env.shares_mode.kind == "compute"


def test_the_agent_refuses_to_start_with_sharing_on_until_shares_are_enforced(
    tmp_path: Path,
) -> None:
    """No promise without code: unenforced shares are refused at start, naming the flag."""
    result = subprocess.run(
        [sys.executable, "-m", "dra_driver", "--node-name", "n1", "--simulate", "h100:1",
         "--kubelet-plugins-directory-path", str(tmp_path / "plugins"),
         "--kubelet-registrar-directory-path", str(tmp_path / "registry"),
         "--cdi-root", str(tmp_path / "cdi"), "--healthcheck-port", "0"],
        capture_output=True, text=True,
        env={"PATH": "/usr/bin:/bin", "CONSUMABLE_SHARES": "memory"},
        check=False, timeout=60,
    )  # fmt: skip
    assert result.returncode == 1
    assert (
        "--consumable-shares (CONSUMABLE_SHARES): 'memory': sharing a device needs the MPS daemon"
        in result.stderr
    )
    assert not (tmp_path / "plugins").exists()  # refused before anything was touched


def test_gpu_dra_devices_shows_the_devices_shareable_as_consumable_shares_says(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert (
        gpu_dra_main(["devices", "--simulate", "h100:1", "--consumable-shares", "4", "-o", "json"])
        == 0
    )
    (obj,) = json.loads(capsys.readouterr().out)["items"]
    (device,) = obj["spec"]["devices"]
    assert device["allowMultipleAllocations"] is True
    assert device["capacity"]["shares"]["value"] == "4"
    assert gpu_dra_main(["devices", "--simulate", "h100:1", "-o", "json"]) == 0
    (obj,) = json.loads(capsys.readouterr().out)["items"]
    assert "allowMultipleAllocations" not in obj["spec"]["devices"][0]
    assert gpu_dra_main(["devices", "--simulate", "h100:1", "--consumable-shares", "x"]) == 2
    assert "--consumable-shares (CONSUMABLE_SHARES): 'x'" in capsys.readouterr().err


def test_gpu_dra_devices_runs_the_agents_pipeline_mig_records_included(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``devices --mig-mode dynamic`` publishes what the agent's first publication would
    (node/discovery.py first_devices): a MIG device that prepare's checkpoint records is the
    driver's own, so its GPU is partitionable; without the record it is foreign and the GPU stays
    static, which the command says."""
    argv = [
        "devices", "--simulate", "h100:1:mig=1g.10gb", "--mig-mode", "dynamic",
        "--kubelet-plugins-directory-path", str(tmp_path), "-o", "json",
    ]  # fmt: skip

    def published() -> tuple[list[str], list[str], str]:
        assert gpu_dra_main(argv) == 0
        out, err = capsys.readouterr()
        items = json.loads(out)["items"]
        sets = [cs["name"] for s in items for cs in s["spec"].get("sharedCounters", ())]
        return sets, [d["name"] for s in items for d in s["spec"].get("devices", ())], err

    sets, names, err = published()
    assert sets == [] and names == ["gpu-0-mig-1g10gb-19-0"]
    assert "gpu-0 stays static in dynamic MIG mode" in err
    config = Config(node_name="node-1", kubelet_plugins_directory_path=tmp_path)
    checkpoint = Checkpoint(config.checkpoint_path)
    checkpoint.open()
    device = PreparedDevice(
        request_names=("r",), pool="node-1", device="gpu-0-mig-1g10gb-19-0", cdi_device_ids=()
    )
    claim = ClaimRecord(uid="u", namespace="ns", name="c", phase=PREPARE_STARTED, devices=(device,))
    checkpoint.transact(lambda claims: claims.__setitem__(claim.uid, claim))
    checkpoint.close()
    sets, names, err = published()
    assert sets == ["gpu-0-counter-set"] and names[0] == "gpu-0" and len(names) > 2
    assert "stays static" not in err


def test_gpu_dra_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    from dra_driver import __version__  # noqa: PLC0415
    from dra_driver.cli import gpu_dra_main  # noqa: PLC0415

    assert gpu_dra_main(["--version"]) == 0
    assert capsys.readouterr().out == f"gpu-dra {__version__}\n"
