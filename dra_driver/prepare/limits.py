"""How much one request and one claim may carry, checked before any work that grows with it.

Place in the flow: the preparer's batches check :func:`batch_refusal` before any claim is
read; :func:`plan.plan_claim <dra_driver.prepare.plan.plan_claim>` checks
:func:`check_claim` on a claim's allocation before its opaque configs are decoded. Each limit
is far above what the API server lets a claim carry (its own limits in brackets), so only a
claim that could not have come from a conforming API server, or a kubelet request no pod could
make, meets one; the error names the limit and docs/plugin.md "Limits" lists them. Every check
here is one pass over what it measures, so a claim's cost grows at most linearly with its size
and stops at the first limit it passes. Pure.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from dra_driver.errors import LimitExceeded, PrepareError

# claims in one NodePrepareResources/NodeUnprepareResources (the kubelet sends one pod's claims)
MAX_CLAIMS_PER_REQUEST = 256
# allocation results of one claim, all drivers (API: 32 per claim)
MAX_RESULTS_PER_CLAIM = 128
# config entries of one allocation, class and claim ones (API: 64)
MAX_CONFIGS_PER_CLAIM = 256
# request names one config entry applies to (API: 32)
MAX_REQUESTS_PER_CONFIG = 256
# one opaque config of our driver, as compact JSON (API: 10 KiB)
MAX_OPAQUE_CONFIG_BYTES = 64 * 1024
# nesting of one opaque config of our driver (ours are at most 4 levels deep)
MAX_OPAQUE_CONFIG_DEPTH = 32

# How much of a value from a claim an error message quotes.
_SHOWN_CHARS = 80

LIMITS_DOC = "docs/plugin.md#limits"


def shown(value: object) -> str:
    """``repr(value)``, cut to a length an error message can carry."""
    text = repr(value)
    if len(text) <= _SHOWN_CHARS:
        return text
    return f"{text[: _SHOWN_CHARS - 15]}... ({len(text)} chars)"


def batch_refusal(claims: int) -> LimitExceeded | None:
    """Why a request naming ``claims`` distinct claims is refused (every claim gets the error,
    the kubelet retries), or None."""
    if claims <= MAX_CLAIMS_PER_REQUEST:
        return None
    return LimitExceeded(
        f"the request names {claims} claims, more than the {MAX_CLAIMS_PER_REQUEST} one request "
        f"may carry ({LIMITS_DOC}); none of them was handled"
    )


def check_claim(where: str, allocation: Mapping[str, Any], *, driver_name: str) -> None:
    """Refuse an allocation past a limit; its lists' types are checked on the way (a
    ``PrepareError`` for a list that is not one), so the code after may iterate them."""
    devices = allocation.get("devices")
    if devices is None:
        devices = {}
    if not isinstance(devices, Mapping):
        raise PrepareError(f"{where}: allocation devices is not an object")
    results = _listed(devices.get("results"), f"{where}: allocation results")
    _at_most(len(results), MAX_RESULTS_PER_CLAIM, f"{where} has {len(results)} allocation results")
    configs = _listed(devices.get("config") or [], f"{where}: configs")
    _at_most(len(configs), MAX_CONFIGS_PER_CLAIM, f"{where} has {len(configs)} config entries")
    for index, entry in enumerate(configs):
        if not isinstance(entry, Mapping):
            continue  # not a config entry of anyone's: plan skips it
        what = f"{where}: config {index}"
        requests = _listed(entry.get("requests") or [], f"{what}: requests")
        _at_most(len(requests), MAX_REQUESTS_PER_CONFIG, f"{what} names {len(requests)} requests")
        opaque = entry.get("opaque")
        if isinstance(opaque, Mapping) and opaque.get("driver") == driver_name:
            check_opaque(what, opaque.get("parameters"))


def check_opaque(what: str, parameters: Any) -> None:
    """Refuse opaque parameters over :data:`MAX_OPAQUE_CONFIG_BYTES` as compact JSON or nested
    deeper than :data:`MAX_OPAQUE_CONFIG_DEPTH`. Size first, which bounds the depth walk."""
    try:
        size = len(json.dumps(parameters, separators=(",", ":")).encode())
    except RecursionError:  # only a depth far past the limit gets here
        size, deep = 0, True
    except (TypeError, ValueError):  # not JSON values: the decoder says what is wrong
        return
    else:
        deep = False
    _at_most(size, MAX_OPAQUE_CONFIG_BYTES, f"{what}: its opaque parameters are {size} bytes")
    if deep or _depth_over(parameters, MAX_OPAQUE_CONFIG_DEPTH):
        raise LimitExceeded(
            f"{what}: its opaque parameters are nested more than {MAX_OPAQUE_CONFIG_DEPTH} "
            f"levels deep, the most a config may be ({LIMITS_DOC})"
        )


def _depth_over(value: Any, limit: int) -> bool:
    """Whether objects and lists nest more than ``limit`` levels in ``value`` (a walk with its
    own stack: recursion would meet Python's limit first)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, Mapping):
            children: Sequence[Any] = list(item.values())
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def _listed(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise PrepareError(f"{what} is not a list")
    return value


def _at_most(count: int, limit: int, what: str) -> None:
    if count > limit:
        raise LimitExceeded(f"{what}, more than the {limit} allowed ({LIMITS_DOC})")
