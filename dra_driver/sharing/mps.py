"""MPS sharing (``sharing: {strategy: MPS}``): what one MPS control daemon is, in data. Pure.

Flow position: prepare/ decides which devices of a claim share one daemon and asks here for
everything that can be computed without touching the node: the daemon's names and directories,
the limits its mpsConfig asks for (validated against the devices), the commands that set them,
the Deployment that runs it, and the CDI edits that make a container its client.
mpsdaemon.py carries it out (nvidia-smi, directories, the tmpfs, the Deployment, the control
pipe).

A daemon is keyed by an **owner** (a DNS label: the claim UID today) and serves a set of devices
(``MpsDaemon.devices``: GPU or MIG UUIDs, the daemon's ``CUDA_VISIBLE_DEVICES``), so one daemon
per GPU shared by several claims can reuse the same key shape later. Everything a daemon owns on
the node lives under ``<plugin dir>/mps/<owner>/`` (a host path the agent sees at the same
path):

- ``gpus``: the full GPUs whose compute mode the daemon's start set to EXCLUSIVE_PROCESS (written,
  durably, before it is set: whoever removes the daemon sets them back to DEFAULT, even when
  its claim's record is gone);
- ``pipe/``: the control daemon's pipe directory (``CUDA_MPS_PIPE_DIRECTORY``), bind-mounted
  into every client at ``/tmp/nvidia-mps``;
- ``log/``: its log directory (``CUDA_MPS_LOG_DIRECTORY``);
- ``shm/``: a tmpfs the daemon and its clients share as ``/dev/shm``.

The Deployment (one replica, pinned to the node by ``nodeName``, labelled with the owner) runs the
driver root's ``nvidia-cuda-mps-control -f`` in the agent's image with the host's driver root
mounted at ``/driver-root``, the pipe and log directories at ``/mps/pipe`` and ``/mps/log`` and
the shm tmpfs at ``/dev/shm``: a process outside the agent's container, so it outlives an agent
restart or upgrade. With ``multiUser: true`` it runs ``nvidia-cuda-mps-control -f -M``
(multi-user mode, Volta or newer: ``multi_user``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Final

from dra_driver.quantity import QuantityError, parse_quantity

# Where a client container sees the daemon's pipe directory and the shared /dev/shm (the paths
# NVIDIA's driver gives its clients).
CLIENT_PIPE_DIR: Final = "/tmp/nvidia-mps"  # inside the client container
CLIENT_SHM_DIR: Final = "/dev/shm"
PIPE_ENV: Final = "CUDA_MPS_PIPE_DIRECTORY"
LOG_ENV: Final = "CUDA_MPS_LOG_DIRECTORY"
# Where the daemon's pod sees the driver root and the daemon's directories.
POD_DRIVER_ROOT: Final = "/driver-root"
POD_PIPE_DIR: Final = "/mps/pipe"
POD_LOG_DIR: Final = "/mps/log"
POD_SHM_DIR: Final = "/dev/shm"
CONTROL: Final = "nvidia-cuda-mps-control"
CONTROL_SOCKET: Final = "control"  # the daemon's socket in its pipe directory
EXCLUSIVE_PROCESS: Final = "EXCLUSIVE_PROCESS"
DEFAULT_COMPUTE_MODE: Final = "DEFAULT"
SHM_SIZE: Final = "1g"  # upper bound of the shared tmpfs (pages are used on demand)
# Mount options of the client's bind mounts (read-write: clients create files in both).
CLIENT_MOUNT_OPTIONS: Final = ("rbind", "rw", "nosuid", "nodev")
APP_LABEL: Final = "app.kubernetes.io/name"
APP: Final = "gpu-dra-mps"
COMPONENT_LABEL: Final = "app.kubernetes.io/component"
COMPONENT: Final = "mps-control-daemon"
# Deployment names: mps-<owner>; owner label values are at most 63 characters.
_OWNER: Final = re.compile(r"^[a-z0-9]([-a-z0-9]{0,57}[a-z0-9])?$")
_MIB: Final = 1024 * 1024
# Multi-user mode of the control daemon: clients of every Linux user connect to one server (they
# appear as root's clients) instead of the daemon running one server per user. The flag and the
# Volta minimum are those of NVIDIA's driver (kubernetes-sigs/dra-driver-nvidia-gpu PR 1153,
# ``multiUser``), which starts the daemon with ``-M``; Pascal's daemon takes the flag but its
# clients' cuInit fails (CUDA_ERROR_NOT_PERMITTED), so it is refused below compute capability 7.0.
MULTI_USER_FLAG: Final = "-M"
MULTI_USER_MIN_CAPABILITY: Final = (7, 0)


class MpsConfigError(ValueError):
    """An mpsConfig that cannot be carried out for the claim's devices (message names why)."""


class MpsNotSupported(MpsConfigError):
    """A valid mpsConfig the claim's devices cannot carry out (multi-user mode below Volta)."""


@dataclass(frozen=True)
class MpsDevice:
    """A device a daemon serves: its UUID (GPU-... or MIG-...), memory, the full GPU whose
    compute mode it sets (None for a MIG device: compute mode is a property of the whole GPU,
    which other MIG devices share) and its CUDA compute capability (a MIG device's is its GPU's;
    None: not known, which ``multi_user`` refuses)."""

    uuid: str
    memory_bytes: int
    exclusive_gpu: str | None
    compute_capability: tuple[int, int] | None = None


@dataclass(frozen=True)
class Limits:
    """What the daemon is told before its first client: the default active thread percentage
    (None: the driver's, 100) and per-device pinned memory limits in MiB, by device UUID."""

    active_thread_percentage: int | None = None
    pinned_mib: tuple[tuple[str, int], ...] = ()

    def commands(self) -> list[str]:
        """The ``nvidia-cuda-mps-control`` commands that set these limits, in order."""
        out = []
        if self.active_thread_percentage is not None:
            out.append(f"set_default_active_thread_percentage {self.active_thread_percentage}")
        out.extend(f"set_default_device_pinned_mem_limit {u} {mib}M" for u, mib in self.pinned_mib)
        return out


@dataclass(frozen=True)
class MpsDaemon:
    """One control daemon: its owner, the devices it serves (in ``CUDA_VISIBLE_DEVICES``
    order), the directory of the node it keeps its files under (``<plugin dir>/mps``) and
    whether it runs in multi-user mode (``-M``)."""

    owner: str
    devices: tuple[MpsDevice, ...]
    base: Path
    multi_user: bool = False

    def __post_init__(self) -> None:
        if not _OWNER.match(self.owner):
            raise ValueError(f"MPS daemon owner {self.owner!r} is not a DNS label of <= 59 chars")
        if not self.devices:
            raise ValueError(f"MPS daemon {self.owner} serves no device")

    @property
    def root(self) -> Path:
        return daemon_root(self.base, self.owner)

    @property
    def pipe_dir(self) -> Path:
        return self.root / "pipe"

    @property
    def log_dir(self) -> Path:
        return self.root / "log"

    @property
    def shm_dir(self) -> Path:
        return self.root / "shm"

    @property
    def gpus_file(self) -> Path:
        return gpus_file(self.base, self.owner)

    @property
    def exclusive_gpus(self) -> tuple[str, ...]:
        """The full GPUs whose compute mode is set to EXCLUSIVE_PROCESS while it runs."""
        return tuple(dict.fromkeys(d.exclusive_gpu for d in self.devices if d.exclusive_gpu))

    @property
    def visible_devices(self) -> str:
        return ",".join(d.uuid for d in self.devices)

    @property
    def deployment_name(self) -> str:
        return deployment_name(self.owner)


def daemon_root(base: Path, owner: str) -> Path:
    return base / owner


def gpus_file(base: Path, owner: str) -> Path:
    return daemon_root(base, owner) / "gpus"


def deployment_name(owner: str) -> str:
    return f"mps-{owner}"


def owner_label(driver_name: str) -> str:
    """The label naming a Deployment's owner (``gpu.nvidia.com/mps-owner``)."""
    return f"{driver_name}/mps-owner"


def node_label(driver_name: str) -> str:
    return f"{driver_name}/mps-node"


def selector(driver_name: str, node_name: str) -> str:
    """The label selector of the daemons of this node."""
    return f"{APP_LABEL}={APP},{node_label(driver_name)}={node_name}"


def strategy(config: Mapping[str, Any] | None) -> str | None:
    """The sharing strategy (``TimeSlicing``, ``MPS``) a recorded effective config asks for
    (None: exclusive)."""
    sharing = (config or {}).get("sharing")
    if sharing is None:  # most configs: told without the Mapping check's call
        return None
    return str(sharing.get("strategy")) if isinstance(sharing, Mapping) else None


def recorded_config(config: Mapping[str, Any]) -> dict[str, Any] | None:
    """The mpsConfig a recorded effective config (checkpoint JSON) asks for: None when it does not
    ask for MPS, ``{}`` when it asks without limits."""
    sharing = config.get("sharing")
    if sharing is None or not isinstance(sharing, Mapping):  # None: most configs, told at once
        return None
    if sharing.get("strategy") != "MPS":
        return None
    mps = sharing.get("mpsConfig")
    return dict(mps) if isinstance(mps, Mapping) else {}


def _mib(text: Any, what: str) -> int:
    try:
        value = parse_quantity(str(text)).value
    except QuantityError as exc:
        raise MpsConfigError(f"{what}: {exc}") from exc
    mib = int(value // _MIB)
    if mib < 1:
        raise MpsConfigError(f"{what}: {text} is below the smallest MPS limit, 1Mi")
    return mib


def multi_user(config: Mapping[str, Any], devices: Sequence[MpsDevice]) -> bool:
    """Whether an mpsConfig (recorded form) asks for a multi-user daemon (``multiUser: true``);
    refused (MpsNotSupported naming the device) when a device is below Volta (compute capability
    7.0) or its compute capability is not known."""
    if config.get("multiUser") is not True:
        return False
    for device in devices:
        capability = device.compute_capability
        if capability is None or capability < MULTI_USER_MIN_CAPABILITY:
            shown = "unknown" if capability is None else f"{capability[0]}.{capability[1]}"
            raise MpsNotSupported(
                f"mpsConfig.multiUser: device {device.uuid} has CUDA compute capability {shown}; "
                "the MPS control daemon's multi-user mode (-M) needs Volta or newer (7.0): "
                "below that the daemon takes -M but its clients other than root cannot "
                "initialize CUDA"
            )
    return True


def limits(config: Mapping[str, Any], devices: Sequence[MpsDevice]) -> Limits:
    """The limits an mpsConfig (recorded form) asks of a daemon serving ``devices``.

    ``defaultPinnedDeviceMemoryLimit`` applies to every device;
    ``defaultPerDevicePinnedMemoryLimit`` overrides it for the devices its keys name: a device
    UUID of the claim, or an index into the claim's devices (``0`` is the first, the order of
    ``CUDA_VISIBLE_DEVICES``). Refused: a percentage outside 1..100 (0, which NVIDIA's driver
    accepts, is refused by deviceconfig.check_supported, which says why), a limit above the
    device's memory or below 1Mi, a key that names no device of the claim (MpsConfigError
    naming it).
    """
    percentage = config.get("defaultActiveThreadPercentage")
    if percentage is not None and not (
        isinstance(percentage, int) and not isinstance(percentage, bool) and 1 <= percentage <= 100
    ):
        raise MpsConfigError(
            f"mpsConfig.defaultActiveThreadPercentage: {percentage!r} is outside 1..100"
        )
    pinned: dict[str, int] = {}
    default = config.get("defaultPinnedDeviceMemoryLimit")
    if default is not None:
        mib = _mib(default, "mpsConfig.defaultPinnedDeviceMemoryLimit")
        pinned = {d.uuid: mib for d in devices}
    by_uuid = {d.uuid: d for d in devices}
    per_device = config.get("defaultPerDevicePinnedMemoryLimit") or {}
    for key, value in sorted(per_device.items()):
        what = f"mpsConfig.defaultPerDevicePinnedMemoryLimit[{key}]"
        if key in by_uuid:
            uuid = key
        elif str(key).isdigit() and int(key) < len(devices):
            uuid = devices[int(key)].uuid
        else:
            raise MpsConfigError(
                f"{what}: names no device of the claim (use a device UUID, "
                f"{', '.join(by_uuid)}, or an index 0..{len(devices) - 1})"
            )
        pinned[uuid] = _mib(value, what)
    for uuid, mib in pinned.items():
        memory_mib = by_uuid[uuid].memory_bytes // _MIB
        if mib > memory_mib:
            raise MpsConfigError(
                f"mpsConfig: the pinned memory limit {mib}Mi of device {uuid} is above its "
                f"memory ({memory_mib}Mi)"
            )
    order = {d.uuid: i for i, d in enumerate(devices)}
    return Limits(
        active_thread_percentage=percentage,
        pinned_mib=tuple(sorted(pinned.items(), key=lambda item: order[item[0]])),
    )


def client_env(daemon: MpsDaemon) -> tuple[str, ...]:
    """The environment that makes a container the daemon's client."""
    del daemon  # the same for every daemon: the pipe directory is mounted at a fixed path
    return (f"{PIPE_ENV}={CLIENT_PIPE_DIR}",)


def client_mounts(daemon: MpsDaemon) -> tuple[tuple[str, str], ...]:
    """(host path, container path) of the client's bind mounts: the pipe directory and the
    shared /dev/shm."""
    return ((str(daemon.pipe_dir), CLIENT_PIPE_DIR), (str(daemon.shm_dir), CLIENT_SHM_DIR))


def deployment(
    daemon: MpsDaemon,
    *,
    namespace: str,
    node_name: str,
    driver_name: str,
    image: str,
    host_driver_root: Path,
    control: PurePosixPath,
    image_pull_secrets: tuple[str, ...] = (),
    image_pull_policy: str | None = None,
) -> dict[str, Any]:
    """The Deployment that runs ``daemon``: ``control`` is the driver root's
    nvidia-cuda-mps-control, relative to the driver root (``usr/bin/nvidia-cuda-mps-control``);
    the image is pulled with ``image_pull_secrets`` (Secret names) and ``image_pull_policy``
    (None: the cluster's default)."""
    labels = {
        APP_LABEL: APP,
        COMPONENT_LABEL: COMPONENT,
        owner_label(driver_name): daemon.owner,
        node_label(driver_name): node_name,
    }
    match = {APP_LABEL: APP, owner_label(driver_name): daemon.owner}
    binary = PurePosixPath(POD_DRIVER_ROOT) / control
    volumes = [
        ("driver-root", str(host_driver_root), POD_DRIVER_ROOT, True),
        ("mps-pipe", str(daemon.pipe_dir), POD_PIPE_DIR, False),
        ("mps-log", str(daemon.log_dir), POD_LOG_DIR, False),
        ("mps-shm", str(daemon.shm_dir), POD_SHM_DIR, False),
    ]
    env = {
        "CUDA_VISIBLE_DEVICES": daemon.visible_devices,
        PIPE_ENV: POD_PIPE_DIR,
        LOG_ENV: POD_LOG_DIR,
        # nvidia-cuda-mps-control starts nvidia-cuda-mps-server from its own directory
        "PATH": f"{binary.parent}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    }
    container: dict[str, Any] = {
        "name": COMPONENT,
        "image": image,
        "command": [str(binary), "-f", *([MULTI_USER_FLAG] if daemon.multi_user else [])],
        "env": [{"name": k, "value": v} for k, v in env.items()],
        "securityContext": {"privileged": True},
        "volumeMounts": [
            {"name": name, "mountPath": path, "readOnly": ro} for name, _, path, ro in volumes
        ],
    }
    if image_pull_policy is not None:
        container["imagePullPolicy"] = image_pull_policy
    pod: dict[str, Any] = {
        "nodeName": node_name,
        "hostPID": True,
        "restartPolicy": "Always",
        "tolerations": [{"operator": "Exists"}],
        "containers": [container],
        "volumes": [
            {"name": name, "hostPath": {"path": host, "type": "Directory"}}
            for name, host, _, _ in volumes
        ],
    }
    if image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": n} for n in image_pull_secrets]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": daemon.deployment_name, "namespace": namespace, "labels": labels},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": match},
            "strategy": {"type": "Recreate"},
            "template": {"metadata": {"labels": labels}, "spec": pod},
        },
    }


def deployment_owner(obj: Mapping[str, Any], driver_name: str) -> str | None:
    """The owner a Deployment of ours is labelled with (None: not one of ours)."""
    labels = (obj.get("metadata") or {}).get("labels") or {}
    if labels.get(APP_LABEL) != APP:
        return None
    owner = labels.get(owner_label(driver_name))
    return str(owner) if owner and _OWNER.match(str(owner)) else None


def is_owner_name(name: str) -> bool:
    """Whether a directory name under the MPS base can be an owner's (anything else there is
    not ours to remove)."""
    return _OWNER.match(name) is not None


def _serves(obj: Mapping[str, Any]) -> tuple[Any, ...]:
    """What decides whether a Deployment runs a given daemon: its node, its devices, its
    directories and whether it is multi-user (not its image: a daemon started by an older agent
    is adopted after an upgrade)."""
    pod = ((obj.get("spec") or {}).get("template") or {}).get("spec") or {}
    containers = pod.get("containers") or [{}]
    env = {e.get("name"): e.get("value") for e in containers[0].get("env") or ()}
    volumes = sorted(
        (str(v.get("name")), str((v.get("hostPath") or {}).get("path")))
        for v in pod.get("volumes") or ()
    )
    multi = MULTI_USER_FLAG in (containers[0].get("command") or ())
    return (pod.get("nodeName"), env.get("CUDA_VISIBLE_DEVICES"), tuple(volumes), multi)


def adoptable(existing: Mapping[str, Any], wanted: Mapping[str, Any]) -> bool:
    """Whether an existing Deployment runs the daemon ``wanted`` describes."""
    return _serves(existing) == _serves(wanted)
