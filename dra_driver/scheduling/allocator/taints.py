"""Device taints as the scheduler sees them: the taints DeviceTaintRules add to the devices they
select (its DeviceTaintRule tracker patches devices the same way), and the taint that keeps a
request off a device (``NoSchedule``/``NoExecute`` not tolerated). Pure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from dra_driver.errors import CelCompileError, CelRuntimeError
from dra_driver.scheduling import cel
from dra_driver.scheduling.allocator.model import (
    DeviceClass,
    DeviceTaintRule,
    ExactRequest,
    Slice,
    SliceDevice,
    Taint,
)


def apply_taint_rules(
    slices: Sequence[Slice],
    rules: Sequence[DeviceTaintRule],
    *,
    classes: Mapping[str, DeviceClass],
) -> list[Slice]:
    """``slices`` with the taints of ``rules`` added to the devices the rules select: the
    devices as the scheduler sees them (its DeviceTaintRule tracker patches them the same way).
    A rule's class or CEL selectors (v1alpha3 before 1.35) that fail on a device, with false or
    a runtime error, do not select it; an unknown class selects nothing."""
    if not rules:
        return list(slices)
    out = []
    for s in slices:
        devices = []
        for d in s.devices:
            extra = tuple(r.taint for r in rules if _rule_selects(r, s, d, classes))
            devices.append(replace(d, taints=d.taints + extra) if extra else d)
        changed = any(a is not b for a, b in zip(devices, s.devices, strict=True))
        out.append(replace(s, devices=tuple(devices)) if changed else s)
    return out


def _rule_selects(
    rule: DeviceTaintRule, s: Slice, d: SliceDevice, classes: Mapping[str, DeviceClass]
) -> bool:
    if not rule.selected:
        return False
    for wanted, have in ((rule.driver, s.driver), (rule.pool, s.pool), (rule.device, d.name)):
        if wanted is not None and wanted != have:
            return False
    exprs = rule.selectors
    if rule.device_class is not None:
        cls = classes.get(rule.device_class)
        if cls is None:
            return False
        exprs = cls.selectors + exprs
    for expr in exprs:
        try:
            if not cel.compile_selector(expr).matches(d.cel_device):
                return False
        except (CelRuntimeError, CelCompileError):  # a stored rule the API server accepted
            return False
    return True


def taint_blocks(device: SliceDevice, req: ExactRequest) -> Taint | None:
    for taint in device.taints:
        if taint.effect in ("NoSchedule", "NoExecute") and not any(
            t.tolerates(taint) for t in req.tolerations
        ):
            return taint
    return None
