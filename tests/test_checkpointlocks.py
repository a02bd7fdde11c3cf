"""checkpointlocks.py: a claim's lock excludes other threads and other processes."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from pathlib import Path

import pytest

from dra_driver.prepare.state.checkpointlocks import ClaimLocks
from tests.claimdata import uid_sharing_the_lock_of


def _hold_claim_lock(
    path: str,
    uid: str,
    held: multiprocessing.synchronize.Event,
    release: multiprocessing.synchronize.Event,
) -> None:  # type: ignore[name-defined]
    locks = ClaimLocks(Path(path))
    locks.open()
    with locks.hold(uid):
        held.set()
        release.wait(10)


def _try_claim_lock(
    path: str, uid: str, got: multiprocessing.sharedctypes.Synchronized[int]
) -> None:  # type: ignore[name-defined]
    locks = ClaimLocks(Path(path))
    locks.open()
    with locks.try_hold(uid) as held:
        got.value = int(held)


def test_claim_locks_exclude_other_processes(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    held, release = ctx.Event(), ctx.Event()
    proc = ctx.Process(
        target=_hold_claim_lock, args=(str(tmp_path / "claims.lock"), "u1", held, release)
    )
    proc.start()
    try:
        assert held.wait(20)
        locks = ClaimLocks(tmp_path / "claims.lock")
        locks.open()
        with locks.try_hold("u1") as got:
            assert not got
        with locks.try_hold("u2-other") as got:
            assert got
        release.set()
        proc.join(10)
        with locks.try_hold("u1") as got:
            assert got
    finally:
        release.set()
        proc.join(10)


def test_claim_locks_exclude_other_threads_and_keep_no_lock_nobody_uses(tmp_path: Path) -> None:
    """Threads of one process on the same claim take turns (a stripe's thread lock, made for
    the first and shared by the waiters); try_hold sees a held claim; once nobody holds or
    waits, no thread lock is kept."""
    locks = ClaimLocks(tmp_path / "claims.lock")
    locks.open()
    inside, most = 0, 0
    count = threading.Lock()

    def work(uid: str) -> None:
        nonlocal inside, most
        for _ in range(50):
            with locks.hold(uid):
                with count:
                    inside += 1
                    most = max(most, inside)
                time.sleep(0.0002)
                with count:
                    inside -= 1

    threads = [threading.Thread(target=work, args=("u1",)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most == 1  # never two threads holding the same claim
    with locks.hold("u1"):
        assert len(locks._threads) == 1
        done: list[bool] = []

        def try_it() -> None:
            with locks.try_hold("u1") as got:
                done.append(got)

        other = threading.Thread(target=try_it)
        other.start()
        other.join()
        assert done == [False]
        with locks.try_hold("u2") as got:
            assert got and len(locks._threads) == 2
    assert locks._threads == {}
    locks.close()


def test_a_hold_left_by_an_exception_lets_go_of_everything(tmp_path: Path) -> None:
    """An error inside ``with hold`` releases the thread lock and the file lock, and keeps no
    stripe lock; so does a hold whose file lock could not be taken."""
    locks = ClaimLocks(tmp_path / "claims.lock")
    locks.open()
    with pytest.raises(RuntimeError), locks.hold("u1"):
        raise RuntimeError("inside")
    assert locks._threads == {}
    with locks.try_hold("u1") as held:
        assert held  # nobody holds it: neither the thread lock nor the byte in the file
    os.close(locks._fd)  # the file lock cannot be taken now: the hold fails, leaves nothing
    with pytest.raises(OSError), locks.hold("u1"):
        pass
    assert locks._threads == {}
    locks._fd = -1


def test_try_hold_of_a_claim_on_the_stripe_the_caller_holds(tmp_path: Path) -> None:
    """A prepare holding claim A's lock asks for claim B's (to clear a stale B): when B shares
    A's stripe, B is held by the caller already: try_hold yields True, and taking nothing, it
    lets go of nothing (another thread and another process still find A held)."""
    locks = ClaimLocks(tmp_path / "claims.lock")
    locks.open()
    a = "claim-a"
    b = uid_sharing_the_lock_of(a)
    ctx = multiprocessing.get_context("spawn")
    with locks.hold(a):
        with locks.try_hold(b) as got:
            assert not got  # without saying what it holds: its own stripe is busy
        with locks.try_hold(b, holding=a) as got:
            assert got
        with locks.try_hold("u-elsewhere", holding=a) as got:
            assert got and len(locks._threads) == 2  # another stripe: taken as usual
        seen: list[bool] = []

        def try_a() -> None:
            with locks.try_hold(a) as held:
                seen.append(held)

        other = threading.Thread(target=try_a)
        other.start()
        other.join()
        value = ctx.Value("i", -1)
        proc = ctx.Process(target=_try_claim_lock, args=(str(tmp_path / "claims.lock"), a, value))
        proc.start()
        proc.join(20)
        assert (seen, value.value) == ([False], 0)
    assert locks._threads == {}
    locks.close()
