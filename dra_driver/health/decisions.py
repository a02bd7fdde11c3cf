"""GPU health decisions: what NVML told us -> conditions per GPU -> device taints and states. Pure.

Place in the flow: gpus/healthwatch.py turns NVML events and periodic checks into observations
(gpus/observations.py: ``XidObserved``, ``EccObserved``, ``GpuChecked``); :class:`HealthBook`
keeps the conditions they imply and decides, for every published device, its taints
(publish/publisher.py puts them into the ResourceSlices) and its state for the kubelet's health
stream. health/monitor.py runs the loop; nothing here does I/O or reads a clock (every method
takes ``now_s``, a monotonic time in seconds).

Conditions (each a taint ``<driver name>/<kind>``; the table of when each comes and goes is in
docs/health.md): ``gpu-lost``, ``ecc-double-bit``, ``row-remap-failed`` (fatal),
``remapped-rows-pending``, ``retired-pages-pending``, ``xid`` (value: the XID; fatal for the
fatal XIDs), ``thermal-slowdown``. A normal XID goes after the quiet period without another.

A GPU reset is recognised when a condition only a reset clears goes away (lost, ECC count,
pending pages or rows); it clears the GPU's XID conditions too. Conditions of the whole GPU
apply to every device published for it (the GPU, or its MIG devices); an XID event that names a
GPU instance (MIG) marks only that MIG device. One ``xid`` taint per device carries the latest
fatal XID, else the latest XID. A device carries at most :data:`MAX_HEALTH_TAINTS` taints, in
the order of the table (1.34 API servers allow 4 per device; later ones 16).

Taint changes of one device are rate-limited: a taint with a new key is published at once (a
device must not stay schedulable because it flapped a minute ago), but a removal, or a change
of value or effect, waits until ``min_change_interval_s`` has passed since the device's last
change; the latest wanted state is applied then. The health stream reports the published
state, so slices and stream agree.

The values below are NamedTuples rather than frozen dataclasses: each dataclass costs the agent
about 11 KiB of memory at import, a NamedTuple 6, and the agent's RSS target has no room for the
difference (bench_publish).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Literal, NamedTuple

from dra_driver.devices import MigMode, Taint, TaintEffect, gpu_device_name, mig_device_name
from dra_driver.gpus.info import Inventory
from dra_driver.gpus.observations import (
    NO_INSTANCE,
    EccObserved,
    GpuChecked,
    Observation,
    XidObserved,
)

DEFAULT_IGNORED_XIDS = frozenset({13, 31, 43, 45, 68, 109})
"""Application errors (nvidia-compat.md "Health"; NVIDIA's driver and device plugin): the
application that caused them failed, the GPU did not."""
DEFAULT_FATAL_XIDS = frozenset({48, 79, 95})
"""Double-bit ECC error, GPU fallen off the bus, uncontained ECC error: the GPU needs a reset."""
EFFECTS: tuple[TaintEffect, ...] = ("None", "NoSchedule", "NoExecute")
MAX_HEALTH_TAINTS = 4

GPU_LOST = "gpu-lost"
ECC_DOUBLE_BIT = "ecc-double-bit"
ROW_REMAP_FAILED = "row-remap-failed"
REMAPPED_ROWS_PENDING = "remapped-rows-pending"
RETIRED_PAGES_PENDING = "retired-pages-pending"
XID = "xid"
THERMAL_SLOWDOWN = "thermal-slowdown"
KINDS = (
    GPU_LOST,
    ECC_DOUBLE_BIT,
    ROW_REMAP_FAILED,
    REMAPPED_ROWS_PENDING,
    RETIRED_PAGES_PENDING,
    XID,
    THERMAL_SLOWDOWN,
)
"""Every condition, in taint order (most severe first)."""
_RESET_CLEARS = (GPU_LOST, ECC_DOUBLE_BIT, REMAPPED_ROWS_PENDING, RETIRED_PAGES_PENDING)

Status = Literal["Healthy", "Unhealthy", "Unknown"]


class HealthPolicy(NamedTuple):
    """How observations become taints (the agent's ``--health-*`` flags)."""

    driver_name: str
    ignored_xids: frozenset[int] = DEFAULT_IGNORED_XIDS
    fatal_xids: frozenset[int] = DEFAULT_FATAL_XIDS
    taint_effect: TaintEffect = "NoSchedule"
    fatal_taint_effect: TaintEffect = "NoSchedule"
    xid_quiet_period_s: float = 300.0  # 0: a normal XID's taint stays until a GPU reset
    min_change_interval_s: float = 10.0  # 0: no rate limit
    # "dynamic": a GPU in MIG mode is watched under its own name too (gpu_targets)
    mig_mode: MigMode = "static"

    def taint_key(self, kind: str) -> str:
        return f"{self.driver_name}/{kind}"


class GpuTarget(NamedTuple):
    """One GPU the book watches: its identity and the devices published for it."""

    gpu_index: int  # NVML index
    uuid: str
    name: str  # gpu-<minor>, also when the GPU is in MIG mode (labels XID counts)
    devices: tuple[str, ...]  # the GPU itself, or its MIG devices
    migs: Mapping[tuple[int, int], str] = {}  # (GI id, CI id) -> name; never mutated


def gpu_targets(inventory: Inventory, *, mig_mode: MigMode = "static") -> tuple[GpuTarget, ...]:
    """The GPUs of ``inventory`` with the names devices.py publishes for them.

    With ``mig_mode="dynamic"`` a GPU in MIG mode also has its own name ``gpu-<minor>`` among
    its devices: ``devices.with_taints`` gives that name's taints to every placement of the
    partitionable GPU (through its counter set), created or not. (On a GPU dynamic mode leaves
    static no device consumes its counter set, and those taints go nowhere.)"""
    targets = []
    for gpu in inventory.gpus:
        migs = {
            (m.gpu_instance_id, m.compute_instance_id): mig_device_name(
                parent_minor=gpu.minor,
                profile=m.profile.name,
                profile_id=m.profile.profile_id,
                placement_start=m.placement.start,
            )
            for m in gpu.mig_instances
        }
        name = gpu_device_name(gpu.minor)
        if not gpu.mig_enabled:
            devices: tuple[str, ...] = (name,)
        elif mig_mode == "dynamic":
            devices = (name, *migs.values())
        else:
            devices = tuple(migs.values())
        targets.append(GpuTarget(gpu.index, gpu.uuid, name, devices, migs))
    return tuple(targets)


# --- what the book reports ------------------------------------------------------------------


class DeviceHealth(NamedTuple):
    """One device's published health: for the health stream, metrics and ``/readyz``.

    ``changed_s``: when ``status`` or ``taints`` last changed (the caller's clock; the monitor
    converts to Unix seconds). ``message``: why it is unhealthy (empty when healthy).
    """

    status: Status
    taints: tuple[Taint, ...]
    message: str
    changed_s: float


class ActiveCondition(NamedTuple):
    """A condition of one device as NVML reports it now (before the rate limit and the cap on
    taints; for metrics): its kind, its value (an XID's number) and whether it is fatal."""

    kind: str
    value: str
    fatal: bool


class HealthChange(NamedTuple):
    """A published change of one device (for logs and Node Events)."""

    device: str
    before: tuple[Taint, ...]
    after: tuple[Taint, ...]
    message: str  # the reasons for ``after``; what cleared for a recovery

    @property
    def healthy(self) -> bool:
        return not self.after


class _Condition(NamedTuple):
    kind: str
    scope: str | None  # a MIG device name for an instance's XID; None: the whole GPU
    value: str = ""
    fatal: bool = False
    since_s: float = 0.0
    last_seen_s: float = 0.0
    seen: int = 1  # how often
    message: str = ""


class _Published:
    __slots__ = ("changed_s", "known", "message", "taints")

    def __init__(self, *, changed_s: float = 0.0, known: bool = False) -> None:
        self.taints: tuple[Taint, ...] = ()
        self.message = ""
        self.changed_s = changed_s
        self.known = known  # the GPU was checked at least once


class HealthBook:
    """Conditions of the watched GPUs and the taints published for their devices.

    Not thread-safe: one thread (the monitor's) calls it. :meth:`settle` after each batch of
    :meth:`record` calls gives the changes to publish; :meth:`next_deadline` says when a quiet
    period or a held-back change needs another :meth:`settle`.
    """

    def __init__(self, policy: HealthPolicy, targets: Sequence[GpuTarget], *, now_s: float) -> None:
        self.policy = policy
        self._targets: dict[str, GpuTarget] = {}
        self._conditions: dict[str, dict[tuple[str, str | None], _Condition]] = {}
        self._published: dict[str, _Published] = {}
        self._xid_counts: dict[tuple[str, int], int] = {}
        self.set_targets(targets, now_s=now_s)

    # --- inputs ---------------------------------------------------------------------------------

    def set_targets(self, targets: Sequence[GpuTarget], *, now_s: float) -> None:
        """Watch ``targets`` from now on (re-discovery changed the GPUs or their MIG devices).

        Conditions of GPUs that stay are kept; devices that are new start as not yet checked
        (Unknown) unless their GPU was checked before, and get the GPU's taints at the next
        :meth:`settle`.
        """
        old = self._targets
        self._targets = {t.uuid: t for t in targets}
        self._conditions = {u: c for u, c in self._conditions.items() if u in self._targets}
        published: dict[str, _Published] = {}
        for target in targets:
            checked = old.get(target.uuid) is not None and any(
                self._published.get(d, _Published()).known for d in old[target.uuid].devices
            )
            for device in target.devices:
                published[device] = self._published.get(device) or _Published(
                    changed_s=now_s, known=checked
                )
        self._published = published

    def record(self, observation: Observation, *, now_s: float) -> None:
        """Take one observation into the GPU's conditions (unknown GPUs are ignored)."""
        target = self._targets.get(observation.gpu_uuid)
        if target is None:
            return
        conditions = self._conditions.setdefault(target.uuid, {})
        if isinstance(observation, XidObserved):
            self._record_xid(target, conditions, observation, now_s=now_s)
        elif isinstance(observation, EccObserved):
            _raise(
                conditions,
                ECC_DOUBLE_BIT,
                fatal=True,
                message="double-bit ECC error",
                now_s=now_s,
            )
        else:
            self._record_check(target, conditions, observation, now_s=now_s)

    def _record_xid(
        self,
        target: GpuTarget,
        conditions: dict[tuple[str, str | None], _Condition],
        event: XidObserved,
        *,
        now_s: float,
    ) -> None:
        key = (target.name, event.xid)
        self._xid_counts[key] = self._xid_counts.get(key, 0) + 1
        if event.xid in self.policy.ignored_xids:
            return
        scope = None
        if event.gpu_instance_id != NO_INSTANCE:
            scope = target.migs.get((event.gpu_instance_id, event.compute_instance_id))
            if scope is None:  # the event names no compute instance, or one we do not know
                scope = next(
                    (n for (gi, _), n in target.migs.items() if gi == event.gpu_instance_id),
                    None,
                )
        fatal = event.xid in self.policy.fatal_xids
        old = conditions.get((XID, scope))
        if old is None:
            conditions[(XID, scope)] = _Condition(
                XID,
                scope,
                value=str(event.xid),
                fatal=fatal,
                since_s=now_s,
                last_seen_s=now_s,
                message=f"XID {event.xid}",
            )
            return
        # The taint names the latest fatal XID, else the latest one.
        value = str(event.xid) if fatal or not old.fatal else old.value
        conditions[(XID, scope)] = old._replace(
            value=value,
            fatal=old.fatal or fatal,
            last_seen_s=now_s,
            seen=old.seen + 1,
            message=f"XID {value} ({old.seen + 1} XIDs)",
        )

    def _record_check(
        self,
        target: GpuTarget,
        conditions: dict[tuple[str, str | None], _Condition],
        check: GpuChecked,
        *,
        now_s: float,
    ) -> None:
        for device in target.devices:
            self._published[device].known = True
        if check.lost:
            _raise(
                conditions,
                GPU_LOST,
                fatal=True,
                message=f"NVML: {check.lost_reason or 'GPU is lost'}",
                now_s=now_s,
            )
            return  # nothing else can be read from a lost GPU: its other conditions stay
        levels: list[tuple[str, bool | None, bool, str]] = [
            (GPU_LOST, False, True, ""),
            (
                ECC_DOUBLE_BIT,
                None if check.ecc_uncorrected is None else check.ecc_uncorrected > 0,
                True,
                f"{check.ecc_uncorrected} uncorrected ECC errors since the last GPU reset",
            ),
            (ROW_REMAP_FAILED, check.row_remap_failed, True, "row remapping failed"),
            (
                REMAPPED_ROWS_PENDING,
                check.remapped_rows_pending,
                False,
                "remapped rows pending (needs a GPU reset)",
            ),
            (
                RETIRED_PAGES_PENDING,
                check.retired_pages_pending,
                False,
                "retired pages pending (needs a GPU reset)",
            ),
        ]
        hot = None
        if check.temperature_c is not None and check.slowdown_c is not None:
            hot = check.temperature_c >= check.slowdown_c
        levels.append(
            (
                THERMAL_SLOWDOWN,
                hot,
                False,
                f"temperature {check.temperature_c} C at or above the slowdown threshold "
                f"{check.slowdown_c} C",
            )
        )
        reset = False
        for kind, present, fatal, message in levels:
            if present is None:
                continue
            if present:
                _raise(conditions, kind, fatal=fatal, message=message, now_s=now_s, level=True)
            elif conditions.pop((kind, None), None) is not None and kind in _RESET_CLEARS:
                reset = True
        if reset:  # the GPU was reset (or came back): its XIDs are history
            for key in [k for k in conditions if k[0] == XID]:
                del conditions[key]

    # --- decisions ------------------------------------------------------------------------------

    def _expire(self, now_s: float) -> None:
        quiet_s = self.policy.xid_quiet_period_s
        if quiet_s <= 0:
            return
        for conditions in self._conditions.values():
            for key, c in list(conditions.items()):
                if c.kind == XID and not c.fatal and now_s - c.last_seen_s >= quiet_s:
                    del conditions[key]

    def _wanted(self) -> dict[str, tuple[tuple[Taint, ...], str]]:
        """Device -> (taints, message) as the conditions are now."""
        wanted: dict[str, tuple[tuple[Taint, ...], str]] = {}
        for uuid, target in self._targets.items():
            conditions = self._conditions.get(uuid, {})
            for device in target.devices:
                mine = [c for c in conditions.values() if c.scope in (None, device)]
                wanted[device] = self._taints(mine)
        return wanted

    def _taints(self, conditions: list[_Condition]) -> tuple[tuple[Taint, ...], str]:
        by_kind: dict[str, list[_Condition]] = {}
        for c in conditions:
            by_kind.setdefault(c.kind, []).append(c)
        taints: list[Taint] = []
        messages: list[str] = []
        for kind in KINDS:
            found = by_kind.get(kind)
            if not found:
                continue
            latest = max(found, key=lambda c: (c.fatal, c.last_seen_s))
            fatal = any(c.fatal for c in found)
            effect = self.policy.fatal_taint_effect if fatal else self.policy.taint_effect
            taints.append(Taint(key=self.policy.taint_key(kind), value=latest.value, effect=effect))
            messages.extend(c.message for c in sorted(found, key=lambda c: c.since_s))
        return tuple(taints[:MAX_HEALTH_TAINTS]), "; ".join(messages)

    def settle(self, *, now_s: float) -> list[HealthChange]:
        """Apply quiet periods and the rate limit; return what changed (to publish now)."""
        self._expire(now_s)
        changes = []
        interval_s = self.policy.min_change_interval_s
        for device, (taints, message) in self._wanted().items():
            published = self._published[device]
            if taints == published.taints:
                if taints and message != published.message:
                    published.message = message  # same taints, more detail for the stream
                continue
            new_key = {t.key for t in taints} - {t.key for t in published.taints}
            held = published.taints and now_s - published.changed_s < interval_s
            if held and not new_key:
                continue
            before = published.taints
            cleared = "; ".join(
                t.key + (f"={t.value}" if t.value else "") for t in before if t not in taints
            )
            published.taints, published.message, published.changed_s = taints, message, now_s
            changes.append(HealthChange(device, before, taints, message or f"cleared {cleared}"))
        return changes

    def next_deadline(self, *, now_s: float) -> float | None:
        """When :meth:`settle` may have something new without any new observation."""
        times: list[float] = []
        if self.policy.xid_quiet_period_s > 0:
            times.extend(
                c.last_seen_s + self.policy.xid_quiet_period_s
                for conditions in self._conditions.values()
                for c in conditions.values()
                if c.kind == XID and not c.fatal
            )
        wanted = self._wanted()
        times.extend(
            p.changed_s + self.policy.min_change_interval_s
            for device, p in self._published.items()
            if wanted.get(device, ((), ""))[0] != p.taints
        )
        return min(times) if times else None

    # --- outputs ----------------------------------------------------------------------------------

    def taints(self) -> dict[str, tuple[Taint, ...]]:
        """Device -> its published health taints (devices without any are left out)."""
        return {d: p.taints for d, p in self._published.items() if p.taints}

    def states(self) -> dict[str, DeviceHealth]:
        """Every watched device's published health; Unknown until its GPU was checked."""
        return {
            device: DeviceHealth(
                status=("Unhealthy" if p.taints else "Healthy") if p.known else "Unknown",
                taints=p.taints,
                message=p.message if p.taints else "",
                changed_s=p.changed_s,
            )
            for device, p in self._published.items()
        }

    def conditions(self) -> dict[str, tuple[ActiveCondition, ...]]:
        """Device -> its conditions now, one per kind in taint order (devices without any are
        left out). A kind's value and fatality are those its taint would have."""
        found: dict[str, tuple[ActiveCondition, ...]] = {}
        for uuid, target in self._targets.items():
            conditions = self._conditions.get(uuid, {})
            for device in target.devices:
                by_kind: dict[str, list[_Condition]] = {}
                for c in conditions.values():
                    if c.scope in (None, device):
                        by_kind.setdefault(c.kind, []).append(c)
                active = tuple(
                    ActiveCondition(
                        kind,
                        max(by_kind[kind], key=lambda c: (c.fatal, c.last_seen_s)).value,
                        any(c.fatal for c in by_kind[kind]),
                    )
                    for kind in KINDS
                    if kind in by_kind
                )
                if active:
                    found[device] = active
        return found

    def xid_counts(self) -> dict[tuple[str, int], int]:
        """(GPU name ``gpu-<minor>``, XID) -> XID events seen, ignored ones included."""
        return dict(self._xid_counts)

    @property
    def targets(self) -> tuple[GpuTarget, ...]:
        return tuple(self._targets.values())


def _raise(
    conditions: dict[tuple[str, str | None], _Condition],
    kind: str,
    *,
    fatal: bool,
    message: str,
    now_s: float,
    level: bool = False,
) -> None:
    """Set (or refresh) a whole-GPU condition. A level refresh keeps its first-seen time."""
    old = conditions.get((kind, None))
    if old is None:
        conditions[(kind, None)] = _Condition(
            kind, None, fatal=fatal, since_s=now_s, last_seen_s=now_s, message=message
        )
    elif level:
        conditions[(kind, None)] = old._replace(last_seen_s=now_s, message=message)
    else:
        conditions[(kind, None)] = old._replace(
            last_seen_s=now_s, seen=old.seen + 1, message=message
        )


def parse_xids(text: str) -> frozenset[int]:
    """``"13, 31,43"`` -> {13, 31, 43}; ``"none"`` -> {}. Raises ValueError naming the bad part."""
    if text.strip().lower() == "none":
        return frozenset()
    xids = set()
    for part in text.split(","):
        item = part.strip()
        if not item:
            continue
        if not item.isascii() or not item.isdigit() or not 0 < int(item) < 2**32:
            raise ValueError(
                f"{item!r} is not an XID number (use a comma-separated list of positive "
                "integers, e.g. 13,31,43, or none)"
            )
        xids.add(int(item))
    if not xids:
        raise ValueError("no XID given (use e.g. 13,31,43, or none for an empty list)")
    return frozenset(xids)


def format_xids(xids: Iterable[int]) -> str:
    """The flag form of an XID set: ``13,31,43``, or ``none``."""
    ordered = sorted(xids)
    return ",".join(str(x) for x in ordered) if ordered else "none"
