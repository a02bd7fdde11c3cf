"""Socket naming of plugin/sockets.py, including the rolling-update fallback chain (spec A.3)."""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path

import pytest

from dra_driver.errors import ConfigError
from dra_driver.plugin.sockets import dra_socket_name, registration_socket_name, socket_paths

UID = "ad4af911-5bcd-47c5-a554-f35cea869472"


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def test_without_pod_uid_the_classic_names_are_used() -> None:
    paths = socket_paths(
        registrar_dir=Path("/var/lib/kubelet/plugins_registry"),
        plugin_dir=Path("/var/lib/kubelet/plugins/gpu.nvidia.com"),
        driver_name="gpu.nvidia.com",
        pod_uid=None,
    )
    assert str(paths.registration) == "/var/lib/kubelet/plugins_registry/gpu.nvidia.com-reg.sock"
    assert str(paths.dra) == "/var/lib/kubelet/plugins/gpu.nvidia.com/dra.sock"


def test_rolling_update_prefers_the_full_pod_uid() -> None:
    name = registration_socket_name(
        registrar_dir=Path("/var/lib/kubelet/plugins_registry"),
        driver_name="gpu.nvidia.com",
        pod_uid=UID,
    )
    assert name == f"gpu.nvidia.com-{UID}-reg.sock"


def test_rolling_update_falls_back_to_a_hashed_uid_then_to_the_shortest_form() -> None:
    driver = "a" * 22 + ".example.org"  # 34 characters, as in the Go helper's tests
    at_limit = Path("/" + "r" * 50)
    hashed = registration_socket_name(registrar_dir=at_limit, driver_name=driver, pod_uid=UID)
    assert hashed == f"{driver}-{b64(hashlib.sha256(UID.encode()).digest()[:8])}-reg.sock"
    assert len(str(at_limit / hashed)) == 107
    longer = Path("/" + "r" * 52)
    shortest = registration_socket_name(registrar_dir=longer, driver_name=driver, pod_uid=UID)
    digest = hashlib.sha256(driver.encode() + b"\x00" + UID.encode()).digest()[:16]
    assert shortest == f"dra-{b64(digest)}-reg.sock"
    assert len(str(longer / shortest)) == 89


def test_a_registrar_directory_too_long_for_any_name_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="Unix socket path limit"):
        registration_socket_name(
            registrar_dir=Path("/" + "r" * 72), driver_name="gpu.nvidia.com", pod_uid=UID
        )


def test_distinct_pods_get_distinct_names() -> None:
    a = registration_socket_name(registrar_dir=Path("/r"), driver_name="d.example", pod_uid=UID)
    b = registration_socket_name(
        registrar_dir=Path("/r"),
        driver_name="d.example",
        pod_uid="ffffffff-ffff-ffff-ffff-ffffffffffff",
    )
    assert a != b


MICROK8S_KUBELET_ROOT = Path("/var/snap/microk8s/common/var/lib/kubelet")  # docs/install.md


def test_on_a_microk8s_kubelet_root_the_dra_socket_name_is_shortened_like_registration() -> None:
    paths = socket_paths(
        registrar_dir=MICROK8S_KUBELET_ROOT / "plugins_registry",
        plugin_dir=MICROK8S_KUBELET_ROOT / "plugins/gpu.nvidia.com",
        driver_name="gpu.nvidia.com",
        pod_uid=UID,
    )
    full = MICROK8S_KUBELET_ROOT / f"plugins/gpu.nvidia.com/dra-{UID}.sock"
    assert len(str(full)) == 110  # what the agent refused to start with
    assert paths.dra.name == f"dra-{b64(hashlib.sha256(UID.encode()).digest()[:8])}.sock"
    assert paths.dra.parent == MICROK8S_KUBELET_ROOT / "plugins/gpu.nvidia.com"
    assert len(str(paths.dra)) < 108
    assert paths.registration.name.startswith("gpu.nvidia.com-")
    assert len(str(paths.registration)) < 108


def test_the_full_pod_uid_names_the_dra_socket_where_it_fits() -> None:
    name = dra_socket_name(plugin_dir=Path("/var/lib/kubelet/plugins/gpu.nvidia.com"), pod_uid=UID)
    assert name == f"dra-{UID}.sock"
    assert dra_socket_name(plugin_dir=Path("/p"), pod_uid=None) == "dra.sock"


def test_distinct_pods_get_distinct_shortened_dra_sockets() -> None:
    long_dir = MICROK8S_KUBELET_ROOT / "plugins/gpu.nvidia.com"
    other = "ffffffff-ffff-ffff-ffff-ffffffffffff"
    a = dra_socket_name(plugin_dir=long_dir, pod_uid=UID)
    b = dra_socket_name(plugin_dir=long_dir, pod_uid=other)
    assert a != b and a != f"dra-{UID}.sock"


def test_a_plugin_directory_too_long_for_any_dra_socket_name_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"PLUGINS_DIRECTORY_PATH.*Unix socket path limit"):
        dra_socket_name(plugin_dir=Path("/" + "p" * 90), pod_uid=UID)


def test_without_a_pod_uid_a_registration_path_too_long_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"REGISTRAR_DIRECTORY_PATH.*Unix socket path limit"):
        registration_socket_name(
            registrar_dir=Path("/" + "r" * 90), driver_name="gpu.nvidia.com", pod_uid=None
        )
