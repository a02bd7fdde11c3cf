"""checkpointlocks.py: a claim's lock excludes other threads and other processes."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

from dra_driver.prepare.state.checkpointlocks import ClaimLocks


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
