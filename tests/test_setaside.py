"""Damaged checkpoints set aside stay bounded in number and size, oldest removed first, each
removal logged (issue 37: 12 files after six restarts, one of 50 MB)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from dra_driver.prepare import setaside
from dra_driver.prepare.state.checkpoint import Checkpoint

NAMES = ("checkpoint.json", "checkpoint.journal")


def make(directory: Path, name: str, size: int) -> Path:
    path = directory / name
    path.write_bytes(b"x" * size)
    return path


def test_the_newest_are_kept_within_the_count_and_the_oldest_removed_with_a_log_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    names = [
        f"checkpoint.json.corrupt-2026010{day}T000000Z{suffix}"
        for day in range(1, 5)
        for suffix in ("", "-1")
    ]
    for name in names:
        make(tmp_path, name, 10)
    other = make(tmp_path, "checkpoint.json.stale-20250101T000000Z", 10)
    unrelated = make(tmp_path, "other.json.corrupt-20250101T000000Z", 10)
    with caplog.at_level(logging.WARNING):
        removed = setaside.prune(tmp_path, names=NAMES, kind="corrupt", max_files=3)
    # newest first: day 4 "-1", day 4, day 3 "-1"
    assert sorted(p.name for p in tmp_path.iterdir() if "corrupt-2026" in p.name) == sorted(
        names[-3:]
    )
    assert sorted(p.name for p in removed) == sorted(names[:-3])
    assert other.exists() and unrelated.exists()  # another kind, another file: not ours
    lines = [r for r in caplog.records if r.getMessage().startswith("removed an old set-aside")]
    assert [r.path for r in lines] == [str(p) for p in removed]  # type: ignore[attr-defined]


def test_the_size_bound_removes_old_files_and_cuts_a_huge_newest_one(tmp_path: Path) -> None:
    make(tmp_path, "checkpoint.json.corrupt-20260101T000000Z", 40)
    make(tmp_path, "checkpoint.journal.corrupt-20260102T000000Z", 50)
    make(tmp_path, "checkpoint.json.corrupt-20260103T000000Z", 30)
    setaside.prune(tmp_path, names=NAMES, kind="corrupt", max_bytes=100)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint.journal.corrupt-20260102T000000Z",
        "checkpoint.json.corrupt-20260103T000000Z",
    ]
    make(tmp_path, "checkpoint.json.corrupt-20260104T000000Z", 500)
    setaside.prune(tmp_path, names=NAMES, kind="corrupt", max_bytes=100)
    (kept,) = tmp_path.iterdir()
    assert kept.name == "checkpoint.json.corrupt-20260104T000000Z"
    assert kept.stat().st_size == 100


def test_a_checkpoint_damaged_at_every_start_leaves_a_bounded_pile(tmp_path: Path) -> None:
    plugin = tmp_path / "plugin"
    plugin.mkdir()
    (tmp_path / "boot_id").write_text("boot-1\n")
    path = plugin / "checkpoint.json"
    moved = []
    for _ in range(10):
        path.write_bytes(b"\x00garbage" * 1000)
        (plugin / "checkpoint.journal").write_bytes(b"junk\n")
        checkpoint = Checkpoint(path, boot_id_path=tmp_path / "boot_id")
        report = checkpoint.open()
        checkpoint.close()
        assert report.corrupt_moved_to is not None
        moved.append(report.corrupt_moved_to)
    pile = sorted(p.name for p in plugin.iterdir() if ".corrupt-" in p.name)
    assert len(pile) == setaside.MAX_FILES
    assert moved[-1].name in pile  # the damage just reported is always kept
    assert moved[0].name not in pile
