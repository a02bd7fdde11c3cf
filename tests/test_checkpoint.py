"""checkpoint.py and checkpointfiles.py on real files: format, journal, damage handling, group
commit, two instances."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from dra_driver.prepare.state.checkpoint import (
    PREPARE_COMPLETED,
    PREPARE_STARTED,
    Checkpoint,
    ClaimRecord,
    PreparedDevice,
    read_state,
)


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
    assert obj["version"] == 2 and len(obj["checksum"]) == 64 and obj["data"]["bootId"] == "boot-1"
    assert (tmp_path / "plugin/checkpoint.journal").read_bytes() == b""  # folded in on close
    again = open_checkpoint(tmp_path)
    assert again.snapshot() == {"u1": record("u1")}


def test_a_snapshot_of_the_earlier_format_is_read_after_an_upgrade(tmp_path: Path) -> None:
    data = {"bootId": "boot-1", "claims": {"u1": record("u1").to_json()}}
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"))
    checksum = hashlib.sha256(canonical.encode()).hexdigest()
    (tmp_path / "plugin").mkdir()
    (tmp_path / "plugin/checkpoint.json").write_text(
        json.dumps({"version": 1, "checksum": checksum, "data": data})
    )
    cp = open_checkpoint(tmp_path)
    assert cp.snapshot() == {"u1": record("u1")}  # no "corrupt" report, nothing rebuilt
    cp.transact(lambda claims: claims.__setitem__("u2", record("u2")))
    cp.close()
    assert json.loads((tmp_path / "plugin/checkpoint.json").read_bytes())["version"] == 2
    assert set(read_state(tmp_path / "plugin/checkpoint.json")[1]) == {"u1", "u2"}


def test_changes_are_journal_appends_that_a_killed_process_leaves_readable(tmp_path: Path) -> None:
    cp = open_checkpoint(tmp_path)
    snapshot = (tmp_path / "plugin/checkpoint.json").read_bytes()
    cp.transact(lambda claims: claims.__setitem__("u1", record("u1", PREPARE_STARTED)))
    cp.transact(lambda claims: claims.__setitem__("u1", record("u1")), durable=False)
    cp.transact(lambda claims: claims.__setitem__("u2", record("u2")))
    cp.transact(lambda claims: claims.discard("u2"))
    # no close: as after kill -9, the snapshot is untouched and the journal holds the changes
    assert (tmp_path / "plugin/checkpoint.json").read_bytes() == snapshot
    lines = (tmp_path / "plugin/checkpoint.journal").read_bytes().splitlines()
    entries = [json.loads(line)["entry"] for line in lines]
    assert [e["seq"] for e in entries] == [1, 2, 3, 4]
    assert entries[3] == {"seq": 4, "put": {}, "del": ["u2"]}
    assert read_state(tmp_path / "plugin/checkpoint.json") == ("boot-1", {"u1": record("u1")})
    again = Checkpoint(tmp_path / "plugin/checkpoint.json", boot_id_path=tmp_path / "boot_id")
    assert again.open().claims == 1
    assert again.snapshot() == {"u1": record("u1")}
    again.transact(lambda claims: claims.__setitem__("u3", record("u3")))
    assert (
        json.loads((tmp_path / "plugin/checkpoint.journal").read_bytes().splitlines()[-1])["entry"][
            "seq"
        ]
        == 5
    )


def test_a_torn_last_journal_line_is_cut_off_and_nothing_else_is_lost(tmp_path: Path) -> None:
    cp = open_checkpoint(tmp_path)
    cp.transact(lambda claims: claims.__setitem__("u1", record("u1")))
    journal = tmp_path / "plugin/checkpoint.journal"
    good = journal.read_bytes()
    cp.transact(lambda claims: claims.__setitem__("u2", record("u2")))
    whole = journal.read_bytes()
    journal.write_bytes(whole[: len(good) + (len(whole) - len(good)) // 2])  # killed mid-append
    reported: list[str] = []
    again = Checkpoint(tmp_path / "plugin/checkpoint.json", boot_id_path=tmp_path / "boot_id")
    again.on_corrupt = lambda moved, why: reported.append(why)
    report = again.open()
    assert report.corrupt_moved_to is None and reported == []
    assert again.snapshot() == {"u1": record("u1")}
    assert journal.read_bytes() == good  # cut back to the last complete line
    again.transact(lambda claims: claims.__setitem__("u3", record("u3")))
    assert set(read_state(tmp_path / "plugin/checkpoint.json")[1]) == {"u1", "u3"}


def test_another_instance_reads_a_torn_tail_as_cut_and_goes_on(tmp_path: Path) -> None:
    a = open_checkpoint(tmp_path)
    b = Checkpoint(tmp_path / "plugin/checkpoint.json", boot_id_path=tmp_path / "boot_id")
    b.open()
    a.transact(lambda claims: claims.__setitem__("u1", record("u1")))
    with (tmp_path / "plugin/checkpoint.journal").open("ab") as f:
        f.write(b'{"checksum":"ab')  # a third instance died mid-append
    assert b.snapshot() == {"u1": record("u1")}
    b.transact(lambda claims: claims.__setitem__("u2", record("u2")))
    assert set(a.snapshot()) == {"u1", "u2"}
    assert set(read_state(tmp_path / "plugin/checkpoint.json")[1]) == {"u1", "u2"}


def _journal_lines(tmp: Path) -> list[bytes]:
    return (tmp / "plugin/checkpoint.journal").read_bytes().splitlines(keepends=True)


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda lines: [lines[0], lines[1].replace(b"gpu-0", b"gpu-1"), lines[2]], "checksum"),
        (lambda lines: [lines[0], b"\x00\xff garbage\n", lines[2]], "not valid JSON"),
        (lambda lines: [lines[0], lines[2]], "expected 2"),
        (lambda lines: [lines[0], b'{"entry": 1}\n'], "not a journal entry"),
    ],
)
def test_a_damaged_journal_is_moved_aside_with_its_snapshot(
    tmp_path: Path, damage, reason: str
) -> None:  # type: ignore[no-untyped-def]
    cp = open_checkpoint(tmp_path)
    for uid in ("u1", "u2", "u3"):
        cp.transact(lambda claims, uid=uid: claims.__setitem__(uid, record(uid)))
    journal = tmp_path / "plugin/checkpoint.journal"
    journal.write_bytes(b"".join(damage(_journal_lines(tmp_path))))
    reported: list[str] = []
    again = Checkpoint(tmp_path / "plugin/checkpoint.json", boot_id_path=tmp_path / "boot_id")
    again.on_corrupt = lambda moved, why: reported.append(why)
    report = again.open()
    assert report.corrupt_moved_to is not None
    assert report.corrupt_moved_to.name.startswith("checkpoint.journal.corrupt-")
    assert reason in report.corrupt_reason and reported == [report.corrupt_reason]
    assert len(list((tmp_path / "plugin").glob("checkpoint.json.corrupt-*"))) == 1
    assert again.snapshot() == {}
    again.transact(lambda claims: claims.__setitem__("u9", record("u9")))
    assert read_state(tmp_path / "plugin/checkpoint.json")[1] == {"u9": record("u9")}


def test_a_journal_without_its_snapshot_is_damage(tmp_path: Path) -> None:
    cp = open_checkpoint(tmp_path)
    cp.transact(lambda claims: claims.__setitem__("u1", record("u1")))
    (tmp_path / "plugin/checkpoint.json").unlink()
    again = Checkpoint(tmp_path / "plugin/checkpoint.json", boot_id_path=tmp_path / "boot_id")
    report = again.open()
    assert "no snapshot" in report.corrupt_reason and again.snapshot() == {}


def test_the_journal_is_folded_into_the_snapshot_and_an_interrupted_fold_is_harmless(
    tmp_path: Path,
) -> None:
    (tmp_path / "boot_id").write_text("boot-1\n")
    path = tmp_path / "plugin/checkpoint.json"
    cp = Checkpoint(path, boot_id_path=tmp_path / "boot_id", compact_after_bytes=4096)
    cp.open()
    journal = tmp_path / "plugin/checkpoint.journal"
    assert not cp.compact()  # empty journal: nothing to fold
    for i in range(5):
        cp.transact(lambda claims, i=i: claims.__setitem__(f"u{i}", record(f"u{i}")))
    assert not cp.compact() and journal.stat().st_size > 0  # below the threshold: kept
    sizes = []
    for i in range(5, 120):  # never compacted by the caller: appends bound the journal
        cp.transact(lambda claims, i=i: claims.__setitem__(f"u{i}", record(f"u{i}")))
        sizes.append(journal.stat().st_size)
    assert max(sizes) < 8 * 4096 + 1024 and 0 in sizes
    for i in range(120, 130):
        cp.transact(lambda claims, i=i: claims.__setitem__(f"u{i}", record(f"u{i}")))
    assert journal.stat().st_size >= 4096 and cp.compact()
    assert journal.read_bytes() == b""
    for i in range(130, 140):
        cp.transact(lambda claims, i=i: claims.__setitem__(f"u{i}", record(f"u{i}")))
    expected = {f"u{i}": record(f"u{i}") for i in range(140)}
    assert read_state(path) == ("boot-1", expected)
    assert json.loads(path.read_bytes())["data"]["seq"] >= 1
    # A crash after the new snapshot but before the journal was emptied: the old lines are
    # already in the snapshot; their sequence numbers say so and they are skipped.
    before = journal.read_bytes()
    cp.transact(lambda claims: claims.discard("u0"))
    stale = journal.read_bytes()
    cp.close()  # folds the journal
    assert journal.read_bytes() == b""
    journal.write_bytes(stale)
    again = Checkpoint(path, boot_id_path=tmp_path / "boot_id")
    report = again.open()
    assert report.corrupt_moved_to is None
    del expected["u0"]
    assert again.snapshot() == expected
    assert len(stale) > len(before)


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda raw: raw[: len(raw) // 2], "not valid JSON"),
        (lambda raw: b"\x00\xff garbage", "not valid JSON"),
        (lambda raw: raw.replace(b"gpu-0", b"gpu-1"), "checksum"),
        (lambda raw: raw.replace(b'"version":2', b'"version":7'), "version 7 is not supported"),
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
    assert read_state(path)[1] == {"u2": record("u2")}


def test_a_checkpoint_from_an_earlier_boot_counts_nothing_as_prepared(tmp_path: Path) -> None:
    cp = open_checkpoint(tmp_path)
    cp.transact(lambda claims: claims.__setitem__("u1", record("u1")))
    cp.close()  # u1 in the snapshot
    cp = open_checkpoint(tmp_path)
    cp.transact(lambda claims: claims.__setitem__("u2", record("u2")))  # u2 in the journal
    (tmp_path / "boot_id").write_text("boot-2\n")
    again = Checkpoint(tmp_path / "plugin/checkpoint.json", boot_id_path=tmp_path / "boot_id")
    assert again.open().discarded_after_reboot == 2
    assert again.snapshot() == {}
    assert read_state(tmp_path / "plugin/checkpoint.json") == ("boot-2", {})
    assert (tmp_path / "plugin/checkpoint.journal").read_bytes() == b""


def test_an_earlier_boots_damaged_journal_is_dropped_not_reported(tmp_path: Path) -> None:
    cp = open_checkpoint(tmp_path)
    cp.transact(lambda claims: claims.__setitem__("u1", record("u1")))
    (tmp_path / "plugin/checkpoint.journal").write_bytes(b"zeros after a power loss\n")
    (tmp_path / "boot_id").write_text("boot-2\n")
    again = Checkpoint(tmp_path / "plugin/checkpoint.json", boot_id_path=tmp_path / "boot_id")
    report = again.open()
    assert report.corrupt_moved_to is None and again.snapshot() == {}


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
    original = cp._append_locked

    def counting(touched: set[str], *, durable: bool = True) -> None:
        nonlocal writes
        writes += 1
        time.sleep(0.002)  # a slow disk makes the next writers queue up
        original(touched, durable=durable)

    cp._append_locked = counting  # type: ignore[method-assign]
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
    assert set(read_state(tmp_path / "plugin/checkpoint.json")[1]) == {f"u{i}" for i in range(50)}
    assert writes < 50  # group commit
    assert len(_journal_lines(tmp_path)) == writes  # one line per group


def test_two_instances_see_each_others_changes(tmp_path: Path) -> None:
    a = open_checkpoint(tmp_path)
    b = Checkpoint(tmp_path / "plugin/checkpoint.json", boot_id_path=tmp_path / "boot_id")
    b.open()
    a.transact(lambda claims: claims.__setitem__("u1", record("u1", PREPARE_STARTED)))
    assert b.get("u1") == record("u1", PREPARE_STARTED)
    b.transact(lambda claims: claims.discard("u1"))
    assert a.get("u1") is None
    b.transact(lambda claims: claims.__setitem__("u3", record("u3")))
    b.close()  # folds the journal into a new snapshot: a reads that, not stale lines
    assert a.get("u3") == record("u3")
    a.transact(lambda claims: claims.discard("u3"))
    a.transact(lambda claims: claims.__setitem__("u2", record("u2")))
    assert set(read_state(tmp_path / "plugin/checkpoint.json")[1]) == {"u2"}


def test_removed_claims_keep_no_cached_json_between_compactions(tmp_path: Path) -> None:
    # A node that prepares and unprepares all day must not hold every claim it ever had until
    # the next compaction (a prepare/unprepare cycle is two appends and no compaction).
    a = open_checkpoint(tmp_path)
    b = Checkpoint(tmp_path / "plugin/checkpoint.json", boot_id_path=tmp_path / "boot_id")
    b.open()
    for i in range(50):
        a.transact(lambda claims, i=i: claims.__setitem__(f"u{i}", record(f"u{i}")))
        assert b.get(f"u{i}") == record(f"u{i}")  # b caught up from the journal's tail
        b.transact(lambda claims, i=i: claims.__setitem__(f"b{i}", record(f"b{i}")))
        b.transact(lambda claims, i=i: claims.discard(f"b{i}"))
        a.transact(lambda claims, i=i: claims.discard(f"u{i}"))
    a.transact(lambda claims: claims.__setitem__("kept", record("kept")))
    assert b.get("kept") == record("kept")
    assert (tmp_path / "plugin/checkpoint.journal").stat().st_size > 0  # never compacted
    assert set(a._fragments) <= {"kept"} and set(b._fragments) <= {"kept"}
    b.close()
    a.close()
    assert set(read_state(tmp_path / "plugin/checkpoint.json")[1]) == {"kept"}


def test_get_needs_no_file_lock_while_nothing_changed_on_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = open_checkpoint(tmp_path)
    b = Checkpoint(tmp_path / "plugin/checkpoint.json", boot_id_path=tmp_path / "boot_id")
    b.open()
    a.transact(lambda claims: claims.__setitem__("u1", record("u1")))
    locks: list[str] = []
    real = a._files.lock

    def counted() -> Any:
        locks.append("lock")
        return real()

    monkeypatch.setattr(a._files, "lock", counted)
    assert a.get("u1") == record("u1") and a.get("u2") is None
    assert locks == []  # answered from memory: its own append is all the disk holds
    b.transact(lambda claims: claims.__setitem__("u2", record("u2")))
    assert a.get("u2") == record("u2")  # another process appended: read under the lock
    assert locks == ["lock"]
    assert a.get("u2") == record("u2") and locks == ["lock"]


def test_a_read_does_not_wait_for_this_processs_commit_in_flight_but_sees_anothers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prepare reads its claim's record while other claims' commit waits for its fsync: its
    own process's append in flight is no change on disk (memory is current), so the read is
    answered at once; another process's append before it is still caught up with."""
    a = open_checkpoint(tmp_path)
    b = Checkpoint(tmp_path / "plugin/checkpoint.json", boot_id_path=tmp_path / "boot_id")
    b.open()
    a.transact(lambda claims: claims.__setitem__("u1", record("u1")))
    b.transact(lambda claims: claims.__setitem__("u2", record("u2")))  # another process
    syncing, release = threading.Event(), threading.Event()
    real_sync = os.fdatasync

    def slow_sync(fd: int) -> None:
        syncing.set()
        assert release.wait(10)
        real_sync(fd)

    monkeypatch.setattr("dra_driver.prepare.state.checkpointfiles.os.fdatasync", slow_sync)
    writer = threading.Thread(
        target=a.transact, args=(lambda claims: claims.__setitem__("u3", record("u3")),)
    )
    writer.start()
    try:
        assert syncing.wait(10)  # a's commit: caught up with b's line, its own line written
        started = time.monotonic()
        assert a.get("u1") == record("u1")
        assert a.get("u2") == record("u2")  # b's append, read by the commit in flight
        assert time.monotonic() - started < 1  # did not wait for the fsync
    finally:
        release.set()
        writer.join()
    b.transact(lambda claims: claims.discard("u1"))  # another process, nothing in flight
    assert a.get("u1") is None
    assert a.get("u3") == record("u3")
