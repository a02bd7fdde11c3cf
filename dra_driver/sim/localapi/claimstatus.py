"""The ResourceClaim ``status`` subresource of the local API server: ``status.devices`` written
by a driver with server-side apply (``PATCH .../resourceclaims/<name>/status``,
``application/apply-patch+yaml``, a ``fieldManager``) or replaced with ``PUT``.

As the real API server does (KEP-4817, DRAResourceClaimDeviceStatus, on by default from 1.32 and
GA in 1.37; pkg/apis/resource/validation): each entry names ``driver``, ``pool`` and ``device`` of
a device in the claim's allocation, at most once; ``data`` is a JSON object (a raw extension,
at most 10 KiB); ``conditions`` are metav1.Conditions (type, status True/False/Unknown,
reason, lastTransitionTime), at most 8.
With the feature off the server drops ``status.devices`` silently. Server-side apply owns list
entries per field manager: an apply replaces the entries its manager owns (keyed by driver, pool
and device) and keeps the others'; an entry another manager owns is a conflict unless
``force=true``. Only the subresource changes status; spec changes sent here are ignored.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from dra_driver.sim.localapi.resources import ApiError, JsonDict

DeviceKey = tuple[str, str, str, str]  # (driver, pool, device, shareID or "")

APPLY_PATCH = "application/apply-patch+yaml"
_REASON = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
_CONDITION_STATUS = ("True", "False", "Unknown")
MAX_CONDITIONS = 8
MAX_DATA_BYTES = 10 * 1024  # resource.AllocatedDeviceStatusDataMaxLength (KEP-4817)


def _invalid(name: str, problems: list[str]) -> ApiError:
    return ApiError(
        422,
        "Invalid",
        f'ResourceClaim.resource.k8s.io "{name}" is invalid: ' + "; ".join(problems),
    )


def _key(entry: Mapping[str, Any]) -> DeviceKey:
    return (
        str(entry.get("driver", "")),
        str(entry.get("pool", "")),
        str(entry.get("device", "")),
        str(entry.get("shareID") or ""),
    )


def validate_devices(stored: Mapping[str, Any], devices: Any) -> list[JsonDict]:
    """``devices`` checked against the stored claim's allocation; 422 ApiError naming each
    problem as the real API server's field paths do."""
    name = stored["metadata"]["name"]
    if not isinstance(devices, list):
        raise _invalid(name, ["status.devices: Invalid value: must be a list"])
    results = ((stored.get("status") or {}).get("allocation") or {}).get("devices") or {}
    allocated = {_key(r) for r in results.get("results") or ()}
    problems: list[str] = []
    seen: set[DeviceKey] = set()
    for i, entry in enumerate(devices):
        path = f"status.devices[{i}]"
        if not isinstance(entry, dict):
            problems.append(f"{path}: Invalid value: must be an object")
            continue
        for field in ("driver", "pool", "device"):
            if not entry.get(field):
                problems.append(f"{path}.{field}: Required value")
        key = _key(entry)
        named = key[:3]
        if key in seen:
            problems.append(f"{path}: Duplicate value: {key}")
        seen.add(key)
        if all(named) and key not in allocated:
            share = f", shareID: {key[3]}" if key[3] else ""
            problems.append(
                f"{path}: Invalid value: {{driver: {key[0]}, pool: {key[1]}, device: {key[2]}"
                f"{share}}}: must be an allocated device in the claim"
            )
        if "data" in entry:
            data = entry["data"]
            if not isinstance(data, dict):
                problems.append(f"{path}.data: Invalid value: must be a valid JSON object")
            elif len(repr(data)) > MAX_DATA_BYTES:
                problems.append(f"{path}.data: Too long: must have at most {MAX_DATA_BYTES} bytes")
        problems += _condition_problems(f"{path}.conditions", entry.get("conditions"))
    if problems:
        raise _invalid(name, problems)
    return [dict(e) for e in devices]


def _condition_problems(path: str, conditions: Any) -> list[str]:
    if conditions is None:
        return []
    if not isinstance(conditions, list):
        return [f"{path}: Invalid value: must be a list"]
    problems: list[str] = []
    if len(conditions) > MAX_CONDITIONS:
        problems.append(f"{path}: Too many: {len(conditions)}: must have at most {MAX_CONDITIONS}")
    types: set[str] = set()
    for i, condition in enumerate(conditions):
        at = f"{path}[{i}]"
        if not isinstance(condition, dict):
            problems.append(f"{at}: Invalid value: must be an object")
            continue
        kind = condition.get("type")
        if not kind:
            problems.append(f"{at}.type: Required value")
        elif kind in types:
            problems.append(f"{at}.type: Duplicate value: {kind!r}")
        types.add(str(kind))
        if condition.get("status") not in _CONDITION_STATUS:
            problems.append(
                f"{at}.status: Unsupported value: {condition.get('status')!r}: supported values: "
                '"False", "True", "Unknown"'
            )
        if not condition.get("lastTransitionTime"):
            problems.append(f"{at}.lastTransitionTime: Required value")
        reason = condition.get("reason")
        if not reason:
            problems.append(f"{at}.reason: Required value")
        elif not _REASON.match(str(reason)):
            problems.append(f"{at}.reason: Invalid value: {reason!r}: a condition reason")
    return problems


def apply_status(
    stored: JsonDict,
    body: Mapping[str, Any],
    *,
    manager: str,
    force: bool,
    owners: dict[DeviceKey, str],
    enabled: bool,
) -> JsonDict:
    """The claim after a server-side apply of ``body`` by ``manager``; ``owners`` (the entries'
    field managers) is updated in place. Raises ApiError as the real server answers."""
    name = stored["metadata"]["name"]
    meta = body.get("metadata") or {}
    if meta.get("name") not in (None, name):
        raise ApiError(400, "BadRequest", "the name of the object does not match the URL")
    if meta.get("uid") and meta["uid"] != stored["metadata"]["uid"]:
        raise ApiError(
            409,
            "Conflict",
            f'Operation cannot be fulfilled on resourceclaims.resource.k8s.io "{name}": '
            f"Precondition failed: UID in precondition: {meta['uid']}, UID in object meta: "
            f"{stored['metadata']['uid']}",
        )
    out = dict(stored)
    status = dict(out.get("status") or {})
    if not enabled:
        return out  # the field is dropped: the claim is unchanged
    applied = validate_devices(stored, (body.get("status") or {}).get("devices") or [])
    conflicts = [k for k in map(_key, applied) if owners.get(k, manager) != manager and not force]
    if conflicts:
        raise ApiError(
            409,
            "Conflict",
            f"Apply failed with {len(conflicts)} conflict(s): conflicts with "
            f'"{owners[conflicts[0]]}": .status.devices{list(conflicts[0])}',
        )
    mine = {_key(e) for e in applied}
    kept = [
        e
        for e in status.get("devices") or ()
        if owners.get(_key(e), "") != manager and _key(e) not in mine
    ]
    for key in [k for k, m in owners.items() if m == manager and k not in mine]:
        del owners[key]
    for key in mine:
        owners[key] = manager
    devices = kept + applied
    if devices:
        status["devices"] = devices
    else:
        status.pop("devices", None)
    out["status"] = status
    return out


def replace_status(stored: JsonDict, body: Mapping[str, Any], *, enabled: bool) -> JsonDict:
    """The claim after a ``PUT`` of the status subresource: its status replaced, spec kept."""
    new_status = dict(body.get("status") or {})
    if not enabled:
        new_status.pop("devices", None)
        if (stored.get("status") or {}).get("devices"):
            new_status["devices"] = stored["status"]["devices"]
    elif "devices" in new_status:
        new_status["devices"] = validate_devices(
            {**stored, "status": new_status}, new_status["devices"]
        )
    return {**stored, "status": new_status}
