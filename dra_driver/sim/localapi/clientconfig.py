"""How clients reach the local API server: its self-signed TLS certificate, a kubeconfig for it,
and the environment of a Pod's in-cluster client (ServiceAccount files, KUBERNETES_SERVICE_*,
and the interpreter settings the chart's DaemonSet gives the agent)."""

from __future__ import annotations

import shutil
import ssl
import subprocess
from pathlib import Path

from dra_driver.sim.localapi.resources import JsonDict

# The interpreter settings the chart's DaemonSet gives the agent's container (a chart test checks
# they are the same), for the benchmarks that run the agent as in the Pod: no docstrings
# (PYTHONOPTIMIZE=2, as ``python -OO``; the agent reads none, and its asserts only narrow types).
AGENT_INTERPRETER_ENV = {"PYTHONOPTIMIZE": "2"}


def certificate(tls_dir: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 in ``tls_dir`` (made once)."""
    cert, key = tls_dir / "ca.crt", tls_dir / "tls.key"
    if not cert.exists():
        tls_dir.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
             "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
             "-keyout", str(key), "-out", str(cert)],
            check=True, capture_output=True,
        )  # fmt: skip
    return cert, key


def tls_context(tls_dir: Path) -> ssl.SSLContext:
    """The server side of TLS with ``tls_dir``'s certificate."""
    cert, key = certificate(tls_dir)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    return context


def kubeconfig(*, url: str, tls_dir: Path | None, token: str) -> JsonDict:
    """A kubeconfig of one cluster at ``url`` (trusting ``tls_dir``'s certificate) and a user
    with a bearer ``token``."""
    cluster: JsonDict = {"server": url}
    if tls_dir is not None:
        cluster["certificate-authority"] = str(tls_dir / "ca.crt")
    user: JsonDict = {"token": token}
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "fake", "cluster": cluster}],
        "users": [{"name": "fake", "user": user}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
        "current-context": "fake",
    }


def in_cluster_command(
    argv: list[str], *, workdir: Path, port: int, token: str, tls_dir: Path
) -> tuple[list[str], dict[str, str]]:
    """``argv`` wrapped to run as in a Pod against the server on ``port``: the ServiceAccount
    files (``token``, ``tls_dir``'s certificate) at their fixed path, KUBERNETES_SERVICE_HOST/PORT
    pointing there, and ``AGENT_INTERPRETER_ENV``. The files live in a tmpfs over /run inside a
    private mount namespace, so the host is not touched (needs root)."""
    account = workdir / "serviceaccount"
    account.mkdir(parents=True, exist_ok=True)
    (account / "token").write_text(token)
    (account / "namespace").write_text("gpu-dra")
    shutil.copyfile(certificate(tls_dir)[0], account / "ca.crt")
    target = "/run/secrets/kubernetes.io/serviceaccount"
    script = f'mount -t tmpfs tmpfs /run && mkdir -p {target} && cp "$0"/* {target}/ && exec "$@"'
    env = {
        "KUBERNETES_SERVICE_HOST": "127.0.0.1",
        "KUBERNETES_SERVICE_PORT": str(port),
        **AGENT_INTERPRETER_ENV,
    }
    return ["unshare", "--mount", "sh", "-c", script, str(account), *argv], env
