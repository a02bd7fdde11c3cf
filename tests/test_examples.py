"""The example claims in examples/resourceclaims: valid objects that ask for what they say.

Each file is checked against the strict OpenAPI schemas of Kubernetes 1.35-1.37, its CEL
selectors are compiled by the project's CEL engine (dra_driver.scheduling.cel), its opaque configs
decoded by the driver's own decoder (deviceconfig), and its header comment must say what it asks
for, when to use it and what to expect. Whether each one is satisfiable on the demo node is tested
by the explain area from the `# expect:` line.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from dra_driver.prepare import deviceconfig
from dra_driver.scheduling import cel
from tests.claimdata import allocated_claim, opaque
from tests.test_mps import Env, mps_node

MPS_MIG_DEVICE = "gpu-4-mig-3g40gb-9-4"

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "resourceclaims"
FILES = sorted(EXAMPLES.rglob("*.yaml"))  # dynamic-mig/: claims for --mig-mode dynamic
KUBERNETES_VERSIONS = ("1.35.0", "1.36.0", "1.37.0")
DRIVER = "gpu.nvidia.com"
CLASSES = {"gpu.nvidia.com", "mig.nvidia.com"}


def load(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def header(path: Path) -> str:
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line)
    return "\n".join(lines)


def claim_specs(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    specs = []
    for obj in objects:
        if obj["kind"] == "ResourceClaim":
            specs.append(obj["spec"])
        elif obj["kind"] == "ResourceClaimTemplate":
            specs.append(obj["spec"]["spec"])
    return specs


def device_requests(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Every exactly-request and firstAvailable sub-request of a claim spec."""
    found = []
    for request in spec["devices"]["requests"]:
        if "exactly" in request:
            found.append(request["exactly"])
        found.extend(request.get("firstAvailable", []))
    return found


def pod_specs(objects: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(metadata, pod spec) of each Pod and of each workload's pod template."""
    pods = []
    for obj in objects:
        if obj["kind"] == "Pod":
            pods.append((obj["metadata"], obj["spec"]))
        elif obj["kind"] in ("Deployment", "StatefulSet", "Job", "DaemonSet"):
            pods.append((obj["metadata"], obj["spec"]["template"]["spec"]))
    return pods


def test_there_are_examples() -> None:
    assert len(FILES) >= 12


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
@pytest.mark.parametrize("kubernetes_version", KUBERNETES_VERSIONS)
def test_every_object_is_valid_for_the_kubernetes_version(
    path: Path, kubernetes_version: str
) -> None:
    for obj in load(path):
        try:
            kubernetes_validate.validate(obj, kubernetes_version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(
                f"{path.name}: {obj['kind']}/{obj['metadata']['name']} is invalid for "
                f"Kubernetes {kubernetes_version}: {exc.message} at {list(exc.absolute_path)}"
            )


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_every_example_opens_with_what_when_and_what_to_expect(path: Path) -> None:
    text = header(path)
    assert "# Asks for:" in text
    assert "# Use it when:" in text
    assert "# What to expect:" in text
    assert re.search(r"^# expect: (satisfiable|unsatisfiable)( |$)", text, re.MULTILINE), (
        f"{path.name} needs a machine-readable '# expect: ...' line in its header"
    )


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_claims_use_v1_and_only_the_driver_classes(path: Path) -> None:
    objects = load(path)
    specs = claim_specs(objects)
    assert specs, f"{path.name} has no ResourceClaim or ResourceClaimTemplate"
    for obj in objects:
        if obj["kind"] in ("ResourceClaim", "ResourceClaimTemplate"):
            assert obj["apiVersion"] == "resource.k8s.io/v1"
    for spec in specs:
        for request in device_requests(spec):
            assert request["deviceClassName"] in CLASSES


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_cel_selectors_compile(path: Path) -> None:
    for spec in claim_specs(load(path)):
        for request in device_requests(spec):
            for selector in request.get("selectors", []):
                cel.compile_selector(selector["cel"]["expression"])


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_opaque_configs_are_accepted_and_carried_out_by_the_driver(path: Path) -> None:
    # what prepare/ does with each config: decode, check it fits the device, check it is
    # something the agent carries out today (an example never promises what is refused)
    for spec in claim_specs(load(path)):
        requests = {r["name"]: r for r in spec["devices"]["requests"]}
        for config in spec["devices"].get("config", []):
            assert config["opaque"]["driver"] == DRIVER
            assert set(config.get("requests", [])) <= set(requests)
            decoded = deviceconfig.decode(config["opaque"]["parameters"])
            for name in config.get("requests") or requests:
                for request in device_requests({"devices": {"requests": [requests[name]]}}):
                    device_type = "mig" if request["deviceClassName"] == "mig.nvidia.com" else "gpu"
                    deviceconfig.check_fits(decoded, device_type=device_type, device_name="d")
                    deviceconfig.check_supported(decoded, device_name="d", request=name)


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_pods_use_claims_that_exist_and_requests_they_declare(path: Path) -> None:
    objects = load(path)
    claims = {o["metadata"]["name"] for o in objects if o["kind"] == "ResourceClaim"}
    templates = {o["metadata"]["name"] for o in objects if o["kind"] == "ResourceClaimTemplate"}
    pods = pod_specs(objects)
    assert pods, f"{path.name} shows no pod that uses its claim"
    for _, pod in pods:
        declared = set()
        for pod_claim in pod["resourceClaims"]:
            declared.add(pod_claim["name"])
            if "resourceClaimName" in pod_claim:
                assert pod_claim["resourceClaimName"] in claims
            else:
                assert pod_claim["resourceClaimTemplateName"] in templates
        for container in pod["containers"]:
            for use in container["resources"]["claims"]:
                assert use["name"] in declared


def _all(path_name: str) -> list[dict[str, Any]]:
    return load(EXAMPLES / path_name)


def _only_request(path_name: str) -> dict[str, Any]:
    (spec,) = claim_specs(_all(path_name))
    (request,) = spec["devices"]["requests"]
    return dict(request)


def _expressions(request: dict[str, Any]) -> list[str]:
    return [s["cel"]["expression"] for s in request.get("selectors", [])]


def test_whole_gpu_asks_for_one_device_of_the_gpu_class() -> None:
    request = _only_request("whole-gpu.yaml")["exactly"]
    assert request == {"deviceClassName": "gpu.nvidia.com"}


def test_memory_example_asks_for_at_least_40_gib() -> None:
    (expression,) = _expressions(_only_request("gpu-40gib.yaml")["exactly"])
    assert "memory.compareTo(quantity('40Gi')) >= 0" in expression


def test_first_available_prefers_h100_then_a100_80gb_then_any_40_gib() -> None:
    subrequests = _only_request("first-available.yaml")["firstAvailable"]
    assert [s["name"] for s in subrequests] == ["h100", "a100-80gb", "any-40gib"]
    h100, a100, any_gpu = (" ".join(_expressions(s)) for s in subrequests)
    assert "startsWith('NVIDIA H100')" in h100
    assert "startsWith('NVIDIA A100')" in a100
    assert "quantity('80Gi')" in a100
    assert "quantity('40Gi')" in any_gpu


def test_same_pcie_root_matches_the_standard_attribute_for_two_gpus() -> None:
    (spec,) = claim_specs(_all("same-pcie-root.yaml"))
    assert spec["devices"]["requests"][0]["exactly"]["count"] == 2
    assert spec["devices"]["constraints"] == [
        {"requests": ["gpus"], "matchAttribute": "resource.kubernetes.io/pcieRoot"}
    ]


@pytest.mark.parametrize(
    ("path_name", "profile"), [("mig-1g10gb.yaml", "1g.10gb"), ("mig-3g40gb.yaml", "3g.40gb")]
)
def test_mig_examples_ask_for_a_profile_of_an_80gb_gpu(path_name: str, profile: str) -> None:
    request = _only_request(path_name)["exactly"]
    assert request["deviceClassName"] == "mig.nvidia.com"
    assert _expressions(request) == [f"device.attributes['gpu.nvidia.com'].profile == '{profile}'"]


def test_all_gpus_uses_allocation_mode_all() -> None:
    request = _only_request("all-gpus.yaml")["exactly"]
    assert request["allocationMode"] == "All"
    assert "count" not in request


def test_template_is_used_by_a_three_replica_deployment() -> None:
    objects = _all("template-deployment.yaml")
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
    assert deployment["spec"]["replicas"] == 3
    (pod_claim,) = deployment["spec"]["template"]["spec"]["resourceClaims"]
    assert pod_claim["resourceClaimTemplateName"] == "one-gpu"


def test_shared_claim_is_used_by_two_containers_of_one_pod() -> None:
    ((_, pod),) = pod_specs(_all("shared-claim.yaml"))
    assert len(pod["containers"]) == 2
    assert all(c["resources"]["claims"] == [{"name": "gpu"}] for c in pod["containers"])


@pytest.fixture
def mps_env() -> Iterator[Env]:
    """A node whose MPS daemons run (tests/test_mps.py)."""
    with mps_node() as env:
        yield env


def _header_text(path_name: str) -> str:
    return " ".join(header(EXAMPLES / path_name).replace("#", " ").split())


@pytest.mark.parametrize(
    ("path_name", "device", "told"),
    [
        (
            "mps.yaml",
            "gpu-0",
            ["set_default_active_thread_percentage 50",
             "set_default_device_pinned_mem_limit {uuid} 10240M"],
        ),
        ("mig-mps.yaml", MPS_MIG_DEVICE, ["set_default_device_pinned_mem_limit {uuid} 8192M"]),
        ("mps-multiuser.yaml", "gpu-0", ["set_default_active_thread_percentage 25"]),
    ],
)  # fmt: skip
def test_mps_examples_are_prepared_as_their_headers_say(
    mps_env: Env, path_name: str, device: str, told: list[str]
) -> None:
    """The example's claim, allocated the device its ``# expect:`` line names and prepared by the
    agent's Preparer with real MPS daemons (tests/test_mps.py): the daemon is told what the
    header says, the containers get the pipe directory and /dev/shm, and unprepare removes it."""
    objects = _all(path_name)
    (spec,) = claim_specs(objects)
    (config,) = spec["devices"]["config"]
    text = _header_text(path_name)
    assert f"expect: satisfiable devices={device}" in text
    claim = mps_env.store.add(
        allocated_claim(name="example", devices=[device],
                        configs=[opaque(config["opaque"]["parameters"])])
    )  # fmt: skip
    uid = claim["metadata"]["uid"]
    uuid = mps_env.uuid(device)
    mps_env.preparer.prepare(mps_env.ref(claim))
    assert mps_env.deployments() == [f"mps-{uid}"]  # "a Deployment `mps-<claim uid>`"
    commands = [c.format(uuid=uuid) for c in told]
    multi_user = config["opaque"]["parameters"]["sharing"]["mpsConfig"].get("multiUser", False)
    start = f"start -M {uuid}" if multi_user else f"start {uuid}"  # the daemon's mode, recorded
    assert mps_env.daemon_calls(uid) == [start, "get_server_list", *commands]
    if multi_user:
        assert "`nvidia-cuda-mps-control -f -M`" in text
    for command in told:
        assert f"`{command.format(uuid='<MIG uuid>' if 'mig' in device else '<GPU uuid>')}`" in text
    modes = mps_env.fake.compute_modes()
    if device.startswith("gpu-") and "-mig-" not in device:
        assert modes == {uuid: "EXCLUSIVE_PROCESS"}
        assert "`nvidia-smi -i <GPU uuid> -c EXCLUSIVE_PROCESS`" in text
    else:
        assert modes == {}
        assert "The parent GPU's compute mode is left alone" in text
    device_spec = json.loads(mps_env.preparer.specs.path_for(uid).read_bytes())["devices"][0]
    assert "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps" in device_spec["containerEdits"]["env"]
    assert "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps" in text
    paths = [m["containerPath"] for m in device_spec["containerEdits"]["mounts"]]
    assert paths == ["/tmp/nvidia-mps", "/dev/shm"]
    mps_env.preparer.unprepare(mps_env.ref(claim))
    assert mps_env.daemon_calls(uid)[-2:] == ["quit", "exit 0"]
    mps_env.assert_nothing_left()


def test_time_slicing_example_is_prepared_as_its_header_says(tmp_path: Path) -> None:
    """The template's claim, allocated gpu-0 and prepared by the agent's Preparer on the fake
    driver: the stand-in nvidia-smi is told what the header says, and Default after."""
    from tests.claimdata import allocated_claim, opaque  # noqa: PLC0415
    from tests.test_prepare import build_env  # noqa: PLC0415

    objects = _all("time-slicing.yaml")
    (spec,) = claim_specs(objects)
    assert [o["kind"] for o in objects] == ["ResourceClaimTemplate", "Pod"]
    (config,) = spec["devices"]["config"]
    decoded = deviceconfig.decode(config["opaque"]["parameters"])
    assert isinstance(decoded, deviceconfig.GpuConfig) and decoded.sharing is not None
    assert decoded.sharing.timeSlicingConfig is not None
    assert decoded.sharing.timeSlicingConfig.interval == "Long"
    env = build_env(tmp_path)
    try:
        claim = env.store.add(
            allocated_claim(
                name="time-sliced-gpu", configs=[opaque(config["opaque"]["parameters"])]
            )
        )
        env.preparer.prepare(env.ref(claim))
        uuid = env.preparer.targets["gpu-0"].gpu.uuid
        smi_dir = tmp_path / "driver-root" / "usr/bin"
        env.preparer.unprepare(env.ref(claim))
        calls = (smi_dir / "nvidia-smi.log").read_text().splitlines()
        assert calls == [
            f"compute-policy -i {uuid} --set-timeslice 3",
            f"compute-policy -i {uuid} --set-timeslice 0",
        ]
    finally:
        env.preparer.close()
    text = " ".join(header(EXAMPLES / "time-slicing.yaml").replace("#", " ").split())
    assert "`nvidia-smi compute-policy -i <GPU uuid> --set-timeslice 3`" in text
    assert "(`--set-timeslice 0`)" in text
    assert "a GPU another claim shares by MPS" in text


def test_video_example_asks_a_gpu_config_for_the_video_capability() -> None:
    objects = _all("video.yaml")
    (spec,) = claim_specs(objects)
    (request,) = spec["devices"]["requests"]
    assert request["exactly"] == {"deviceClassName": "gpu.nvidia.com"}
    (config,) = spec["devices"]["config"]
    assert config["requests"] == [request["name"]]
    decoded = deviceconfig.decode(config["opaque"]["parameters"])
    assert isinstance(decoded, deviceconfig.GpuConfig)
    assert deviceconfig.driver_capabilities(decoded) == {"compute", "utility", "video"}
    assert deviceconfig.driver_capabilities(decoded) > deviceconfig.DEFAULT_DRIVER_CAPABILITIES
    text = header(EXAMPLES / "video.yaml")
    for library in ("libnvcuvid", "libnvidia-encode", "libnvidia-opticalflow"):
        assert library in text
        assert library in pod_specs(objects)[0][1]["containers"][0]["command"][-1]


def test_admin_access_claim_lives_in_a_namespace_labelled_for_it() -> None:
    objects = _all("admin-access.yaml")
    (namespace,) = [o for o in objects if o["kind"] == "Namespace"]
    assert namespace["metadata"]["labels"]["resource.kubernetes.io/admin-access"] == "true"
    (claim,) = [o for o in objects if o["kind"] == "ResourceClaim"]
    assert claim["metadata"]["namespace"] == namespace["metadata"]["name"]
    assert claim["spec"]["devices"]["requests"][0]["exactly"]["adminAccess"] is True
    ((metadata, _),) = pod_specs(objects)
    assert metadata["namespace"] == namespace["metadata"]["name"]
