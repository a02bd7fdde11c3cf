"""Where ``explain``'s ResourceSlices come from, beside a file of them: simulated GPUs run through
the driver's real publishing pipeline (``simulated_slices``), or the live cluster
(``read_cluster``: slices, DeviceClasses, the ResourceClaims in use and DeviceTaintRules).

The I/O edge of the scheduling package (the cluster, through ``dra_driver.kube``); the simulated
GPUs themselves are discovered by a callable the CLI passes in (``SimulatedDiscovery``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from dra_driver.devices.classes import DEFAULT_DRIVER_NAME
from dra_driver.errors import ExplainError, KubeForbidden

if TYPE_CHECKING:
    from dra_driver.devices import MigMode
    from dra_driver.gpus.info import Inventory

JSON = dict[str, Any]


class SimulatedDiscovery(Protocol):
    """Discovery of simulated GPUs (``sim.nvml.discover_simulated``), which the CLI passes in:
    ``scheduling`` sits below ``sim`` and does not import it."""

    def __call__(self, spec: str, *, node_name: str) -> Inventory: ...


def simulated_slices(
    spec: str,
    *,
    discover: SimulatedDiscovery,
    node_name: str,
    driver_name: str = DEFAULT_DRIVER_NAME,
    consumable_shares: str = "disabled",
    mig_mode: MigMode = "static",
) -> list[JSON]:
    """The ResourceSlices our driver would publish for simulated GPUs ``spec`` on ``node_name``
    with ``--mig-mode mig_mode`` (the simulated MIG devices count as the driver's own),
    shareable as ``consumable_shares`` (a ``--consumable-shares`` value) says.

    Runs the real pipeline: simulated NVML -> nvml.discover (both behind ``discover``) ->
    devices -> shares -> slices.
    """
    from dra_driver.devices import (  # noqa: PLC0415 - only this path needs them
        mig_instance_name,
        node_devices,
    )
    from dra_driver.publish.slices import build_slices, to_api_objects  # noqa: PLC0415
    from dra_driver.sharing.shares import parse_mode, shareable  # noqa: PLC0415

    try:
        mode = parse_mode(consumable_shares)
    except ValueError as exc:
        raise ExplainError(f"--consumable-shares {consumable_shares!r}: {exc}") from None
    inventory = discover(spec, node_name=node_name)
    devices = shareable(
        node_devices(
            inventory,
            driver_name=driver_name,
            mig_mode=mig_mode,
            managed_mig=frozenset(
                mig_instance_name(g, m) for g in inventory.gpus for m in g.mig_instances
            ),
        ),
        mode,
    )
    pool = build_slices(devices, driver_name=driver_name, node_name=node_name)
    objs = to_api_objects(pool, node_uid="simulated")
    for i, obj in enumerate(objs):
        meta = obj["metadata"]
        meta["name"] = f"{meta.get('generateName', 'slice-')}{i:05d}"
    return objs


@dataclass(frozen=True)
class ClusterState:
    """What ``--kubeconfig`` reads: what the scheduler sees, as plain v1-shape JSON."""

    slices: list[JSON]
    classes: list[JSON]
    claims: list[JSON]  # every ResourceClaim, allocated or not
    taint_rules: list[JSON]
    notes: tuple[str, ...]


def read_cluster(kubeconfig: Path | None) -> ClusterState:
    """Slices, DeviceClasses, ResourceClaims (all namespaces) and DeviceTaintRules from the
    cluster, through ``dra_driver.kube.clusterreads.ClusterClient``, with the user's credentials.

    DeviceTaintRules that the cluster does not serve, or that these credentials may not list,
    are skipped with a note; ResourceClaims that may not be listed are an ExplainError: without
    them every device would look free.
    """
    from dra_driver.kube.clusterreads import ClusterClient  # noqa: PLC0415 - the only API path

    client = ClusterClient.from_config(kubeconfig=kubeconfig)
    try:
        slices = client.list_all_slices()
        classes = client.list_device_classes()
        try:
            claims = client.list_resource_claims()
        except KubeForbidden as exc:
            raise ExplainError(
                "these credentials may not list resourceclaims.resource.k8s.io in all "
                "namespaces (403); explain needs them to know which devices are in use. "
                "Without that permission, use --slices and --allocated with files exported by "
                "someone who has it"
            ) from exc
        try:
            rules = client.list_device_taint_rules()
        except KubeForbidden:
            rules = None
            rules_note = (
                "DeviceTaintRules: these credentials may not list "
                "devicetaintrules.resource.k8s.io; only the slices' own taints were applied"
            )
        else:
            rules_note = (
                "DeviceTaintRules: not served by this cluster; only the slices' own taints apply"
                if rules is None
                else f"{_count(len(rules), 'DeviceTaintRule')} applied"
            )
    finally:
        client.close()
    allocated = sum(1 for c in claims if (c.get("status") or {}).get("allocation") is not None)
    notes = (
        f"read from the cluster: {_count(len(slices), 'ResourceSlice')}, "
        f"{_count(len(classes), 'DeviceClass', 'DeviceClasses')}, "
        f"{_count(len(claims), 'ResourceClaim')} ({allocated} allocated)",
        rules_note,
    )
    return ClusterState(slices, classes, claims, list(rules or ()), notes)


def _count(n: int, singular: str, plural: str = "") -> str:
    return f"{n} {singular if n == 1 else plural or singular + 's'}"
