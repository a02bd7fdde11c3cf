"""The chart installed with a values file written for NVIDIA's chart v0.5 (docs/migration.md).

Both files under tests/data/nvidia-chart/ are written here from the keys NVIDIA's chart documents:
its defaults, and a user's file that sets most of them. Each renders with the real helm, each
object passes the strict Kubernetes schemas, NVIDIA's keys reach the agent as our own settings
(checked through the agent's real flag parser), keys without an equivalent are named in NOTES, and
keys this driver cannot honour stop the install with a message saying what to use instead.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from dra_driver import cli
from dra_driver.health.decisions import DEFAULT_IGNORED_XIDS
from dra_driver.node import nvidiaenv
from tests.test_chart import (
    CHART,
    HELM,
    KUBERNETES_VERSIONS,
    NAMESPACE,
    RELEASE,
    agent_container,
    env_of,
    helm,
    of_kind,
    one,
    render,
    render_error,
)

DATA = Path(__file__).resolve().parent / "data" / "nvidia-chart"
DEFAULTS = DATA / "defaults-v0.5.yaml"
CUSTOM = DATA / "custom-v0.5.yaml"
MIGRATION = Path(__file__).resolve().parent.parent / "docs" / "migration.md"

pytestmark = [
    pytest.mark.helm,
    pytest.mark.skipif(HELM is None, reason="helm not on PATH nor at .tools/bin/helm"),
]


@pytest.fixture(scope="module")
def defaults() -> list[dict[str, Any]]:
    return render("-f", str(DEFAULTS))


@pytest.fixture(scope="module")
def custom() -> list[dict[str, Any]]:
    return render("-f", str(CUSTOM))


def agent_config(objects: list[dict[str, Any]]) -> Any:
    container = agent_container(objects)
    environ = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    environ |= {"NODE_NAME": "gpu-node-1", "POD_NAMESPACE": "gpu-system"}
    return cli.build_config(container.get("args", []), environ)


def keys_of(values: dict[str, Any], prefix: str = "") -> set[str]:
    """Dotted paths of every key, down to leaves and to maps of free-form content."""
    found = set()
    for key, value in values.items():
        path = f"{prefix}{key}"
        found.add(path)
        if isinstance(value, dict) and value and key not in ("affinity", "securityContext"):
            found |= keys_of(value, f"{path}.")
    return found


@pytest.mark.parametrize("kubernetes_version", KUBERNETES_VERSIONS)
def test_nvidias_values_files_render_objects_valid_for_kubernetes(
    defaults: list[dict[str, Any]], custom: list[dict[str, Any]], kubernetes_version: str
) -> None:
    for obj in defaults + custom:
        kubernetes_validate.validate(obj, kubernetes_version, strict=True)


@pytest.mark.parametrize("path", [DEFAULTS, CUSTOM], ids=["defaults", "custom"])
def test_helm_lint_strict_passes_with_nvidias_values(path: Path) -> None:
    result = helm("lint", "--strict", str(CHART), "-f", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


def test_nvidias_defaults_install_what_our_defaults_install(defaults: list[dict[str, Any]]) -> None:
    ours = render()
    assert sorted(o["kind"] for o in defaults) == sorted(o["kind"] for o in ours)
    config = agent_config(defaults)
    assert config.mig_mode == "static"
    assert config.consumable_shares == "disabled"  # NVIDIA's "" default
    assert config.log_level == "info"  # logVerbosity "4"
    assert config.cdi_hook == "builtin"  # nvidiaCDIHookPath ""
    assert config.health_ignored_xids == DEFAULT_IGNORED_XIDS
    assert config.healthcheck_port == 51516  # containers.gpus.healthcheckPort


def test_a_users_nvidia_values_reach_the_agent_as_our_settings(
    custom: list[dict[str, Any]],
) -> None:
    config = agent_config(custom)
    assert config.mig_mode == "dynamic"  # featureGates.DynamicMIG
    assert config.log_level == "debug"  # logVerbosity "6"
    assert config.cdi_hook == "/usr/local/nvidia/toolkit/nvidia-cdi-hook"
    assert str(config.nvidia_driver_root) == "/run/nvidia/driver"
    assert str(config.kubelet_registrar_directory_path) == "/data/kubelet/plugins_registry"
    assert str(config.kubelet_plugins_directory_path) == "/data/kubelet/plugins"
    assert config.metrics_port == 9400  # kubeletPlugin.metrics.gpuHttpEndpoint
    assert config.healthcheck_port == 51516
    assert config.health_ignored_xids == DEFAULT_IGNORED_XIDS | {94, 119}  # added, not replaced
    assert config.mps_image == "registry.example.com/gpu-dra:0.5.0"  # MPSSupport
    assert config.consumable_shares == "memory"


def test_a_users_nvidia_values_shape_the_daemonset(custom: list[dict[str, Any]]) -> None:
    daemonset = one(custom, "DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    container = agent_container(custom)
    assert daemonset["spec"]["selector"]["matchLabels"]["team"] == "ml"
    assert daemonset["spec"]["template"]["metadata"]["labels"]["team"] == "ml"
    assert daemonset["spec"]["updateStrategy"]["rollingUpdate"] == {
        "maxSurge": 0,
        "maxUnavailable": 1,
    }
    assert pod["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}
    assert pod["nodeSelector"] == {"gpu": "true"}
    assert {"key": "dedicated", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"} in (
        pod["tolerations"]
    )
    assert container["resources"] == {"requests": {"cpu": "100m", "memory": "256Mi"}}
    assert container["securityContext"]["privileged"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True  # ours kept
    assert env_of(container)["EXTRA_SETTING"]["value"] == "1"
    assert container["imagePullPolicy"] == "Always"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert "/data/kubelet/plugins_registry" in mounts
    assert "/data/kubelet/plugins/gpu.nvidia.com" in mounts


def test_namespace_override_moves_every_namespaced_object(custom: list[dict[str, Any]]) -> None:
    namespaced = [o for o in custom if "namespace" in o["metadata"]]
    assert namespaced
    assert {o["metadata"]["namespace"] for o in namespaced} == {"gpu-system"}
    for binding in of_kind(custom, "ClusterRoleBinding"):
        assert {s["namespace"] for s in binding["subjects"]} == {"gpu-system"}


def test_feature_gates_reach_the_agent_in_nvidias_form(custom: list[dict[str, Any]]) -> None:
    env = env_of(agent_container(custom))
    gates = nvidiaenv.parse_feature_gates(env["FEATURE_GATES"]["value"])
    assert gates["DynamicMIG"] is True
    assert gates["TimeSlicingSettings"] is True


def test_mps_support_off_turns_mps_off_as_nvidia_does() -> None:
    objects = render("-f", str(DEFAULTS), "--set", "featureGates.MPSSupport=false")
    assert agent_config(objects).mps_image is None
    assert not of_kind(objects, "Role")


def test_the_schema_knows_exactly_the_feature_gates_the_agent_knows() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert set(schema["properties"]["featureGates"]["propertyNames"]["enum"]) == (
        nvidiaenv.KNOWN_GATES
    )


def notes(*args: str) -> str:
    result = helm(
        "install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--dry-run=client", *args
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.split("NOTES:", 1)[1]


def test_notes_name_each_nvidia_key_that_has_no_effect() -> None:
    text = notes("-f", str(DEFAULTS))
    for key in (
        "gpuResourcesEnabledOverride",
        "allowDefaultNamespace",
        "resources.computeDomains",
        "controller",
        "kubeletPlugin.networkPolicy",
        "kubeletPlugin.containers.init",
        "kubeletPlugin.containers.computeDomains",
    ):
        assert f"   - {key}: " in text, key
    assert "featureGates.ContextualLogging: no effect" in notes("-f", str(CUSTOM))
    assert "Values of NVIDIA's chart" not in notes()


@pytest.mark.parametrize(
    ("args", "complaint"),
    [
        (("--set", "resources.gpus.enabled=false"), "install NVIDIA's chart instead"),
        (
            ("--set", "kubeletPlugin.containers.gpus.healthcheckPort=-1"),
            "gpu-dra's probes need a port",
        ),
        (("--set", "kubeletPlugin.metrics.metricsPath=/m"), "serves its metrics on /metrics only"),
        (("--set", "featureGates.Bogus=true"), "invalid propertyName 'Bogus'"),
        (("--set", "logVerbosity=loud"), "logVerbosity"),
        (
            ("--set", "featureGates.ConsumableShares=false", "--set", "consumableShares=memory"),
            "set consumableShares to disabled",
        ),
        (("--set", "kubeletPlugin.updateStrategy.type=Recreate"), "updateStrategy"),
    ],
)
def test_nvidia_keys_this_driver_cannot_honour_are_refused_saying_why(
    args: tuple[str, ...], complaint: str
) -> None:
    assert complaint in render_error(*args)


def migration_table_keys() -> set[str]:
    """Keys in the first column of docs/migration.md's table of NVIDIA's values."""
    text = MIGRATION.read_text()
    section = text.split("## A values file written for NVIDIA's chart", 1)[1].split("\n## ", 1)[0]
    keys = set()
    for cell in re.findall(r"^\| (`[^|]+) \|", section, flags=re.MULTILINE):
        names = re.findall(r"`([^`]+)`", cell)
        parent = names[0].rpartition(".")[0]
        keys |= {f"{parent}{n}" if n.startswith(".") else n for n in names}
    return keys


def test_migration_doc_maps_every_key_of_nvidias_values_file() -> None:
    documented = migration_table_keys()
    for path in (DEFAULTS, CUSTOM):
        values = yaml.safe_load(path.read_text())
        missing = {
            key
            for key in keys_of(values)
            if not any(
                key == d or key.startswith(f"{d}.") or d.startswith(f"{key}.") for d in documented
            )
        }
        assert not missing, f"docs/migration.md has no row for {sorted(missing)}"
