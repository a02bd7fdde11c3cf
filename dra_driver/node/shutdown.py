"""A stop that always completes: a deadline armed when SIGTERM (or SIGINT) arrives.

Place in the flow: node/agent.py arms :class:`ShutdownDeadline` in its signal handler; the
agent then stops its parts in order (probes, plugin, publisher, monitor) as usual. A part can be
stuck beyond any timeout of its own: a prepare worker in an NVML call on a GPU that hangs, an
``nvidia-smi`` that never returns; the claim workers are joined at interpreter exit, so the
process would then outlive the kubelet's grace period and be killed with SIGKILL, its sockets
and the checkpoint's journal left as they were (issue 37: SIGTERM did not stop the agent in
60 s). When the deadline passes first, the process ends itself: it logs the threads still
running (each with the frame it is stuck in), flushes the log and exits with status 1, without
waiting for them. Nothing is lost by it: a claim stuck in its prepare is ``PrepareStarted`` in
the checkpoint (durably, before its first change to the node), so the next start rolls it back
and the kubelet's retry prepares it again; a claim stuck before that was never recorded. The
deadline (``--shutdown-timeout``) is below the chart's ``terminationGracePeriodSeconds``
(values.schema.json keeps the two apart), so the forced exit comes before SIGKILL.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import traceback
from collections.abc import Callable

from dra_driver.node import log as node_log

log = logging.getLogger(__name__)

DEFAULT_SHUTDOWN_TIMEOUT_S = 20.0
EXIT_STATUS = 1


class ShutdownDeadline:
    """Ends the process ``timeout_s`` after :meth:`arm`, unless it ended by itself first (the
    watching thread is a daemon: it never holds the process).

    ``arm`` is safe to call from a signal handler and more than once (the first call counts).
    ``exit`` is ``os._exit``; a test passes another to see the exit without the process
    ending."""

    def __init__(self, timeout_s: float, *, exit: Callable[[int], object] = os._exit) -> None:
        self.timeout_s = timeout_s
        self._exit = exit
        self._thread: threading.Thread | None = None

    def arm(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._watch, name="shutdown-deadline", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        threading.Event().wait(self.timeout_s)
        log.error(
            "the stop did not complete within %g s (--shutdown-timeout); exiting without "
            "waiting for the threads still running (a claim stuck in its prepare is rolled "
            "back at the next start)",
            self.timeout_s,
            extra={"threads": stuck_threads()},
        )
        node_log.flush()  # the writer thread's queue: os._exit would drop it
        sys.stderr.flush()
        self._exit(EXIT_STATUS)


def stuck_threads() -> list[str]:
    """Every other live thread as ``name: file:line in function`` (its innermost frame)."""
    frames = sys._current_frames()
    out = []
    for thread in threading.enumerate():
        if thread is threading.current_thread() or thread.ident is None:
            continue
        frame = frames.get(thread.ident)
        where = ""
        if frame is not None:
            last = traceback.extract_stack(frame, limit=1)[-1]
            where = f": {last.filename}:{last.lineno} in {last.name}"
        out.append(f"{thread.name}{where}")
    return out
