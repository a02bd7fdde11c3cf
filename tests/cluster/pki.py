"""The cluster's certificates, made with the ``openssl`` command: one CA, the API server's
serving certificate (127.0.0.1, localhost and the ``kubernetes`` Service names), a client
certificate per identity (CN = user, O = groups, as the API server's x509 authenticator reads
them), and the ServiceAccount signing key pair."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


class PkiError(RuntimeError):
    """openssl failed; the message carries its stderr."""


def _openssl(*args: str, cwd: Path) -> None:
    done = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise PkiError(f"openssl {' '.join(args)} failed: {done.stderr.strip()}")


@dataclass(frozen=True)
class Identity:
    """A client certificate and its key."""

    user: str
    cert: Path
    key: Path


class Pki:
    """Certificates under ``root`` (made on construction)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        _openssl(
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
            "-subj", "/CN=gpu-dra-test-ca",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign",
            "-keyout", "ca.key", "-out", "ca.crt", cwd=root,
        )  # fmt: skip
        self.ca = root / "ca.crt"
        self.server_cert, self.server_key = self._sign(
            "apiserver",
            "/CN=kube-apiserver",
            extended="serverAuth",
            san="IP:127.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,"
            "DNS:kubernetes.default.svc,IP:10.0.0.1",
        )
        _openssl("genrsa", "-out", "sa.key", "2048", cwd=root)
        _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=root)
        self.sa_key, self.sa_pub = root / "sa.key", root / "sa.pub"

    def client(self, user: str, *groups: str) -> Identity:
        subject = "".join(f"/O={g}" for g in groups) + f"/CN={user}"
        name = user.replace(":", "-")
        cert, key = self._sign(name, subject, extended="clientAuth")
        return Identity(user=user, cert=cert, key=key)

    def serving(self, name: str, *, san: str) -> tuple[Path, Path]:
        """A serving certificate for a webhook or another server on loopback."""
        return self._sign(name, f"/CN={name}", extended="serverAuth", san=san)

    def _sign(self, name: str, subject: str, *, extended: str, san: str = "") -> tuple[Path, Path]:
        _openssl(
            "req", "-newkey", "rsa:2048", "-nodes", "-subj", subject,
            "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=self.root,
        )  # fmt: skip
        lines = [
            "basicConstraints=critical,CA:FALSE",
            "keyUsage=critical,digitalSignature,keyEncipherment",
            f"extendedKeyUsage={extended}",
            "subjectKeyIdentifier=hash",
            "authorityKeyIdentifier=keyid",
        ]
        if san:
            lines.insert(0, f"subjectAltName={san}")
        (self.root / f"{name}.cnf").write_text("\n".join(lines) + "\n")
        _openssl(
            "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "2", "-extfile", f"{name}.cnf", "-out", f"{name}.crt",
            cwd=self.root,
        )  # fmt: skip
        return self.root / f"{name}.crt", self.root / f"{name}.key"
