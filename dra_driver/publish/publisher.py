"""Keeps the API server's ResourceSlices of this node equal to the desired ones.

Place in the flow: devices.NodeDevices -> (slices.build_slices) -> **Publisher** -> kube/.
The node agent starts one Publisher; it runs two threads:

* the watcher (watcher.SliceWatcher) lists our slices and watches from that resourceVersion; every
  change it did not cause itself (the kubelet deleting all slices of its node at start-up, spec
  C.6; someone editing a slice) wakes the syncer. The syncer records each write it makes in the
  watcher's watcher.OwnWrites, so that its own events wake nobody.
* the syncer (this module) waits to be woken, lets a burst of events settle (``debounce_s``,
  well under the 2 s re-sync promise; the Go helper waits 30 s), lists the slices, computes the
  G.3 plan (syncplan.plan_sync) and writes it: deletes, updates, creates. A restart with
  unchanged devices adopts the existing slices and writes nothing.

Failures never end the threads: unreachable API server or 5xx/429 -> backoff (sliceapi.Backoff);
403 -> an error naming the missing RBAC rule, retried slowly; the last error stays visible in
:meth:`Publisher.status`. Each thread keeps a health.Heartbeat (``/healthz``: alive, not stuck);
:meth:`Publisher.readiness_problems` tells ``/readyz`` whether the slices are published and
current. When the server stores less than we sent (a feature gate is off, spec
D.0), the gate is logged once and the stored form becomes the desired one, so no update loop.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dra_driver.devices.model import NodeDevices, Taint, with_taints
from dra_driver.errors import (
    KubeConflict,
    KubeError,
    KubeForbidden,
    KubeGone,
    KubeNotFound,
    KubeUnavailable,
)
from dra_driver.heartbeat import Heartbeat
from dra_driver.publish.sliceapi import Backoff, SliceApi
from dra_driver.publish.slices import DesiredPool, build_slices, content_of
from dra_driver.publish.syncplan import SliceWrite, SyncPlan, dropped_fields, plan_sync
from dra_driver.publish.watcher import SliceWatcher
from dra_driver.resourceapi import JsonDict

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WriteCounts:
    creates: int = 0
    updates: int = 0
    deletes: int = 0

    @property
    def total(self) -> int:
        return self.creates + self.updates + self.deletes


@dataclass(frozen=True)
class PublisherStatus:
    """A snapshot for probes and logs. ``synced``: the server matched the desired slices at the
    end of the last sync and nothing changed since. ``desired_written``: the desired slices of
    the latest set_devices() (or of the start) were written, or found already there, by a sync
    that succeeded; a later event that only asks for a re-check does not clear it.
    ``last_error``: why the last sync (or a forbidden watch) failed; None after a success."""

    synced: bool
    generation: int | None
    slice_names: tuple[str, ...]
    last_error: str | None
    writes: WriteCounts
    dropped_gates: tuple[str, ...] = field(default=())
    desired_written: bool = False


class Publisher:
    """Publishes one node's pool; ``start()`` once, ``set_devices()`` on change, ``stop()``."""

    def __init__(
        self,
        api: SliceApi,
        *,
        driver_name: str,
        node_name: str,
        node_devices: NodeDevices,
        debounce_s: float = 0.05,
        backoff: Backoff | None = None,
        forbidden_retry_s: float = 30.0,
        watch_timeout_s: int = 300,
    ) -> None:
        self._api = api
        self._driver_name = driver_name
        self._node_name = node_name
        self._debounce_s = debounce_s
        self._backoff = backoff or Backoff()
        self._forbidden_retry_s = forbidden_retry_s
        self._rng = random.Random()  # noqa: S311 (backoff jitter, not security)
        self._lock = threading.Condition()
        self._compose = threading.Lock()  # one set_devices/set_taints at a time
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._node_devices = node_devices
        self._taints: dict[str, tuple[Taint, ...]] = {}
        self._desired = self._build(node_devices)
        self._desired_version = 1
        self._synced_version = 0
        self._node_uid: str | None = None
        self._generation: int | None = None
        self._slice_names: tuple[str, ...] = ()
        self._last_error: str | None = None
        self._writes = WriteCounts()
        self._reported_gates: set[str] = set()
        self._threads: list[threading.Thread] = []
        self._watcher = SliceWatcher(
            api,
            driver_name=driver_name,
            node_name=node_name,
            lock=self._lock,
            stop=self._stop,
            wake=self._wake,
            backoff=self._backoff,
            forbidden_retry_s=forbidden_retry_s,
            watch_timeout_s=watch_timeout_s,
            forget_node=self._forget_node,
            report_error=self._report_watch_error,
        )
        self._own = self._watcher.own
        # A sync pass makes a few calls of at most the client's timeout each.
        self.heartbeats = (Heartbeat("slice-sync", stall_s=300.0), self._watcher.heartbeat)

    def _build(
        self, node_devices: NodeDevices, taints: Mapping[str, tuple[Taint, ...]] | None = None
    ) -> DesiredPool:
        return build_slices(
            with_taints(node_devices, taints or {}),
            driver_name=self._driver_name,
            node_name=self._node_name,
        )

    # --- public API ------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the watcher and syncer threads; the first sync begins at once."""
        if self._threads:
            raise RuntimeError("Publisher.start() called twice")
        self._threads = [
            threading.Thread(target=self._sync_loop, name="slice-sync", daemon=True),
            threading.Thread(target=self._watcher.run, name="slice-watch", daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        self._wake.set()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop both threads (an open watch is closed); slices stay published. Idempotent."""
        self._stop.set()
        self._wake.set()
        with self._lock:
            self._lock.notify_all()
        self._watcher.close()
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def set_devices(self, node_devices: NodeDevices) -> None:
        """Make ``node_devices`` the desired pool (with the current health taints) and sync soon.

        Raises PublishError (and keeps publishing the previous pool) if the pool is invalid.
        """
        with self._compose:
            desired = self._build(node_devices, self._taints)
            self._node_devices = node_devices
            self._replace_desired(desired)

    def set_taints(self, taints: Mapping[str, tuple[Taint, ...]]) -> None:
        """Make ``taints`` (device name -> health taints, added to the device's own) the taints
        of the pool, replacing the previous ones, and sync soon. Names the pool does not have
        are kept for when it has them. Nothing is written when the taints did not change.

        Raises PublishError (keeping the previous taints) if a tainted device would break the
        API's rules.
        """
        wanted = {name: tuple(t) for name, t in taints.items() if t}
        with self._compose:
            if wanted == self._taints:
                return
            desired = self._build(self._node_devices, wanted)
            self._taints = wanted
            self._replace_desired(desired)

    def _replace_desired(self, desired: DesiredPool) -> None:
        with self._lock:
            self._desired = desired
            self._desired_version += 1
        self._wake.set()

    @property
    def writes(self) -> WriteCounts:
        with self._lock:
            return self._writes

    def status(self) -> PublisherStatus:
        with self._lock:
            return PublisherStatus(
                synced=self._synced_version == self._desired_version and not self._wake.is_set(),
                generation=self._generation,
                slice_names=self._slice_names,
                last_error=self._last_error,
                writes=self._writes,
                dropped_gates=tuple(sorted(self._reported_gates)),
                desired_written=self._synced_version == self._desired_version,
            )

    def readiness_problems(self) -> list[str]:
        """Empty when the desired slices are published and the last sync succeeded; otherwise
        what is missing, one line each (for ``/readyz``)."""
        status = self.status()
        problems = []
        if not status.desired_written:
            problems.append(
                "ResourceSlices: the current devices are not published yet"
                if status.generation is not None
                else "ResourceSlices: not published yet"
            )
        if status.last_error is not None:
            problems.append(f"ResourceSlices: the last sync failed: {status.last_error}")
        return problems

    def wait_synced(self, timeout_s: float) -> bool:
        """Block until the current desired pool has been synced; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._synced_version != self._desired_version or self._wake.is_set():
                left = deadline - time.monotonic()
                if left <= 0 or self._stop.is_set():
                    return False
                self._lock.wait(min(left, 0.05))
            return True

    # --- syncer ----------------------------------------------------------------------------------

    def _sync_loop(self) -> None:
        beat = self.heartbeats[0]
        with beat.running():
            attempt = 0
            wait_s: float | None = None
            while not self._stop.is_set():
                woken = self._wake.wait(wait_s)
                if self._stop.is_set():
                    return
                with beat.busy():
                    attempt, wait_s = self._sync_pass(woken, attempt)

    def _sync_pass(self, woken: bool, attempt: int) -> tuple[int, float | None]:
        """One sync with its error handling; returns the attempt count and how long to wait
        for the next one unless woken (None: until woken)."""
        wait_s: float | None = None
        if woken and self._debounce_s > 0:
            # Let a burst (the kubelet deleting every slice) arrive before listing once.
            self._stop.wait(self._debounce_s)
        self._wake.clear()
        try:
            self._sync_once()
        except KubeForbidden as exc:
            wait_s = self._forbidden_retry_s
            self._fail(exc, wait_s, level=logging.ERROR)
        except (KubeUnavailable, KubeConflict, KubeNotFound, KubeGone) as exc:
            attempt += 1
            wait_s = self._backoff.delay_s(attempt, self._rng)
            self._fail(exc, wait_s, level=logging.WARNING)
        except KubeError as exc:  # 401, 422 and others: will not fix themselves quickly
            wait_s = self._forbidden_retry_s
            self._fail(exc, wait_s, level=logging.ERROR)
        except Exception as exc:  # a bug must not end publishing for good
            attempt += 1
            wait_s = self._backoff.delay_s(attempt, self._rng)
            with self._lock:
                self._last_error = f"unexpected error: {exc!r}"
                self._lock.notify_all()
            log.exception(
                "publishing ResourceSlices failed unexpectedly, retrying in %.1f s",
                wait_s,
                extra={"node": self._node_name, "retry_in_s": round(wait_s, 3)},
            )
        else:
            attempt, wait_s = 0, None
        return attempt, wait_s

    def _fail(self, exc: KubeError, wait_s: float, *, level: int) -> None:
        with self._lock:
            self._last_error = str(exc)
            self._lock.notify_all()
        log.log(
            level,
            "publishing ResourceSlices failed, retrying in %.1f s: %s",
            wait_s,
            exc,
            extra={
                "node": self._node_name,
                "verb": exc.verb,
                "resource": exc.resource,
                "status": exc.status,
                "retry_in_s": round(wait_s, 3),
            },
        )

    def _sync_once(self) -> None:
        with self._lock:
            desired, version, node_uid = self._desired, self._desired_version, self._node_uid
        if node_uid is None:
            node = self._api.get_node(self._node_name)
            node_uid = str(node.get("metadata", {}).get("uid", ""))
            with self._lock:
                self._node_uid = node_uid
        existing = self._api.list_slices(driver_name=self._driver_name, node_name=self._node_name)
        plan = plan_sync(desired, existing.items, node_uid=node_uid)
        names = self._execute(plan, desired, version)
        with self._lock:
            self._generation = plan.generation
            self._slice_names = names
            self._last_error = None
            if version == self._desired_version:
                self._synced_version = version
            self._lock.notify_all()
        if plan.write_count:
            log.info(
                "ResourceSlices published: %d created, %d updated, %d deleted (generation %d)",
                len(plan.creates),
                len(plan.updates),
                len(plan.deletes),
                plan.generation,
                extra={
                    "node": self._node_name,
                    "generation": plan.generation,
                    "slices": len(names),
                    "devices": desired.device_count,
                },
            )
        else:
            log.debug(
                "ResourceSlices up to date",
                extra={"node": self._node_name, "generation": plan.generation},
            )

    def _execute(self, plan: SyncPlan, desired: DesiredPool, version: int) -> tuple[str, ...]:
        """Run the plan in G.3 order; returns the names of the pool's slices afterwards."""
        for ref in plan.deletes:
            self._own.deleting(ref.name)
            self._api.delete_slice(
                name=ref.name, uid=ref.uid, resource_version=ref.resource_version
            )
            self._count(deletes=1)
        names = list(plan.unchanged)
        for write in plan.updates:
            stored = self._api.update_slice(write.body)
            self._count(updates=1)
            self._after_write(write, stored, version)
            names.append(_name(stored))
        for write in plan.creates:
            stored = self._api.create_slice(write.body)
            self._count(creates=1)
            self._after_write(write, stored, version)
            names.append(_name(stored))
        return tuple(sorted(names))

    def _count(self, *, creates: int = 0, updates: int = 0, deletes: int = 0) -> None:
        with self._lock:
            w = self._writes
            self._writes = WriteCounts(
                creates=w.creates + creates,
                updates=w.updates + updates,
                deletes=w.deletes + deletes,
            )

    def _after_write(self, write: SliceWrite, stored: JsonDict, version: int) -> None:
        """Remember our own write (so its watch event is not a reason to sync) and adopt what
        the server stored if it dropped fields (G.3 step 9)."""
        self._own.wrote(stored)
        dropped = dropped_fields(content_of(write.body), content_of(stored))
        if not dropped:
            return
        gates = {d.gate or "unknown" for d in dropped}
        with self._lock:
            new_gates = gates - self._reported_gates
            self._reported_gates |= gates
            if version == self._desired_version:
                self._desired = self._desired.with_slice(write.index, content_of(stored))
        if new_gates:
            fields = ", ".join(d.path for d in dropped)
            known = sorted(g for g in gates if g != "unknown")
            hint = (
                f"feature gate {' / '.join(known)} is probably off on the API server"
                if known
                else "no known feature gate explains it"
            )
            log.warning(
                "the API server did not store %s of ResourceSlice %s: %s; "
                "publishing what it stored instead",
                fields,
                _name(stored),
                hint,
                extra={"node": self._node_name, "slice_name": _name(stored), "gates": known},
            )

    # --- what the watcher tells the syncer ------------------------------------------------------

    def _forget_node(self) -> None:
        """A slice was deleted by someone else: our slices vanish with their Node, and a
        re-created Node has a new uid, so the next sync reads it again."""
        with self._lock:
            self._node_uid = None

    def _report_watch_error(self, message: str) -> None:
        """A forbidden list or watch: shown by status() until a sync succeeds."""
        with self._lock:
            self._last_error = message


def _name(obj: Mapping[str, Any]) -> str:
    return str(obj.get("metadata", {}).get("name", ""))


__all__ = ["Backoff", "Publisher", "PublisherStatus", "SliceApi", "WriteCounts"]
