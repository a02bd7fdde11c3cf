"""The checkpoint's bytes on disk: the snapshot and the journal lines, encoded and verified.

Pure (bytes <-> records); checkpointfiles.py does the file I/O. Two files in the plugin data dir:

- ``checkpoint.json``, the snapshot::

    {"version": 2, "checksum": "<sha256 of data>",
     "data": {"bootId": ..., "seq": <last change>, "claims": {uid: record}}}

- ``checkpoint.journal``, the changes since the snapshot, one JSON line per commit::

    {"checksum": "<sha256 of entry>", "entry": {"seq": n, "put": {uid: record}, "del": [uid]}}

Checksums are over the canonical JSON (sorted keys, no spaces) of ``data`` and ``entry``.
Snapshots of the earlier snapshot-only format (version 1, no ``seq``) are read; snapshots are
written as version 2. Anything that cannot be used raises CheckpointCorrupt saying why.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dra_driver.errors import CheckpointCorrupt
from dra_driver.prepare.state.checkpointrecords import ClaimRecord

VERSION = 2
READABLE_VERSIONS = (1, 2)  # 1: the snapshot-only format of earlier releases (no "seq")


@dataclass(frozen=True)
class JournalEntry:
    """One journal line: the claims a group commit put and deleted."""

    seq: int
    put: dict[str, ClaimRecord]
    delete: tuple[str, ...]


def record_json(record: ClaimRecord) -> str:
    """A claim record's canonical JSON, as it appears in the snapshot and the journal."""
    return canonical(record.to_json())


def encode_snapshot(*, boot_id: str, seq: int, claims: Sequence[str]) -> bytes:
    """The snapshot file's bytes; ``claims`` are the ``"<uid>":<record_json>`` members, in
    UID order."""
    data = f'{{"bootId":{json.dumps(boot_id)},"claims":{{{",".join(claims)}}},"seq":{seq}}}'
    checksum = hashlib.sha256(data.encode()).hexdigest()
    return f'{{"version":{VERSION},"checksum":"{checksum}","data":{data}}}\n'.encode()


def encode_journal_line(*, seq: int, put: Sequence[str], delete: Sequence[str]) -> bytes:
    """One journal line, newline-terminated; ``put`` are ``"<uid>":<record_json>`` members in
    UID order, ``delete`` the removed UIDs, sorted."""
    entry = f'{{"del":{canonical(list(delete))},"put":{{{",".join(put)}}},"seq":{seq}}}'
    checksum = hashlib.sha256(entry.encode()).hexdigest()
    return f'{{"checksum":"{checksum}","entry":{entry}}}\n'.encode()


def claim_member(uid: str, record_json: str) -> str:
    """``"<uid>":<record JSON>``: one member of the snapshot's ``claims`` or an entry's ``put``."""
    return f"{json.dumps(uid)}:{record_json}"


def decode(raw: bytes) -> tuple[str, dict[str, ClaimRecord]]:
    """Parse and verify a snapshot file; CheckpointCorrupt says why it cannot be used."""
    boot_id, _, claims = decode_snapshot(raw)
    return boot_id, claims


def decode_snapshot(raw: bytes) -> tuple[str, int, dict[str, ClaimRecord]]:
    """A snapshot file's boot ID, sequence number (0 for version 1) and claims."""
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointCorrupt(f"not valid JSON ({exc})") from exc
    if not isinstance(obj, dict):
        raise CheckpointCorrupt("not a JSON object")
    version = obj.get("version")
    if not isinstance(version, int) or version not in READABLE_VERSIONS:
        raise CheckpointCorrupt(
            f"version {version!r} is not supported (this plugin reads "
            f"{', '.join(map(str, READABLE_VERSIONS))})"
        )
    data = obj.get("data")
    checksum = obj.get("checksum")
    if not isinstance(data, dict) or not isinstance(checksum, str):
        raise CheckpointCorrupt("missing data or checksum")
    if hashlib.sha256(canonical(data).encode()).hexdigest() != checksum:
        raise CheckpointCorrupt("checksum does not match the content")
    try:
        boot_id = str(data["bootId"])
        seq = data["seq"] if version >= 2 else 0
        if not isinstance(seq, int) or seq < 0:
            raise ValueError(f"bad sequence number {seq!r}")
        claims = {
            str(uid): ClaimRecord.from_json(str(uid), rec) for uid, rec in data["claims"].items()
        }
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointCorrupt(f"malformed content ({exc!r})") from exc
    return boot_id, seq, claims


def parse_journal(
    raw: bytes, *, after_seq: int, strict: bool = False
) -> tuple[list[JournalEntry], int, bool]:
    """Verified entries of journal bytes that follow snapshot/entry ``after_seq``.

    Returns the entries, how many bytes of complete lines were read, and whether the bytes end
    in a torn line (no newline: a writer killed mid-append). Lines the snapshot already holds
    (``seq <= after_seq``, left by a compaction interrupted before it emptied the journal) are
    skipped, unless ``strict`` (reading on from a known point, where every line must be new).
    A damaged complete line or a gap in the sequence raises CheckpointCorrupt.
    """
    entries: list[JournalEntry] = []
    expected = after_seq + 1
    pos = 0
    while pos < len(raw):
        newline = raw.find(b"\n", pos)
        if newline < 0:
            return entries, pos, True
        entry = _decode_entry(raw[pos:newline], where=f"journal line at byte {pos}")
        if entry.seq != expected:
            if entry.seq < expected and not entries and not strict:
                pos = newline + 1
                continue
            raise CheckpointCorrupt(
                f"journal line at byte {pos} has sequence number {entry.seq}, "
                f"expected {expected} (lines are missing or out of order)"
            )
        entries.append(entry)
        expected += 1
        pos = newline + 1
    return entries, pos, False


def _decode_entry(line: bytes, *, where: str) -> JournalEntry:
    try:
        obj = json.loads(line)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointCorrupt(f"{where}: not valid JSON ({exc})") from exc
    if not isinstance(obj, dict) or not isinstance(obj.get("entry"), dict):
        raise CheckpointCorrupt(f"{where}: not a journal entry")
    entry = obj["entry"]
    if hashlib.sha256(canonical(entry).encode()).hexdigest() != obj.get("checksum"):
        raise CheckpointCorrupt(f"{where}: checksum does not match the content")
    try:
        seq = entry["seq"]
        if not isinstance(seq, int):
            raise TypeError(f"bad sequence number {seq!r}")
        put = {str(uid): ClaimRecord.from_json(str(uid), rec) for uid, rec in entry["put"].items()}
        delete = tuple(str(uid) for uid in entry["del"])
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointCorrupt(f"{where}: malformed content ({exc!r})") from exc
    return JournalEntry(seq=seq, put=put, delete=delete)


def apply_entries(claims: dict[str, ClaimRecord], entries: list[JournalEntry], seq: int) -> int:
    """Apply journal entries to ``claims`` in order; return the last sequence number."""
    for entry in entries:
        claims.update(entry.put)
        for uid in entry.delete:
            claims.pop(uid, None)
        seq = entry.seq
    return seq


def canonical(obj: Any) -> str:
    """The JSON that checksums are taken over: sorted keys, no spaces."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))
