"""The chart's admission webhook (templates/webhook.yaml), rendered by the real helm: valid
objects for Kubernetes 1.35-1.37 in each TLS mode, a configuration that sends exactly
ResourceClaims and templates to the Service's /validate, a Deployment whose arguments the real
``gpu-dra-webhook`` accepts, and the self-signed Secret the chart makes served by that command
and trusted through the rendered caBundle under the Service's DNS name."""

from __future__ import annotations

import base64
import http.client
import json
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from dra_driver.sim.localapi import free_port
from dra_driver.webhook.server import parser
from tests.test_chart import (
    HELM,
    KUBERNETES_VERSIONS,
    NAMESPACE,
    RELEASE,
    of_kind,
    one,
    render,
    render_error,
)
from tests.test_webhook import admission, claim, gpu_config

pytestmark = [
    pytest.mark.helm,
    pytest.mark.skipif(HELM is None, reason="helm not on PATH nor at .tools/bin/helm"),
]
ON = ("--set", "webhook.enabled=true")
NAME = f"{RELEASE}-webhook"


def test_the_webhook_is_off_by_default_like_nvidias() -> None:
    assert not of_kind(render(), "ValidatingWebhookConfiguration")


@pytest.mark.parametrize(
    "mode",
    [
        ("--set", "webhook.tls.mode=self-signed"),
        ("--set", "webhook.tls.mode=cert-manager"),
        ("--set", "webhook.tls.mode=cert-manager",
         "--set", "webhook.tls.certManager.issuerType=clusterissuer",
         "--set", "webhook.tls.certManager.issuerName=corp-ca"),
        ("--set", "webhook.tls.mode=secret", "--set", "webhook.tls.secret.name=mine",
         "--set", "webhook.tls.secret.caBundle=" + base64.b64encode(b"pem").decode()),
    ],
    ids=["self-signed", "cert-manager", "cluster-issuer", "secret"],
)  # fmt: skip
def test_each_tls_mode_renders_valid_objects(mode: tuple[str, ...]) -> None:
    objects = render(*ON, *mode)
    for obj in objects:
        if obj["apiVersion"].startswith("cert-manager.io/"):
            continue  # a CRD's kind
        for version in KUBERNETES_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)
    config = one(objects, "ValidatingWebhookConfiguration")
    (hook,) = config["webhooks"]
    if "webhook.tls.mode=cert-manager" in mode:
        assert config["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == (
            f"{NAMESPACE}/{NAME}"
        )
        certificate = one(objects, "Certificate")
        assert f"{NAME}.{NAMESPACE}.svc" in certificate["spec"]["dnsNames"]
        assert certificate["spec"]["secretName"] == f"{NAME}-tls"
    else:
        assert hook["clientConfig"]["caBundle"]


def test_claims_and_templates_go_to_the_services_validate_path() -> None:
    objects = render(*ON)
    (hook,) = one(objects, "ValidatingWebhookConfiguration")["webhooks"]
    assert hook["rules"] == [
        {
            "apiGroups": ["resource.k8s.io"],
            "apiVersions": ["*"],
            "operations": ["CREATE", "UPDATE"],
            "resources": ["resourceclaims", "resourceclaimtemplates"],
            "scope": "Namespaced",
        }
    ]
    assert hook["failurePolicy"] == "Fail" and hook["sideEffects"] == "None"
    service = one(objects, "Service")
    assert hook["clientConfig"]["service"] == {
        "name": service["metadata"]["name"], "namespace": NAMESPACE, "path": "/validate",
        "port": service["spec"]["ports"][0]["port"],
    }  # fmt: skip
    deployment = one(objects, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["gpu-dra-webhook"]
    args = parser().parse_args(container["args"])
    assert args.port == container["ports"][0]["containerPort"] == 8443
    assert args.driver_name == "gpu.nvidia.com"
    assert str(args.tls_cert_file) == "/tls/tls.crt"
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volume = next(v for v in deployment["spec"]["template"]["spec"]["volumes"]
                  if v["name"] == mounts["/tls"])  # fmt: skip
    assert volume["secret"]["secretName"] == f"{NAME}-tls"


@pytest.mark.parametrize(
    ("args", "complaint"),
    [
        (("--set", "webhook.tls.mode=secret"), "webhook.tls.secret.name is required"),
        (("--set", "webhook.tls.mode=secret", "--set", "webhook.tls.secret.name=s",
          "--set", "webhook.tls.secret.caBundle=x", "--set", "webhook.tls.secret.namespace=other"),
         "can mount a Secret of its own namespace"),
        (("--set", "webhook.tls.mode=cert-manager",
          "--set", "webhook.tls.certManager.issuerType=issuer"), "issuerName is required"),
        (("--set", "webhook.tls.mode=vault"), "webhook/tls/mode"),
    ],
)  # fmt: skip
def test_an_incomplete_tls_setting_is_refused_saying_what_is_missing(
    args: tuple[str, ...], complaint: str
) -> None:
    assert complaint in render_error(*ON, *args)


def test_the_secret_the_chart_makes_is_served_and_trusted_under_the_service_name(
    tmp_path: Path,
) -> None:
    objects = render(*ON)
    secret = one(objects, "Secret")
    for key in ("tls.crt", "tls.key"):
        (tmp_path / key).write_bytes(base64.b64decode(secret["data"][key]))
    (hook,) = one(objects, "ValidatingWebhookConfiguration")["webhooks"]
    ca = base64.b64decode(hook["clientConfig"]["caBundle"]).decode()
    (container,) = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    port = free_port()
    args = [a.replace("/tls/", f"{tmp_path}/") for a in container["args"]]
    args = [f"--port={port}" if a.startswith("--port=") else a for a in args]
    process = subprocess.Popen(
        [str(Path(sys.executable).parent / "gpu-dra-webhook"), *args,
         "--bind-address", "127.0.0.1"],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        # what the API server does: TLS to the Service's DNS name, trusting the caBundle
        context = ssl.create_default_context(cadata=ca)
        host = f"{NAME}.{NAMESPACE}.svc"
        deadline = time.monotonic() + 20
        while True:
            try:
                raw = socket.create_connection(("127.0.0.1", port), timeout=5)
                break
            except ConnectionRefusedError:
                assert process.poll() is None and time.monotonic() < deadline
                time.sleep(0.1)
        with context.wrap_socket(raw, server_hostname=host) as tls:
            connection = http.client.HTTPConnection(host)
            connection.sock = tls
            body = json.dumps(admission(claim(gpu_config(sharing={"strategy": "Bogus"}))))
            connection.request("POST", "/validate", body, {"Content-Type": "application/json"})
            answer: Any = json.loads(connection.getresponse().read())
        assert answer["response"]["allowed"] is False
        assert "strategy" in answer["response"]["status"]["message"]
    finally:
        process.terminate()
        process.communicate(timeout=10)
