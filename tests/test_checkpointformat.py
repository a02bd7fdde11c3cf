"""checkpointformat.py: the snapshot and journal bytes, pinned, and what is refused."""

from __future__ import annotations

import hashlib
import json

import pytest

from dra_driver.errors import CheckpointCorrupt
from dra_driver.prepare.state.checkpointformat import (
    apply_entries,
    claim_member,
    decode,
    decode_snapshot,
    encode_journal_line,
    encode_snapshot,
    parse_journal,
    record_json,
)
from dra_driver.prepare.state.checkpointrecords import (
    PREPARE_COMPLETED,
    PREPARE_STARTED,
    ClaimRecord,
    PreparedDevice,
)

UID = "6c0e1d2f-0000-4000-8000-00000000abcd"
OTHER = "0bcdef00-0000-4000-8000-000000000000"


def record(uid: str, phase: str = PREPARE_COMPLETED) -> ClaimRecord:
    device = PreparedDevice(
        ("gpus",),
        "node1",
        "gpu-0",
        (f"k8s.gpu.nvidia.com/claim={uid}-gpu-0",),
        share_id="s1",
        consumed_capacity={"memory": "10Gi"},
        config={"kind": "GpuConfig"},
    )
    return ClaimRecord(uid, "default", "c", phase, (device,))  # type: ignore[arg-type]


def test_a_snapshot_has_exactly_the_bytes_of_the_version_2_format() -> None:
    """Pinned: a plugin of an earlier or later release must read what this one writes."""
    member = claim_member(UID, record_json(record(UID)))
    raw = encode_snapshot(boot_id="boot-1", seq=7, claims=[member])
    data = (
        '{"bootId":"boot-1","claims":{"' + UID + '":{"devices":[{"cdiDeviceIds":'
        '["k8s.gpu.nvidia.com/claim=' + UID + '-gpu-0"],"config":{"kind":"GpuConfig"},'
        '"consumedCapacity":{"memory":"10Gi"},"device":"gpu-0","pool":"node1",'
        '"requestNames":["gpus"],"shareId":"s1"}],"name":"c","namespace":"default",'
        '"phase":"PrepareCompleted"}},"seq":7}'
    )
    checksum = hashlib.sha256(data.encode()).hexdigest()
    assert raw == f'{{"version":2,"checksum":"{checksum}","data":{data}}}\n'.encode()
    assert decode_snapshot(raw) == ("boot-1", 7, {UID: record(UID)})
    assert decode(raw) == ("boot-1", {UID: record(UID)})


def test_a_journal_line_has_exactly_the_bytes_of_the_format_and_applies_in_order() -> None:
    started = record(OTHER, PREPARE_STARTED)
    first = encode_journal_line(
        seq=3, put=[claim_member(OTHER, record_json(started))], delete=[UID]
    )
    entry = first[first.index(b'"entry":') + len(b'"entry":') : -2]
    assert first.startswith(b'{"checksum":"') and first.endswith(b"}\n")
    assert json.loads(first)["checksum"] == hashlib.sha256(entry).hexdigest()
    assert entry.startswith(b'{"del":["' + UID.encode() + b'"],"put":{"' + OTHER.encode())
    assert entry.endswith(b',"seq":3}')
    second = encode_journal_line(seq=4, put=[], delete=[])
    assert b'"entry":{"del":[],"put":{},"seq":4}}' in second
    entries, end, torn = parse_journal(first + second + b'{"checks', after_seq=2)
    assert [e.seq for e in entries] == [3, 4] and end == len(first + second) and torn
    claims = {UID: record(UID)}
    assert apply_entries(claims, entries, 2) == 4
    assert claims == {OTHER: started}


def test_a_journal_line_with_a_gap_or_a_wrong_checksum_is_damage() -> None:
    line = encode_journal_line(seq=5, put=[], delete=[])
    with pytest.raises(CheckpointCorrupt, match="expected 3"):
        parse_journal(line, after_seq=2)
    assert parse_journal(line, after_seq=5) == ([], len(line), False)  # already in the snapshot
    with pytest.raises(CheckpointCorrupt, match="expected 6"):
        parse_journal(line, after_seq=5, strict=True)
    with pytest.raises(CheckpointCorrupt, match="checksum does not match"):
        parse_journal(line.replace(b'"seq":5', b'"seq":6'), after_seq=5)


def test_decode_rejects_a_file_that_is_not_ours() -> None:
    with pytest.raises(CheckpointCorrupt, match="missing data or checksum"):
        decode(b'{"version": 2}')
