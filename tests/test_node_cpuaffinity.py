"""cpuaffinity.py: which CPU ``--cpu-affinity one`` keeps the agent on, and that every thread of
the process (those already running too) is kept there."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dra_driver.node.cpuaffinity import chosen_cpu


def test_the_highest_numbered_allowed_cpu_is_chosen_and_one_cpu_leaves_nothing_to_choose() -> None:
    assert chosen_cpu({0, 1, 2, 3}) == 3
    assert chosen_cpu({2, 7, 5}) == 7
    assert chosen_cpu({4}) is None
    assert chosen_cpu(set()) is None


def test_every_thread_of_the_process_is_kept_on_the_chosen_cpu() -> None:
    """A thread started before the pin (a library's own) and one started after both end up on
    the CPU chosen; run in a child process, so that this one keeps its CPUs."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("this process may run on one CPU only: nothing to choose")
    script = """
import os, threading
from dra_driver.node.cpuaffinity import pin_to_one_cpu
go = threading.Event()
before = threading.Thread(target=go.wait)
before.start()
cpu = pin_to_one_cpu()
after = threading.Thread(target=go.wait)
after.start()
cpus = {
    tid: open(f"/proc/self/task/{tid}/status").read().split("Cpus_allowed_list:")[1].split()[0]
    for tid in os.listdir("/proc/self/task")
}
go.set()
print(cpu, len(cpus), sorted(set(cpus.values())))
"""
    out = (
        subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=30, check=True
        )
        .stdout.strip()
        .split(maxsplit=2)
    )
    cpu = max(os.sched_getaffinity(0))
    assert out == [str(cpu), "3", f"['{cpu}']"]
