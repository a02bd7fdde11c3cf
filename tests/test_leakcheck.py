"""The session-wide check that the tests leave nothing behind (tests/leakcheck.py): it names a
leaked temporary directory and a leftover process, removes and kills them, and fails the run;
a run that leaves nothing passes, and processes of other sessions never count."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import leakcheck

ROOT = Path(__file__).resolve().parent.parent
CONFTEST = """
import pytest
from tests import leakcheck

@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    leakcheck.install(config)
"""


def run_session(tmp_path: Path, tests: str) -> subprocess.CompletedProcess[str]:
    """A pytest session of its own over ``tests``, with the check installed as the suite's."""
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_sample.py").write_text(tests)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", tmp_path],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def gone(pid: int) -> bool:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.02)
    return False


def test_a_session_that_leaves_a_directory_and_a_process_fails_and_names_both(
    tmp_path: Path,
) -> None:
    run = run_session(
        tmp_path,
        "import subprocess, tempfile\n"
        "def test_leaks():\n"
        "    tempfile.mkdtemp(prefix='gpu-dra-sysfs-')\n"
        "    subprocess.Popen(['sleep', '120'])\n",
    )

    assert run.returncode == 1, run.stdout + run.stderr
    assert "1 passed" in run.stdout
    assert re.search(r"left in the temporary directory: gpu-dra-sysfs-\w+", run.stdout)
    found = re.search(r"process (\d+) still running: sleep 120", run.stdout)
    assert found, run.stdout
    assert gone(int(found[1]))  # killed


def test_a_session_that_cleans_up_passes(tmp_path: Path) -> None:
    run = run_session(
        tmp_path,
        "import subprocess, tempfile\n"
        "def test_cleans_up(tmp_path):\n"
        "    with tempfile.TemporaryDirectory(prefix='gpu-dra-sysfs-'):\n"
        "        subprocess.run(['true'], check=True)\n"
        "    (tmp_path / 'kept-by-pytest').write_text('')\n",
    )

    assert run.returncode == 0, run.stdout + run.stderr
    assert "left behind" not in run.stdout


@pytest.fixture
def orphan() -> Iterator[tuple[int, str]]:
    """A ``sleep`` whose parent exited (so not a descendant of pytest), started with a token of
    another session in its environment; its pid and that token."""
    token = "other-session"
    started = subprocess.run(
        ["sh", "-c", "sleep 120 >/dev/null 2>&1 & echo $!"],
        env={**os.environ, leakcheck.TOKEN_VARIABLE: token},
        capture_output=True,
        text=True,
        check=True,
    )
    pid = int(started.stdout)
    try:
        yield pid, token
    finally:
        os.kill(pid, signal.SIGKILL)
        assert gone(pid)


def test_processes_are_this_sessions_by_descent_or_by_token(orphan: tuple[int, str]) -> None:
    pid, token = orphan
    child = subprocess.Popen(["sleep", "120"])
    try:
        ours = {p.pid for p in leakcheck.session_processes(root_pid=os.getpid(), token="mine")}
        by_token = leakcheck.session_processes(root_pid=os.getpid(), token=token)
    finally:
        child.kill()
        child.wait()

    assert child.pid in ours and pid not in ours  # another session's orphan never counts
    assert pid in {p.pid for p in by_token}
    assert [p.command for p in by_token if p.pid == pid] == ["sleep 120"]
    assert os.getpid() not in ours


def test_leftover_entries_lists_a_directory_and_nothing_for_a_missing_one(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "a").write_text("")

    assert [p.name for p in leakcheck.leftover_entries(tmp_path)] == ["a", "b"]
    assert leakcheck.leftover_entries(tmp_path / "missing") == []


def test_tmp_path_lives_in_the_sessions_private_directory_which_goes_with_the_session(
    tmp_path: Path,
) -> None:
    session_dir = Path(os.environ["TMPDIR"])
    assert session_dir.name.startswith("gdtests-")
    assert tmp_path.is_relative_to(session_dir / "pytest")
    # no longer than pytest's own basetemp (/tmp/pytest-of-<user>/pytest-<n>): socket paths fit
    assert len(str(session_dir / "pytest")) <= len("/tmp/pytest-of-root/pytest-99")
