"""The GPU health monitor: NVML health -> device taints, the kubelet's health stream, Node Events.

Place in the flow: beside publishing. gpus/healthwatch.py (NVML events and checks) ->
health/decisions.HealthBook (conditions, taints, rate limit) -> ``Publisher.set_taints`` (the taints
go into the ResourceSlices; no write when nothing changed), the listeners (the health stream
sends at once) and a Node Event per change (``DeviceUnhealthy`` Warning, ``DeviceHealthy``
Normal), plus a log line.

One thread ("gpu-health") does all NVML work and decides; it waits for NVML events at most
:data:`MAX_WAIT_S` at a time (or until the next check, quiet-period end or held-back change),
and checks every GPU every ``check_interval_s`` and any GPU right after an event about it. A
second small thread ("gpu-health-events") posts the Node Events, so an unreachable API server
never holds up NVML, and watches for a hung NVML call. The API server being down does not lose
a change either: the publisher keeps retrying until the taints are stored.

An NVML call that does not return is bounded: it cannot be interrupted, but after ``stall_s``
(beyond the wait's own timeout) every device reads Unknown in :meth:`HealthMonitor.states`
(the listeners hear of it, so the health stream says so at once), :meth:`readiness_problems`
says so (``/readyz``), and it is logged; the rest of the agent goes on. ``heartbeat`` only
reports the thread dying (``/healthz``).

For metrics: :meth:`HealthMonitor.states` (device -> status, taints, reason, last change in
Unix seconds) and :meth:`HealthMonitor.xid_counts` ((``gpu-<minor>``, XID) -> events seen).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from typing import Protocol

from dra_driver.devices import Taint
from dra_driver.errors import DraError, HealthWatchError, PublishError
from dra_driver.gpus.healthwatch import NvmlHealthWatch
from dra_driver.gpus.info import GpuInfo, Inventory
from dra_driver.health.decisions import (
    ActiveCondition,
    DeviceHealth,
    GpuTarget,
    HealthBook,
    HealthChange,
    HealthPolicy,
    Status,
    gpu_targets,
)
from dra_driver.heartbeat import Heartbeat
from dra_driver.kube import EventType

log = logging.getLogger(__name__)

MAX_WAIT_S = 1.0
"""Longest single NVML event wait: how long stop() and a new inventory may wait for the loop."""
NVML_STALL_S = 10.0
"""An NVML call still running this long (past its own timeout) counts as hung."""
_RETRY_S = (1.0, 30.0)  # backoff when NVML cannot be opened: first, most
_EVENT_QUEUE = 64


class TaintSink(Protocol):
    """Where the taints go (publisher.Publisher)."""

    def set_taints(self, taints: Mapping[str, tuple[Taint, ...]]) -> None: ...


class NodeEvents(Protocol):
    """Records an Event on our Node (agent.py's reporter, through kube.KubeClient)."""

    def __call__(self, reason: str, message: str, *, event_type: EventType) -> None: ...


class HealthMonitor:
    """Watches the GPUs of one node; ``start()`` once, ``set_inventory()`` on change, ``stop()``.

    ``taints`` receives every published taint change; ``events`` records Node Events;
    ``subscribe`` adds listeners called (from the monitor's thread, quickly) whenever a
    device's state changed. Thread-safe.
    """

    def __init__(
        self,
        *,
        policy: HealthPolicy,
        inventory: Inventory,
        taints: TaintSink,
        events: NodeEvents | None = None,
        check_interval_s: float = 10.0,
        stall_s: float = NVML_STALL_S,
    ) -> None:
        self.policy = policy
        self._taints = taints
        self._events = events
        self._check_interval_s = check_interval_s
        self._stall_s = stall_s
        self._watch = NvmlHealthWatch()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._gpus = inventory.gpus
        self._targets = gpu_targets(inventory, mig_mode=policy.mig_mode)
        self._book = HealthBook(policy, self._targets, now_s=time.monotonic())
        self._pending: Inventory | None = None
        self._pushed: dict[str, tuple[Taint, ...]] = {}
        self._notified: dict[str, tuple[Status, tuple[Taint, ...]]] = {}
        self._listeners: list[Callable[[], None]] = []
        self._call: tuple[float, float] | None = None  # (started, its own timeout) of a call
        self._stall_seen = False  # the running call's stall was reported
        self._problem: str | None = None
        self._event_queue: queue.Queue[tuple[str, str, EventType] | None] = queue.Queue(
            _EVENT_QUEUE
        )
        self._threads: list[threading.Thread] = []
        self.heartbeat = Heartbeat("gpu-health", stall_s=float("inf"))

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start the monitor thread (it opens NVML and checks every GPU at once)."""
        if self._threads:
            raise RuntimeError("HealthMonitor.start() called twice")
        self._threads = [
            threading.Thread(target=self._run, name="gpu-health", daemon=True),
            threading.Thread(target=self._side_loop, name="gpu-health-events", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop both threads; taints stay published. A thread stuck in NVML is left behind
        (it is a daemon). Idempotent."""
        self._stop.set()
        self._wake.set()
        with suppress(queue.Full):
            self._event_queue.put_nowait(None)
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def set_inventory(self, inventory: Inventory) -> None:
        """Watch the GPUs of ``inventory`` from now on (applied by the monitor's thread within
        :data:`MAX_WAIT_S`). Conditions of GPUs that stay are kept."""
        with self._lock:
            self._pending = inventory
        self._wake.set()

    def subscribe(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` after every change of a device's state (it must not block)."""
        with self._lock:
            self._listeners.append(listener)

    # --- what others read --------------------------------------------------------------------

    def states(self) -> dict[str, DeviceHealth]:
        """Device name -> its health as published; ``changed_s`` in Unix seconds.

        While NVML hangs every device is Unknown (its taints stay as they were)."""
        mono, wall = time.monotonic(), time.time()
        with self._lock:
            states = self._book.states()
            stall = self._stall(mono)
        if stall is not None:
            started, unknown_since = stall
            message = f"NVML has not answered for {mono - started:.0f} s"
            changed_s = wall - (mono - unknown_since)
            return {
                d: s._replace(status="Unknown", message=message, changed_s=changed_s)
                for d, s in states.items()
            }
        return {d: s._replace(changed_s=wall - (mono - s.changed_s)) for d, s in states.items()}

    def conditions(self) -> dict[str, tuple[ActiveCondition, ...]]:
        """Device name -> the health conditions NVML reports for it now (for alerts)."""
        with self._lock:
            return self._book.conditions()

    def xid_counts(self) -> dict[tuple[str, int], int]:
        """(GPU name ``gpu-<minor>``, XID) -> XID events seen since start, ignored ones too."""
        with self._lock:
            return self._book.xid_counts()

    def readiness_problems(self) -> list[str]:
        """Empty while NVML answers the health checks (for ``/readyz``)."""
        now = time.monotonic()
        with self._lock:
            stall = self._stall(now)
            problem = self._problem
        problems = []
        if stall is not None:
            problems.append(
                f"GPU health: an NVML call has not returned for {now - stall[0]:.0f} s "
                f"(limit {self._stall_s:.0f} s); device health is reported Unknown"
            )
        if problem is not None:
            problems.append(f"GPU health: {problem}")
        return problems

    def _stall(self, now: float) -> tuple[float, float] | None:
        """(started, counted as hung since) of a hung NVML call; None if none (lock held)."""
        if self._call is None:
            return None
        started, timeout_s = self._call
        hung_at = started + timeout_s + self._stall_s
        return (started, hung_at) if now > hung_at else None

    # --- the loop ----------------------------------------------------------------------------

    @contextmanager
    def _nvml(self, timeout_s: float = 0.0) -> Iterator[None]:
        """Around every NVML call: the stall clock for ``/readyz`` and Unknown states."""
        with self._lock:
            self._call = (time.monotonic(), timeout_s)
            self._stall_seen = False
        try:
            yield
        finally:
            now = time.monotonic()
            with self._lock:
                stall = self._stall(now)
                self._call = None
            if stall is not None:
                log.warning(
                    "NVML answered again after %.0f s; GPU health is known again",
                    now - stall[0],
                    extra={"call_s": round(now - stall[0], 1)},
                )
                self._notify()

    def _run(self) -> None:
        with self.heartbeat.running():
            attempt = 0
            while not self._stop.is_set():
                try:
                    with self._nvml():
                        self._watch.open()
                except HealthWatchError as exc:
                    attempt += 1
                    wait_s = min(_RETRY_S[1], _RETRY_S[0] * 2 ** (attempt - 1))
                    with self._lock:
                        self._problem = str(exc)
                    log.error(
                        "GPU health checks cannot use NVML, retrying in %.0f s: %s", wait_s, exc
                    )
                    self._stop.wait(wait_s)
                    continue
                with self._lock:
                    self._problem = None
                try:
                    self._loop()
                    attempt = 0
                except HealthWatchError as exc:
                    attempt += 1
                    with self._lock:
                        self._problem = str(exc)
                    log.error("GPU health checks lost NVML, opening it again: %s", exc)
                    self._stop.wait(min(_RETRY_S[1], _RETRY_S[0] * 2 ** (attempt - 1)))
                finally:
                    with self._nvml():
                        self._watch.close()

    def _loop(self) -> None:
        next_check = time.monotonic()
        urgent: set[str] = set()
        self._register(self._gpus)
        while not self._stop.is_set():
            self._apply_inventory()
            now = time.monotonic()
            if now >= next_check:
                urgent = {g.uuid for g in self._gpus}
                next_check = now + self._check_interval_s
            self._check(urgent)
            urgent = set()
            self._settle()
            with self._lock:
                deadline = self._book.next_deadline(now_s=time.monotonic())
            wait_until = min(next_check, deadline or next_check, time.monotonic() + MAX_WAIT_S)
            timeout_s = max(0.0, wait_until - time.monotonic())
            if not self._watch.has_events:
                self._wake.wait(timeout_s)
                self._wake.clear()
                continue
            with self._nvml(timeout_s):
                result = self._watch.wait(timeout_s)
            if result.observations:
                now = time.monotonic()
                with self._lock:
                    for observation in result.observations:
                        self._book.record(observation, now_s=now)
                self._settle()  # publish the event before the checks it asks for
            urgent = {g.uuid for g in self._gpus} if result.check_all else result.check

    def _apply_inventory(self) -> None:
        with self._lock:
            inventory, self._pending = self._pending, None
        if inventory is None:
            return
        known = {g.uuid for g in inventory.gpus}
        for gpu in self._gpus:
            if gpu.uuid not in known:
                self._watch.forget(gpu.uuid)
        targets = gpu_targets(inventory, mig_mode=self.policy.mig_mode)
        with self._lock:
            self._gpus, self._targets = inventory.gpus, targets
            self._book.set_targets(targets, now_s=time.monotonic())
        self._register(inventory.gpus)

    def _register(self, gpus: tuple[GpuInfo, ...]) -> None:
        names = _names(self._targets)
        for gpu in gpus:
            if not self._watch.is_registered(gpu.uuid):
                with self._nvml():
                    self._watch.register(gpu, name=names.get(gpu.uuid, gpu.uuid))

    def _check(self, uuids: set[str]) -> None:
        if not uuids:
            return
        names = _names(self._targets)
        for gpu in self._gpus:
            if gpu.uuid not in uuids or self._stop.is_set():
                continue
            with self._nvml():
                checked = self._watch.check(gpu)
            if checked.lost:
                self._watch.forget(gpu.uuid)
            elif not self._watch.is_registered(gpu.uuid):
                with self._nvml():
                    self._watch.register(gpu, name=names.get(gpu.uuid, gpu.uuid))
            with self._lock:
                self._book.record(checked, now_s=time.monotonic())

    def _settle(self) -> None:
        with self._lock:
            changes = self._book.settle(now_s=time.monotonic())
            taints = self._book.taints()
        if taints != self._pushed:
            try:
                self._taints.set_taints(taints)
            except PublishError as exc:  # a bug in the taints; the next change tries again
                log.error("the health taints cannot be published: %s", exc)
            else:
                self._pushed = taints
        self._report(changes)
        self._notify_if_changed()

    def _notify_if_changed(self) -> None:
        with self._lock:
            now = {d: (s.status, s.taints) for d, s in self._book.states().items()}
        if now != self._notified:
            self._notified = now
            self._notify()

    def _notify(self) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            listener()

    # --- reporting ---------------------------------------------------------------------------

    def _report(self, changes: list[HealthChange]) -> None:
        """Log every change; one Node Event per group of devices that changed alike."""
        groups: dict[tuple[tuple[Taint, ...], str], list[str]] = {}
        for change in changes:
            groups.setdefault((change.after, change.message), []).append(change.device)
            if change.healthy:
                log.info(
                    "device healthy again; health taints removed",
                    extra={"device": change.device, "reason": change.message},
                )
            else:
                log.warning(
                    "device unhealthy; tainted",
                    extra={
                        "device": change.device,
                        "taints": [_taint_text(t) for t in change.after],
                        "reason": change.message,
                    },
                )
        for (after, message), devices in groups.items():
            names = ", ".join(devices)
            if after:
                text = f"{names}: tainted {', '.join(_taint_text(t) for t in after)} ({message})"
                self._queue_event("DeviceUnhealthy", text, "Warning")
            else:
                self._queue_event(
                    "DeviceHealthy", f"{names}: healthy again, taints removed ({message})", "Normal"
                )

    def _queue_event(self, reason: str, message: str, event_type: EventType) -> None:
        if self._events is None:
            return
        try:
            self._event_queue.put_nowait((reason, message, event_type))
        except queue.Full:
            log.warning("too many health Events queued; not recording: %s", message)

    def _side_loop(self) -> None:
        """Post queued Node Events; between them, look for a hung NVML call."""
        while True:
            try:
                item = self._event_queue.get(timeout=self._stall_s / 2)
            except queue.Empty:
                self._look_for_stall()
                continue
            if item is None:
                return
            reason, message, event_type = item
            if self._events is not None:
                try:
                    self._events(reason, message, event_type=event_type)
                except DraError as exc:
                    log.warning(
                        "cannot record a health Event on the Node",
                        extra={"event_reason": reason, "error": str(exc)},
                    )
            self._look_for_stall()

    def _look_for_stall(self) -> None:
        now = time.monotonic()
        with self._lock:
            stall = self._stall(now)
            new = stall is not None and not self._stall_seen
            if new:
                self._stall_seen = True
        if new and stall is not None:
            log.error(
                "an NVML call has not returned for %.0f s: GPU health is Unknown until it does",
                now - stall[0],
                extra={"limit_s": self._stall_s},
            )
            self._notify()


def _names(targets: tuple[GpuTarget, ...]) -> dict[str, str]:
    return {t.uuid: t.name for t in targets}


def _taint_text(taint: Taint) -> str:
    value = f"={taint.value}" if taint.value else ""
    return f"{taint.key}{value}:{taint.effect}"
