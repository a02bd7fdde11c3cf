"""log.py: JSON/text lines on stderr, written by a background thread, nothing lost at exit."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dra_driver.node import log

logger = logging.getLogger("dra_driver.test")


@pytest.fixture
def configured() -> Iterator[None]:
    """Leave the process's logging as it was (configure() changes it for the whole process)."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    flags = (logging._srcfile, logging.logThreads, logging.logProcesses, logging.logMultiprocessing)
    yield
    log.flush()
    root.handlers[:] = handlers
    root.setLevel(level)
    logging._srcfile, logging.logThreads, logging.logProcesses, logging.logMultiprocessing = flags


def _lines(err: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in err.splitlines() if line.strip()]


def test_json_lines_carry_the_extra_fields_and_flush_writes_them_all(
    configured: None, capsys: pytest.CaptureFixture[str]
) -> None:
    log.configure(log_format="json", level="info")

    def work(n: int) -> None:
        for i in range(50):
            logger.info("prepared claim", extra={"claim_uid": f"{n}-{i}"})

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    logger.debug("below the level")
    log.flush()
    lines = _lines(capsys.readouterr().err)
    assert sorted(str(line["claim_uid"]) for line in lines) == sorted(
        f"{n}-{i}" for n in range(4) for i in range(50)
    )
    assert {(line["level"], line["logger"], line["msg"]) for line in lines} == {
        ("info", "dra_driver.test", "prepared claim")
    }
    assert all(str(line["ts"]).endswith("Z") for line in lines)

    # after flush the caller's own thread writes: nothing is left waiting in a queue
    logger.warning("after", extra={"k": 1})
    (after,) = _lines(capsys.readouterr().err)
    assert (after["level"], after["msg"], after["k"]) == ("warning", "after", 1)


def test_the_message_is_fixed_when_logged_and_exceptions_keep_their_traceback(
    configured: None, capsys: pytest.CaptureFixture[str]
) -> None:
    log.configure(log_format="json", level="info")
    devices = ["gpu-0"]
    logger.info("devices %s", devices)
    devices.append("gpu-1")  # changed before the writer thread formats the line
    try:
        raise ValueError("broken spec")
    except ValueError:
        logger.exception("prepare failed", extra={"claim_uid": "u1"})
    log.flush()
    first, second = _lines(capsys.readouterr().err)
    assert first["msg"] == "devices ['gpu-0']"
    assert second["msg"] == "prepare failed"
    assert second["claim_uid"] == "u1"
    assert "ValueError: broken spec" in str(second["exception"])
    assert "Traceback" in str(second["exception"])


def test_text_format_and_configuring_again_loses_nothing(
    configured: None, capsys: pytest.CaptureFixture[str]
) -> None:
    log.configure(log_format="json", level="info")
    logger.info("one")
    log.configure(log_format="text", level="debug")  # stops the first writer after it drained
    logger.debug("two", extra={"device": "gpu-0"})
    log.flush()
    err = capsys.readouterr().err.splitlines()
    assert json.loads(err[0])["msg"] == "one"
    assert err[1] == "DEBUG   dra_driver.test: two device=gpu-0"
    assert len(err) == 2


def test_lines_still_queued_at_exit_are_written() -> None:
    script = (
        "import logging\n"
        "from dra_driver.node import log\n"
        "log.configure(log_format='json', level='info')\n"
        "for i in range(2000):\n"
        "    logging.getLogger('x').info('line', extra={'i': i})\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert [line["i"] for line in _lines(done.stderr)] == list(range(2000))


def test_the_writer_writes_what_was_queued_in_batches_not_a_write_per_line(
    configured: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lines logged together leave in one write of the writer thread (it wakes every
    FLUSH_INTERVAL_S, not for each record, so a handler that just logged keeps the interpreter
    lock), and every line is there, in order."""
    import io  # noqa: PLC0415

    writes: list[str] = []

    class Stream(io.StringIO):
        def write(self, text: str) -> int:
            writes.append(text)
            return len(text)

    monkeypatch.setattr(sys, "stderr", Stream())
    log.configure(log_format="json", level="info")
    for i in range(200):
        logger.info("prepared claim", extra={"i": i})
    log.flush()
    lines = _lines("".join(writes))
    assert [line["i"] for line in lines] == list(range(200))
    assert len(writes) <= 5, f"{len(writes)} writes for 200 lines"


def _switches(native_id: int) -> int:
    """How many times the thread has gone to sleep and been woken (voluntary switches)."""
    status = Path(f"/proc/self/task/{native_id}/status").read_text()
    return int(re.findall(r"voluntary_ctxt_switches:\s*(\d+)", status)[0])


def test_an_idle_writer_sleeps_until_a_line_comes(
    configured: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With nothing logged the writer thread is not woken at all (an agent on every GPU node
    that logs nothing for hours costs no wakeups); the next line still gets written."""
    import io  # noqa: PLC0415

    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    log.configure(log_format="json", level="info")
    logger.info("first")
    deadline = time.monotonic() + 5
    while "first" not in stream.getvalue() and time.monotonic() < deadline:
        time.sleep(0.01)
    (writer,) = [t for t in threading.enumerate() if t.name == "log-writer"]
    assert writer.native_id is not None
    time.sleep(2 * log.FLUSH_INTERVAL_S)  # what the first line woke is over
    before = _switches(writer.native_id)
    time.sleep(10 * log.FLUSH_INTERVAL_S)
    assert _switches(writer.native_id) == before  # a periodic writer wakes 10 times here
    logger.info("second")
    log.flush()
    assert [line["msg"] for line in _lines(stream.getvalue())] == ["first", "second"]


def test_timestamps_are_right_across_seconds_and_extras_follow_the_record() -> None:
    """The formatter keeps the text of the last second it formatted: a record of another
    second (later or earlier: lines of two threads) gets its own; only ``extra`` fields are
    added, in the order given."""
    formatter = log.JsonFormatter()
    for created in (1_764_900_000.998, 1_764_900_000.999, 1_764_900_001.0, 1_764_899_999.5, 0.25):
        record = logging.LogRecord("dra_driver.x", logging.INFO, "", 0, "m %s", ("a",), None)
        record.created, record.msecs = created, (created - int(created)) * 1000
        record.claim_uid, record.devices = "u", ["gpu-0"]
        line = json.loads(formatter.format(record))
        want = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(int(created)))
        assert line == {
            "ts": f"{want}.{int(record.msecs):03d}Z",
            "level": "info",
            "logger": "dra_driver.x",
            "msg": "m a",
            "claim_uid": "u",
            "devices": ["gpu-0"],
        }
        assert list(line)[-2:] == ["claim_uid", "devices"]


def test_a_filter_on_the_queueing_handler_still_drops_lines(
    configured: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """The queueing handler takes no lock of its own, but still asks its filters."""
    log.configure(log_format="json", level="info")
    (handler,) = (h for h in logging.getLogger().handlers if isinstance(h, log._Enqueue))
    handler.addFilter(lambda record: record.getMessage() != "dropped")
    logger.info("dropped")
    logger.info("kept")
    log.flush()
    assert [line["msg"] for line in _lines(capsys.readouterr().err)] == ["kept"]
