"""Structured logging for the node agent: one JSON object per line (or readable text).

Fields passed through ``extra={...}`` become keys of the JSON object, so log pipelines can filter
on ``claim_uid``, ``slice`` or ``device`` without parsing messages.

Lines are formatted and written by a background thread, in batches (as klog, the Go drivers'
logger, buffers them and flushes every 5 s): a prepare logs one line, and formatting it as JSON
and writing it to stderr took about 0.1 ms of the kubelet's wait on a small node. The calling
thread only makes the record and queues it. The writer sleeps until a record is queued, waits
``FLUSH_INTERVAL_S`` more, and writes all that was queued meanwhile with one write: a writer
woken for every record (the standard library's QueueListener) took the interpreter lock from the
handler that had just queued it, in the middle of that handler's answer, and cost a thread
wakeup per line; a writer woken on a timer would wake 20 times a second on an agent that logs
nothing for hours. Everything queued is written before the process exits normally
(``atexit``); a process killed with SIGKILL may lose the last ``FLUSH_INTERVAL_S`` of lines
(klog: 5 s).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import logging
import logging.handlers
import queue
import sys
import threading
import time
from typing import Any

# Attributes every LogRecord has; anything else on a record came from ``extra``.
_STANDARD = tuple(vars(logging.LogRecord("", 0, "", 0, "", (), None)))
_RESERVED = frozenset(_STANDARD) | {"message", "asctime", "taskName"}


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    # LogRecord.__init__ sets the standard attributes first, in one order, and makeRecord adds
    # ``extra`` after them: only what follows is looked at (this runs for every line)
    extra = itertools.islice(vars(record).items(), len(_STANDARD), None)
    return {k: v for k, v in extra if k not in _RESERVED}


# One encoder for every line (json.dumps with ``default`` builds a new one per call)
_encode = json.JSONEncoder(default=str).encode


class JsonFormatter(logging.Formatter):
    """``{"ts": ..., "level": ..., "logger": ..., "msg": ..., **extra}`` per line."""

    def __init__(self) -> None:
        super().__init__()
        self._second: tuple[int, str] = (-1, "")  # the last second formatted, and its text

    def _timestamp(self, created: float, msecs: float) -> str:
        second, text = self._second
        if int(created) != second:
            second = int(created)
            text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
            self._second = (second, text)
        return f"{text}.{int(msecs):03d}Z"

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": self._timestamp(record.created, record.msecs),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        entry.update(_extras(record))
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return _encode(entry)


class TextFormatter(logging.Formatter):
    """``LEVEL logger: message key=value ...`` for people reading a terminal."""

    def format(self, record: logging.LogRecord) -> str:
        pairs = " ".join(f"{k}={v}" for k, v in _extras(record).items())
        line = f"{record.levelname:<7} {record.name}: {record.getMessage()}"
        if pairs:
            line = f"{line} {pairs}"
        if record.exc_info:
            line = f"{line}\n{self.formatException(record.exc_info)}"
        return line


class _Enqueue(logging.handlers.QueueHandler):
    """Hands records to the writer thread as they are: the message is fixed now (its arguments
    may change later), formatting (exceptions included) happens in the writer thread."""

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        record.msg = record.getMessage()
        record.args = None
        return record

    def handle(self, record: logging.LogRecord) -> Any:
        """As Handler.handle without the handler's lock, which only serializes ``emit``: the
        queue is safe across threads (the lock cost every logged line a lock round trip)."""
        rv: Any = self.filter(record)
        if rv:
            # Python 3.12+: a filter may hand back the record to use instead
            self.emit(rv if isinstance(rv, logging.LogRecord) else record)
        return rv


# How often the writer thread writes what was queued (see the module docstring).
FLUSH_INTERVAL_S = 0.05


class _BatchListener:
    """Waits for a record, lets the others of its burst gather for ``FLUSH_INTERVAL_S``, then
    takes them all off the queue, formats them with ``handler``'s formatter and writes them to
    its stream at once. ``None`` on the queue wakes it to stop."""

    def __init__(
        self,
        records: queue.SimpleQueue[logging.LogRecord | None],
        handler: logging.StreamHandler[Any],
    ) -> None:
        self._records = records
        self._handler = handler
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="log-writer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Write what is queued and stop the thread."""
        self._stopping.set()
        self._records.put(None)  # wakes the thread if it waits for a record
        self._thread.join()
        self._write_queued()  # what was queued after the thread's last pass

    def _run(self) -> None:
        # stop() sets _stopping before it queues the marker: a pass that took the marker off
        # the queue (_write_queued) ends the loop here.
        while not self._stopping.is_set():
            first = self._records.get()  # asleep while nothing is logged
            if first is None:
                break
            self._stopping.wait(FLUSH_INTERVAL_S)  # the rest of the burst; at once when stopping
            self._write_queued(first)
        self._write_queued()

    def _write_queued(self, first: logging.LogRecord | None = None) -> None:
        handler = self._handler
        records = [first] if first is not None else []
        while True:
            try:
                record = self._records.get_nowait()
            except queue.Empty:
                break
            if record is not None:  # None: the stop marker
                records.append(record)
        lines = []
        for record in records:
            try:
                lines.append(handler.format(record))
            except Exception:  # noqa: BLE001 - logging never raises (Handler.handleError)
                handler.handleError(record)
        if not lines:
            return
        with handler.lock or contextlib.nullcontext():
            try:
                handler.stream.write("\n".join(lines) + "\n")
                handler.stream.flush()
            except Exception:  # noqa: BLE001
                handler.handleError(records[-1])


class _Writer:
    """The one background writer of this process (configure() may be called again)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._listener: _BatchListener | None = None
        self._direct: logging.Handler | None = None
        self._at_exit = False

    def start(self, handler: logging.StreamHandler[Any]) -> logging.Handler:
        """Start writing through ``handler``; returns the handler that queues for it."""
        records: queue.SimpleQueue[logging.LogRecord | None] = queue.SimpleQueue()
        listener = _BatchListener(records, handler)
        self.stop()
        with self._lock:
            if not self._at_exit:
                atexit.register(self.stop)
                self._at_exit = True
            self._listener, self._direct = listener, handler
            listener.start()
        return _Enqueue(records)

    def stop(self) -> None:
        """Write what is queued and stop; records logged from now on are written directly."""
        with self._lock:
            listener, direct = self._listener, self._direct
            self._listener = self._direct = None
        if listener is None or direct is None:
            return
        root = logging.getLogger()
        for handler in list(root.handlers):
            if isinstance(handler, _Enqueue):
                root.removeHandler(handler)
                root.addHandler(direct)
        listener.stop()  # drains the queue


_WRITER = _Writer()


def configure(*, log_format: str, level: str) -> None:
    """Send all records to stderr in ``log_format`` ("json" or "text") at ``level``, written by
    a background thread (see the module docstring)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    # What records would otherwise gather on every call and no format here shows (the logging
    # HOWTO's "Optimization" list): the caller's frame, process and thread names.
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    root = logging.getLogger()
    root.handlers[:] = [_WRITER.start(handler)]
    root.setLevel(level.upper())
    # The kubernetes client logs every retry at WARNING through urllib3; we report those ourselves.
    logging.getLogger("urllib3").setLevel(logging.ERROR)


def flush() -> None:
    """Write everything logged so far and stop the writer thread; later records are written
    by the thread that logs them. Runs at exit by itself; safe to call more than once."""
    _WRITER.stop()
