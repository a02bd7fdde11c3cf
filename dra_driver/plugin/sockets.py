"""Socket file names and the Unix-socket listening rules the kubelet expects (spec A.3).

Without a pod UID: ``<registrar dir>/<driver>-reg.sock`` and ``<plugin dir>/dra.sock``. With one
(rolling updates, kubelet >= 1.33) every instance gets its own names, so an old and a new pod can
be registered side by side: ``dra-<podUID>.sock`` and the first registration name whose full path
fits the 108-byte AF_UNIX limit (including the terminating NUL) of
``<driver>-<podUID>-reg.sock``, ``<driver>-<b64url(sha256(podUID))[:8 bytes]>-reg.sock``,
``dra-<b64url(sha256(driver NUL podUID))[:16 bytes]>-reg.sock`` (same chain as the Go helper's
``RollingUpdateRegistrarSocketFile``).

The DRA service socket is shortened the same way when its full path would not fit (a long kubelet
root such as MicroK8s's ``/var/snap/microk8s/common/var/lib/kubelet``): the first that fits of
``dra-<podUID>.sock`` and ``dra-<b64url(sha256(podUID))[:8 bytes]>.sock``. The kubelet never
derives this name: it connects to the endpoint the registration's ``GetInfo`` answer names (spec
A.2, A.3), so a shorter unique name changes nothing for it.
"""

from __future__ import annotations

import base64
import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from dra_driver.errors import ConfigError

UNIX_PATH_MAX = 108  # sizeof(sun_path) on Linux, NUL included


@dataclass(frozen=True)
class SocketPaths:
    registration: Path
    dra: Path


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _fits(path: Path) -> bool:
    return len(os.fsencode(path)) < UNIX_PATH_MAX


def registration_socket_name(*, registrar_dir: Path, driver_name: str, pod_uid: str | None) -> str:
    """File name of the registration socket (see the module docstring for the chain)."""
    if not pod_uid:
        name = f"{driver_name}-reg.sock"
        if _fits(registrar_dir / name):
            return name
        raise ConfigError(
            "--kubelet-registrar-directory-path (KUBELET_REGISTRAR_DIRECTORY_PATH)",
            f"{str(registrar_dir / name)!r} exceeds the {UNIX_PATH_MAX - 1}-byte Unix socket "
            "path limit (without a pod UID the name is not shortened, as in the Go helper)",
        )
    uid_hash = hashlib.sha256(pod_uid.encode()).digest()[:8]
    both_hash = hashlib.sha256(driver_name.encode() + b"\x00" + pod_uid.encode()).digest()[:16]
    candidates = [
        f"{driver_name}-{pod_uid}-reg.sock",
        f"{driver_name}-{_b64(uid_hash)}-reg.sock",
        f"dra-{_b64(both_hash)}-reg.sock",
    ]
    for name in candidates:
        if _fits(registrar_dir / name):
            return name
    raise ConfigError(
        "--kubelet-registrar-directory-path (KUBELET_REGISTRAR_DIRECTORY_PATH)",
        f"{str(registrar_dir)!r} is too long: even {str(registrar_dir / candidates[-1])!r} "
        f"exceeds the {UNIX_PATH_MAX - 1}-byte Unix socket path limit",
    )


def dra_socket_name(*, plugin_dir: Path, pod_uid: str | None) -> str:
    """File name of the DRA service socket (see the module docstring for the chain)."""
    if not pod_uid:
        candidates = ["dra.sock"]
    else:
        uid_hash = hashlib.sha256(pod_uid.encode()).digest()[:8]
        candidates = [f"dra-{pod_uid}.sock", f"dra-{_b64(uid_hash)}.sock"]
    for name in candidates:
        if _fits(plugin_dir / name):
            return name
    raise ConfigError(
        "--kubelet-plugins-directory-path (KUBELET_PLUGINS_DIRECTORY_PATH)",
        f"{str(plugin_dir)!r} is too long: even {str(plugin_dir / candidates[-1])!r} "
        f"exceeds the {UNIX_PATH_MAX - 1}-byte Unix socket path limit",
    )


def socket_paths(
    *, registrar_dir: Path, plugin_dir: Path, driver_name: str, pod_uid: str | None
) -> SocketPaths:
    """Both sockets' paths; ConfigError when a directory is too long for any name."""
    dra = plugin_dir / dra_socket_name(plugin_dir=plugin_dir, pod_uid=pod_uid)
    name = registration_socket_name(
        registrar_dir=registrar_dir, driver_name=driver_name, pod_uid=pod_uid
    )
    return SocketPaths(registration=registrar_dir / name, dra=dra)


def remove_stale(path: Path) -> None:
    """Remove a socket file left by an earlier run; refuse to delete anything else."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ConfigError(
            "socket path", f"{str(path)!r} exists and is not a socket; not removing it"
        )
    path.unlink(missing_ok=True)
