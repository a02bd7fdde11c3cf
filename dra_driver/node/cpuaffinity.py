"""``--cpu-affinity``: let the agent run on every CPU it may use (``all``, the default), or keep
all of its threads on one of them (``one``).

Why one CPU can be faster: the agent's Python threads (gRPC's server thread and workers, the
claim GETs, the checkpoint's group commit, the log writer) share one interpreter lock. A
prepare hands that lock from thread to thread a dozen times (`strace` counts about 46 futex
calls per call over dra.sock). On two CPUs each handoff wakes a thread on the other CPU and
waits for it to be scheduled there; on one CPU the next thread simply runs when the current
one blocks. Measured with ``bench/bench_prepare.py`` on a 2-vCPU VM, 4 runs each, alternating:
at concurrency 16, 741-984 prepares/s and 1.05-1.3 ms of agent CPU per prepare on one CPU
against 523-730 /s and 1.45-2.1 ms on both; a prepare alone and an unprepare take the same time
either way. The agent never needs more than about one CPU of Python anyway.

Why it is not the default: a CPU of the node is then the agent's only one. Should other work keep
that CPU busy, the agent shares it rather than moving to an idle one. The CPU chosen is the
highest-numbered one the process may use (CPU 0 carries most of a node's housekeeping: timer
ticks and many devices' interrupts). Under the kubelet's static CPU manager policy the pod's
cpuset changes as CPUs are handed to Guaranteed pods and back; the kernel may then give the
threads the whole new cpuset (at every change before Linux 6.2; since then only when the chosen
CPU left it), so the agent runs on all of them again, never on none. With that policy, a
Guaranteed agent pod with one whole CPU gets the same effect from the kubelet instead.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Collection

CPU_AFFINITIES = ("all", "one")


def chosen_cpu(allowed: Collection[int]) -> int | None:
    """The CPU ``one`` keeps the agent on: the highest-numbered of ``allowed``; None when there
    is nothing to choose (one CPU or none allowed)."""
    return max(allowed) if len(allowed) > 1 else None


def pin_to_one_cpu() -> int | None:
    """Restrict every thread of this process to :func:`chosen_cpu` of the CPUs it may use now;
    threads started later inherit it. Returns the CPU, None when there was nothing to choose.
    OSError when the kernel refuses (the process then runs as before)."""
    cpu = chosen_cpu(os.sched_getaffinity(0))
    if cpu is None:
        return None
    os.sched_setaffinity(0, {cpu})
    for tid in os.listdir("/proc/self/task"):  # threads started before (a library's own)
        with contextlib.suppress(ProcessLookupError):  # ended meanwhile
            os.sched_setaffinity(int(tid), {cpu})
    return cpu
