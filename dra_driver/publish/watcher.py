"""The publisher's watcher thread: notices every change to our ResourceSlices that we did not make.

Place in the flow: publish/publisher.py starts it as the ``slice-watch`` thread beside its syncer.
It lists our slices (field selector ``spec.driver=<driver>,spec.nodeName=<node>``) for a
resourceVersion and watches from there; every change it did not cause itself (the kubelet deleting
all slices of its node at start-up, spec C.6; someone editing a slice) wakes the syncer, which
lists, plans and writes. 410 Gone -> relist. Connection trouble -> exponential backoff with jitter;
403 -> the error is reported to the publisher's status and retried slowly.

Telling our writes from foreign ones is :class:`OwnWrites`: the syncer records each write as it
makes it, the watcher crosses off the events they cause. Both sides take the publisher's lock.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable, Mapping
from typing import Any

from dra_driver.errors import KubeError, KubeForbidden, KubeGone, KubeUnavailable
from dra_driver.heartbeat import Heartbeat
from dra_driver.publish.sliceapi import Backoff, SliceApi, SliceEvent, SliceWatch

# The publisher's two threads log as one component (operators filter on it; its docs name it).
log = logging.getLogger("dra_driver.publish.publisher")


class OwnWrites:
    """The syncer's writes whose watch events have not arrived yet: (name, resourceVersion) of
    each create or update, the name of each delete.

    Locking: every method holds ``lock``, the publisher's lock (re-entrant, so the watcher may
    call :meth:`claim` while holding it). A delete is recorded before its call, so its event
    always finds it; a create or update is recorded when the call returns, so an event that
    beats it counts as foreign and costs one extra sync that writes nothing.
    """

    def __init__(self, lock: threading.Condition) -> None:
        self._lock = lock
        self._writes: set[tuple[str, str]] = set()
        self._deletes: set[str] = set()

    def deleting(self, name: str) -> None:
        """The syncer is about to delete slice ``name``."""
        with self._lock:
            self._deletes.add(name)

    def wrote(self, stored: Mapping[str, Any]) -> None:
        """The syncer created or updated a slice; ``stored`` is what the server returned."""
        with self._lock:
            self._writes.add((_name(stored), _resource_version(stored)))

    def forget(self) -> None:
        """After a list: events for writes before it will never arrive now."""
        with self._lock:
            self._writes.clear()
            self._deletes.clear()

    def claim(self, event: SliceEvent) -> bool:
        """Whether ``event`` is one our writes caused; if so it is crossed off (each write causes
        one event)."""
        name = _name(event.object)
        with self._lock:
            if event.type == "DELETED":
                if name in self._deletes:
                    self._deletes.discard(name)
                    return True
                return False
            key = (name, event.resource_version)
            if key in self._writes:
                self._writes.discard(key)
                return True
            return False


class SliceWatcher:
    """Watches our slices and sets ``wake`` on every foreign change; :meth:`run` is the thread.

    Shared with the publisher: ``lock``, ``stop`` (ends :meth:`run`), ``wake`` (the syncer's),
    :attr:`own` (the syncer records its writes there). ``forget_node`` is called, with ``lock``
    held, when a slice is deleted by someone else (our slices vanish with their Node, and a
    re-created Node has a new uid); ``report_error`` gets the message of a forbidden list or
    watch.
    """

    def __init__(
        self,
        api: SliceApi,
        *,
        driver_name: str,
        node_name: str,
        lock: threading.Condition,
        stop: threading.Event,
        wake: threading.Event,
        backoff: Backoff,
        forbidden_retry_s: float,
        watch_timeout_s: int,
        forget_node: Callable[[], None],
        report_error: Callable[[str], None],
    ) -> None:
        self._api = api
        self._driver_name = driver_name
        self._node_name = node_name
        self._lock = lock
        self._stop = stop
        self._wake = wake
        self._backoff = backoff
        self._forbidden_retry_s = forbidden_retry_s
        self._watch_timeout_s = watch_timeout_s
        self._forget_node = forget_node
        self._report_error = report_error
        self._rng = random.Random()  # noqa: S311 (backoff jitter, not security)
        self._stream: SliceWatch | None = None
        self.own = OwnWrites(lock)
        # A watch ends after watch_timeout_s (plus the client's read margin) and every event is
        # progress.
        self.heartbeat = Heartbeat("slice-watch", stall_s=watch_timeout_s + 120.0)

    def close(self) -> None:
        """Close the open watch, if any (after ``stop`` is set: :meth:`run` then returns)."""
        with self._lock:
            stream = self._stream
        if stream is not None:
            stream.close()

    def run(self) -> None:
        beat = self.heartbeat
        # Always at work (a watch is open or about to be): each round and each event is
        # progress, and a round ends within the watch's timeout.
        with beat.running(), beat.busy():
            resource_version = ""
            attempt = 0
            while not self._stop.is_set():
                beat.beat()
                try:
                    if not resource_version:
                        # only its version: the slices themselves are not kept while watching
                        resource_version = self._api.list_slices(
                            driver_name=self._driver_name, node_name=self._node_name
                        ).resource_version
                        # Events for writes before this list will never arrive now.
                        self.own.forget()
                        # Anything may have happened while we were not watching.
                        self._wake.set()
                    resource_version = self._watch_from(resource_version)
                    attempt = 0
                except KubeGone:
                    log.info(
                        "ResourceSlice watch expired; listing again",
                        extra={"node": self._node_name},
                    )
                    resource_version = ""
                except KubeError as exc:
                    attempt += 1
                    wait_s = (
                        self._forbidden_retry_s
                        if isinstance(exc, KubeForbidden)
                        else self._backoff.delay_s(attempt, self._rng)
                    )
                    log.log(
                        logging.DEBUG if isinstance(exc, KubeUnavailable) else logging.ERROR,
                        "watching ResourceSlices failed, retrying in %.1f s: %s",
                        wait_s,
                        exc,
                        extra={"node": self._node_name, "retry_in_s": round(wait_s, 3)},
                    )
                    if isinstance(exc, KubeForbidden):
                        self._report_error(str(exc))
                    self._stop.wait(wait_s)
                except Exception:  # a dead watch would leave deleted slices missing
                    attempt += 1
                    wait_s = self._backoff.delay_s(attempt, self._rng)
                    log.exception(
                        "watching ResourceSlices failed unexpectedly, listing again in %.1f s",
                        wait_s,
                        extra={"node": self._node_name, "retry_in_s": round(wait_s, 3)},
                    )
                    resource_version = ""
                    self._stop.wait(wait_s)

    def _watch_from(self, resource_version: str) -> str:
        stream = self._api.watch_slices(
            driver_name=self._driver_name,
            node_name=self._node_name,
            resource_version=resource_version,
            timeout_s=self._watch_timeout_s,
        )
        with self._lock:
            self._stream = stream
        try:
            if self._stop.is_set():
                return resource_version
            for event in stream:
                self.heartbeat.beat()
                resource_version = event.resource_version or resource_version
                if event.type != "BOOKMARK" and self._is_foreign(event):
                    log.debug(
                        "ResourceSlice %s %s by someone else; syncing",
                        _name(event.object),
                        event.type.lower(),
                        extra={"node": self._node_name, "slice_name": _name(event.object)},
                    )
                    self._wake.set()
                del event  # a whole slice: not kept while the next event is awaited
            return resource_version
        finally:
            with self._lock:
                self._stream = None
            stream.close()

    def _is_foreign(self, event: SliceEvent) -> bool:
        # One hold of the lock for the crossing-off and the node uid's reset: the syncer, which
        # records its writes and reads the uid under the same lock, sees both or neither.
        with self._lock:
            if self.own.claim(event):
                return False
            if event.type == "DELETED":
                self._forget_node()
            return True


def _name(obj: Mapping[str, Any]) -> str:
    return str(obj.get("metadata", {}).get("name", ""))


def _resource_version(obj: Mapping[str, Any]) -> str:
    return str(obj.get("metadata", {}).get("resourceVersion", ""))
