"""The claim table's index of which claims hold each device (checkpointrecords.Claims.holding):
whatever way a transaction or the journal's replay changes the table, ``holding`` answers what
a scan of every record would."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from dra_driver.prepare.state.checkpointrecords import (
    ClaimRecord,
    Claims,
)
from tests.claimdata import checkpoint_record

DEVICES = ("gpu-0", "gpu-1", "gpu-2", "gpu-3")
UIDS = ("a", "b", "c", "d", "e")


def scanned(claims: dict[str, ClaimRecord], device: str) -> set[str]:
    return {uid for uid, r in claims.items() if any(d.device == device for d in r.devices)}


records = st.builds(
    lambda uid, devices: checkpoint_record(uid, *devices),
    st.sampled_from(UIDS),
    st.lists(st.sampled_from(DEVICES), max_size=3),
)
operations = st.one_of(
    st.tuples(st.just("set"), records),
    st.tuples(st.just("del"), st.sampled_from(UIDS)),
    st.tuples(st.just("discard"), st.sampled_from(UIDS)),
    st.tuples(st.just("pop"), st.sampled_from(UIDS)),
    st.tuples(st.just("update"), st.lists(records, max_size=3)),
    st.tuples(st.just("ior"), st.lists(records, max_size=3)),
    st.tuples(st.just("setdefault"), records),
    st.tuples(st.just("popitem"), st.none()),
    st.tuples(st.just("clear"), st.none()),
)


def apply(claims: Any, op: str, arg: Any) -> None:
    """One change, made the same way to a Claims and to a plain dict."""
    if op == "set":
        claims[arg.uid] = arg
    elif op == "del":
        if arg in claims:
            del claims[arg]
    elif op == "discard":
        claims.pop(arg, None)
    elif op == "pop":
        if arg in claims:
            claims.pop(arg)
    elif op == "update":
        claims.update({r.uid: r for r in arg})
    elif op == "ior":
        claims |= {r.uid: r for r in arg}
    elif op == "setdefault":
        claims.setdefault(arg.uid, arg)
    elif op == "popitem":
        if claims:
            claims.popitem()
    elif op == "clear":
        claims.clear()


@settings(max_examples=300, deadline=None)
@given(st.lists(records, max_size=4), st.lists(operations, max_size=12))
def test_holding_answers_what_a_scan_would(initial: list[ClaimRecord], ops: list[Any]) -> None:
    start = {r.uid: r for r in initial}
    claims, plain = Claims(start), dict(start)
    for op, arg in ops:
        apply(claims, op, arg)
        apply(plain, op, arg)
        assert dict(claims) == plain
        for device in DEVICES:
            assert {r.uid for r in claims.holding(device)} == scanned(plain, device), (op, device)


def test_every_change_is_touched() -> None:
    claims = Claims({"a": checkpoint_record("a", "gpu-0"), "b": checkpoint_record("b", "gpu-1")})
    assert not claims.changed
    claims.pop("a")
    claims.setdefault("c", checkpoint_record("c", "gpu-2"))
    claims |= {"d": checkpoint_record("d", "gpu-3")}
    assert claims.touched == {"a", "c", "d"}
    claims.clear()
    assert claims.touched == {"a", "b", "c", "d"}
    assert claims.holding("gpu-1") == []


def test_a_record_replaced_leaves_the_devices_it_no_longer_holds() -> None:
    claims = Claims({"a": checkpoint_record("a", "gpu-0", "gpu-1")})
    claims["a"] = checkpoint_record("a", "gpu-1")
    assert claims.holding("gpu-0") == []
    assert [r.uid for r in claims.holding("gpu-1")] == ["a"]
