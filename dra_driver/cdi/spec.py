"""What a claim's CDI spec says: its devices' nodes and names, encoded to the bytes on disk. Pure.

Place in the flow: prepare decides which devices a claim gets and gives them here as
:class:`ClaimDevice` values (nodes from :func:`gpu_nodes` / :func:`mig_nodes`, plus what its
steps add: MPS env and mounts); :class:`ClaimSpecEncoder` turns them, with the edits every claim
shares (driverfiles.py), into one transient spec per claim, kind ``<vendor>/claim``, device names
``<claimUID>-<device name>`` (nvidia-compat.md "Names", spec F). specdir.py writes those bytes.
The container runtime (containerd, CRI-O, podman) reads the spec when the kubelet passes our CDI
IDs (:func:`cdi_device_id`) at CreateContainer.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dra_driver.cdi.driverfiles import (
    DEFAULT_CAPABILITIES,
    DeviceNode,
    DriverFiles,
    device_node_json,
)
from dra_driver.errors import CdiError

CDI_CLASS = "claim"
# Read-write bind mounts a device of a claim gives its container (an MPS daemon's directories).
RW_MOUNT_OPTIONS = ("rw", "nosuid", "nodev", "rbind")
# A claim UID as the API server writes it; it becomes part of a file name (specdir.py).
CLAIM_UID_PATTERN = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
CLAIM_UID = re.compile(rf"^{CLAIM_UID_PATTERN}$")


@dataclass(frozen=True)
class ClaimDevice:
    """One device of a claim as the container sees it."""

    name: str  # the DRA device name, e.g. gpu-0
    nodes: tuple[DeviceNode, ...]
    env: tuple[str, ...] = ()
    # (host path, container path) of read-write bind mounts (an MPS daemon's pipe and shm)
    mounts: tuple[tuple[str, str], ...] = ()


def gpu_nodes(files: DriverFiles, *, minor: int) -> tuple[DeviceNode, ...]:
    """Device nodes of a full GPU."""
    return (files.node(f"/dev/nvidia{minor}"),)


def mig_nodes(
    files: DriverFiles, *, parent_minor: int, gpu_instance_id: int, compute_instance_id: int
) -> tuple[DeviceNode, ...]:
    """Device nodes of a MIG device: the parent GPU plus its GI and CI capability nodes."""
    gi = files.mig_cap_minor(f"gpu{parent_minor}/gi{gpu_instance_id}/access")
    ci = files.mig_cap_minor(
        f"gpu{parent_minor}/gi{gpu_instance_id}/ci{compute_instance_id}/access"
    )
    return (
        files.node(f"/dev/nvidia{parent_minor}"),
        files.node(f"/dev/nvidia-caps/nvidia-cap{gi}"),
        files.node(f"/dev/nvidia-caps/nvidia-cap{ci}"),
    )


def cdi_device_name(*, claim_uid: str, device_name: str) -> str:
    return f"{claim_uid}-{device_name}"


def cdi_device_id(*, vendor: str, claim_uid: str, device_name: str) -> str:
    """Fully qualified CDI name given to the runtime: ``<vendor>/claim=<uid>-<device>``."""
    return f"{vendor}/{CDI_CLASS}={cdi_device_name(claim_uid=claim_uid, device_name=device_name)}"


class ClaimSpecEncoder:
    """Claim specs for one vendor and driver install.

    Deterministic: the same input gives the same bytes. The edits every claim shares (control
    device nodes, driver mounts: most of a spec's bytes) are built and JSON-encoded once;
    :meth:`encode` splices them in, giving exactly the compact JSON of :meth:`spec` in its own
    key order. A prepare waits for these bytes before its spec's fsync can start, so the bytes
    of a set of devices are also kept as a template cut where the claim UID goes: the spec of a
    claim whose devices were seen before is one join (the UID's first character is part of the
    key, since it decides the cdiVersion). A template holds only its devices' bytes; the shared
    edits are appended from the one copy (kept in every template, they were most of the
    agent's memory growth under load).
    """

    max_templates = 256

    def __init__(self, *, vendor: str, files: DriverFiles) -> None:
        self.kind = f"{vendor}/{CDI_CLASS}"
        self._files = files
        # capabilities -> (the shared edits, their JSON, the spec's closing bytes with them)
        self._common: dict[frozenset[str], tuple[dict[str, Any], str, bytes]] = {}
        self._templates: dict[
            tuple[tuple[ClaimDevice, ...], bool, frozenset[str]], list[bytes]
        ] = {}
        self._templates_lock = threading.Lock()

    def _common_edits(self, capabilities: frozenset[str]) -> tuple[dict[str, Any], str, bytes]:
        common = self._common.get(capabilities)
        if common is None:
            edits = self._files.edits(capabilities)
            edits_json = json.dumps(edits, separators=(",", ":"))
            common = (edits, edits_json, f',"containerEdits":{edits_json}}}\n'.encode())
            self._common[capabilities] = common  # a few sets at most: no eviction
        return common

    def spec(
        self,
        claim_uid: str,
        devices: Sequence[ClaimDevice],
        capabilities: frozenset[str] = DEFAULT_CAPABILITIES,
    ) -> dict[str, Any]:
        """The spec as a mapping (its ``containerEdits`` is shared: do not change it)."""
        if not devices:
            raise CdiError(f"claim {claim_uid}: a CDI spec needs at least one device")
        spec_devices = []
        for dev in devices:
            edits: dict[str, Any] = {}
            if dev.env:
                edits["env"] = list(dev.env)
            edits["deviceNodes"] = [device_node_json(n) for n in dev.nodes]
            if dev.mounts:
                edits["mounts"] = [
                    {"hostPath": host, "containerPath": path, "options": list(RW_MOUNT_OPTIONS)}
                    for host, path in dev.mounts
                ]
            spec_devices.append(
                {
                    "name": cdi_device_name(claim_uid=claim_uid, device_name=dev.name),
                    "containerEdits": edits,
                }
            )
        spec: dict[str, Any] = {
            "cdiVersion": "",
            "kind": self.kind,
            "devices": spec_devices,
            "containerEdits": self._common_edits(capabilities)[0],
        }
        spec["cdiVersion"] = minimum_version(spec)
        return spec

    def encode(
        self,
        claim_uid: str,
        devices: Sequence[ClaimDevice],
        capabilities: frozenset[str] = DEFAULT_CAPABILITIES,
    ) -> bytes:
        """The spec's bytes on disk: compact JSON of :meth:`spec`, newline-terminated."""
        if not CLAIM_UID.match(claim_uid):  # JSON might escape it: no template
            return self._encode(claim_uid, devices, capabilities)
        key = (tuple(devices), claim_uid[0].isdigit(), capabilities)
        parts = self._templates.get(key)
        if parts is None:
            # A UID of the same first-character class whose JSON form ("\u0000") no path,
            # name or UUID contains: the encoding cut at it is the template. Only the devices'
            # part is kept per template; the shared edits (most of the bytes) are kept once.
            marker = "0\x00" if key[1] else "a\x00"
            parts = self._head(marker, devices, capabilities).split(
                json.dumps(marker)[1:-1].encode()
            )
            with self._templates_lock:
                if len(self._templates) >= self.max_templates:
                    del self._templates[next(iter(self._templates))]  # the oldest
                self._templates[key] = parts
        return claim_uid.encode().join(parts) + self._common_edits(capabilities)[2]

    def _encode(
        self, claim_uid: str, devices: Sequence[ClaimDevice], capabilities: frozenset[str]
    ) -> bytes:
        return self._head(claim_uid, devices, capabilities) + self._common_edits(capabilities)[2]

    def _head(
        self, claim_uid: str, devices: Sequence[ClaimDevice], capabilities: frozenset[str]
    ) -> bytes:
        """The spec's bytes up to its shared ``containerEdits`` (no closing brace)."""
        spec = self.spec(claim_uid, devices, capabilities)
        head = json.dumps(
            {"cdiVersion": spec["cdiVersion"], "kind": spec["kind"], "devices": spec["devices"]},
            separators=(",", ":"),
        )
        return head[:-1].encode()


def minimum_version(spec: Mapping[str, Any]) -> str:
    """The lowest cdiVersion that allows every field ``spec`` uses (spec F.1).

    Older runtimes only know older versions (podman 4.3 accepts <= 0.5.0), so a spec must not
    claim a newer version than it needs.
    """
    if "annotations" in spec or "." in str(spec.get("kind", "")).split("/")[-1]:
        return "0.6.0"
    version = "0.3.0"
    edit_sets = [spec.get("containerEdits") or {}]
    for dev in spec.get("devices", ()):
        if "annotations" in dev:
            return "0.6.0"
        if str(dev.get("name", "")).startswith(tuple("0123456789")):
            version = "0.5.0"
        edit_sets.append(dev.get("containerEdits") or {})
    for edits in edit_sets:
        if "additionalGids" in edits or "intelRdt" in edits:
            return "0.7.0"
        if any("hostPath" in n for n in edits.get("deviceNodes", ())):
            version = "0.5.0"
        if version < "0.4.0" and any("type" in m for m in edits.get("mounts", ())):
            version = "0.4.0"
    return version


def device_names_in_spec(content: bytes, *, claim_uid: str) -> list[str]:
    """DRA device names a spec of ours was written for (used to rebuild lost state)."""
    try:
        spec = json.loads(content)
        names = [str(d["name"]) for d in spec["devices"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise CdiError(f"CDI spec of claim {claim_uid} is not readable: {exc}") from exc
    prefix = f"{claim_uid}-"
    return sorted(n.removeprefix(prefix) for n in names if n.startswith(prefix))
