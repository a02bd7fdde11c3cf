"""The whole-GPU DeviceClass's ``extendedResourceName`` (KEP-5004), rendered by the real helm.

NVIDIA's chart sets ``extendedResourceName: nvidia.com/gpu`` on the ``gpu.nvidia.com`` class
wherever its classes are written in resource.k8s.io/v1; this chart does the same by default
(``deviceClasses.gpuExtendedResourceName``, empty turns it off). Each case is rendered for
Kubernetes 1.35, 1.36 and 1.37 with and without v1 served, and validated against that
version's strict OpenAPI schemas (kubernetes-validate); the classes the code ships
(dra_driver.devices.classes: explain, the demo) must equal the rendered ones.
"""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest

from dra_driver.devices import classes
from tests.test_chart import (
    CHART,
    DISCOVERED,
    KUBERNETES_VERSIONS,
    NAMESPACE,
    RELEASE,
    helm,
    of_kind,
    pytestmark,  # noqa: F401  (helm is needed: skipped without it)
    render,
)

# What a cluster's discovery says it serves (the chart picks the newest DeviceClass version).
SERVED: dict[str, tuple[str, ...]] = {
    "v1 served": (*DISCOVERED, "--api-versions", "resource.k8s.io/v1/DeviceClass",
                  "--api-versions", "resource.k8s.io/v1beta2/DeviceClass"),
    "v1beta2 newest": (*DISCOVERED, "--api-versions", "resource.k8s.io/v1beta2/DeviceClass",
                       "--api-versions", "resource.k8s.io/v1beta1/DeviceClass"),
    "v1beta1 only": (*DISCOVERED, "--api-versions", "resource.k8s.io/v1beta1/DeviceClass"),
}  # fmt: skip
SWITCH: dict[str, tuple[str, ...]] = {
    "default": (),
    "off": ("--set", "deviceClasses.gpuExtendedResourceName="),
    "renamed": ("--set", "deviceClasses.gpuExtendedResourceName=example.com/gpu"),
}
EXPECTED: dict[str, str | None] = {
    "default": "nvidia.com/gpu",
    "off": None,
    "renamed": "example.com/gpu",
}


def extended_names(objects: list[dict[str, Any]]) -> dict[str, str | None]:
    return {
        c["metadata"]["name"]: c["spec"].get("extendedResourceName")
        for c in of_kind(objects, "DeviceClass")
    }


def validate(obj: dict[str, Any], kubernetes_version: str) -> None:
    try:
        kubernetes_validate.validate(obj, kubernetes_version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(
            f"{obj['kind']}/{obj['metadata']['name']} is invalid for Kubernetes "
            f"{kubernetes_version}: {exc.message} at {list(exc.absolute_path)}"
        )


@pytest.mark.parametrize("switch", list(SWITCH))
@pytest.mark.parametrize("served", list(SERVED))
@pytest.mark.parametrize("kubernetes_version", KUBERNETES_VERSIONS)
def test_the_gpu_class_maps_the_extended_resource_only_in_v1_and_only_when_on(
    kubernetes_version: str, served: str, switch: str
) -> None:
    objects = render("--kube-version", kubernetes_version, *SERVED[served], *SWITCH[switch])
    device_classes = of_kind(objects, "DeviceClass")
    in_v1 = served == "v1 served"
    assert {c["apiVersion"] for c in device_classes} == {
        "resource.k8s.io/v1" if in_v1 else f"resource.k8s.io/{served.split(maxsplit=1)[0]}"
    }
    assert extended_names(objects) == {
        "gpu.nvidia.com": EXPECTED[switch] if in_v1 else None,
        "mig.nvidia.com": None,  # MIG devices are never the device plugin's nvidia.com/gpu
    }
    for device_class in device_classes:
        validate(device_class, kubernetes_version)


def test_a_forced_older_api_version_leaves_the_field_out_on_a_v1_cluster() -> None:
    objects = render(*SERVED["v1 served"], "--set", "resourceApiVersion=v1beta2")
    assert extended_names(objects) == {"gpu.nvidia.com": None, "mig.nvidia.com": None}


def test_offline_template_writes_v1_with_the_extended_resource() -> None:
    # helm's own list of APIs (no discovery) includes resource.k8s.io/v1
    assert extended_names(render()) == {"gpu.nvidia.com": "nvidia.com/gpu", "mig.nvidia.com": None}


@pytest.mark.parametrize("driver", ["gpu.nvidia.com", "gpu.example.com"])
@pytest.mark.parametrize(
    ("switch", "name"), [("default", classes.GPU_EXTENDED_RESOURCE_NAME), ("off", None)]
)
def test_the_classes_the_code_ships_equal_the_rendered_ones(
    driver: str, switch: str, name: str | None
) -> None:
    shipped = classes.default_device_classes(driver, gpu_extended_resource_name=name)
    rendered = of_kind(
        render(*SERVED["v1 served"], "--set", f"driverName={driver}", *SWITCH[switch]),
        "DeviceClass",
    )
    assert {c["metadata"]["name"]: (c["apiVersion"], c["spec"]) for c in shipped} == {
        c["metadata"]["name"]: (c["apiVersion"], c["spec"]) for c in rendered
    }
    for device_class in shipped:
        validate(device_class, "1.37.0")


def test_the_default_the_code_ships_is_the_charts_default() -> None:
    assert classes.default_device_classes() == classes.default_device_classes(
        gpu_extended_resource_name=classes.GPU_EXTENDED_RESOURCE_NAME
    )
    gpu_class = classes.default_device_classes()[0]
    assert gpu_class["metadata"]["name"] == classes.GPU_CLASS
    assert gpu_class["spec"]["extendedResourceName"] == "nvidia.com/gpu"


def notes(*args: str) -> str:
    result = helm("install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--dry-run=client",
                  *args)  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout.split("NOTES:", 1)[1]


def test_notes_say_what_the_extended_resource_means_for_existing_pods() -> None:
    text = " ".join(notes().split())
    assert "class gpu.nvidia.com has extendedResourceName nvidia.com/gpu (KEP-5004)" in text
    assert (
        "`resources.limits: {nvidia.com/gpu: 1}` and no ResourceClaim is allocated one whole-GPU "
        "device of this driver on nodes whose status does not list nvidia.com/gpu"
    ) in text
    assert "Nodes where a device plugin (NVIDIA's) advertises nvidia.com/gpu keep serving" in text
    assert "on by default from Kubernetes 1.36, GA in 1.37" in text
    assert '--set deviceClasses.gpuExtendedResourceName=""' in text


def test_notes_warn_that_under_consumable_shares_such_a_pod_may_get_a_share() -> None:
    assert "consumableShares" not in notes()
    text = " ".join(notes("--set", "consumableShares=unlimited").split())
    assert "With consumableShares=unlimited that claim asks for no capacity" in text
    assert "which may be a share of the GPU" in text


@pytest.mark.parametrize(
    "args",
    [
        ("--set", "deviceClasses.gpuExtendedResourceName="),
        ("--set", "resourceApiVersion=v1beta2"),
        ("--set", "deviceClasses.create=false"),
    ],
)
def test_notes_say_nothing_of_it_when_no_class_maps_it(args: tuple[str, ...]) -> None:
    assert "extendedResourceName" not in notes(*args)


@pytest.mark.parametrize(
    "value",
    [
        "nvidia gpu",
        "gpu",
        "nvidia.com/",
        "NVIDIA.com/gpu",
        "kubernetes.io/gpu",  # Kubernetes' own namespace is no extended resource
        "deviceclass.resource.kubernetes.io/gpu.nvidia.com",  # a class's implicit name
    ],
)
def test_the_schema_refuses_a_name_that_is_no_extended_resource(value: str) -> None:
    result = helm("template", RELEASE, str(CHART), "--set",
                  f"deviceClasses.gpuExtendedResourceName={value}")  # fmt: skip
    assert result.returncode != 0
    assert "gpuExtendedResourceName" in result.stderr
