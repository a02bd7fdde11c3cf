"""A watch of API objects: its events, read from a chunked HTTP stream, and closing it.

Place in the flow: resourceslices.py opens a watch of our ResourceSlices for the publisher's
watcher (publish/watcher.py), which reads its events until the server ends it or the publisher
stops.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import urllib3

from dra_driver.errors import KubeUnavailable
from dra_driver.kube.connection import status_error
from dra_driver.resourceapi import JsonDict


@dataclass(frozen=True)
class WatchEvent:
    """One watch event: ADDED, MODIFIED, DELETED or BOOKMARK, with the object in v1 shape."""

    type: str
    object: JsonDict

    @property
    def resource_version(self) -> str:
        return str(self.object.get("metadata", {}).get("resourceVersion", ""))


class WatchStream:
    """An open watch. Iterate for events; ``close()`` from any thread ends the iteration.

    Iteration raises KubeGone when the server says the resourceVersion is too old (relist), and
    KubeUnavailable when the connection breaks; it simply ends when the server closes the watch
    (its ``timeoutSeconds`` elapsed) or after ``close()``.
    """

    def __init__(
        self,
        response: Any,
        *,
        resource: str,
        convert: Any,
    ) -> None:
        self._response = response
        self._resource = resource
        self._convert = convert
        self._closed = threading.Event()
        self._close_lock = threading.Lock()

    def __enter__(self) -> WatchStream:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Unblock a reader in another thread and release the connection. Idempotent."""
        with self._close_lock:  # the reader's cleanup and stop() may close at the same time
            if self._closed.is_set():
                return
            self._closed.set()
            # shutdown() wakes a thread blocked in a socket read; close() alone would not.
            # It refuses when there is nothing to wake: RuntimeError once the stream was read to
            # the end and the connection went back to the pool, ValueError once urllib3 closed
            # the response itself (the server broke the stream mid-chunk).
            with contextlib.suppress(RuntimeError, ValueError, OSError):
                self._response.shutdown()
            self._response.release_conn()

    def __iter__(self) -> Iterator[WatchEvent]:
        # Nothing of an event is kept here once it is handed out: a watch waits for the next
        # one for minutes, and an event of a slice is a whole slice (tens of KiB of JSON,
        # hundreds of KiB decoded).
        try:
            for line in self._lines():
                if not line.strip():
                    continue
                event = self._event(line)
                del line
                yield event
                del event
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            if self._closed.is_set():
                return
            raise KubeUnavailable(
                f"watch {self._resource}: connection to the API server broke: {exc}",
                verb="watch",
                resource=self._resource,
            ) from exc
        except ValueError as exc:
            if self._closed.is_set():
                return
            raise KubeUnavailable(
                f"watch {self._resource}: the API server sent an unreadable event: {exc}",
                verb="watch",
                resource=self._resource,
            ) from exc

    def _event(self, line: str) -> WatchEvent:
        event = json.loads(line)
        kind, obj = str(event.get("type", "")), event.get("object") or {}
        if kind == "ERROR":
            raise status_error(
                int(obj.get("code") or 500), obj, verb="watch", resource=self._resource
            )
        return WatchEvent(kind, obj if kind == "BOOKMARK" else self._convert(obj))

    def _lines(self) -> Iterator[str]:
        buffer = b""
        for chunk in self._response.stream(amt=None, decode_content=True):
            if self._closed.is_set():
                return
            buffer += chunk
            del chunk  # not kept while the next one is awaited
            *lines, buffer = buffer.split(b"\n")
            lines.reverse()
            while lines:
                yield lines.pop().decode("utf-8")
        if buffer.strip() and not self._closed.is_set():
            yield buffer.decode("utf-8")
