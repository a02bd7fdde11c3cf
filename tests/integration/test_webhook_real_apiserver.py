"""The admission webhook called by a real kube-apiserver: the chart's ValidatingWebhookConfiguration
(``helm template --set webhook.enabled=true``) registered through the official client, and the
``gpu-dra-webhook`` command with the arguments of the chart's Deployment answering it.

One change to what the chart renders: the API server reaches the webhook at
``https://127.0.0.1:<port>/validate`` (``clientConfig.url``, with this test's CA as ``caBundle``)
instead of through the Service, which needs cluster networking this tier does not have. The
webhook's name, rules, failure policy, match policy, side effects and review versions are the
chart's. tests/test_chart_webhook.py checks the Service route and the chart's certificate.

Checked: a ResourceClaim and a ResourceClaimTemplate with a bad ``GpuConfig`` are refused when
they are created, with the webhook's own message (also ``defaultActiveThreadPercentage: 0``,
which docs/compatibility.md says this driver refuses); good configs (a MIG device's time
slicing among them, a no-op accepted as NVIDIA's driver accepts it) are stored; and the agent's
``status.devices`` write is not sent to the webhook (it is the status subresource, which the
chart's rules leave out), so it goes through while a registration of the same rules cannot be
reached.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as kube_client
from kubernetes import config as kube_config
from kubernetes.client.exceptions import ApiException

from dra_driver.claimstatus.entries import StatusDevice, status_entries
from dra_driver.kube import KubeClient
from dra_driver.sim.fakedriver import simulated_inventory
from dra_driver.sim.localapi import free_port
from dra_driver.webhook.review import review
from tests.integration.conftest import RealApiServer
from tests.kubebins import required_in_ci
from tests.test_chart import HELM, one, render
from tests.test_webhook import admission, gpu_config

pytestmark = pytest.mark.integration

DRIVER = "gpu.nvidia.com"
NODE = "gpu-node-1"
WAIT_S = 30.0
GOOD = [  # NVIDIA's driver accepts these too; a MIG device's time slicing is a no-op in both
    gpu_config(sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}),
    gpu_config(sharing={"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 50}}),
    {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "MigDeviceConfig",
     "sharing": {"strategy": "TimeSlicing"}},
]  # fmt: skip


def _openssl(*args: str, cwd: Path) -> None:
    done = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, check=False)
    assert done.returncode == 0, f"openssl {' '.join(args)}: {done.stderr.strip()}"


def serving_certificate(pki: Path) -> tuple[Path, Path, Path]:
    """A CA and a serving certificate for 127.0.0.1 signed by it (as the chart's self-signed
    mode makes a CA and a certificate for the Service's names): (ca, cert, key)."""
    pki.mkdir()
    _openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=webhook-ca",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        "-keyout", "ca.key", "-out", "ca.crt", cwd=pki,
    )  # fmt: skip
    _openssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=gpu-dra-webhook",
        "-keyout", "tls.key", "-out", "tls.csr", cwd=pki,
    )  # fmt: skip
    (pki / "san.cnf").write_text(
        "subjectAltName=IP:127.0.0.1\n"
        "basicConstraints=critical,CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth\n"
    )
    _openssl(
        "x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "1", "-extfile", "san.cnf", "-out", "tls.crt", cwd=pki,
    )  # fmt: skip
    return pki / "ca.crt", pki / "tls.crt", pki / "tls.key"


def chart_objects() -> list[dict[str, Any]]:
    if HELM is None:
        message = "helm not on PATH nor at .tools/bin/helm (run `make helm`)"
        if required_in_ci():
            pytest.fail(f"CI=true and {message}")
        pytest.skip(message)
    return render("--set", "webhook.enabled=true")


def registration(
    chart_config: dict[str, Any], *, name: str, url: str, ca: bytes, namespace: str | None = None
) -> dict[str, Any]:
    """The chart's ValidatingWebhookConfiguration, reaching the webhook at ``url``; with
    ``namespace``, only for objects of that namespace."""
    webhooks = []
    for chart_hook in chart_config["webhooks"]:
        hook = {
            **chart_hook,
            "clientConfig": {"url": url, "caBundle": base64.b64encode(ca).decode()},
        }
        if namespace is not None:
            hook["namespaceSelector"] = {"matchLabels": {"kubernetes.io/metadata.name": namespace}}
        webhooks.append(hook)
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": name, "labels": chart_config["metadata"].get("labels", {})},
        "webhooks": webhooks,
    }


@dataclass
class Admission:
    """The official client on the real API server, with the chart's webhook registered."""

    api: Any  # kubernetes.client.ApiClient
    hook_name: str
    chart_config: dict[str, Any]
    ca: bytes
    namespace: str

    @property
    def resource(self) -> Any:
        return kube_client.ResourceV1Api(self.api)

    @property
    def registrations(self) -> Any:
        return kube_client.AdmissionregistrationV1Api(self.api)

    def create(self, obj: dict[str, Any], *, dry_run: bool = False) -> dict[str, Any]:
        kwargs = {"dry_run": "All"} if dry_run else {}
        namespace = obj["metadata"]["namespace"]
        if obj["kind"] == "ResourceClaimTemplate":
            created = self.resource.create_namespaced_resource_claim_template(
                namespace, obj, **kwargs
            )
        else:
            created = self.resource.create_namespaced_resource_claim(namespace, obj, **kwargs)
        result: dict[str, Any] = self.api.sanitize_for_serialization(created)
        return result

    def refusal(self, obj: dict[str, Any], *, dry_run: bool = False) -> tuple[int, str]:
        """(HTTP status, message) of the API server's refusal to create ``obj``."""
        with pytest.raises(ApiException) as refused:
            self.create(obj, dry_run=dry_run)
        body = json.loads(refused.value.body)
        return int(refused.value.status), str(body["message"])


def resource_claim(
    name: str, namespace: str, *parameters: Any, kind: str = "ResourceClaim"
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "devices": {
            "requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}],
            "config": [
                {"requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": p}}
                for p in parameters
            ],
        }
    }
    if kind == "ResourceClaimTemplate":
        spec = {"spec": spec}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": kind,
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


def webhook_message(hook_name: str, obj: dict[str, Any]) -> str:
    """What the API server says when the webhook refuses ``obj``: the webhook's own message
    (review.py), after the API server's ``admission webhook ... denied the request``."""
    answer = review(admission(obj), driver=DRIVER)["response"]
    assert answer["allowed"] is False
    return f'admission webhook "{hook_name}" denied the request: {answer["status"]["message"]}'


def wait_until(what: str, done: Any, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.2)


def create_namespace(api: Any, name: str) -> None:
    kube_client.CoreV1Api(api).create_namespace({"metadata": {"name": name}})


@pytest.fixture(scope="module")
def webhook(
    real_apiserver: RealApiServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Admission]:
    objects = chart_objects()
    chart_config = one(objects, "ValidatingWebhookConfiguration")
    (container,) = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    ca, cert, key = serving_certificate(tmp_path_factory.mktemp("webhook") / "pki")
    port = free_port()
    # The chart's container arguments, with this test's port and certificate files.
    args = [
        f"--port={port}" if a.startswith("--port=")
        else a.replace("/tls/tls.crt", str(cert)).replace("/tls/tls.key", str(key))
        for a in container["args"]
    ]  # fmt: skip
    process = subprocess.Popen(
        [str(Path(sys.executable).parent / container["command"][0]), *args,
         "--bind-address", "127.0.0.1"],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip

    api = kube_config.new_client_from_config(config_file=str(real_apiserver.kubeconfig))
    namespace = f"webhook-{uuid.uuid4().hex[:6]}"
    create_namespace(api, namespace)
    config_name = f"{chart_config['metadata']['name']}-{namespace}"
    hook = Admission(
        api=api,
        hook_name=chart_config["webhooks"][0]["name"],
        chart_config=chart_config,
        ca=ca.read_bytes(),
        namespace=namespace,
    )
    try:
        hook.registrations.create_validating_webhook_configuration(
            registration(
                chart_config, name=config_name, url=f"https://127.0.0.1:{port}/validate",
                ca=hook.ca,
            )
        )  # fmt: skip
        # The API server picks up a new registration from its informer: until a dry run is
        # refused, the webhook is not called yet.
        probe = resource_claim("probe", namespace, gpu_config(sharng={}))

        def in_effect() -> bool:
            assert process.poll() is None, process.communicate()[1][-3000:]
            try:
                hook.create(probe, dry_run=True)
            except ApiException as exc:
                return "denied the request" in str(exc.body)
            return False

        wait_until("the API server to call the webhook", in_effect)
        yield hook
    finally:
        try:
            hook.registrations.delete_validating_webhook_configuration(config_name)
        except ApiException as exc:  # not created: the failure above is the one to see
            if exc.status != 404:
                raise
        process.terminate()
        try:
            _, stderr = process.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            _, stderr = process.communicate()
        api.close()
    assert process.returncode in (0, -15), stderr[-3000:]


BAD = {
    "strategy": (gpu_config(sharing={"strategy": "Bogus"}), "invalid GpuConfig"),
    # NVIDIA's driver passes 0 on to MPS; refused here, docs/compatibility.md says why
    "mps-0": (
        gpu_config(sharing={"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 0}}),
        "defaultActiveThreadPercentage 0 is refused",
    ),
}


@pytest.mark.parametrize("case", BAD)
def test_a_claim_with_a_bad_gpu_config_is_refused_when_it_is_created(
    webhook: Admission, case: str
) -> None:
    parameters, complaint = BAD[case]
    bad = resource_claim(f"bad-{case}", webhook.namespace, parameters)
    status, message = webhook.refusal(bad)
    assert status == 422
    assert message == webhook_message(webhook.hook_name, bad)
    assert "spec.devices.config[0].opaque.parameters: " in message and complaint in message
    stored = webhook.resource.list_namespaced_resource_claim(webhook.namespace)
    assert f"bad-{case}" not in [c.metadata.name for c in stored.items]


def test_every_bad_config_of_a_claim_is_named(webhook: Admission) -> None:
    bad = resource_claim(
        "two-bad", webhook.namespace, gpu_config(), gpu_config(sharng={}),
        {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
         "sharing": {"strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": "x"}}},
    )  # fmt: skip
    status, message = webhook.refusal(bad)
    assert status == 422 and message == webhook_message(webhook.hook_name, bad)
    assert "config[1]" in message and "config[2]" in message and "config[0]" not in message


@pytest.mark.parametrize("parameters", GOOD, ids=["timeslicing", "mps-50", "mig-timeslicing"])
def test_a_claim_with_a_good_config_is_stored(webhook: Admission, parameters: Any) -> None:
    name = f"good-{uuid.uuid4().hex[:6]}"
    created = webhook.create(resource_claim(name, webhook.namespace, parameters))
    assert created["metadata"]["name"] == name
    stored = webhook.resource.read_namespaced_resource_claim(name, webhook.namespace)
    config = webhook.api.sanitize_for_serialization(stored.spec.devices.config)
    assert config[0]["opaque"]["parameters"] == parameters


def test_a_template_with_a_bad_config_is_refused_and_a_good_one_stored(
    webhook: Admission,
) -> None:
    bad = resource_claim(
        "bad-template", webhook.namespace, gpu_config(sharing={"strategy": "Timeslicing"}),
        kind="ResourceClaimTemplate",
    )  # fmt: skip
    status, message = webhook.refusal(bad)
    assert status == 422 and message == webhook_message(webhook.hook_name, bad)
    assert "spec.spec.devices.config[0].opaque.parameters" in message
    good = resource_claim(
        "good-template", webhook.namespace, gpu_config(), kind="ResourceClaimTemplate"
    )
    assert webhook.create(good)["metadata"]["name"] == "good-template"


def test_configs_of_other_drivers_pass_untouched(webhook: Admission) -> None:
    claim = resource_claim("other-driver", webhook.namespace)
    claim["spec"]["devices"]["config"] = [
        {"requests": ["gpu"], "opaque": {"driver": "nic.example.com", "parameters": {"x": 1}}}
    ]
    assert webhook.create(claim)["metadata"]["name"] == "other-driver"


def test_the_agents_status_write_is_not_sent_to_the_webhook(
    webhook: Admission, real_apiserver: RealApiServer
) -> None:
    """A second registration of the chart's rules, for a namespace of its own, at a port where
    nothing listens, with the chart's failurePolicy Fail: a claim created there is refused, but
    the scheduler's allocation and the agent's ``status.devices`` (the status subresource) are
    written."""
    namespace = f"{webhook.namespace}-down"
    create_namespace(webhook.api, namespace)
    name = "prepared"
    created = webhook.create(resource_claim(name, namespace, gpu_config()))
    uid = created["metadata"]["uid"]
    down_name = f"{webhook.chart_config['metadata']['name']}-{namespace}"
    webhook.registrations.create_validating_webhook_configuration(
        registration(
            webhook.chart_config, name=down_name, url=f"https://127.0.0.1:{free_port()}/validate",
            ca=webhook.ca, namespace=namespace,
        )
    )  # fmt: skip
    try:
        assert webhook.chart_config["webhooks"][0]["failurePolicy"] == "Fail"

        def refused_unreachable() -> bool:
            try:
                webhook.create(resource_claim("probe", namespace, gpu_config()), dry_run=True)
            except ApiException as exc:
                return "failed calling webhook" in str(exc.body)
            return False

        wait_until("the unreachable registration to refuse claims", refused_unreachable)

        # The scheduler's write: the allocation, through the status subresource.
        claim = webhook.api.sanitize_for_serialization(
            webhook.resource.read_namespaced_resource_claim(name, namespace)
        )
        claim["status"] = {
            "allocation": {
                "devices": {
                    "results": [
                        {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-0"}
                    ]
                },
                "nodeSelector": {
                    "nodeSelectorTerms": [
                        {
                            "matchFields": [
                                {"key": "metadata.name", "operator": "In", "values": [NODE]}
                            ]
                        }
                    ]
                },
            }
        }
        webhook.resource.replace_namespaced_resource_claim_status(name, namespace, claim)

        # The agent's write, as its claim-status reporter makes it (kube/, claimstatus/).
        inventory = simulated_inventory("h100:1", node_name=NODE)
        entries = status_entries(
            driver=DRIVER,
            devices=[StatusDevice(NODE, "gpu-0")],
            inventory=inventory,
            now="2026-12-04T10:00:00Z",
        )
        agent = KubeClient.from_config(kubeconfig=real_apiserver.kubeconfig)
        try:
            assert agent.apply_resource_claim_status(
                namespace=namespace, name=name, uid=uid, devices=entries, field_manager=DRIVER
            )
        finally:
            agent.close()
        stored = webhook.api.sanitize_for_serialization(
            webhook.resource.read_namespaced_resource_claim(name, namespace)
        )
        (device,) = stored["status"]["devices"]
        assert (device["driver"], device["pool"], device["device"]) == (DRIVER, NODE, "gpu-0")
        assert device["data"]["uuid"] == inventory.gpus[0].uuid
        assert device["conditions"][0]["type"] == "Ready"
    finally:
        webhook.registrations.delete_validating_webhook_configuration(down_name)
