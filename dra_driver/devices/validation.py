"""Whether the API server would accept a device: the ResourceSlice device rules, checked here
so that a bad device fails at start with its name and field, not at the API server. Pure.

Place in the flow: pool.py validates every device it builds; the limits are resourceapi.py's
(spec D.1, k8s:pkg/apis/resource/validation/validation.go).
"""

from __future__ import annotations

import itertools
import re

from dra_driver.devices.model import Device, RequestPolicy, Version
from dra_driver.errors import DeviceModelError
from dra_driver.quantity import QuantityError, parse_quantity
from dra_driver.resourceapi import (
    MAX_ATTRIBUTES_AND_CAPACITIES,
    MAX_COUNTER_CONSUMPTIONS,
    MAX_COUNTERS,
    MAX_DOMAIN_LENGTH,
    MAX_IDENTIFIER_LENGTH,
    MAX_NAME_LENGTH,
    MAX_STRING_LENGTH,
    MAX_TAINTS,
    MAX_VALID_VALUES,
    MAX_VERSION_LENGTH,
)

UNSTABLE_ATTRIBUTES = frozenset({"index", "minor"})
"""NVIDIA's driver stopped publishing these in 2025: they change when GPUs are drained."""

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_C_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# semver.org's reference expression for 2.0.0.
_SEMVER = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
    r"(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?$"
)
_INT64 = (-(2**63), 2**63 - 1)


def validate_driver_name(driver_name: str) -> None:
    """Raise DeviceModelError unless ``driver_name`` is a DNS subdomain the API accepts."""
    if len(driver_name) > MAX_DOMAIN_LENGTH or not _DNS_SUBDOMAIN.match(driver_name.lower()):
        raise DeviceModelError(
            f"driver name {driver_name!r} is not a DNS subdomain of at most "
            f"{MAX_DOMAIN_LENGTH} characters"
        )


def _qualified_name_problem(name: str) -> str | None:
    """Why ``name`` is not a valid attribute/capacity name, or None if it is."""
    domain, slash, identifier = name.rpartition("/")
    if slash:
        if not domain:
            return "the domain before '/' is empty"
        if len(domain) > MAX_DOMAIN_LENGTH or not _DNS_SUBDOMAIN.match(domain.lower()):
            return f"domain {domain!r} is not a DNS subdomain of at most {MAX_DOMAIN_LENGTH} chars"
    if not _C_IDENTIFIER.match(identifier):
        return f"{identifier!r} is not a C identifier ([A-Za-z_][A-Za-z0-9_]*)"
    if len(identifier) > MAX_IDENTIFIER_LENGTH:
        return f"{identifier!r} is longer than {MAX_IDENTIFIER_LENGTH} characters"
    return None


def _attribute_problem(value: object) -> str | None:
    """Why ``value`` is not a valid attribute value, or None if it is."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        if not _INT64[0] <= value <= _INT64[1]:
            return f"int {value} does not fit in int64"
        return None
    if isinstance(value, str):
        if len(value) > MAX_STRING_LENGTH:
            return f"string is {len(value)} characters, more than {MAX_STRING_LENGTH}"
        return None
    if isinstance(value, Version):
        if len(value.value) > MAX_VERSION_LENGTH:
            return f"version is longer than {MAX_VERSION_LENGTH} characters"
        if not _SEMVER.match(value.value):
            return (
                f"version {value.value!r} is not semver 2.0.0 (MAJOR.MINOR.PATCH, no leading zeros)"
            )
        return None
    return f"{type(value).__name__} is not an attribute type (bool, int, str, Version)"


def validate_device(device: Device) -> None:
    """Raise DeviceModelError naming the device and the field if the API server would reject it.

    Checks the ResourceSlice device rules of spec D.1: DNS-label name, qualified attribute and
    capacity names, at most 32 attributes and capacities together, string and version limits,
    canonical-parsable capacity quantities, counter consumption and taint limits. Also refuses
    ``index``/``minor`` attributes (nvidia-compat.md: not stable, not published).
    """
    where = f"device {device.name!r}"
    if len(device.name) > MAX_NAME_LENGTH or not _DNS_LABEL.match(device.name):
        raise DeviceModelError(
            f"{where}: name is not a DNS label (lowercase letters, digits and '-', at most "
            f"{MAX_NAME_LENGTH} characters, starting and ending with a letter or digit)"
        )
    total = len(device.attributes) + len(device.capacity)
    if total > MAX_ATTRIBUTES_AND_CAPACITIES:
        raise DeviceModelError(
            f"{where}: {total} attributes and capacities, at most "
            f"{MAX_ATTRIBUTES_AND_CAPACITIES} allowed"
        )
    for name, value in device.attributes.items():
        problem = _qualified_name_problem(name) or _attribute_problem(value)
        if problem is None and name in UNSTABLE_ATTRIBUTES:
            problem = "index and minor are not stable across GPU drains and are not published"
        if problem is not None:
            raise DeviceModelError(f"{where}: attribute {name!r}: {problem}")
    for name, quantity in device.capacity.items():
        problem = _qualified_name_problem(name)
        if problem is None:
            try:
                parse_quantity(quantity)
            except QuantityError as exc:
                problem = str(exc)
        if problem is not None:
            raise DeviceModelError(f"{where}: capacity {name!r}: {problem}")
    _validate_counters(device, where=where)
    _validate_request_policies(device, where=where)
    if len(device.taints) > MAX_TAINTS:
        raise DeviceModelError(f"{where}: {len(device.taints)} taints, at most {MAX_TAINTS}")
    for taint in device.taints:
        if taint.effect not in ("None", "NoSchedule", "NoExecute"):
            raise DeviceModelError(f"{where}: taint {taint.key!r} has effect {taint.effect!r}")


def _validate_counters(device: Device, *, where: str) -> None:
    if len(device.consumes_counters) > MAX_COUNTER_CONSUMPTIONS:
        raise DeviceModelError(
            f"{where}: consumes counters from {len(device.consumes_counters)} counter sets, "
            f"at most {MAX_COUNTER_CONSUMPTIONS}"
        )
    sets: set[str] = set()
    for consumption in device.consumes_counters:
        label = f"{where}: counter set {consumption.counter_set!r}"
        if not _DNS_LABEL.match(consumption.counter_set) or consumption.counter_set in sets:
            raise DeviceModelError(f"{label}: not a DNS label, or listed twice")
        sets.add(consumption.counter_set)
        if len(consumption.counters) > MAX_COUNTERS:
            raise DeviceModelError(f"{label}: more than {MAX_COUNTERS} counters")
        for counter, quantity in consumption.counters.items():
            if len(counter) > MAX_NAME_LENGTH or not _DNS_LABEL.match(counter):
                raise DeviceModelError(f"{label}: counter name {counter!r} is not a DNS label")
            try:
                parse_quantity(quantity)
            except QuantityError as exc:
                raise DeviceModelError(f"{label}: counter {counter!r}: {exc}") from exc


def _validate_request_policies(device: Device, *, where: str) -> None:
    """The ``requestPolicy`` rules of spec D.1 (``validateRequestPolicy`` upstream)."""
    if device.request_policies and not device.allow_multiple_allocations:
        raise DeviceModelError(
            f"{where}: a requestPolicy is only allowed on a device with allowMultipleAllocations"
        )
    for name, policy in device.request_policies.items():
        label = f"{where}: capacity {name!r}: requestPolicy"
        if name not in device.capacity:
            raise DeviceModelError(f"{label} for a capacity the device does not have")
        problem = request_policy_problem(policy, capacity=device.capacity[name])
        if problem is not None:
            raise DeviceModelError(f"{label}: {problem}")


def request_policy_problem(policy: RequestPolicy, *, capacity: str) -> str | None:
    """Why the API server would refuse ``policy`` on a capacity of value ``capacity``, or None."""
    try:
        value = parse_quantity(capacity).value
        default = None if policy.default is None else parse_quantity(policy.default).value
        values = [parse_quantity(v).value for v in policy.valid_values]
        low = None if policy.range_min is None else parse_quantity(policy.range_min).value
        high = None if policy.range_max is None else parse_quantity(policy.range_max).value
        step = None if policy.range_step is None else parse_quantity(policy.range_step).value
    except QuantityError as exc:
        return str(exc)
    ranged = low is not None or high is not None or step is not None
    if values and ranged:
        return "validValues and validRange are mutually exclusive"
    if values:
        if len(values) > MAX_VALID_VALUES:
            return f"{len(values)} validValues, at most {MAX_VALID_VALUES}"
        if any(b <= a for a, b in itertools.pairwise(values)):
            return "validValues must be ascending, without duplicates"
        if values[-1] > value:
            return f"validValues go beyond the capacity {capacity}"
        if default is not None and default not in values:
            return "validValues must include the default"
    if ranged:
        if low is None:
            return "validRange.min is required"
        if low > value:
            return f"validRange.min is more than the capacity {capacity}"
        if default is not None and (default < low or (high is not None and default > high)):
            return "the default is outside validRange"
        if high is not None and (high > value or high < low):
            return f"validRange.max must be between min and the capacity {capacity}"
        if step is not None:
            if step <= 0 or low + step > value:
                return f"validRange.step must be positive and min + step at most {capacity}"
            for what, v in (("default", default), ("max", high)):
                if v is not None and (v - low) % step:
                    return f"validRange: the {what} is not min plus a multiple of step"
    if default is not None and (default < 0 or default > value):
        return f"the default is not between 0 and the capacity {capacity}"
    return None
