"""fsutil.py's file calls: the ones through libc with the interpreter lock held (for a CDI
directory on a tmpfs) do what the ``os`` ones do, errors included."""

from __future__ import annotations

import errno
import os
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from dra_driver.fsutil import OS_CALLS, FileCalls, held_calls


@pytest.fixture(params=["os", "held"])
def calls(request: pytest.FixtureRequest) -> FileCalls:
    return OS_CALLS if request.param == "os" else held_calls()


@pytest.fixture
def memory_dir() -> Iterator[Path]:
    """A directory on /dev/shm (a tmpfs, as a node's /run/cdi), else the test's own."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(dir=base) as d:
        yield Path(d)


def test_the_held_calls_are_libcs_not_the_os_modules() -> None:
    held = held_calls()
    assert held is not OS_CALLS and type(held) is not FileCalls
    assert held_calls() is held  # one libc handle for the process


def test_a_file_written_renamed_and_unlinked_as_os_does(calls: FileCalls, memory_dir: Path) -> None:
    temp, final = f"{memory_dir}/.spec.tmp", f"{memory_dir}/spec.json"
    fd = calls.create(temp)
    calls.write_all(fd, b"x" * 70_000 + b"\n")  # more than one page, and than a pipe takes
    calls.rename(temp, final)
    calls.close(fd)
    assert Path(final).read_bytes() == b"x" * 70_000 + b"\n"
    assert not Path(temp).exists()
    assert (os.stat(final).st_mode & 0o777) == 0o644 & ~_umask()
    calls.unlink(final)
    assert list(memory_dir.iterdir()) == []


def test_each_call_fails_with_the_os_modules_error_naming_the_path(
    calls: FileCalls, memory_dir: Path
) -> None:
    there = memory_dir / "there"
    there.write_bytes(b"")
    missing = memory_dir / "missing"
    with pytest.raises(FileExistsError) as created:
        calls.create(str(there))
    assert created.value.filename == str(there) and created.value.errno == errno.EEXIST
    with pytest.raises(FileNotFoundError) as renamed:
        calls.rename(missing, memory_dir / "elsewhere")
    assert renamed.value.filename == str(missing)
    assert renamed.value.filename2 == str(memory_dir / "elsewhere")
    with pytest.raises(FileNotFoundError) as unlinked:
        calls.unlink(missing)
    assert unlinked.value.filename == str(missing)
    assert str(unlinked.value) == f"[Errno 2] No such file or directory: '{missing}'"
    with pytest.raises(OSError) as closed:
        calls.close(_closed_fd())
    assert closed.value.errno == errno.EBADF
    with pytest.raises(OSError) as written:
        calls.write_all(_closed_fd(), b"x")
    assert written.value.errno == errno.EBADF
    assert sorted(p.name for p in memory_dir.iterdir()) == ["there"]


def test_held_calls_from_many_threads_lose_no_file(memory_dir: Path) -> None:
    """Each thread's calls are whole: 8 threads writing and renaming 50 files each."""
    held = held_calls()

    def work(n: int) -> None:
        for i in range(50):
            temp, final = f"{memory_dir}/.{n}.{i}.tmp", f"{memory_dir}/{n}.{i}"
            fd = held.create(temp)
            held.write_all(fd, f"{n}.{i}".encode())
            held.rename(temp, final)
            held.close(fd)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    files = {p.name: p.read_text() for p in memory_dir.iterdir()}
    assert files == {f"{n}.{i}": f"{n}.{i}" for n in range(8) for i in range(50)}


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _closed_fd() -> int:
    fd = os.open(os.devnull, os.O_RDONLY)
    os.close(fd)
    return fd
