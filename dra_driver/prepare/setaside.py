"""Files set aside for an operator to look at, kept to a bounded number and size.

Place in the flow: the checkpoint (state/checkpointfiles.py) moves a damaged snapshot and its
journal aside as ``<name>.corrupt-<stamp>[-<n>]`` (and reports it) instead of deleting them. A
node whose checkpoint is damaged at every start (a failing disk, a tool that keeps writing into
the directory) would pile them up without end: 12 files after six restarts, one of 50 MB
(issue 37). :func:`prune` keeps the newest ones within :data:`MAX_FILES` and :data:`MAX_BYTES`,
removes the oldest first and logs each removal. The newest file is always kept (the damage just
reported), cut to :data:`MAX_BYTES` when it alone is larger: its beginning says what it was.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable
from pathlib import Path

from dra_driver.fsutil import fsync_dir

log = logging.getLogger(__name__)

MAX_FILES = 6  # three damaged (snapshot, journal) pairs
MAX_BYTES = 64 * 1024 * 1024  # all of them together


def prune(
    directory: Path,
    *,
    names: Iterable[str],
    kind: str,
    max_files: int = MAX_FILES,
    max_bytes: int = MAX_BYTES,
) -> list[Path]:
    """Keep the newest ``<name>.<kind>-<stamp>[-<n>]`` files of ``names`` in ``directory``
    within ``max_files`` and ``max_bytes`` (newest: the latest stamp, then the highest ``n``);
    remove the others, oldest first, and return them. Idempotent; a file another process removed
    meanwhile is skipped. An OSError while removing is logged and the file left."""
    pattern = re.compile(
        rf"^(?:{'|'.join(re.escape(n) for n in names)})\.{re.escape(kind)}-"
        r"(?P<stamp>\d{8}T\d{6}Z)(?:-(?P<n>\d+))?$"
    )
    found = []
    for entry in os.scandir(directory):
        match = pattern.match(entry.name)
        if match is None or not entry.is_file(follow_symlinks=False):
            continue
        try:
            size = entry.stat(follow_symlinks=False).st_size
        except FileNotFoundError:
            continue
        found.append(((match["stamp"], int(match["n"] or 0), entry.name), Path(entry.path), size))
    found.sort(reverse=True)
    removed: list[Path] = []
    kept_files = kept_bytes = 0
    for index, (_, path, size) in enumerate(found):
        if index == 0 and size > max_bytes:
            _cut(path, max_bytes)
        kept_size = min(size, max_bytes) if index == 0 else size
        if kept_files < max_files and kept_bytes + kept_size <= max_bytes:
            kept_files += 1
            kept_bytes += kept_size
            continue
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.warning(
                "cannot remove an old set-aside file", extra={"path": str(path), "error": str(exc)}
            )
            continue
        log.warning(
            "removed an old set-aside file (at most %d files, %d MiB are kept)",
            max_files,
            max_bytes // (1024 * 1024),
            extra={"path": str(path), "bytes": size},
        )
        removed.append(path)
    if removed:
        fsync_dir(directory)
    return removed


def next_number(paths: Iterable[Path], *, kind: str, stamp: str) -> int:
    """The ``n`` of a new ``<name>.<kind>-<stamp>[-<n>]`` for every one of ``paths``: after
    the highest one taken this second, never a gap :func:`prune` left (``n`` orders the files
    of one second, and prune removes the lowest first). 0 when none is taken."""
    n = 0
    for path in paths:
        prefix = f"{path.name}.{kind}-{stamp}"
        for taken in path.parent.glob(f"{prefix}*"):
            number = taken.name[len(prefix) :].lstrip("-")
            n = max(n, int(number) + 1 if number.isdigit() else 1)
    return n


def _cut(path: Path, max_bytes: int) -> None:
    try:
        os.truncate(path, max_bytes)
    except OSError as exc:
        log.warning("cannot cut a set-aside file", extra={"path": str(path), "error": str(exc)})
        return
    log.warning(
        "cut a set-aside file to its first %d MiB",
        max_bytes // (1024 * 1024),
        extra={"path": str(path)},
    )
