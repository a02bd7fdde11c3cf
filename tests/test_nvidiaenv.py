"""NVIDIA's kubelet-plugin variables, read through the agent's real configuration
(cli.build_config)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dra_driver.cli import build_config
from dra_driver.errors import ConfigError
from dra_driver.health.decisions import DEFAULT_IGNORED_XIDS
from dra_driver.node.nvidiaenv import parse_feature_gates

NODE = {"NODE_NAME": "n1"}


def config(**env: str):  # type: ignore[no-untyped-def]
    return build_config([], NODE | env)


@pytest.mark.parametrize("name", ["ADDITIONAL_XIDS_TO_IGNORE", "ADDITIONAL_XIDs_TO_IGNORE"])
def test_additional_xids_are_added_to_the_default_list_not_in_place_of_it(name: str) -> None:
    assert config(**{name: "79, 94"}).health_ignored_xids == DEFAULT_IGNORED_XIDS | {79, 94}


def test_additional_xids_are_added_to_our_own_list_when_both_are_set() -> None:
    got = config(HEALTH_IGNORED_XIDS="13", ADDITIONAL_XIDS_TO_IGNORE="94").health_ignored_xids
    assert got == {13, 94}


def test_a_bad_additional_xid_names_nvidias_variable() -> None:
    with pytest.raises(ConfigError, match=r"ADDITIONAL_XIDS_TO_IGNORE.*'x'"):
        config(ADDITIONAL_XIDS_TO_IGNORE="13,x")


def test_feature_gates_take_nvidias_form_with_its_trailing_comma() -> None:
    assert parse_feature_gates("DynamicMIG=true,MPSSupport=false,") == {
        "DynamicMIG": True,
        "MPSSupport": False,
    }


def test_the_dynamic_mig_gate_turns_on_dynamic_mig_mode() -> None:
    assert config(FEATURE_GATES="DynamicMIG=true").mig_mode == "dynamic"
    assert config(FEATURE_GATES="DynamicMIG=false").mig_mode == "static"
    assert config(FEATURE_GATES="DynamicMIG=true", MIG_MODE="dynamic").mig_mode == "dynamic"


def test_a_gate_that_contradicts_our_own_setting_is_refused_naming_both() -> None:
    with pytest.raises(ConfigError, match="DynamicMIG=true contradicts MIG_MODE='static'"):
        config(FEATURE_GATES="DynamicMIG=true", MIG_MODE="static")


def test_mps_support_off_refuses_mps_as_nvidia_does() -> None:
    assert config(MPS_IMAGE="gpu-dra:1").mps_image == "gpu-dra:1"
    assert config(MPS_IMAGE="gpu-dra:1", FEATURE_GATES="MPSSupport=false").mps_image is None
    assert config(MPS_IMAGE="gpu-dra:1", FEATURE_GATES="MPSSupport=true").mps_image == "gpu-dra:1"


@pytest.mark.parametrize(
    ("gates", "complaint"),
    [
        ("Nonsense=true", "unrecognized feature gate 'Nonsense'"),
        ("DynamicMIG=yes", "use Name=true or Name=false"),
        ("DynamicMIG", "use Name=true or Name=false"),
    ],
)
def test_bad_feature_gates_are_refused_naming_the_variable(gates: str, complaint: str) -> None:
    with pytest.raises(ConfigError, match=f"FEATURE_GATES.*{complaint}"):
        config(FEATURE_GATES=gates)


def test_gates_of_features_always_on_here_are_accepted() -> None:
    got = config(FEATURE_GATES="TimeSlicingSettings=true,NVMLDeviceHealthCheck=true,")
    assert got.mig_mode == "static"


def test_nvidias_cdi_hook_path_replaces_the_builtin_hook() -> None:
    assert config(NVIDIA_CDI_HOOK_PATH="/usr/bin/nvidia-cdi-hook").cdi_hook == (
        "/usr/bin/nvidia-cdi-hook"
    )
    got = config(NVIDIA_CDI_HOOK_PATH="/usr/bin/nvidia-cdi-hook", CDI_HOOK="builtin")
    assert got.cdi_hook == "/usr/bin/nvidia-cdi-hook"
    with pytest.raises(ConfigError, match=r"NVIDIA_CDI_HOOK_PATH.*contradicts CDI_HOOK='none'"):
        config(NVIDIA_CDI_HOOK_PATH="/usr/bin/nvidia-cdi-hook", CDI_HOOK="none")


def test_nvidias_names_of_our_settings_are_aliases() -> None:
    got = config(
        HOST_DRIVER_ROOT="/run/nvidia/driver",
        DRIVER_ROOT_CTR_PATH="/driver-root",
        NAMESPACE="nvidia-dra-driver-gpu",
        IMAGE_NAME="registry.example.com/gpu-dra:1",
    )
    assert got.nvidia_driver_root == Path("/run/nvidia/driver")
    assert got.container_driver_root == Path("/driver-root")
    assert got.pod_namespace == "nvidia-dra-driver-gpu"
    assert got.mps_image == "registry.example.com/gpu-dra:1"


def test_klog_verbosity_sets_the_log_level_unless_ours_is_set() -> None:
    assert config(LOG_VERBOSITY="4").log_level == "info"
    assert config(LOG_VERBOSITY="6").log_level == "debug"
    assert config(LOG_VERBOSITY="6", LOG_LEVEL="warning").log_level == "warning"
    with pytest.raises(ConfigError, match="LOG_VERBOSITY"):
        config(LOG_VERBOSITY="loud")
