"""prepare/state/instances.py: an instance alone on the node works without locks against other
instances; a second one waits until the first shares, then both take every lock; a solo
instance lets a newcomer in only after its operations in flight; the checkpoint and the claim
locks follow (checkpoint.py, checkpointlocks.py)."""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dra_driver.prepare.state.checkpoint import (
    Checkpoint,
)
from dra_driver.prepare.state.checkpointlocks import ClaimLocks
from dra_driver.prepare.state.instances import Instances
from tests.claimdata import checkpoint_record

CHECK_S = 0.02


def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


@pytest.fixture
def instances(tmp_path: Path) -> Iterator[Callable[[], Instances]]:
    made: list[Instances] = []

    def make() -> Instances:
        instance = Instances(tmp_path / "instances.lock", check_s=CHECK_S)
        made.append(instance)
        return instance

    yield make
    for instance in made:
        instance.close()


def opened(instance: Instances, *, allow: bool = True) -> Instances:
    instance.open()
    if allow:
        instance.allow_solo()
    return instance


def test_an_instance_alone_is_solo_and_its_operations_say_so(
    instances: Callable[[], Instances],
) -> None:
    first = opened(instances())
    assert first.solo and first.generation == 1
    with first.op() as alone:
        assert alone
    # an operation left by an error is done too: a newcomer is not held off by it
    with pytest.raises(RuntimeError), first.op():
        raise RuntimeError("inside")
    assert first._solo_ops == 0


def test_solo_only_once_allowed(instances: Callable[[], Instances]) -> None:
    """While the checkpoint is shared with an earlier release's agent (which knows nothing of
    the lock file) the instance never goes solo."""
    first = opened(instances(), allow=False)
    time.sleep(5 * CHECK_S)
    assert not first.solo
    with first.op() as alone:
        assert not alone


def test_a_newcomer_waits_for_the_solo_instance_to_share_then_neither_is_solo(
    instances: Callable[[], Instances],
) -> None:
    first = opened(instances())
    second = instances()
    started = time.monotonic()
    opened(second)
    assert time.monotonic() - started < 2.0
    assert not first.solo and not second.solo
    time.sleep(5 * CHECK_S)  # both keep trying: neither may be solo while the other is there
    assert not first.solo and not second.solo
    with first.op() as a, second.op() as b:
        assert not a and not b
    second.close()
    until(lambda: first.solo)
    assert first.generation == 2


def test_the_newcomer_gets_in_only_after_the_operations_in_flight(
    instances: Callable[[], Instances],
) -> None:
    first = opened(instances())
    second = instances()
    in_flight = first.op()
    assert in_flight.__enter__()
    arrived = threading.Event()

    def arrive() -> None:
        second.open()
        arrived.set()

    thread = threading.Thread(target=arrive)
    thread.start()
    until(lambda: not first.solo)  # noticed: operations from now on take the locks
    with first.op() as alone:
        assert not alone
    time.sleep(5 * CHECK_S)
    assert not arrived.is_set()  # still held off by the solo operation in flight
    in_flight.__exit__(None, None, None)
    assert arrived.wait(5)
    thread.join()


def test_a_killed_solo_instance_lets_the_newcomer_in(
    instances: Callable[[], Instances], tmp_path: Path
) -> None:
    """Its locks go with its file (here: closed without a word, as a kill closes it)."""
    first = opened(instances())
    assert first.solo
    assert first._watcher is not None
    first._stopping.set()
    first._watcher.join()
    os.close(first._fd)
    first._fd = -1
    second = opened(instances())
    assert second.solo


def test_claim_locks_skip_lockf_only_while_solo(
    instances: Callable[[], Instances], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = opened(instances())
    locks = ClaimLocks(tmp_path / "claims.lock", instances=first)
    locks.open()
    calls: list[int] = []
    real = fcntl.lockf
    monkeypatch.setattr(fcntl, "lockf", lambda *a: (calls.append(a[1]), real(*a))[1])
    with locks.hold("a"), locks.try_hold("b") as held:
        assert held
    assert calls == []
    second = opened(instances())
    with locks.hold("a"), locks.try_hold("b") as held:
        assert held
    assert len(calls) == 4  # each: lock and unlock
    second.close()
    locks.close()


def test_a_checkpoint_that_becomes_solo_again_first_catches_up_with_the_other_instance(
    instances: Callable[[], Instances], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "checkpoint.json"
    boot = tmp_path / "boot_id"
    boot.write_text("boot-1\n")
    first = opened(instances())
    mine = Checkpoint(path, boot_id_path=boot, instances=first)
    mine.open()
    mine.transact(lambda claims: claims.__setitem__("a", checkpoint_record("a", "gpu-0")))
    second = opened(instances())
    theirs = Checkpoint(path, boot_id_path=boot, instances=second)
    theirs.open()
    assert theirs.get("a") is not None
    theirs.transact(lambda claims: claims.__setitem__("b", checkpoint_record("b", "gpu-1")))
    theirs.close()
    second.close()
    until(lambda: first.solo)
    assert mine.get("b") is not None  # caught up once solo again
    # from then on: no file lock, no look at the files
    monkeypatch.setattr(
        "dra_driver.prepare.state.checkpointfiles.CheckpointFiles.change",
        lambda self: pytest.fail("looked at the files while solo and caught up"),
    )
    monkeypatch.setattr(
        "dra_driver.prepare.state.checkpointfiles.fcntl.flock",
        lambda *a: pytest.fail("took the file lock while solo and caught up"),
    )
    assert mine.get("b") is not None
    mine.transact(lambda claims: claims.__setitem__("c", checkpoint_record("c", "gpu-2")))
    monkeypatch.undo()
    mine.close()
    reread = Checkpoint(path, boot_id_path=boot)
    reread.open()
    assert set(reread.snapshot()) == {"a", "b", "c"}
    reread.close()


def test_without_open_file_description_locks_an_instance_never_goes_solo(
    instances: Callable[[], Instances], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file system that refuses the locks: the agent starts and takes every lock."""

    def refuse(*args: object) -> bytes:
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr("dra_driver.prepare.state.instances.fcntl.fcntl", refuse)
    first = opened(instances())
    assert not first.solo
    with first.op() as alone:
        assert not alone
