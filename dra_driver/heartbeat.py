"""Liveness of the agent's background loops: each loop keeps a :class:`Heartbeat`, and the
probes (node/probes.py, ``/healthz``) ask every heartbeat whether its loop is alive.

Below every part that runs a loop (publisher, plugin, health monitor, telemetry), so none of them
imports the node's probe server to report that it is alive.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager


class Heartbeat:
    """Liveness of one background loop, for ``/healthz``.

    The loop runs its whole body inside :meth:`running` and each pass of work inside
    :meth:`busy`; a long pass that makes progress (a watch receiving events) calls :meth:`beat`.
    The loop is dead when its body ended by an exception, and stuck when one pass (or the time
    since its last beat) has gone on longer than ``stall_s``: every call a pass makes has its
    own timeout well below that, so only a hang or a deadlock gets there. Waiting between
    passes, however long, is healthy: the loop sleeps on purpose. Not started yet, or ended
    normally (stopped), is not a problem either. Only the loop's thread writes; probes read.
    """

    def __init__(
        self, name: str, *, stall_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.name = name
        self.stall_s = stall_s
        self._clock = clock
        self._busy_since: float | None = None
        self._died: str | None = None
        self.passes = 0

    @contextmanager
    def running(self) -> Iterator[None]:
        """Around the loop's whole body: an exception out of it marks the loop dead."""
        try:
            yield
        except BaseException as exc:
            self._died = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            self._busy_since = None

    @contextmanager
    def busy(self) -> Iterator[None]:
        """Around one pass of work."""
        self._busy_since = self._clock()
        try:
            yield
        finally:
            self._busy_since = None
            self.passes += 1

    def beat(self) -> None:
        """Progress inside a long pass: its stall clock starts again."""
        if self._busy_since is not None:
            self._busy_since = self._clock()

    def problem(self) -> str | None:
        """Why this loop is not alive, or None."""
        if self._died is not None:
            return f"loop {self.name} died: {self._died}"
        since = self._busy_since
        if since is not None:
            busy_s = self._clock() - since
            if busy_s > self.stall_s:
                return (
                    f"loop {self.name} is stuck: no progress for {busy_s:.0f} s "
                    f"(limit {self.stall_s:.0f} s)"
                )
        return None


def heartbeat_problems(beats: Iterable[Heartbeat]) -> list[str]:
    """The problems of every loop in ``beats``: a :data:`Check` for ``/healthz``."""
    return [p for p in (b.problem() for b in beats) if p is not None]
