"""The validating admission webhook (dra_driver/webhook): the same strict decoding the agent
uses, answered to a direct AdmissionReview over real HTTPS (TLS from a certificate on disk that
is renewed while it runs), and the ``gpu-dra-webhook`` command as the chart's Deployment runs it.
A real kube-apiserver calls it in tests/integration/test_webhook_real_apiserver.py."""

from __future__ import annotations

import json
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from dra_driver.errors import ConfigDecodeError, ConfigNotSupported
from dra_driver.prepare.deviceconfig import check_supported, decode
from dra_driver.sim.localapi import free_port
from dra_driver.webhook.review import review
from dra_driver.webhook.server import WebhookServer, parser

DRIVER = "gpu.nvidia.com"
needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


def gpu_config(**fields: Any) -> dict[str, Any]:
    return {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig", **fields}


def claim(*parameters: Any, driver: str = DRIVER, kind: str = "ResourceClaim") -> dict[str, Any]:
    spec = {
        "devices": {
            "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}],
            "config": [
                {"requests": ["gpu"], "opaque": {"driver": driver, "parameters": p}}
                for p in parameters
            ],
        }
    }
    if kind == "ResourceClaimTemplate":
        spec = {"spec": spec}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": kind,
        "metadata": {"name": "c", "namespace": "ml"},
        "spec": spec,
    }


def admission(obj: dict[str, Any], uid: str = "705ab4f5-6393-11e8-b7cc-42010a800002") -> Any:
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid, "operation": "CREATE", "name": "c", "namespace": "ml",
            "kind": {"group": "resource.k8s.io", "version": "v1", "kind": obj["kind"]},
            "resource": {"group": "resource.k8s.io", "version": "v1",
                         "resource": obj["kind"].lower() + "s"},
            "object": obj,
        },
    }  # fmt: skip


CONFIGS = [
    gpu_config(),
    gpu_config(sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}),
    gpu_config(sharing={"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 50}}),
    gpu_config(sharing={"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 0}}),
    gpu_config(sharing={"strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": "x"}}),
    gpu_config(sharing={"strategy": "Timeslicing"}),
    gpu_config(sharng={}),
    {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "MigDeviceConfig",
     "sharing": {"strategy": "MPS"}},
    {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "MigDeviceConfig",
     "sharing": {"strategy": "TimeSlicing"}},
    {"apiVersion": "resource.nvidia.com/v1", "kind": "GpuConfig"},
    {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomainConfig"},
    "not an object",
]  # fmt: skip


def agent_accepts(parameters: Any) -> bool:
    """What the agent's own decoding says of a config (prepare/deviceconfig.py)."""
    try:
        check_supported(decode(parameters), device_name="gpu-0", request="gpu")
    except (ConfigDecodeError, ConfigNotSupported):
        return False
    return True


@pytest.mark.parametrize("parameters", CONFIGS, ids=range(len(CONFIGS)))
@pytest.mark.parametrize("kind", ["ResourceClaim", "ResourceClaimTemplate"])
def test_the_webhook_refuses_exactly_what_the_agent_refuses(parameters: Any, kind: str) -> None:
    answer = review(admission(claim(parameters, kind=kind)), driver=DRIVER)["response"]
    assert answer["allowed"] is agent_accepts(parameters)
    if not answer["allowed"]:
        prefix = "spec.spec" if kind == "ResourceClaimTemplate" else "spec"
        assert f"{prefix}.devices.config[0].opaque.parameters:" in answer["status"]["message"]
        assert answer["status"]["code"] == 422


def test_the_answer_names_the_field_and_keeps_the_uid() -> None:
    body = admission(claim(gpu_config(), gpu_config(sharng={})), uid="u-1")
    answer = review(body, driver=DRIVER)
    assert answer["apiVersion"] == "admission.k8s.io/v1"
    response = answer["response"]
    assert response["uid"] == "u-1" and response["allowed"] is False
    message = response["status"]["message"]
    assert "config[1].opaque.parameters: invalid GpuConfig: sharng: Extra inputs" in message
    assert "config[0]" not in message


def test_configs_of_other_drivers_and_other_objects_pass_untouched() -> None:
    assert review(admission(claim({"bogus": 1}, driver="nic.example.com")), driver=DRIVER)[
        "response"
    ]["allowed"]
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": {}}
    assert review(admission(pod), driver=DRIVER)["response"]["allowed"]


def test_what_is_not_an_admission_review_is_an_error() -> None:
    with pytest.raises(ValueError, match="AdmissionReview"):
        review({"kind": "Pod"}, driver=DRIVER)


# -- over HTTPS --------------------------------------------------------------------------------


def make_certificate(directory: Path, name: str) -> tuple[Path, Path]:
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / "tls.crt", directory / "tls.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", f"/CN={name}", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


def post(port: int, ca: Path, body: Any) -> tuple[int, Any]:
    context = ssl.create_default_context(cafile=str(ca))
    request = urllib.request.Request(
        f"https://127.0.0.1:{port}/validate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, context=context, timeout=5) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def served_common_name(port: int) -> str:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        context.wrap_socket(raw) as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    text = subprocess.run(
        ["openssl", "x509", "-inform", "DER", "-noout", "-subject"],
        input=der, capture_output=True, check=True,
    ).stdout.decode()  # fmt: skip
    return text.strip().rsplit("=", 1)[-1].strip()


@needs_openssl
def test_an_admission_review_over_https_and_a_renewed_certificate(tmp_path: Path) -> None:
    cert, key = make_certificate(tmp_path / "tls", "first")
    server = WebhookServer(cert=cert, key=key, driver=DRIVER, port=0, host="127.0.0.1").start()
    try:
        status, answer = post(server.port, cert, admission(claim(gpu_config(sharng={}))))
        assert status == 200 and answer["response"]["allowed"] is False
        assert "sharng" in answer["response"]["status"]["message"]
        status, answer = post(server.port, cert, admission(claim(gpu_config())))
        assert status == 200 and answer["response"]["allowed"] is True
        status, text = post(server.port, cert, {"kind": "nonsense"})
        assert status == 400 and "AdmissionReview" in text
        # cert-manager renews: new files on disk, the next handshake serves them
        assert served_common_name(server.port) == "first"
        time.sleep(0.01)
        make_certificate(tmp_path / "renewed", "second")
        for name in ("tls.crt", "tls.key"):
            (tmp_path / "renewed" / name).replace(tmp_path / "tls" / name)
        assert served_common_name(server.port) == "second"
        status, answer = post(server.port, cert, admission(claim(gpu_config())))  # the new CA
        assert status == 200 and answer["response"]["allowed"] is True
    finally:
        server.stop()


@needs_openssl
def test_the_command_serves_as_the_charts_deployment_runs_it(tmp_path: Path) -> None:
    cert, key = make_certificate(tmp_path / "tls", "webhook")
    port = free_port()
    command = [
        str(Path(sys.executable).parent / "gpu-dra-webhook"), "--port", str(port),
        "--bind-address", "127.0.0.1",
    ]  # fmt: skip
    env = {"TLS_CERT_FILE": str(cert), "TLS_PRIVATE_KEY_FILE": str(key), "PATH": "/usr/bin"}
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    try:
        context = ssl.create_default_context(cafile=str(cert))
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(
                    f"https://127.0.0.1:{port}/healthz", context=context, timeout=2
                ) as answer:
                    assert answer.read() == b"ok\n"
                    break
            except (urllib.error.URLError, ConnectionError):
                assert process.poll() is None, process.communicate()[1]
                assert time.monotonic() < deadline
                time.sleep(0.1)
        status, answer = post(port, cert, admission(claim(gpu_config(sharng={}))))
        assert status == 200 and not answer["response"]["allowed"]
    finally:
        process.terminate()
        _, stderr = process.communicate(timeout=10)
    assert process.returncode == 0, stderr


def test_the_command_refuses_to_run_without_tls() -> None:
    with pytest.raises(SystemExit):
        parser().parse_args(["--tls-cert-file"])
    result = subprocess.run(
        [str(Path(sys.executable).parent / "gpu-dra-webhook")],
        capture_output=True, text=True, timeout=30, env={"PATH": "/usr/bin"}, check=False,
    )  # fmt: skip
    assert result.returncode == 2 and "--tls-cert-file and --tls-private-key-file" in result.stderr
