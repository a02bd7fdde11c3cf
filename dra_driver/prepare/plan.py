"""A claim's plan: what the kubelet names, what the API server allocated, checked and decoded,
before anything on the node changes.

Flow position: plugin/ names a claim (:class:`ClaimRef`) -> the preparer GETs it
(:class:`ClaimSource`) -> :func:`plan_claim` here (node, results of our driver, devices we have,
opaque configs decoded strictly) -> a :class:`ClaimPlan` that each step plans from (and may
refine: a share's canonical capacity, a created MIG instance) -> answers, record, CDI spec.

Also here: what a recorded claim's devices are when reconcile writes its spec again
(:func:`recorded_claim`), and why no pod can use a prepared claim any more
(:func:`stale_reason`). Pure, but for the lazy import of deviceconfig (see below).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeGuard

from dra_driver.cdi.driverfiles import DEFAULT_CAPABILITIES
from dra_driver.cdi.spec import cdi_device_id
from dra_driver.errors import ClaimNotFound, ConfigDecodeError, PrepareError
from dra_driver.prepare.limits import check_claim, shown
from dra_driver.prepare.state.checkpointrecords import ClaimRecord, PreparedDevice
from dra_driver.prepare.targets import DeviceTarget

if TYPE_CHECKING:
    from dra_driver.prepare import deviceconfig

_UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_SHARE_DEVICE = re.compile(
    r"^(?P<device>[a-z0-9]([-a-z0-9]*[a-z0-9])?)-share-"
    r"(?P<share>[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})$"
)


class ClaimSource(Protocol):
    """Where ResourceClaims come from (kube.KubeClient in production)."""

    def get_resource_claim(self, *, namespace: str, name: str) -> dict[str, Any] | None:
        """The claim as v1-shaped JSON, or None when it does not exist."""
        ...


@dataclass(frozen=True)
class ClaimRef:
    """A claim as the kubelet names it in NodePrepareResources/NodeUnprepareResources."""

    namespace: str
    name: str
    uid: str


def validate_ref(ref: ClaimRef, *, need_names: bool = True) -> None:
    """Refuse a claim reference that could not have come from the API server."""
    if not _UUID.match(ref.uid):
        raise PrepareError(f"claim UID {ref.uid!r} is not a lowercase UUID")
    if need_names:
        if not _DNS_LABEL.match(ref.namespace):
            raise PrepareError(f"claim namespace {ref.namespace!r} is not a valid namespace name")
        if len(ref.name) > 253 or not _DNS_SUBDOMAIN.match(ref.name):
            raise PrepareError(f"claim name {ref.name!r} is not a valid object name")


def share_device_name(device: str, share_id: str) -> str:
    """The name a share's CDI device carries after the claim UID: ``<device>-share-<shareID>``."""
    return f"{device}-share-{share_id}"


def parse_share_device_name(name: str) -> tuple[str, str | None]:
    """(device, share ID) from a name of :func:`share_device_name`, else (name, None)."""
    match = _SHARE_DEVICE.match(name)
    if match is None:
        return name, None
    return match["device"], match["share"]


# deviceconfig is imported where it is used (the ``noqa: PLC0415`` lines), so it is loaded with
# the first claim that carries an opaque config of ours: building its pydantic models (and
# pydantic's plugin scan of every installed distribution) costs the idle agent about 0.2 MiB,
# and most claims carry no opaque config. A device no config applies to gets the default one,
# recorded as deviceconfig.to_json(deviceconfig.default_for(type)) would give it (a test holds
# the two equal).
_DEFAULT_CONFIG_KINDS = {"gpu": "GpuConfig", "mig": "MigDeviceConfig"}


def default_config_json(device_type: str) -> dict[str, Any]:
    """The recorded form of the config a device gets when no opaque config applies."""
    return {"apiVersion": "resource.nvidia.com/v1beta1", "kind": _DEFAULT_CONFIG_KINDS[device_type]}


@dataclass(frozen=True)
class PlannedDevice:
    """One device of a claim: an allocation result of our driver, checked, with its effective
    config (``config``: None when no opaque config applies; ``config_json``: the config as the
    checkpoint records it, which is what steps read), or a recorded claim's device.

    ``share_id``: the device is held as one share of several (KEP-5075), whose
    ``consumed_capacity`` is recorded beside it; the sharing step checks the allocation result
    and sets both (canonical quantities). The core only names the share's CDI device, records
    it, and lets it conflict only with a claim holding the device whole."""

    target: DeviceTarget
    config_json: Mapping[str, Any]
    admin_access: bool = False
    request: str = ""
    pool: str = ""
    config: deviceconfig.DeviceConfig | None = None
    result: Mapping[str, Any] = field(default_factory=dict)  # the allocation result, as sent
    share_id: str | None = None
    consumed_capacity: Mapping[str, str] = field(default_factory=dict)

    @property
    def cdi_name(self) -> str:
        """The device's name in the claim's CDI spec: one CDI device per share."""
        if self.share_id is None:
            return self.target.name
        return share_device_name(self.target.name, self.share_id)

    @property
    def capabilities(self) -> frozenset[str]:
        if self.config is None:
            return DEFAULT_CAPABILITIES
        from dra_driver.prepare.deviceconfig import driver_capabilities  # noqa: PLC0415

        return driver_capabilities(self.config)


@dataclass
class ClaimPlan:
    """A claim on its way through prepare (or a recorded claim at reconcile): its devices in
    allocation order. A step may replace a device by a refined one (``dataclasses.replace``:
    a share's canonical capacity, a created MIG instance); nothing else changes it."""

    ref: ClaimRef
    devices: list[PlannedDevice]

    @property
    def where(self) -> str:
        """How an error names the claim."""
        return f"ResourceClaim {self.ref.namespace}/{self.ref.name}"


def plan_claim(
    ref: ClaimRef,
    claim: Mapping[str, Any],
    *,
    driver_name: str,
    node_name: str,
    targets: Mapping[str, DeviceTarget],
) -> ClaimPlan:
    """The claim's devices of our driver, checked against ``targets`` (one version of the
    devices for the whole claim): refused when the UID differs, it is not allocated, it is
    allocated to another node or a device we do not have, or a config does not decode or fit."""
    where = f"ResourceClaim {ref.namespace}/{ref.name}"
    uid = get(claim, "metadata", "uid")
    if uid != ref.uid:
        raise ClaimNotFound(
            f"{where} has UID {shown(uid)}, not {ref.uid!r} (it was deleted and re-created)"
        )
    allocation = get(claim, "status", "allocation")
    if not _is_mapping(allocation):
        raise PrepareError(f"{where} is not allocated")
    check_claim(where, allocation, driver_name=driver_name)
    _check_node(where, allocation, node_name)
    results = _list(get(allocation, "devices", "results"), f"{where}: allocation results")
    configs = _decode_configs(where, allocation, driver_name)
    planned = []
    for result in results:
        if not _is_mapping(result) or result.get("driver") != driver_name:
            continue
        request = str(result.get("request", ""))
        pool = str(result.get("pool", ""))
        device = str(result.get("device", ""))
        target = targets.get(device)
        if pool != node_name or target is None:
            raise PrepareError(
                f"{where} is allocated device {pool}/{device}, which this node does not have"
                + (_not_created(device) if pool == node_name else "")
            )
        config = _effective(configs, request)
        if config is None:  # the default config fits every device and asks for nothing
            config_json = default_config_json(target.type)
        else:
            from dra_driver.prepare.deviceconfig import (  # noqa: PLC0415
                check_fits,
                check_supported,
                to_json,
            )

            try:
                check_fits(config, device_type=target.type, device_name=device)
                check_supported(config, device_name=device, request=request)
            except ConfigDecodeError as exc:
                raise type(exc)(f"{where}: {exc}") from exc
            config_json = to_json(config)
        planned.append(
            PlannedDevice(
                request=request,
                target=target,
                pool=pool,
                admin_access=bool(result.get("adminAccess", False)),
                config=config,
                config_json=config_json,
                result=result,
            )
        )
    if not planned:
        raise PrepareError(f"{where} has no device of driver {driver_name}")
    return ClaimPlan(ref, planned)


def recorded_claim(record: ClaimRecord, targets: Mapping[str, DeviceTarget]) -> ClaimPlan:
    """A prepared claim as its record says, with the devices this node still has (a device gone
    since it was prepared has no nodes to give: the plugin reports those)."""
    return ClaimPlan(
        ClaimRef(namespace=record.namespace, name=record.name, uid=record.uid),
        [
            PlannedDevice(
                target=targets[d.device],
                config_json=d.config,
                admin_access=d.admin_access,
                pool=d.pool,
                share_id=d.share_id,
                consumed_capacity=d.consumed_capacity,
            )
            for d in record.devices
            if d.device in targets
        ],
    )


def answer(device: PlannedDevice, *, claim_uid: str, cdi_vendor: str) -> PreparedDevice:
    """What the kubelet is told (and the checkpoint records) of one planned device."""
    return PreparedDevice(
        request_names=(device.request.split("/", 1)[0],),
        pool=device.pool,
        device=device.target.name,
        cdi_device_ids=(
            cdi_device_id(vendor=cdi_vendor, claim_uid=claim_uid, device_name=device.cdi_name),
        ),
        share_id=device.share_id,
        admin_access=device.admin_access,
        config=device.config_json,
        consumed_capacity=device.consumed_capacity,
    )


def recorded_capabilities(record: ClaimRecord) -> frozenset[str]:
    """The driver capabilities a prepared claim's spec was written with, from the effective
    configs recorded per device (a claim rebuilt from its spec has none: the default)."""
    capabilities: set[str] = set()
    for device in record.devices:
        config = DEFAULT_CAPABILITIES
        if device.config and "driverCapabilities" in device.config:
            from dra_driver.prepare.deviceconfig import decode, driver_capabilities  # noqa: PLC0415

            with contextlib.suppress(ConfigDecodeError):  # an older agent's: its default
                config = driver_capabilities(decode(device.config))
        capabilities |= config
    return frozenset(capabilities) or DEFAULT_CAPABILITIES


def stale_reason(
    record: ClaimRecord, claim: Mapping[str, Any] | None, *, driver_name: str, node_name: str
) -> str | None:
    """Why no pod on this node can use the prepared claim any more, by the API server's
    ``claim`` (None: it does not exist); None while one may.

    Stale: the claim was deleted or re-created under another UID, it is no longer allocated
    (or allocated none of the recorded devices of this node), or it is reserved for no
    consumer (its pods are gone: the kubelet prepares a claim again before a new pod uses
    it)."""
    if claim is None:
        return "deleted"
    if get(claim, "metadata", "uid") != record.uid:
        return "deleted and re-created with another UID"
    results = get(claim, "status", "allocation", "devices", "results")
    if not isinstance(results, list):
        return "no longer allocated"
    allocated = {
        str(r.get("device"))
        for r in results
        if isinstance(r, Mapping) and r.get("driver") == driver_name and r.get("pool") == node_name
    }
    if not allocated & {d.device for d in record.devices}:
        return "allocated other devices"
    if not get(claim, "status", "reservedFor"):
        return "reserved for no pod"
    return None


def reserved_pods(claim: Mapping[str, Any]) -> tuple[str, ...]:
    """The names of the pods a claim is reserved for (``status.reservedFor`` entries of
    resource ``pods`` in the core group), in the claim's order."""
    pods = []
    for consumer in get(claim, "status", "reservedFor") or ():
        if (
            _is_mapping(consumer)
            and consumer.get("resource") == "pods"
            and not consumer.get("apiGroup")
        ):
            pods.append(str(consumer.get("name", "")))
    return tuple(pods)


def owner(record: ClaimRecord) -> str:
    """How an error names a claim that holds a device."""
    return f"{record.namespace}/{record.name} ({record.uid})" if record.namespace else record.uid


def _check_node(where: str, allocation: Mapping[str, Any], node_name: str) -> None:
    selector = allocation.get("nodeSelector")
    if not _is_mapping(selector):
        return
    names: list[str] = []
    for term in _items(selector.get("nodeSelectorTerms")):
        for match in _items(term.get("matchFields")):
            if match.get("key") == "metadata.name" and match.get("operator") == "In":
                values = match.get("values")
                if isinstance(values, list):
                    names.extend(v for v in values if isinstance(v, str))
    if names and node_name not in names:
        raise PrepareError(
            f"{where} is allocated on node {', '.join(sorted(set(names)))}, "
            f"not on this node ({node_name})"
        )


def _decode_configs(
    where: str, allocation: Mapping[str, Any], driver_name: str
) -> list[tuple[frozenset[str], deviceconfig.DeviceConfig]]:
    entries = _list(get(allocation, "devices", "config") or [], f"{where}: configs")
    ours = [
        e
        for e in entries
        if _is_mapping(e)
        and _is_mapping(e.get("opaque"))
        and e["opaque"].get("driver") == driver_name
    ]
    # class configs apply before claim configs, whatever order they arrive in
    ordered = [e for e in ours if e.get("source") == "FromClass"] + [
        e for e in ours if e.get("source") != "FromClass"
    ]
    if not ordered:
        return []
    from dra_driver.prepare.deviceconfig import decode  # noqa: PLC0415

    decoded = []
    for index, entry in enumerate(ordered):
        try:
            config = decode(entry["opaque"].get("parameters"))
        except ConfigDecodeError as exc:
            raise ConfigDecodeError(
                f"{where}: config {index} ({entry.get('source', 'FromClaim')}): {exc}"
            ) from exc
        decoded.append((frozenset(str(r) for r in entry.get("requests") or ()), config))
    return decoded


def _effective(
    configs: Sequence[tuple[frozenset[str], deviceconfig.DeviceConfig]], request: str
) -> deviceconfig.DeviceConfig | None:
    """The last config that applies to ``request`` (``<req>`` also covers ``<req>/<sub>``)."""
    main = request.split("/", 1)[0]
    chosen = None
    for requests, config in configs:
        if not requests or request in requests or main in requests:
            chosen = config
    return chosen


def _not_created(device: str) -> str:
    """Why a device named like ours can be missing under dynamic MIG: a placement of a GPU
    that stays static (it has MIG devices this driver did not create), or the whole GPU of a
    GPU in MIG mode that is not offered whole (static MIG mode, a GPU left static, or one
    that cannot leave MIG mode without a reset)."""
    if "-mig-" in device:
        return (
            ": no such MIG device exists (under --mig-mode dynamic, a GPU with MIG devices "
            "this driver did not create offers only those, as static MIG devices, until they "
            "are removed)"
        )
    return (
        " as a whole GPU (a GPU in MIG mode is prepared whole only under --mig-mode dynamic, "
        "when it has no MIG devices this driver did not create and leaves MIG mode without a "
        "reset: Hopper and newer)"
    )


def get(obj: Any, *path: str) -> Any:
    """``obj[path[0]][path[1]]...``, None where a level is missing or not a mapping."""
    for key in path:
        if not _is_mapping(obj):
            return None
        obj = obj.get(key)
    return obj


def _is_mapping(value: Any) -> TypeGuard[Mapping[str, Any]]:
    """isinstance(value, Mapping), a claim's decoded JSON (a dict) told at once: the ABC check
    costs a call of its own, and a prepare made 19 of them."""
    return type(value) is dict or isinstance(value, Mapping)


def _items(value: Any) -> list[Mapping[str, Any]]:
    """The objects of a list in a claim (anything else in their place is not ours to read)."""
    return [v for v in value if _is_mapping(v)] if isinstance(value, list) else []


def _list(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise PrepareError(f"{what} is not a list")
    return value
