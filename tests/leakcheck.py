"""Nothing left behind: the test session fails if it leaves temporary files or processes.

A pytest plugin (tests/conftest.py installs it). At the start of the session it gives the run a
private temporary directory (``TMPDIR`` and ``tempfile.tempdir``, inherited by every process the
tests start; pytest's basetemp, the home of every ``tmp_path``, is its subdirectory ``pytest``
unless ``--basetemp`` names another) and marks the environment with a token of its own
(``GPU_DRA_TEST_SESSION``). At the end, once every fixture is torn down, it fails the run, naming
each, if

- the private directory holds anything but pytest's basetemp: a temporary file or directory the
  code under test or a test made and did not remove (``leftover_entries``);
- a process this session started is alive: a descendant of pytest, or any process whose
  environment carries the token (an orphan, reparented away from pytest) (``session_processes``).

What it names is then removed or killed, so one leak does not pile up run after run, and the
private directory goes, basetemp included: a run leaves nothing in ``/tmp`` (``tmp_path``
directories are not kept for a look after the run; ``--basetemp`` keeps them where it says). Both
checks look only at what is this session's own (its directory, its token), so tests that other
sessions run on the machine at the same time cannot make it fail.
"""

from __future__ import annotations

import contextlib
import gc
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import pytest

PLUGIN_NAME = "gpu-dra-leakcheck"
TOKEN_VARIABLE = "GPU_DRA_TEST_SESSION"
GRACE_S = 5.0  # how long processes get to finish exiting after the last test
_PROC = Path("/proc")


@dataclass(frozen=True)
class SessionProcess:
    """A live process of this session: its pid and command line."""

    pid: int
    command: str


def leftover_entries(directory: Path) -> list[Path]:
    """The entries of ``directory``, sorted; none when it is missing."""
    try:
        return sorted(directory.iterdir())
    except FileNotFoundError:
        return []


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of ``pid``; None when it is gone."""
    try:
        after_comm = (_PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return after_comm[0], int(after_comm[1])


def _has_token(pid: int, token: str) -> bool:
    try:
        environ = (_PROC / str(pid) / "environ").read_bytes()
    except OSError:
        return False
    return f"{TOKEN_VARIABLE}={token}".encode() in environ.split(b"\0")


def _command(pid: int) -> str:
    try:
        raw = (_PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return "?"
    return raw.replace(b"\0", b" ").decode(errors="replace").strip() or "?"


def session_processes(*, root_pid: int, token: str) -> list[SessionProcess]:
    """Live processes (zombies are dead) that descend from ``root_pid`` or whose environment
    carries ``token``; ``root_pid`` itself excluded. Sorted by pid."""
    parents: dict[int, int] = {}
    states: dict[int, str] = {}
    for entry in _PROC.iterdir():
        if entry.name.isdigit():
            found = _stat(int(entry.name))
            if found is not None:
                states[int(entry.name)], parents[int(entry.name)] = found
    ours: set[int] = set()
    for pid in parents:
        ancestor = parents.get(pid)
        seen = {pid}
        while ancestor is not None and ancestor not in seen:
            if ancestor == root_pid:
                ours.add(pid)
                break
            seen.add(ancestor)
            ancestor = parents.get(ancestor)
        if pid not in ours and pid != root_pid and _has_token(pid, token):
            ours.add(pid)
    return [
        SessionProcess(pid=pid, command=_command(pid))
        for pid in sorted(ours)
        if states.get(pid) != "Z"
    ]


def _wait_for_exits(*, root_pid: int, token: str, grace_s: float) -> list[SessionProcess]:
    deadline = time.monotonic() + grace_s
    while True:
        alive = session_processes(root_pid=root_pid, token=token)
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.05)


def _kill(processes: Collection[SessionProcess]) -> None:
    for process in processes:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(process.pid, signal.SIGKILL)


class LeakCheck:
    """The plugin object: set up at configure, checked at session finish, undone at unconfigure."""

    def __init__(self) -> None:
        self.token = secrets.token_hex(8)
        self._saved_env = {k: os.environ.get(k) for k in ("TMPDIR", TOKEN_VARIABLE)}
        self._saved_debug_temproot = os.environ.get("PYTEST_DEBUG_TEMPROOT")
        self._saved_tempdir = tempfile.tempdir
        outer = tempfile.gettempdir()
        # pytest's basetemp stays in the usual temporary directory (short Unix socket paths,
        # pytest's own retention of the last runs).
        os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", outer)
        self.directory = Path(tempfile.mkdtemp(prefix="gdtests-", dir=outer))
        # Every tmp_path under the private directory: no shorter than pytest's own
        # (/tmp/pytest-of-<user>/pytest-<n>), so Unix socket paths stay within their limit.
        self.basetemp = self.directory / "pytest"
        os.environ["TMPDIR"] = tempfile.tempdir = str(self.directory)
        os.environ[TOKEN_VARIABLE] = self.token

    def problems(self) -> list[str]:
        """What this session left behind, one line each; removes and kills what it names."""
        gc.collect()  # objects whose finalizers remove their files (weakref.finalize)
        _stop_resource_tracker()
        alive = _wait_for_exits(root_pid=os.getpid(), token=self.token, grace_s=GRACE_S)
        lines = [f"process {p.pid} still running: {p.command}" for p in alive]
        _kill(alive)
        for entry in leftover_entries(self.directory):
            if entry == self.basetemp:
                continue
            lines.append(f"left in the temporary directory: {entry.name}")
        return lines

    @pytest.hookimpl(trylast=True)  # after the session's fixtures are torn down
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        lines = self.problems()
        if not lines:
            return
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        title = "left behind by the tests (tests/leakcheck.py)"
        if reporter is not None:
            reporter.write_sep("=", title, red=True, bold=True)
            for line in lines:
                reporter.write_line(line, red=True)
        else:
            print(title, *lines, sep="\n", file=sys.stderr)
        if session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED  # (an interrupted run stays so)

    def pytest_unconfigure(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
        tempfile.tempdir = self._saved_tempdir
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if self._saved_debug_temproot is None:
            os.environ.pop("PYTEST_DEBUG_TEMPROOT", None)


def _stop_resource_tracker() -> None:
    """Stop multiprocessing's resource tracker if a test started it (a ``spawn`` context's
    Event does): the interpreter's own helper process, which would otherwise stop only when
    pytest exits, after this check."""
    from multiprocessing import resource_tracker  # noqa: PLC0415  (only when a test used it)

    stop = getattr(resource_tracker._resource_tracker, "_stop", None)
    if stop is not None:
        stop()


def install(config: pytest.Config) -> None:
    """Check this session (from a ``pytest_configure`` hook that runs before pytest's own, so
    that the basetemp it sets is the one pytest uses)."""
    if not config.pluginmanager.has_plugin(PLUGIN_NAME):
        check = LeakCheck()
        if config.option.basetemp is None:
            config.option.basetemp = str(check.basetemp)
        config.pluginmanager.register(check, PLUGIN_NAME)
