"""checkpoint.py on real files: format, damage handling, group commit, two instances."""

from __future__ import annotations

import json
import multiprocessing
import threading
import time
from pathlib import Path

import pytest

from dra_driver.checkpoint import (
    PREPARE_COMPLETED,
    PREPARE_STARTED,
    Checkpoint,
    ClaimLocks,
    ClaimRecord,
    PreparedDevice,
    decode,
)
from dra_driver.errors import CheckpointCorrupt


def record(uid: str, phase: str = PREPARE_COMPLETED) -> ClaimRecord:
    device = PreparedDevice(
        ("gpus",),
        "node1",
        "gpu-0",
        (f"k8s.gpu.nvidia.com/claim={uid}-gpu-0",),
        config={"kind": "GpuConfig"},
    )
    return ClaimRecord(uid, "default", "c", phase, (device,))  # type: ignore[arg-type]


def open_checkpoint(tmp: Path, boot: str = "boot-1") -> Checkpoint:
    (tmp / "boot_id").write_text(boot + "\n")
    cp = Checkpoint(tmp / "plugin/checkpoint.json", boot_id_path=tmp / "boot_id")
    cp.open()
    return cp


def test_records_survive_a_restart_with_checksum_and_boot_id(tmp_path: Path) -> None:
    cp = open_checkpoint(tmp_path)
    cp.transact(lambda claims: claims.__setitem__("u1", record("u1")))
    cp.close()
    raw = (tmp_path / "plugin/checkpoint.json").read_bytes()
    obj = json.loads(raw)
    assert obj["version"] == 1 and len(obj["checksum"]) == 64 and obj["data"]["bootId"] == "boot-1"
    again = open_checkpoint(tmp_path)
    assert again.snapshot() == {"u1": record("u1")}


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda raw: raw[: len(raw) // 2], "not valid JSON"),
        (lambda raw: b"\x00\xff garbage", "not valid JSON"),
        (lambda raw: raw.replace(b"gpu-0", b"gpu-1"), "checksum"),
        (lambda raw: raw.replace(b'"version":1', b'"version":7'), "version 7 is not supported"),
        (lambda raw: b"", "not valid JSON"),
    ],
)
def test_a_damaged_checkpoint_is_moved_aside_and_never_stops_the_start(
    tmp_path: Path, damage, reason: str
) -> None:  # type: ignore[no-untyped-def]
    cp = open_checkpoint(tmp_path)
    cp.transact(lambda claims: claims.__setitem__("u1", record("u1")))
    cp.close()
    path = tmp_path / "plugin/checkpoint.json"
    path.write_bytes(damage(path.read_bytes()))
    reported: list[str] = []
    again = Checkpoint(path, boot_id_path=tmp_path / "boot_id")
    again.on_corrupt = lambda moved, why: reported.append(why)
    report = again.open()
    assert report.corrupt_moved_to is not None and report.corrupt_moved_to.name.startswith(
        "checkpoint.json.corrupt-"
    )
    assert reason in report.corrupt_reason and reported == [report.corrupt_reason]
    assert again.snapshot() == {}
    again.transact(lambda claims: claims.__setitem__("u2", record("u2")))
    assert decode(path.read_bytes())[1] == {"u2": record("u2")}


def test_a_checkpoint_from_an_earlier_boot_counts_nothing_as_prepared(tmp_path: Path) -> None:
    cp = open_checkpoint(tmp_path)
    cp.transact(lambda claims: claims.__setitem__("u1", record("u1")))
    cp.close()
    again = open_checkpoint(tmp_path, boot="boot-2")
    assert again.snapshot() == {}
    assert decode((tmp_path / "plugin/checkpoint.json").read_bytes())[0] == "boot-2"


def test_a_failing_transaction_changes_nothing_and_does_not_fail_the_others(tmp_path: Path) -> None:
    cp = open_checkpoint(tmp_path)

    def bad(claims: object) -> None:
        raise ValueError("refused")

    with pytest.raises(ValueError, match="refused"):
        cp.transact(bad)
    cp.transact(lambda claims: claims.__setitem__("u1", record("u1")))
    assert set(cp.snapshot()) == {"u1"}


def test_concurrent_transactions_are_all_applied_and_share_writes(tmp_path: Path) -> None:
    cp = open_checkpoint(tmp_path)
    writes = 0
    original = cp._write_locked

    def counting(*, durable: bool = True) -> None:
        nonlocal writes
        writes += 1
        time.sleep(0.002)  # a slow disk makes the next writers queue up
        original(durable=durable)

    cp._write_locked = counting  # type: ignore[method-assign]
    threads = [
        threading.Thread(
            target=cp.transact, args=(lambda c, i=i: c.__setitem__(f"u{i}", record(f"u{i}")),)
        )
        for i in range(50)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(decode((tmp_path / "plugin/checkpoint.json").read_bytes())[1]) == {
        f"u{i}" for i in range(50)
    }
    assert writes < 50  # group commit


def test_two_instances_see_each_others_changes(tmp_path: Path) -> None:
    a = open_checkpoint(tmp_path)
    b = Checkpoint(tmp_path / "plugin/checkpoint.json", boot_id_path=tmp_path / "boot_id")
    b.open()
    a.transact(lambda claims: claims.__setitem__("u1", record("u1", PREPARE_STARTED)))
    assert b.get("u1") == record("u1", PREPARE_STARTED)
    b.transact(lambda claims: claims.discard("u1"))
    assert a.get("u1") is None


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


def test_decode_rejects_a_file_that_is_not_ours() -> None:
    with pytest.raises(CheckpointCorrupt, match="missing data or checksum"):
        decode(b'{"version": 1}')
