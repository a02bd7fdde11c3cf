"""Field and label selectors of list and watch requests on the local API server: which stored
objects a ``fieldSelector`` and ``labelSelector`` let through."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from dra_driver.sim.localapi.resources import ApiError

SLICE_FIELDS = ("spec.driver", "spec.nodeName", "spec.pool.name", "metadata.name")


def field_value(obj: Mapping[str, Any], path: Iterable[str]) -> Any:
    """The value at ``path`` in ``obj``; None where a step is missing or not a mapping."""
    cur: Any = obj
    for part in path:
        if not isinstance(cur, Mapping):
            return None
        cur = cur.get(part)
    return cur


def matches(resource: str, obj: Mapping[str, Any], query: Mapping[str, str]) -> bool:
    """Whether ``obj`` passes the query's selectors; 400 for a field the resource has no
    selector for (as the API server answers)."""
    for term in filter(None, (query.get("fieldSelector") or "").split(",")):
        negate = "!=" in term
        key, _, value = term.replace("!=", "=").replace("==", "=").partition("=")
        allowed = SLICE_FIELDS if resource == "resourceslices" else ("metadata.name",)
        if key not in allowed:
            raise ApiError(400, "BadRequest", f"field label not supported: {key} for {resource}")
        actual = str(field_value(obj, key.split(".")) or "")
        if (actual == value) == negate:
            return False
    labels = obj.get("metadata", {}).get("labels") or {}
    for term in filter(None, (query.get("labelSelector") or "").split(",")):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key) != value:
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True
