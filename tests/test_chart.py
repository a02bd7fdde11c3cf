"""The Helm chart charts/gpu-dra, rendered by the real helm binary.

Every rendered object is checked against the strict OpenAPI schemas of Kubernetes 1.35-1.37
(kubernetes-validate), the DaemonSet against the agent's real flags (dra_driver.cli.FLAGS), the
DeviceClass selectors and the admission policy against the project's CEL engine
(dra_driver.scheduling.cel) and the defaults the code ships, and the ClusterRole
against the API calls the code declares (dra_driver.kube).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from dra_driver import cli
from dra_driver.errors import DraError
from dra_driver.node import nvidiaenv
from dra_driver.scheduling import cel
from dra_driver.sim.localapi import AGENT_INTERPRETER_ENV

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "charts" / "gpu-dra"
RELEASE = "gpu-dra"
NAMESPACE = "gpu-dra"
KUBERNETES_VERSIONS = ("1.35.0", "1.36.0", "1.37.0")


def _find_helm() -> str | None:
    on_path = shutil.which("helm")
    if on_path:
        return on_path
    local = REPO / ".tools" / "bin" / "helm"
    return str(local) if local.is_file() else None


HELM = _find_helm()

pytestmark = [
    pytest.mark.helm,
    pytest.mark.skipif(
        HELM is None, reason="helm not on PATH nor at .tools/bin/helm (run `make helm`)"
    ),
]

# A live cluster's discovery lists group/version/Kind entries (v1/Pod); offline `helm template`
# knows only bare group/versions. Passing v1/Pod makes the chart trust the kind entries it is given.
DISCOVERED = ("--api-versions", "v1/Pod")

# Value combinations every test below renders; each must lint, render and validate.
COMBINATIONS: dict[str, tuple[str, ...]] = {
    "defaults": (),
    "custom driver name": ("--set", "driverName=gpu.example.com"),
    "operator driver root": ("--set", "nvidiaDriverRoot=/run/nvidia/driver"),
    "v1 cluster": (*DISCOVERED, "--api-versions", "resource.k8s.io/v1/DeviceClass",
                   "--api-versions", "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy"),
    "v1beta2 cluster": (*DISCOVERED, "--api-versions", "resource.k8s.io/v1beta2/DeviceClass",
                        "--api-versions", "resource.k8s.io/v1beta1/DeviceClass"),
    "v1beta1 cluster": (*DISCOVERED, "--api-versions", "resource.k8s.io/v1beta1/DeviceClass"),
    "no policy support": (*DISCOVERED, "--api-versions", "resource.k8s.io/v1/DeviceClass"),
    "policy switched off": ("--set", "admissionPolicy.enabled=false"),
    "forced v1beta2": ("--set", "resourceApiVersion=v1beta2"),
    "extended resource off": ("--set", "deviceClasses.gpuExtendedResourceName="),
    "simulated gpus": ("--set", "simulate=h100:2",
                       "--set", "kubeletPlugin.securityContext.privileged=false",
                       "--set", "kubeletPlugin.mountHostDev=false", "--set", "metricsPort=0"),
    "monitoring": ("--set", "metrics.podMonitor.enabled=true",
                   "--set", "metrics.podMonitor.labels.release=kube-prometheus-stack",
                   "--set", "metrics.podMonitor.interval=30s",
                   "--set", "metrics.dashboard.enabled=true",
                   "--set", "metrics.dashboard.annotations.grafana_folder=GPUs"),
    "service monitor": ("--set", "metrics.serviceMonitor.enabled=true",
                        "--set", "metrics.serviceMonitor.labels.release=kube-prometheus-stack",
                        "--set", "metrics.serviceMonitor.interval=30s",
                        "--set", "metrics.serviceMonitor.scrapeTimeout=10s"),
    "existing service account": ("--set", "serviceAccount.create=false",
                                 "--set", "serviceAccount.name=gpu-agent",
                                 "--set", "rbac.create=false"),
    "pinned image and overrides": (
        "--set", "image.repository=registry.example.com/gpu-dra",
        "--set", "image.digest=sha256:" + "ab" * 32,
        "--set", "kubeletPlugin.nodeSelector.pool=gpu",
        "--set", "kubeletPlugin.tolerations[0].key=dedicated",
        "--set", "kubeletPlugin.tolerations[0].operator=Exists",
        "--set", "kubeletPlugin.extraArgs[0]=--rediscover-interval=30",
        "--set", "imagePullSecrets[0].name=regcred",
        "--set", "serviceAccount.annotations.team=ml",
    ),
    "health settings": ("--set-json", "health.ignoredXids=[]",
                        "--set", "health.fatalXids={79,94}",
                        "--set", "health.fatalTaintEffect=NoExecute",
                        "--set-json", "health.checkIntervalSeconds=2.5",
                        "--set", "health.xidQuietPeriodSeconds=0",
                        "--set-json", "health.reportIntervalSeconds=5"),
}  # fmt: skip


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    assert HELM is not None
    return subprocess.run(
        [HELM, *args], capture_output=True, text=True, timeout=120, check=False, cwd=REPO
    )


def value_args(args: tuple[str, ...]) -> list[str]:
    """Only the --set/--set-string pairs of a combination (helm lint knows no --api-versions)."""
    pairs = zip(args[::2], args[1::2], strict=True)
    return [part for flag, value in pairs if flag.startswith("--set") for part in (flag, value)]


def render(*args: str) -> list[dict[str, Any]]:
    """`helm template` of the chart as a list of objects (fails the test on a helm error)."""
    result = helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, *args)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def render_error(*args: str) -> str:
    """stderr of a `helm template` that must fail."""
    result = helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, *args)
    assert result.returncode != 0, f"helm accepted {args}:\n{result.stdout[:2000]}"
    return result.stderr


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {[o['metadata']['name'] for o in found]}"
    return found[0]


def of_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def agent_container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    containers = one(objects, "DaemonSet")["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container["env"]}


def volume_for_mount(objects: list[dict[str, Any]], mount_path: str) -> dict[str, Any]:
    pod = one(objects, "DaemonSet")["spec"]["template"]["spec"]
    mounts = [m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == mount_path]
    assert len(mounts) == 1, f"no single mount at {mount_path}"
    return next(v for v in pod["volumes"] if v["name"] == mounts[0]["name"]) | {"mount": mounts[0]}


# ---------------------------------------------------------------------------------------------
# lint, render, schemas


@pytest.mark.parametrize("name", list(COMBINATIONS))
def test_helm_lint_strict_passes(name: str) -> None:
    result = helm("lint", "--strict", str(CHART), *value_args(COMBINATIONS[name]))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name", list(COMBINATIONS))
@pytest.mark.parametrize("kubernetes_version", KUBERNETES_VERSIONS)
def test_every_rendered_object_is_valid_for_the_kubernetes_version(
    name: str, kubernetes_version: str
) -> None:
    objects = render(*COMBINATIONS[name])
    assert objects
    for obj in objects:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD's kind (prometheus-operator): test_*_monitor_* check it
        try:
            kubernetes_validate.validate(obj, kubernetes_version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(
                f"{obj['kind']}/{obj['metadata']['name']} is invalid for Kubernetes "
                f"{kubernetes_version}: {exc.message} at {list(exc.absolute_path)}"
            )


def test_defaults_render_the_agent_its_identity_classes_and_policy() -> None:
    kinds = sorted(o["kind"] for o in render())
    assert kinds == sorted(
        [
            "ServiceAccount",
            "ClusterRole",
            "ClusterRoleBinding",
            "Role",  # MPS daemons' Deployments, in the release namespace
            "RoleBinding",
            "DaemonSet",
            "DeviceClass",
            "DeviceClass",
            "ValidatingAdmissionPolicy",
            "ValidatingAdmissionPolicyBinding",
        ]
    )


def test_namespaced_objects_go_to_the_release_namespace() -> None:
    for obj in render():
        if obj["kind"] in ("ServiceAccount", "DaemonSet"):
            assert obj["metadata"]["namespace"] == NAMESPACE


# ---------------------------------------------------------------------------------------------
# resource.k8s.io version and admission policy follow what the cluster serves


@pytest.mark.parametrize(
    ("name", "version"),
    [
        ("defaults", "v1"),
        ("v1 cluster", "v1"),
        ("v1beta2 cluster", "v1beta2"),
        ("v1beta1 cluster", "v1beta1"),
        ("forced v1beta2", "v1beta2"),
    ],
)
def test_device_classes_use_the_newest_resource_api_the_cluster_serves(
    name: str, version: str
) -> None:
    classes = of_kind(render(*COMBINATIONS[name]), "DeviceClass")
    assert [c["apiVersion"] for c in classes] == [f"resource.k8s.io/{version}"] * 2


def test_a_forced_resource_api_version_wins_over_discovery() -> None:
    args = (*COMBINATIONS["v1 cluster"], "--set", "resourceApiVersion=v1beta1")
    classes = of_kind(render(*args), "DeviceClass")
    assert {c["apiVersion"] for c in classes} == {"resource.k8s.io/v1beta1"}


def test_a_cluster_without_any_device_class_api_fails_with_a_clear_message() -> None:
    error = render_error(*DISCOVERED)
    assert "serves no resource.k8s.io DeviceClass" in error
    assert "Kubernetes >= 1.32" in error


def test_the_policy_is_left_out_when_the_cluster_does_not_serve_it() -> None:
    kinds = {o["kind"] for o in render(*COMBINATIONS["no policy support"])}
    assert "ValidatingAdmissionPolicy" not in kinds
    assert "ValidatingAdmissionPolicyBinding" not in kinds
    assert "DaemonSet" in kinds


def test_the_policy_can_be_switched_off() -> None:
    kinds = {o["kind"] for o in render(*COMBINATIONS["policy switched off"])}
    assert not kinds & {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}


def test_the_policy_is_rendered_when_the_cluster_serves_it() -> None:
    objects = render(*COMBINATIONS["v1 cluster"])
    policy = one(objects, "ValidatingAdmissionPolicy")
    binding = one(objects, "ValidatingAdmissionPolicyBinding")
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]


# ---------------------------------------------------------------------------------------------
# the admission policy: only slices of the agent's own node and driver


POLICY_VARIABLES = {name: cel.DYN for name in ("request", "object", "oldObject", "variables")}


def evaluate_policy(
    policy: dict[str, Any], *, username: str, node_claim: str | None, operation: str, slice_: Any
) -> tuple[bool, list[str]]:
    """Run the policy's CEL (match condition, variables in order, validations and their message
    expressions) with the project's CEL engine, the way the apiserver does.

    Returns (matched, messages of the failed validations).
    """

    def run(expression: str, activation: dict[str, Any]) -> Any:
        return cel.compile_expression(expression, POLICY_VARIABLES).evaluate(activation)

    extra = {} if node_claim is None else {"authentication.kubernetes.io/node-name": [node_claim]}
    activation: dict[str, Any] = {
        "request": {"userInfo": {"username": username, "extra": extra}, "operation": operation},
        "object": None if operation == "DELETE" else slice_,
        "oldObject": None if operation == "CREATE" else slice_,
        "variables": {},
    }
    (condition,) = policy["spec"]["matchConditions"]
    if run(condition["expression"], activation) is not True:
        return False, []
    for variable in policy["spec"]["variables"]:
        activation["variables"][variable["name"]] = run(variable["expression"], activation)
    failed = []
    for validation in policy["spec"]["validations"]:
        if run(validation["expression"], activation) is not True:
            if "messageExpression" in validation:
                failed.append(run(validation["messageExpression"], activation))
            else:
                failed.append(validation["message"])
    return True, failed


def test_policy_variables_read_the_node_name_claim_of_the_token() -> None:
    policy = one(render(), "ValidatingAdmissionPolicy")
    variables = {v["name"]: v["expression"] for v in policy["spec"]["variables"]}
    assert variables == {
        "userNodeName": (
            "request.userInfo.extra[?'authentication.kubernetes.io/node-name'][0].orValue('')"
        ),
        "slice": "request.operation == 'DELETE' ? oldObject : object",
        "sliceNodeName": "variables.slice.spec.?nodeName.orValue('')",
    }
    rule = policy["spec"]["matchConstraints"]["resourceRules"]
    assert rule == [
        {
            "apiGroups": ["resource.k8s.io"],
            "apiVersions": ["*"],
            "operations": ["CREATE", "UPDATE", "DELETE"],
            "resources": ["resourceslices"],
        }
    ]
    assert policy["spec"]["failurePolicy"] == "Fail"


AGENT = f"system:serviceaccount:{NAMESPACE}:{RELEASE}-kubelet-plugin"


def slice_of(node: str, driver: str = "gpu.nvidia.com") -> dict[str, Any]:
    return {"spec": {"driver": driver, "nodeName": node, "pool": {"name": node}}}


@pytest.mark.parametrize("operation", ["CREATE", "UPDATE", "DELETE"])
def test_policy_lets_the_agent_write_slices_of_its_own_node(operation: str) -> None:
    policy = one(render(), "ValidatingAdmissionPolicy")
    matched, failed = evaluate_policy(
        policy, username=AGENT, node_claim="node-a", operation=operation, slice_=slice_of("node-a")
    )
    assert matched
    assert failed == []


def test_policy_refuses_a_slice_of_another_node() -> None:
    policy = one(render(), "ValidatingAdmissionPolicy")
    _, failed = evaluate_policy(
        policy, username=AGENT, node_claim="node-a", operation="CREATE", slice_=slice_of("node-b")
    )
    assert len(failed) == 1
    assert "may only write ResourceSlices of that node" in failed[0]


def test_policy_refuses_a_slice_of_another_driver() -> None:
    policy = one(render(), "ValidatingAdmissionPolicy")
    _, failed = evaluate_policy(
        policy,
        username=AGENT,
        node_claim="node-a",
        operation="UPDATE",
        slice_=slice_of("node-a", driver="other.example.com"),
    )
    assert len(failed) == 1
    assert "may only write ResourceSlices of driver gpu.nvidia.com" in failed[0]


def test_policy_refuses_a_token_without_a_node_name() -> None:
    policy = one(render(), "ValidatingAdmissionPolicy")
    _, failed = evaluate_policy(
        policy, username=AGENT, node_claim=None, operation="CREATE", slice_=slice_of("node-a")
    )
    assert any("carries no node name" in message for message in failed)


def test_policy_does_not_apply_to_other_users() -> None:
    policy = one(render(), "ValidatingAdmissionPolicy")
    matched, _ = evaluate_policy(
        policy,
        username="system:serviceaccount:kube-system:resourceclaim-controller",
        node_claim=None,
        operation="DELETE",
        slice_=slice_of("node-b"),
    )
    assert not matched


def test_policy_names_the_service_account_the_daemonset_runs_as() -> None:
    objects = render(*COMBINATIONS["existing service account"])
    pod = one(objects, "DaemonSet")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "gpu-agent"
    (condition,) = one(objects, "ValidatingAdmissionPolicy")["spec"]["matchConditions"]
    assert f"'system:serviceaccount:{NAMESPACE}:gpu-agent'" in condition["expression"]
    assert not of_kind(objects, "ServiceAccount")
    assert not of_kind(objects, "ClusterRole")


# ---------------------------------------------------------------------------------------------
# the DaemonSet


def test_agent_gets_node_namespace_and_pod_uid_from_the_downward_api() -> None:
    env = env_of(agent_container(render()))
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env["POD_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert env["POD_UID"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.uid"}}


# Set by the downward API for the code's own use (namespace of the agent), not a flag.
NON_FLAG_ENV = {"POD_NAMESPACE", *AGENT_INTERPRETER_ENV}  # the latter: read by the interpreter
# NVIDIA's names, read by dra_driver/node/nvidiaenv.py (tests/test_chart_nvidia.py)
NON_FLAG_ENV |= {"FEATURE_GATES", *nvidiaenv.ADDITIONAL_XIDS_VARIABLES, *nvidiaenv.ALIASES}


def test_every_variable_the_chart_sets_is_read_by_the_agent() -> None:
    """A misspelt variable would be ignored silently and the agent would run on its default."""
    flag_env = {flag.env for flag in cli.FLAGS}
    unknown = {
        variable: name
        for name, args in COMBINATIONS.items()
        for variable in env_of(agent_container(render(*args)))
        if variable not in flag_env | NON_FLAG_ENV
    }
    assert not unknown, f"the agent has no flag for {unknown} (dra_driver/cli.py FLAGS)"


def test_every_setting_of_the_agent_is_passed_from_values() -> None:
    env = env_of(agent_container(render()))
    required = {
        "NODE_NAME",
        "DRIVER_NAME",
        "NVIDIA_DRIVER_ROOT",
        "KUBELET_REGISTRAR_DIRECTORY_PATH",
        "KUBELET_PLUGINS_DIRECTORY_PATH",
        "CDI_ROOT",
        "POD_UID",
        "HEALTHCHECK_PORT",
        "METRICS_PORT",
        "TELEMETRY_INTERVAL",
        "LOG_FORMAT",
        "LOG_LEVEL",
        "CPU_AFFINITY",
        "HEALTH_IGNORED_XIDS",
        "HEALTH_FATAL_XIDS",
        "HEALTH_TAINT_EFFECT",
        "HEALTH_FATAL_TAINT_EFFECT",
        "HEALTH_CHECK_INTERVAL",
        "HEALTH_XID_QUIET_PERIOD",
        "HEALTH_MIN_CHANGE_INTERVAL",
        "HEALTH_REPORT_INTERVAL",
    }
    assert required <= set(env)
    assert env["DRIVER_NAME"]["value"] == "gpu.nvidia.com"
    assert env["HEALTHCHECK_PORT"]["value"] == "51515"
    assert "SIMULATE" not in env


def test_the_agent_runs_with_the_interpreter_settings_the_benchmarks_give_it() -> None:
    """The benchmarks run the agent "as the chart's DaemonSet runs it" with
    localapi.AGENT_INTERPRETER_ENV (PYTHONOPTIMIZE=2): the chart must set exactly those."""
    env = env_of(agent_container(render()))
    assert {
        name: env[name]["value"] for name in env if name.startswith("PYTHON")
    } == AGENT_INTERPRETER_ENV


def test_the_agent_accepts_the_values_the_chart_renders() -> None:
    """The rendered environment, fed to the real flag parser, gives a valid Config."""
    container = agent_container(render())
    environ = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    environ |= {"NODE_NAME": "gpu-node-1", "POD_UID": "0f6b8d5e-3c1a-4f0e-9d7b-2a4c6e8f0a1b"}
    config = cli.build_config(container.get("args", []), environ)
    assert config.driver_name == "gpu.nvidia.com"
    assert str(config.cdi_root) == "/var/run/cdi"
    assert config.healthcheck_port == 51515
    assert config.telemetry_interval_s == 10
    assert config.pod_uid == environ["POD_UID"]
    assert config.cpu_affinity == "all"
    assert container["command"] == ["gpu-dra-kubelet-plugin"]


@pytest.mark.parametrize("mode", ["static", "dynamic"])
def test_mig_mode_reaches_the_agent_as_the_value_says(mode: str) -> None:
    args = () if mode == "static" else ("--set", "mig.mode=dynamic")
    container = agent_container(render(*args))
    environ = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    assert environ["MIG_MODE"] == mode
    assert cli.build_config([], {**environ, "NODE_NAME": "gpu-node-1"}).mig_mode == mode


def test_a_mig_mode_other_than_static_or_dynamic_is_refused_by_the_schema() -> None:
    assert "mig.mode" in render_error("--set", "mig.mode=auto").replace("/", ".")


@pytest.mark.parametrize("name", ["defaults", "health settings"])
def test_health_settings_reach_the_agent_as_the_values_say(name: str) -> None:
    container = agent_container(render(*COMBINATIONS[name]))
    environ = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    config = cli.build_config([], {**environ, "NODE_NAME": "gpu-node-1"})
    if name == "defaults":
        assert config.health_ignored_xids == {13, 31, 43, 45, 68, 109}
        assert config.health_fatal_xids == {48, 79, 95}
        assert config.health_fatal_taint_effect == "NoSchedule"
        assert config.health_check_interval_s == 10
        assert config.health_xid_quiet_period_s == 300
        assert config.health_report_interval_s == 10
    else:
        assert environ["HEALTH_IGNORED_XIDS"] == "none"
        assert config.health_ignored_xids == frozenset()
        assert config.health_fatal_xids == {79, 94}
        assert config.health_fatal_taint_effect == "NoExecute"
        assert config.health_check_interval_s == 2.5
        assert config.health_xid_quiet_period_s == 0
        assert config.health_report_interval_s == 5
    assert config.health_taint_effect == "NoSchedule"
    assert config.health_min_change_interval_s == 10


def test_simulated_gpus_are_passed_to_the_agent() -> None:
    container = agent_container(render(*COMBINATIONS["simulated gpus"]))
    assert env_of(container)["SIMULATE"]["value"] == "h100:2"
    assert container["securityContext"]["privileged"] is False
    assert [p["name"] for p in container["ports"]] == ["healthz"]


def test_daemonset_is_node_critical_and_tolerates_the_gpu_taint() -> None:
    pod = one(render(), "DaemonSet")["spec"]["template"]["spec"]
    assert pod["priorityClassName"] == "system-node-critical"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]


def test_extra_tolerations_are_added_to_the_gpu_taint_toleration() -> None:
    pod = one(render(*COMBINATIONS["pinned image and overrides"]), "DaemonSet")["spec"]["template"]
    keys = [t["key"] for t in pod["spec"]["tolerations"]]
    assert keys == ["nvidia.com/gpu", "dedicated"]
    assert pod["spec"]["nodeSelector"] == {"pool": "gpu"}


def places_the_agent_on(objects: list[dict[str, Any]], labels: dict[str, str]) -> bool:
    """Whether the DaemonSet's required node affinity matches a node with ``labels`` (terms
    ORed, expressions ANDed; the operators the chart uses)."""
    pod = one(objects, "DaemonSet")["spec"]["template"]["spec"]
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]

    def matches(expression: dict[str, Any]) -> bool:
        if expression["operator"] == "In":
            return labels.get(expression["key"]) in expression["values"]
        assert expression["operator"] == "Exists", expression
        return expression["key"] in labels

    return any(all(matches(e) for e in term["matchExpressions"]) for term in terms)


NFD = "feature.node.kubernetes.io"


@pytest.mark.parametrize(
    ("labels", "placed"),
    [
        ({f"{NFD}/pci-0302_10de.present": "true"}, True),  # stock NFD: an H100 (3D controller)
        ({f"{NFD}/pci-0300_10de.present": "true"}, True),  # stock NFD: a VGA-class NVIDIA GPU
        ({f"{NFD}/pci-10de.present": "true"}, True),  # NFD with vendor-only labels
        ({"nvidia.com/gpu.present": "true"}, True),  # the GPU operator's feature discovery
        ({f"{NFD}/pci-0300_1a03.present": "true"}, False),  # a BMC's VGA device, no NVIDIA
        ({"nvidia.com/gpu.present": "false"}, False),
        ({}, False),
    ],
)
def test_the_default_affinity_matches_stock_nfd_the_vendor_label_and_the_operator_label(
    labels: dict[str, str], placed: bool
) -> None:
    """Issue 37: keyed on pci-10de alone, no agent started on a cluster with stock NFD."""
    assert places_the_agent_on(render(), labels) is placed


def test_the_gpu_node_labels_are_configurable_and_never_empty() -> None:
    objects = render("--set", "kubeletPlugin.gpuNodeLabels={example.com/gpu}")
    assert places_the_agent_on(objects, {"example.com/gpu": "true"})
    assert not places_the_agent_on(objects, {"nvidia.com/gpu.present": "true"})
    assert "gpuNodeLabels" in render_error("--set", "kubeletPlugin.gpuNodeLabels=null")
    assert "gpuNodeLabels" in render_error("--set-json", "kubeletPlugin.gpuNodeLabels=[]")
    assert "gpuNodeLabels" in render_error("--set", "kubeletPlugin.gpuNodeLabels={bad key!}")


@pytest.mark.parametrize("shares", ["memory", "compute", "unlimited", "4"])
def test_the_schema_refuses_consumable_shares_without_mps_as_the_agent_would(shares: str) -> None:
    """Issue 37: this rendered, and the agent then crash-looped (refuse_unenforced_shares)."""
    error = render_error("--set", f"consumableShares={shares}", "--set", "mps.enabled=false")
    assert "/mps/enabled" in error and "value must be true" in error
    render("--set", f"consumableShares={shares}")
    render("--set", "consumableShares=disabled", "--set", "mps.enabled=false")


def test_an_affinity_from_values_replaces_the_default() -> None:
    objects = render(
        "--set",
        "kubeletPlugin.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
        ".nodeSelectorTerms[0].matchExpressions[0].key=gpu",
        "--set",
        "kubeletPlugin.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
        ".nodeSelectorTerms[0].matchExpressions[0].operator=Exists",
    )
    affinity = one(objects, "DaemonSet")["spec"]["template"]["spec"]["affinity"]
    terms = affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert terms == [{"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}]


def test_rolling_update_surges_one_pod_and_keeps_the_old_one_until_ready() -> None:
    daemonset = one(render(), "DaemonSet")
    assert daemonset["spec"]["updateStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    container = daemonset["spec"]["template"]["spec"]["containers"][0]
    # Both pods share the node during the surge: a hostPort would keep the new one Pending.
    assert all("hostPort" not in port for port in container["ports"])
    assert "hostNetwork" not in daemonset["spec"]["template"]["spec"]


def test_probes_use_the_health_endpoint_on_the_healthcheck_port() -> None:
    container = agent_container(render("--set", "healthcheckPort=40000"))
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["healthz"] == 40000
    assert env_of(container)["HEALTHCHECK_PORT"]["value"] == "40000"
    paths = {
        probe: (container[probe]["httpGet"]["path"], container[probe]["httpGet"]["port"])
        for probe in ("startupProbe", "livenessProbe", "readinessProbe")
    }
    assert paths == {
        "startupProbe": ("/healthz", "healthz"),
        "livenessProbe": ("/healthz", "healthz"),
        "readinessProbe": ("/readyz", "healthz"),
    }


def test_metrics_port_is_exposed_and_passed_to_the_agent() -> None:
    container = agent_container(render("--set", "metricsPort=9400"))
    assert {"name": "metrics", "containerPort": 9400, "protocol": "TCP"} in container["ports"]
    assert env_of(container)["METRICS_PORT"]["value"] == "9400"


def pod_annotations(objects: list[dict[str, Any]]) -> dict[str, str] | None:
    return one(objects, "DaemonSet")["spec"]["template"]["metadata"].get("annotations")


def test_pods_carry_prometheus_scrape_annotations_only_while_metrics_are_served() -> None:
    assert pod_annotations(render("--set", "metricsPort=9400")) == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": "9400",
        "prometheus.io/path": "/metrics",
    }
    assert pod_annotations(render("--set", "metricsPort=0")) is None
    assert "prometheus.io/port" not in yaml.safe_dump(render("--set", "metricsPort=0"))
    assert pod_annotations(
        render("--set", "metricsPort=0", "--set", "kubeletPlugin.podAnnotations.team=ml")
    ) == {"team": "ml"}


def test_pod_annotations_from_values_are_kept_and_win_over_the_scrape_defaults() -> None:
    annotations = pod_annotations(
        render(
            "--set-string", "kubeletPlugin.podAnnotations.prometheus\\.io/scrape=false",
            "--set", "kubeletPlugin.podAnnotations.team=ml",
        )
    )  # fmt: skip
    assert annotations == {
        "prometheus.io/scrape": "false",
        "prometheus.io/port": "8080",
        "prometheus.io/path": "/metrics",
        "team": "ml",
    }


def test_agent_has_resource_requests_and_limits() -> None:
    resources = agent_container(render())["resources"]
    assert set(resources["requests"]) == {"cpu", "memory"}
    assert set(resources["limits"]) == {"cpu", "memory"}


def test_agent_mounts_the_kubelet_and_cdi_directories_at_their_host_paths() -> None:
    objects = render()
    registrar = volume_for_mount(objects, "/var/lib/kubelet/plugins_registry")
    assert registrar["hostPath"] == {
        "path": "/var/lib/kubelet/plugins_registry",
        "type": "Directory",
    }
    own = volume_for_mount(objects, "/var/lib/kubelet/plugins/gpu.nvidia.com")
    assert own["hostPath"]["path"] == "/var/lib/kubelet/plugins/gpu.nvidia.com"
    cdi = volume_for_mount(objects, "/var/run/cdi")
    assert cdi["hostPath"]["path"] == "/var/run/cdi"
    host_paths = [
        v["hostPath"]["path"]
        for v in one(objects, "DaemonSet")["spec"]["template"]["spec"]["volumes"]
        if "hostPath" in v
    ]
    # Only this driver's directory under the kubelet plugins directory: never other plugins'.
    assert "/var/lib/kubelet/plugins" not in host_paths


def test_moved_kubelet_directories_move_mounts_and_flags_together() -> None:
    objects = render(
        "--set",
        "kubeletRegistrarDirectoryPath=/data/kubelet/plugins_registry",
        "--set",
        "kubeletPluginsDirectoryPath=/data/kubelet/plugins",
        "--set",
        "cdiRoot=/etc/cdi-dynamic",
    )
    env = env_of(agent_container(objects))
    assert env["KUBELET_REGISTRAR_DIRECTORY_PATH"]["value"] == "/data/kubelet/plugins_registry"
    assert env["KUBELET_PLUGINS_DIRECTORY_PATH"]["value"] == "/data/kubelet/plugins"
    assert env["CDI_ROOT"]["value"] == "/etc/cdi-dynamic"
    volume_for_mount(objects, "/data/kubelet/plugins_registry")
    volume_for_mount(objects, "/data/kubelet/plugins/gpu.nvidia.com")
    volume_for_mount(objects, "/etc/cdi-dynamic")


@pytest.mark.parametrize(
    ("name", "host_root"), [("defaults", "/"), ("operator driver root", "/run/nvidia/driver")]
)
def test_driver_root_is_mounted_read_only_and_named_to_the_agent(name: str, host_root: str) -> None:
    objects = render(*COMBINATIONS[name])
    volume = volume_for_mount(objects, "/driver-root")
    assert volume["hostPath"]["path"] == host_root
    assert volume["mount"]["readOnly"] is True
    assert volume["mount"]["mountPropagation"] == "HostToContainer"
    env = env_of(agent_container(objects))
    assert env["NVIDIA_DRIVER_ROOT"]["value"] == host_root
    assert env["CONTAINER_DRIVER_ROOT"]["value"] == "/driver-root"


def test_security_context_is_what_the_values_explain() -> None:
    context = agent_container(render())["securityContext"]
    assert context == {
        "privileged": True,
        "runAsUser": 0,
        "runAsGroup": 0,
        "readOnlyRootFilesystem": True,
    }


def test_image_digest_wins_over_the_tag() -> None:
    objects = render(*COMBINATIONS["pinned image and overrides"])
    assert agent_container(objects)["image"] == "registry.example.com/gpu-dra@sha256:" + "ab" * 32
    assert agent_container(render())["image"] == "gpu-dra:0.1.0"


# ---------------------------------------------------------------------------------------------
# values.schema.json


def test_the_schema_names_each_key_once() -> None:
    """A JSON object with a key twice parses (the last one wins), so an edit of the first copy
    would silently change nothing."""
    repeated: list[str] = []

    def no_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [key for key, _ in pairs]
        repeated.extend(sorted({key for key in keys if keys.count(key) > 1}))
        return dict(pairs)

    json.loads((CHART / "values.schema.json").read_text(), object_pairs_hook=no_repeats)
    assert repeated == []


def test_the_cdi_hook_value_reaches_the_agent() -> None:
    for value in ("builtin", "none", "/usr/bin/nvidia-cdi-hook"):
        (ds,) = [d for d in render("--set", f"cdiHook={value}") if d["kind"] == "DaemonSet"]
        env = {
            e["name"]: e.get("value")
            for e in ds["spec"]["template"]["spec"]["containers"][0]["env"]
        }
        assert env["CDI_HOOK"] == value


@pytest.mark.parametrize(
    ("args", "complaint"),
    [
        (("--set", "driverNmae=gpu.example.com"), "driverNmae"),
        (("--set", "kubeletPlugin.probes.startup.periodSecond=3"), "periodSecond"),
        (("--set", "deviceClasses.enabled=true"), "enabled"),
        (("--set-string", "healthcheckPort=http"), "healthcheckPort"),
        (("--set", "healthcheckPort=70000"), "healthcheckPort"),
        (("--set", "logLevel=verbose"), "logLevel"),
        (("--set", "cpuAffinity=two"), "cpuAffinity"),
        (("--set", "nvidiaDriverRoot=run/nvidia/driver"), "nvidiaDriverRoot"),
        (("--set", "driverName=GPU_Nvidia"), "driverName"),
        (("--set", "resourceApiVersion=v1alpha3"), "resourceApiVersion"),
        (("--set-string", "admissionPolicy.enabled=yes"), "enabled"),
        (("--set", "image.digest=latest"), "digest"),
        (("--set", "kubeletPlugin.resources.requests.gpu=1"), "gpu"),
        (("--set", "cdiHook=nvidia-cdi-hook"), "cdiHook"),
        (("--set", "metrics.telemetryInterval=-1"), "telemetryInterval"),
        (("--set-string", "metrics.telemetryInterval=10s"), "telemetryInterval"),
        (("--set", "metrics.podMonitor.enable=true"), "enable"),
        (("--set", "metrics.podMonitor.interval=half a minute"), "interval"),
        (("--set", "metrics.serviceMonitor.enable=true"), "enable"),
        (("--set", "metrics.serviceMonitor.scrapeTimeout=10 seconds"), "scrapeTimeout"),
        (("--set", "metrics.serviceMonitor.labels.tier=1"), "tier"),
        (("--set", "metrics.dashboard.namespace=Monitoring"), "namespace"),
        (("--set", "health.taintEffect=NoSchedul"), "taintEffect"),
        (("--set", "health.fatalXids={0}"), "fatalXids"),
        (("--set-string", "health.ignoredXids={13}"), "ignoredXids"),
        (("--set", "health.checkIntervalSeconds=0"), "checkIntervalSeconds"),
        (("--set", "health.minChangeIntervalSeconds=-1"), "minChangeIntervalSeconds"),
        (("--set", "health.reportIntervalSeconds=30"), "reportIntervalSeconds"),
        (("--set", "health.quietPeriod=5"), "quietPeriod"),
    ],
)
def test_values_schema_rejects_typos_and_wrong_types(args: tuple[str, ...], complaint: str) -> None:
    error = render_error(*args)
    assert "values don't meet the specifications of the schema" in error
    assert complaint in error


def test_every_default_value_is_documented_in_values_yaml() -> None:
    """Each key in values.yaml has a comment line right above it (or above its parent block)."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    undocumented = []
    for index, line in enumerate(lines):
        stripped = line.strip()
        if not stripped or stripped.startswith("#") or ":" not in stripped:
            continue
        previous = lines[index - 1].strip() if index else ""
        is_block = stripped.endswith(":")
        if (
            not previous.startswith("#")
            and not is_block
            and not _inside_documented_block(lines, index)
        ):
            undocumented.append(stripped)
    assert undocumented == []


def _inside_documented_block(lines: list[str], index: int) -> bool:
    """True for plain data lines of a documented map (resources.requests.cpu and the like)."""
    indent = len(lines[index]) - len(lines[index].lstrip())
    for back in range(index - 1, -1, -1):
        line = lines[back]
        if not line.strip() or line.strip().startswith("#"):
            continue
        parent_indent = len(line) - len(line.lstrip())
        if parent_indent < indent:
            above = lines[back - 1].strip() if back else ""
            return line.strip().endswith(":") and (
                above.startswith("#") or _inside_documented_block(lines, back)
            )
    return False


# ---------------------------------------------------------------------------------------------
# DeviceClasses


def _cel_device(driver: str, device_type: str) -> cel.DeviceObject:
    return cel.device_variable(
        driver=driver,
        attributes={"type": device_type, "productName": "NVIDIA H100 80GB HBM3"},
        capacity={},
    )


def cel_matches(expression: str, device: cel.DeviceObject) -> bool:
    return cel.compile_selector(expression).matches(device)


@pytest.mark.parametrize("driver", ["gpu.nvidia.com", "gpu.example.com", "accel.example.org"])
def test_device_class_selectors_parse_and_pick_their_device_type(driver: str) -> None:
    classes = of_kind(render("--set", f"driverName={driver}"), "DeviceClass")
    assert len(classes) == 2
    by_type = {}
    for device_class in classes:
        (selector,) = device_class["spec"]["selectors"]
        expression = selector["cel"]["expression"]
        matched = [t for t in ("gpu", "mig") if cel_matches(expression, _cel_device(driver, t))]
        assert len(matched) == 1, f"{expression} matches {matched}"
        assert not cel_matches(expression, _cel_device("other.example.com", matched[0]))
        by_type[matched[0]] = device_class["metadata"]["name"]
    assert by_type["gpu"] == driver


def test_device_classes_are_nvidia_compatible_by_default() -> None:
    classes = {c["metadata"]["name"]: c["spec"] for c in of_kind(render(), "DeviceClass")}
    assert classes == {
        "gpu.nvidia.com": {
            "selectors": [
                {
                    "cel": {
                        "expression": "device.driver == 'gpu.nvidia.com' && "
                        "device.attributes['gpu.nvidia.com'].type == 'gpu'"
                    }
                }
            ],
            # NVIDIA's chart sets it wherever resource.k8s.io/v1 is served (test_chart_classes)
            "extendedResourceName": "nvidia.com/gpu",
        },
        "mig.nvidia.com": {
            "selectors": [
                {
                    "cel": {
                        "expression": "device.driver == 'gpu.nvidia.com' && "
                        "device.attributes['gpu.nvidia.com'].type == 'mig'"
                    }
                }
            ]
        },
    }


@pytest.mark.parametrize("driver", ["gpu.nvidia.com", "gpu.example.com"])
def test_device_classes_equal_the_defaults_the_code_ships(driver: str) -> None:
    """The chart's classes and dra_driver.devices.classes (used by explain and the demo) agree."""
    from dra_driver.devices import classes  # noqa: PLC0415  (written by the explain area)

    shipped = classes.default_device_classes(driver_name=driver)
    rendered = of_kind(render("--set", f"driverName={driver}"), "DeviceClass")
    assert {c["metadata"]["name"]: c["spec"] for c in shipped} == {
        c["metadata"]["name"]: c["spec"] for c in rendered
    }


def test_custom_driver_name_flows_into_every_derived_name() -> None:
    objects = render(*COMBINATIONS["custom driver name"])
    text = yaml.safe_dump_all(objects)
    assert "gpu.nvidia.com" not in text
    names = sorted(c["metadata"]["name"] for c in of_kind(objects, "DeviceClass"))
    assert names == ["gpu.example.com", "mig.example.com"]
    env = env_of(agent_container(objects))
    assert env["DRIVER_NAME"]["value"] == "gpu.example.com"
    volume_for_mount(objects, "/var/lib/kubelet/plugins/gpu.example.com")
    validations = one(objects, "ValidatingAdmissionPolicy")["spec"]["validations"]
    assert "variables.slice.spec.driver == 'gpu.example.com'" in [
        v["expression"] for v in validations
    ]


# ---------------------------------------------------------------------------------------------
# ClusterRole: exactly the API calls the code makes


def granted(cluster_role: dict[str, Any]) -> set[tuple[str, str, str]]:
    """(api group, resource, verb) triples a ClusterRole grants, without wildcards."""
    triples = set()
    for rule in cluster_role["rules"]:
        assert "resourceNames" not in rule or rule["resourceNames"]
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    assert "*" not in (group, resource, verb), f"wildcard in {rule}"
                    triples.add((group, resource, verb))
    return triples


def test_cluster_role_grants_only_the_calls_the_agent_needs() -> None:
    role = one(render(), "ClusterRole")
    assert granted(role) == {
        ("resource.k8s.io", "resourceslices", verb)
        for verb in ("list", "watch", "create", "update", "delete")
    } | {
        ("resource.k8s.io", "resourceclaims", "get"),
        ("resource.k8s.io", "resourceclaims/status", "patch"),  # status.devices (KEP-4817)
        ("", "nodes", "get"),
        ("", "events", "create"),
        ("", "pods", "get"),  # the containers of a claim's pods (DCGM-compatible telemetry)
    }
    binding = one(render(), "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": f"{RELEASE}-kubelet-plugin", "namespace": NAMESPACE}
    ]


def test_cluster_role_equals_the_api_calls_kube_py_declares() -> None:
    """dra_driver.kube is the one module that talks to the API; it lists the calls it can make."""
    from dra_driver.kube import permissions  # noqa: PLC0415  (another area's; fails loudly if absent)

    declared = {(group, resource, verb) for verb, group, resource in permissions.API_PERMISSIONS}
    assert granted(one(render(), "ClusterRole")) == declared


def test_notes_tell_how_to_check_slices_and_a_test_claim() -> None:
    result = helm("install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--dry-run=client")
    assert result.returncode == 0, result.stderr
    notes = result.stdout.split("NOTES:", 1)[1]
    assert "kubectl get resourceslices --field-selector spec.driver=gpu.nvidia.com" in notes
    assert "examples/resourceclaims/whole-gpu.yaml" in notes
    assert (REPO / "examples" / "resourceclaims" / "whole-gpu.yaml").is_file()
    assert "gpu-dra explain" in notes


def test_every_call_the_agent_makes_against_an_api_server_is_granted(
    kubeapi: Any, tmp_path: Path
) -> None:
    """Drive the real publisher, preparer and event path through the real client and compare the
    fake API server's request log with the ClusterRole."""
    from dra_driver import cdi, devices  # noqa: PLC0415
    from dra_driver.kube import KubeClient  # noqa: PLC0415
    from dra_driver.prepare import ClaimRef, Preparer, device_targets  # noqa: PLC0415
    from dra_driver.publish.publisher import Publisher  # noqa: PLC0415
    from dra_driver.sim.fakedriver import make_fake_driver, simulated_inventory  # noqa: PLC0415
    from tests.claimdata import allocated_claim  # noqa: PLC0415
    from tests.nodestorage import open_node_storage  # noqa: PLC0415

    driver, node_name = "gpu.nvidia.com", "node1"
    node = kubeapi.add_node(node_name)
    client = KubeClient.from_config(kubeconfig=kubeapi.kubeconfig_path)
    inventory = simulated_inventory("h100:2", node_name=node_name)
    publisher = Publisher(
        api=client,
        driver_name=driver,
        node_name=node_name,
        node_devices=devices.node_devices(inventory, driver_name=driver),
    )
    publisher.start()
    try:
        assert publisher.wait_synced(10.0)
        # The kubelet deletes the node's slices when it starts; the publisher writes them again.
        kubeapi.delete_slices(node_name=node_name)
        fewer = simulated_inventory("h100:1", node_name=node_name)
        publisher.set_devices(devices.node_devices(fewer, driver_name=driver))
        assert publisher.wait_synced(10.0)
    finally:
        publisher.stop()
    assert kubeapi.slices(node_name=node_name)

    make_fake_driver(tmp_path)
    (tmp_path / "boot_id").write_text("boot-1\n")
    specs, checkpoint, locks = open_node_storage(
        tmp_path, vendor=f"k8s.{driver}", boot_id_path=tmp_path / "boot_id"
    )
    preparer = Preparer(
        driver_name=driver,
        node_name=node_name,
        cdi_vendor=f"k8s.{driver}",
        targets=device_targets(inventory),
        files=cdi.find_driver_files(
            driver_root=tmp_path / "driver-root",
            driver_version=inventory.gpus[0].driver_version,
            proc_root=tmp_path / "proc",
        ),
        specs=specs,
        checkpoint=checkpoint,
        locks=locks,
        claims=client,
    )
    try:
        claim = kubeapi.add_claim(allocated_claim(name="train", node=node_name))
        meta = claim["metadata"]
        ref = ClaimRef(namespace=meta["namespace"], name=meta["name"], uid=meta["uid"])
        assert preparer.prepare(ref)
        preparer.unprepare(ref)
    finally:
        preparer.close()
    client.create_event(
        node_name=node_name, node_uid=node["metadata"]["uid"], reason="GpuLost", message="test"
    )
    client.close()

    used = {(group, resource, verb) for verb, group, resource in kubeapi.permissions_used()}
    assert {
        ("resource.k8s.io", "resourceslices", "list"),
        ("resource.k8s.io", "resourceslices", "watch"),
        ("resource.k8s.io", "resourceslices", "create"),
        ("resource.k8s.io", "resourceclaims", "get"),
        ("", "events", "create"),
    } <= used
    assert used <= granted(one(render(), "ClusterRole"))


# ---------------------------------------------------------------------------------------------
# Monitoring: telemetry interval, PodMonitor, Grafana dashboard

DASHBOARD = CHART / "dashboards" / "gpu-dra.json"


def test_the_telemetry_interval_reaches_the_agent() -> None:
    assert env_of(agent_container(render()))["TELEMETRY_INTERVAL"]["value"] == "10"
    container = agent_container(render("--set", "metrics.telemetryInterval=0"))
    assert env_of(container)["TELEMETRY_INTERVAL"]["value"] == "0"
    environ = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    config = cli.build_config([], environ | {"NODE_NAME": "n1"})
    assert config.telemetry_interval_s == 0


def test_the_dcgm_series_are_on_by_default_and_the_value_reaches_the_agent() -> None:
    for sets, wanted in (((), True), (("--set", "metrics.dcgm=false"), False)):
        container = agent_container(render(*sets))
        environ = {e["name"]: e["value"] for e in container["env"] if "value" in e}
        assert environ["DCGM_METRICS"] == str(wanted).lower()
        assert cli.build_config([], environ | {"NODE_NAME": "n1"}).dcgm_metrics is wanted


def test_pod_monitor_scrapes_the_metrics_port_of_the_agent_pods() -> None:
    objects = render(*COMBINATIONS["monitoring"])
    monitor = one(objects, "PodMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["namespace"] == NAMESPACE
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    pod_labels = one(objects, "DaemonSet")["spec"]["template"]["metadata"]["labels"]
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod_labels.items()  # it selects the agent pods
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint == {
        "port": "metrics", "path": "/metrics", "interval": "30s", "honorLabels": True,
        "relabelings": AGENT_POD_RELABELINGS,
    }  # fmt: skip
    ports = {p["name"] for p in agent_container(objects)["ports"]}
    assert "metrics" in ports
    # The agent's own labels select it: `gpu-dra status` finds the pods the same way.
    from dra_driver.telemetry.status.cluster import DEFAULT_AGENT_SELECTOR  # noqa: PLC0415

    wanted = dict(label.split("=") for label in DEFAULT_AGENT_SELECTOR.split(","))
    assert wanted.items() <= pod_labels.items()


# The agent's own pod and namespace under agent_*, so that an idle GPU's DCGM series (honorLabels)
# names no pod: tests/test_prometheus_tier.py scrapes through them.
AGENT_POD_RELABELINGS = [
    {"sourceLabels": ["__meta_kubernetes_pod_name"], "targetLabel": "agent_pod"},
    {"sourceLabels": ["__meta_kubernetes_namespace"], "targetLabel": "agent_namespace"},
    {"action": "labeldrop", "regex": "pod|namespace|container"},
]


def test_pod_monitor_needs_the_metrics_port() -> None:
    error = render_error("--set", "metrics.podMonitor.enabled=true", "--set", "metricsPort=0")
    assert "metrics.podMonitor.enabled needs metricsPort" in error


def test_monitoring_objects_are_only_rendered_when_asked_for() -> None:
    kinds = {o["kind"] for o in render()}
    assert not kinds & {"PodMonitor", "ServiceMonitor", "Service", "ConfigMap"}


def test_service_monitor_scrapes_the_agent_pods_through_a_headless_service() -> None:
    objects = render(*COMBINATIONS["service monitor"])
    service = one(objects, "Service")
    assert service["metadata"]["namespace"] == NAMESPACE
    assert service["spec"]["clusterIP"] == "None"
    daemonset = one(objects, "DaemonSet")
    pod_labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"] == daemonset["spec"]["selector"]["matchLabels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    (port,) = service["spec"]["ports"]
    assert port == {"name": "metrics", "port": 8080, "targetPort": "metrics", "protocol": "TCP"}
    container_ports = {p["name"]: p["containerPort"] for p in agent_container(objects)["ports"]}
    assert container_ports["metrics"] == 8080

    monitor = one(objects, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["namespace"] == NAMESPACE
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    assert not selector.items() <= pod_labels.items()  # the Service's own label, not the pods'
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint == {
        "port": "metrics",
        "path": "/metrics",
        "interval": "30s",
        "scrapeTimeout": "10s",
        "honorLabels": True,  # the DCGM series' pod/namespace are the claim's pod's
        "relabelings": AGENT_POD_RELABELINGS,
    }  # the metrics carry their own node label
    assert "PodMonitor" not in {o["kind"] for o in objects}
    without = render(*COMBINATIONS["service monitor"], "--set", "metrics.dcgm=false")
    (endpoint,) = one(without, "ServiceMonitor")["spec"]["endpoints"]
    assert "honorLabels" not in endpoint
    assert "relabelings" not in endpoint


def test_service_port_follows_the_metrics_port() -> None:
    objects = render("--set", "metrics.serviceMonitor.enabled=true", "--set", "metricsPort=9400")
    (port,) = one(objects, "Service")["spec"]["ports"]
    assert port["port"] == 9400
    container_ports = {p["name"]: p["containerPort"] for p in agent_container(objects)["ports"]}
    assert container_ports["metrics"] == 9400
    assert "interval" not in one(objects, "ServiceMonitor")["spec"]["endpoints"][0]


def test_service_name_stays_a_dns_label_with_a_long_fullname() -> None:
    objects = render(
        "--set", "metrics.serviceMonitor.enabled=true", "--set", "fullnameOverride=" + "g" * 63
    )  # fmt: skip
    name = one(objects, "Service")["metadata"]["name"]
    assert len(name) <= 63
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name)


def test_service_monitor_needs_the_metrics_port() -> None:
    error = render_error("--set", "metrics.serviceMonitor.enabled=true", "--set", "metricsPort=0")
    assert "metrics.serviceMonitor.enabled needs metricsPort" in error


def test_pod_monitor_and_service_monitor_cannot_both_be_enabled() -> None:
    error = render_error(
        "--set", "metrics.podMonitor.enabled=true", "--set", "metrics.serviceMonitor.enabled=true"
    )  # fmt: skip
    assert "metrics.podMonitor.enabled and metrics.serviceMonitor.enabled are both true" in error
    assert "enable only one" in error


def test_the_dashboard_ships_as_a_configmap_labelled_for_the_grafana_sidecar() -> None:
    configmap = one(render(*COMBINATIONS["monitoring"]), "ConfigMap")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["metadata"]["annotations"] == {"grafana_folder": "GPUs"}
    assert configmap["metadata"]["namespace"] == NAMESPACE
    assert configmap["data"]["gpu-dra.json"].strip() == DASHBOARD.read_text().strip()
    elsewhere = one(
        render(
            "--set", "metrics.dashboard.enabled=true",
            "--set", "metrics.dashboard.namespace=monitoring",
            "--set", "metrics.dashboard.labels.grafana_dashboard=null",
            "--set", "metrics.dashboard.labels.dashboards=gpu",
        ),
        "ConfigMap",
    )  # fmt: skip
    assert elsewhere["metadata"]["namespace"] == "monitoring"
    assert elsewhere["metadata"]["labels"]["dashboards"] == "gpu"
    assert "grafana_dashboard" not in elsewhere["metadata"]["labels"]


def dashboard_queries() -> list[str]:
    """Every PromQL query of the dashboard: panel targets and template variables."""
    board = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for p in board["panels"] for t in p.get("targets", ())]
    for variable in board["templating"]["list"]:
        query = variable.get("query")
        if isinstance(query, dict):
            queries.append(query["query"])
    return queries


def test_the_dashboard_has_the_panels_a_gpu_operator_looks_for() -> None:
    board = json.loads(DASHBOARD.read_text())
    titles = [p["title"] for p in board["panels"] if p["type"] != "row"]
    for wanted in ("GPU utilisation", "Memory used", "Temperature", "Power", "Health",
                   "Claims per GPU"):  # fmt: skip
        assert wanted in titles
    assert {v["name"] for v in board["templating"]["list"]} == {"datasource", "node"}
    for panel in board["panels"]:
        for target in panel.get("targets", ()):
            assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            # Every panel follows the node picker: every series the agent exports has `node`
            # (the driver's request and error series too), and every selector in a query uses it.
            expr = target["expr"]
            selectors = re.findall(r"\b(?:gpu_dra|nvidia_dra)_[a-z0-9_]+(\{[^}]*\})?", expr)
            assert selectors and all('node=~"$node"' in s for s in selectors), expr
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))


def test_every_metric_the_dashboard_queries_is_one_the_agent_exposes() -> None:
    """Names taken from the dashboard's PromQL, compared with a real scrape (over HTTP) of an
    agent registry on simulated GPUs with a claim held and health reported."""
    queried = {
        name
        for query in dashboard_queries()
        for name in re.findall(r"\b(?:gpu_dra|nvidia_dra)_[a-z0-9_]+\b", query)
    }
    assert "gpu_dra_gpu_utilization_ratio" in queried and "gpu_dra_device_claim_info" in queried
    exposed = scraped_sample_names()
    assert sorted(queried - exposed) == []


def scraped_sample_names() -> set[str]:
    import urllib.request  # noqa: PLC0415

    from dra_driver.gpus import nvml  # noqa: PLC0415
    from dra_driver.gpus.readings import NvmlReader  # noqa: PLC0415
    from dra_driver.metrics import DriverMetrics, Registry  # noqa: PLC0415
    from dra_driver.node.http_server import metrics_server  # noqa: PLC0415
    from dra_driver.prepare import ERROR_TYPES  # noqa: PLC0415
    from dra_driver.sim.nvml import simulated_nvml  # noqa: PLC0415
    from dra_driver.telemetry.sampler import ClaimHolder, Telemetry  # noqa: PLC0415
    from tests import exposition  # noqa: PLC0415

    with simulated_nvml("h100:1,a100-80gb:1:mig=3g.40gb", node_name="n1") as node:
        inventory = nvml.discover(driver_root=Path("/"), sysfs_root=node.sysfs_root)
        reader = NvmlReader()
        registry = Registry()
        driver = DriverMetrics(
            registry, driver_name="gpu.nvidia.com", node_name="n1", error_types=ERROR_TYPES
        )
        driver.prepared_devices.set_collector(lambda: {("n1", "gpu.nvidia.com", "gpu"): 1.0})
        telemetry = Telemetry(
            node_name="n1",
            inventory=inventory,
            read=reader,
            holders=lambda: {"gpu-0": (ClaimHolder("ns", "c", "u", ("p",)),)},
        )
        telemetry.set_health_providers(states=lambda: {"gpu-0": "Healthy"}, xid_counts=lambda: {})
        telemetry.sample()
        registry.register_formatted(telemetry)
        server = metrics_server(registry, port=0, host="127.0.0.1")
        server.start()
        try:
            url = f"http://127.0.0.1:{server.port}/metrics"
            with urllib.request.urlopen(url, timeout=5) as answer:
                text = answer.read().decode()
        finally:
            server.stop()
            reader.close()
    return {name for name, _ in exposition.parse(text)}


@pytest.mark.parametrize(
    ("values", "rendered"),
    [
        ((), "disabled"),
        (("--set", "consumableShares=4"), "4"),
        (("--set", "consumableShares=memory"), "memory"),
    ],
)
def test_consumable_shares_reach_the_agent_as_nvidias_chart_names_them(
    values: tuple[str, ...], rendered: str
) -> None:
    container = agent_container(render(*values))
    assert env_of(container)["CONSUMABLE_SHARES"]["value"] == rendered


@pytest.mark.parametrize("value", ["1", "half", "Memory"])
def test_the_schema_refuses_consumable_shares_the_agent_would_refuse(value: str) -> None:
    assert "consumableShares" in render_error("--set", f"consumableShares={value}")


def test_the_deployed_agent_refuses_consumable_shares_without_mps_to_enforce_them(
    tmp_path: Path,
) -> None:
    """The DaemonSet's command with the environment the chart would render for consumableShares
    with MPS off, which its schema refuses (the test above): should the schema be skipped
    (``--skip-schema-validation``), the agent exits at once with the flag's name and why
    (docs/publishing.md)."""
    container = agent_container(
        render(
            "--skip-schema-validation",
            "--set",
            "consumableShares=memory",
            "--set",
            "simulate=h100:1",
            "--set",
            "mps.enabled=false",
        )
    )
    environ = {e["name"]: str(e["value"]) for e in container["env"] if "value" in e}
    environ |= {
        "NODE_NAME": "gpu-node-1",
        "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
        # this machine's paths instead of the host's: nothing may be created there anyway
        "KUBELET_PLUGINS_DIRECTORY_PATH": str(tmp_path / "plugins"),
        "KUBELET_REGISTRAR_DIRECTORY_PATH": str(tmp_path / "registry"),
        "CDI_ROOT": str(tmp_path / "cdi"),
    }
    result = subprocess.run(
        container["command"], env=environ, capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 1
    assert "--consumable-shares (CONSUMABLE_SHARES): 'memory'" in result.stderr
    assert "MPS daemon" in result.stderr
    assert not (tmp_path / "plugins").exists()


# ---------------------------------------------------------------------------------------------
# MPS: the daemons' Deployments (dra_driver/sharing/mpsdaemon.py)


def test_mps_role_grants_exactly_the_deployment_calls_kube_py_declares_in_the_namespace() -> None:
    from dra_driver.kube import permissions  # noqa: PLC0415

    objects = render()
    role = one(objects, "Role")
    assert role["metadata"]["namespace"] == NAMESPACE
    assert granted(role) == {(g, r, v) for v, g, r in permissions.MPS_PERMISSIONS}
    binding = one(objects, "RoleBinding")
    assert binding["metadata"]["namespace"] == NAMESPACE
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role["metadata"]["name"]
    }  # fmt: skip
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": f"{RELEASE}-kubelet-plugin", "namespace": NAMESPACE}
    ]
    # the ClusterRole gains nothing: deployments are granted in the release namespace only
    assert not any(r == "deployments" for _, r, _ in granted(one(objects, "ClusterRole")))


def test_mps_passes_the_agents_image_and_shares_the_plugin_directory_with_the_host() -> None:
    objects = render("--set", "image.tag=1.2.3", "--set", "mps.startTimeoutSeconds=12")
    container = agent_container(objects)
    env = env_of(container)
    assert env["MPS_IMAGE"]["value"] == container["image"]
    assert env["MPS_IMAGE"]["value"].endswith(":1.2.3")
    config = cli.build_config(
        [], {e["name"]: e["value"] for e in container["env"] if "value" in e} | {"NODE_NAME": "n"}
    )
    assert config.mps_image == container["image"] and config.mps_start_timeout_s == 12
    plugin_dir = "/var/lib/kubelet/plugins/gpu.nvidia.com"
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == plugin_dir)
    assert mount["mountPropagation"] == "Bidirectional"
    assert container["securityContext"]["privileged"] is True  # Bidirectional needs it
    # switched off: no image (MPS claims are refused naming --mps-image), no Role, no propagation
    off = render("--set", "mps.enabled=false")
    assert "MPS_IMAGE" not in env_of(agent_container(off))
    assert of_kind(off, "Role") == []
    mount = next(m for m in agent_container(off)["volumeMounts"] if m["mountPath"] == plugin_dir)
    assert "mountPropagation" not in mount


def test_the_mps_daemons_pull_the_image_with_the_charts_secrets_and_policy() -> None:
    objects = render(
        "--set", "imagePullSecrets[0].name=regcred", "--set", "imagePullSecrets[1].name=mirror",
        "--set", "image.pullPolicy=Always",
    )  # fmt: skip
    container = agent_container(objects)
    environ = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    config = cli.build_config([], environ | {"NODE_NAME": "n"})
    assert config.mps_image_pull_secrets == ("regcred", "mirror")
    assert config.mps_image_pull_policy == "Always"
    # the agent's own pod pulls with the same secrets
    pod = one(objects, "DaemonSet")["spec"]["template"]["spec"]
    assert pod["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror"}]
    default = env_of(agent_container(render()))
    assert "MPS_IMAGE_PULL_SECRETS" not in default
    assert default["MPS_IMAGE_PULL_POLICY"]["value"] == "IfNotPresent"


def test_the_role_in_nvidias_namespace_grants_exactly_the_adopted_mps_cleanup_when_asked() -> None:
    from dra_driver.kube import permissions  # noqa: PLC0415

    default = render()
    env = env_of(agent_container(default))
    assert env["NVIDIA_NAMESPACE"]["value"] == "nvidia-dra-driver-gpu"
    assert [r["metadata"]["namespace"] for r in of_kind(default, "Role")] == [NAMESPACE]
    objects = render(
        "--set", "switchover.grantMpsCleanup=true", "--set", "switchover.nvidiaNamespace=nv-dra"
    )  # fmt: skip
    environ = {e["name"]: e["value"] for e in agent_container(objects)["env"] if "value" in e}
    assert cli.build_config([], environ | {"NODE_NAME": "n"}).nvidia_namespace == "nv-dra"
    (role,) = [r for r in of_kind(objects, "Role") if r["metadata"]["namespace"] == "nv-dra"]
    assert granted(role) == {(g, r, v) for v, g, r in permissions.NVIDIA_MPS_PERMISSIONS}
    (binding,) = [
        b for b in of_kind(objects, "RoleBinding") if b["metadata"]["namespace"] == "nv-dra"
    ]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": f"{RELEASE}-kubelet-plugin", "namespace": NAMESPACE}
    ]
    assert "nvidiaNamespace" in render_error("--set", "switchover.nvidiaNamespace=NV_DRA")


def test_every_call_mps_makes_against_an_api_server_is_granted_by_the_role(
    kubeapi: Any, tmp_path: Path
) -> None:
    from dra_driver.kube import KubeClient  # noqa: PLC0415
    from dra_driver.sharing import mps  # noqa: PLC0415
    from dra_driver.sharing.mpsdaemon import MpsDaemons  # noqa: PLC0415
    from dra_driver.sim.fakedriver import make_fake_driver  # noqa: PLC0415

    fake = make_fake_driver(tmp_path)
    client = KubeClient.from_config(kubeconfig=kubeapi.kubeconfig_path)
    daemons = MpsDaemons(
        api=client, namespace=NAMESPACE, node_name="node1", driver_name="gpu.nvidia.com",
        image="img", base=tmp_path / "mps", driver_root=fake.root, host_driver_root=fake.root,
        start_timeout_s=0.2,
    )  # fmt: skip
    daemon = mps.MpsDaemon(
        owner="o1", devices=(mps.MpsDevice("MIG-x", 2**30, None),), base=tmp_path / "mps"
    )
    # no kubelet runs the Deployment here: the start times out, and the stop removes it
    with pytest.raises(DraError, match="did not answer within"):
        daemons.start(daemon, mps.Limits())
    assert daemons.deployed() == {"o1"}
    daemons.stop("o1")
    client.close()
    used = {
        (group, resource, verb)
        for verb, group, resource in kubeapi.permissions_used()
        if resource == "deployments"
    }
    assert used == granted(one(render(), "Role"))
