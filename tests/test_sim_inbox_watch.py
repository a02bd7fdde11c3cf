"""A simulated ``nvmlEventSetWait_v2`` watches the inbox file without polling it
(sim/nvml/inboxwatch.py): it wakes when another process appends a fault, when the inbox first
appears or is replaced, and when this process injects one, and otherwise does no work while it
waits; where inotify cannot be had it polls as before. Each wait's descriptors are closed."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pynvml
import pytest

from dra_driver.sim.faults import SimulatedFault, append_fault
from dra_driver.sim.nvml import SimulatedNode, simulated_nvml
from dra_driver.sim.nvml import health as health_module
from dra_driver.sim.nvml.inboxwatch import open_inbox_watch
from tests.test_sim_nvml_health import registered


@pytest.fixture
def inbox(tmp_path: Path) -> Path:
    (tmp_path / "plugin").mkdir()
    return tmp_path / "plugin" / "simulated-faults.jsonl"


@pytest.fixture
def node(inbox: Path) -> Iterator[SimulatedNode]:
    with simulated_nvml("h100:2", node_name="n", inbox=inbox) as n:
        pynvml.nvmlInit()
        try:
            yield n
        finally:
            pynvml.nvmlShutdown()


def later(seconds: float, action: object, *args: object) -> threading.Timer:
    timer = threading.Timer(seconds, action, args)  # type: ignore[arg-type]
    timer.start()
    return timer


def timed_wait(event_set: object, timeout_ms: int) -> tuple[int, float]:
    began = time.monotonic()
    data = pynvml.nvmlEventSetWait_v2(event_set, timeout_ms)
    return int(data.eventData), time.monotonic() - began


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_a_fault_appended_while_a_wait_is_blocked_wakes_it_at_once(
    node: SimulatedNode, inbox: Path
) -> None:
    inbox.touch()
    event_set = registered(1)
    later(0.3, append_fault, inbox, SimulatedFault(kind="xid", gpu=1, xid=31)).join(0)
    xid, waited = timed_wait(event_set, 5000)
    assert xid == 31
    assert 0.25 <= waited < 1.0


def test_a_blocked_wait_does_not_look_at_the_inbox_until_it_changes(
    node: SimulatedNode, inbox: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bug this fixes: the wait looked at the file every 20 ms (50 looks in a second)."""
    inbox.touch()
    looks: list[bool] = []
    health = node.library.health
    read = health.read_inbox

    def counted(*, now: bool = False) -> None:
        looks.append(now)
        read(now=now)

    event_set = registered(0)
    monkeypatch.setattr(health, "read_inbox", counted)
    began = time.monotonic()
    with pytest.raises(pynvml.NVMLError_Timeout):
        pynvml.nvmlEventSetWait_v2(event_set, 1000)
    assert time.monotonic() - began >= 0.95
    # the NVML call's own (rate-limited) look, the wait's look before it blocks and its last
    # (rate-limited) look when the timeout came: none while it was blocked
    assert looks == [False, True, False]


def test_an_inbox_that_appears_or_is_replaced_during_a_wait_is_read_from_its_start(
    node: SimulatedNode, inbox: Path
) -> None:
    assert not inbox.exists()
    event_set = registered(1)
    later(0.2, append_fault, inbox, SimulatedFault(kind="xid", gpu=1, xid=43))
    xid, waited = timed_wait(event_set, 5000)
    assert (xid, waited < 1.0) == (43, True)

    def replace() -> None:  # another file renamed over the inbox, shorter than the first
        fresh = inbox.with_name("fresh.jsonl")
        fresh.write_text('{"kind": "xid", "gpu": 1, "xid": 8}\n')
        fresh.rename(inbox)

    later(0.2, replace)
    xid, waited = timed_wait(event_set, 5000)
    assert (xid, waited < 1.0) == (8, True)


def test_a_fault_injected_in_process_wakes_a_wait_blocked_on_the_inbox(
    node: SimulatedNode,
) -> None:
    event_set = registered(0)
    later(0.2, node.library.health.inject, SimulatedFault(kind="xid", gpu=0, xid=79))
    xid, waited = timed_wait(event_set, 5000)
    assert (xid, 0.15 <= waited < 1.0) == (79, True)


def test_waits_leave_no_descriptor_open(node: SimulatedNode, inbox: Path) -> None:
    event_set = registered(0)
    before = open_fds()
    for _ in range(20):
        with pytest.raises(pynvml.NVMLError_Timeout):
            pynvml.nvmlEventSetWait_v2(event_set, 1)
    later(0.1, append_fault, inbox, SimulatedFault(kind="xid", gpu=0, xid=13))
    assert timed_wait(event_set, 5000)[0] == 13
    assert open_fds() == before


def test_without_inotify_the_wait_polls_the_inbox(
    node: SimulatedNode, inbox: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(health_module, "open_inbox_watch", lambda path: None)
    event_set = registered(1)
    later(0.2, append_fault, inbox, SimulatedFault(kind="xid", gpu=1, xid=62))
    xid, waited = timed_wait(event_set, 5000)
    assert (xid, waited < 1.0) == (62, True)


def test_no_watch_without_the_inbox_directory(tmp_path: Path) -> None:
    assert open_inbox_watch(tmp_path / "missing" / "simulated-faults.jsonl") is None
    watch = open_inbox_watch(tmp_path / "simulated-faults.jsonl")
    assert watch is not None
    try:
        assert watch.wait(0.05) is False  # nothing happened
        watch.wake()
        assert watch.wait(5) is True
        assert watch.wait(0.05) is False  # the wake was taken
        (tmp_path / "simulated-faults.jsonl").write_text("x\n")
        assert watch.wait(5) is True
    finally:
        watch.close()
