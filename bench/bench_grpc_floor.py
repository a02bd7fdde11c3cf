"""The floor under bench_prepare: what a prepare and an unprepare cost with only the chosen
libraries' part of the work, measured the same way on the same machine.

Issue 15's absolute targets (prepare p50 <= 1.5 ms, >= 1,500 prepares/s at concurrency 16,
unprepare p50 <= 0.5 ms; bench_prepare shows them without a verdict) are for the whole agent.
This bench serves the DRA v1 service with the agent's own gRPC server settings and servicer,
and behind it only part of a prepare (bench/floorserver.py), cumulatively:

- ``grpc``: nothing (gRPC's Python server, the servicer, the messages);
- ``get``: the claim GET through the agent's KubeClient, over TLS with a bearer token, from the
  same stand-in API server as bench_prepare's, with the same latency (``--api-latency-ms``);
- ``record``: then the claim's record, committed durably through the agent's Checkpoint (one
  fdatasync per group of commits); an unprepare appends the removal without a sync.

No CDI spec, no checks of the claim, no log line, no metrics. Every level is a lower bound of
the agent's cost: where a level misses a target, the agent cannot meet it with these libraries
on this machine. Same caller as bench_prepare (the native one, else Python), same claims (the
192 in sequence, unprepared every 16; then the 200 at concurrency 16, each on its own device).
The levels run side by side and take turns, 16 calls at a time, so that all see the same
machine (this VM's pace changes by a third from one minute to the next). No targets of its own:
it always exits 0 once measured.

bench_prepare starts the two levels it judges the agent against, ``record`` and ``grpc``
(``floor_servers``), and measures them in the same run, taking turns with the agent: its targets
are relative to them.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from bench.cluster import (
    _Claims,
    _start,
    _stop,
    _Workload,
    _workload,
    api_latency_ms,
    start_api_server,
)
from bench.floorserver import LEVELS
from bench.kubeletcaller import (
    _Caller,
    _callers,
    _pct,
    _sequence,
    concurrent_in_turns,
    sequences_in_turns,
)
from bench.table import Row, print_table, scaled
from dra_driver.sim.localapi import AGENT_INTERPRETER_ENV, FakeKubeApi

ROUNDS = scaled(3, 1)  # concurrency-16 runs per level, taking turns; the median is reported


@contextlib.contextmanager
def floor_servers(
    tmp: Path, api: FakeKubeApi, levels: Sequence[str] = LEVELS
) -> Iterator[dict[str, tuple[_Caller, int]]]:
    """The floor plugin (bench/floorserver.py) at each of ``levels``, each in its own process
    (with the interpreter settings the chart gives the agent) on its own socket under ``tmp``,
    asking ``api`` for its claims. Level -> a caller to it (the native one, else Python) and the
    plugin's pid; all stopped on exit."""
    kubeconfig = api.write_kubeconfig(tmp / "floor-kubeconfig")
    servers = {}
    callers: dict[str, _Caller] = {}
    try:
        for level in levels:
            state = tmp / f"floor-{level}"
            state.mkdir()
            servers[level] = _start(
                [sys.executable, "-m", "bench.floorserver", level, str(state / "dra.sock"),
                 str(state), str(kubeconfig)],
                env=os.environ | AGENT_INTERPRETER_ENV,
            )[0]  # fmt: skip
            callers[level] = _callers(str(state / "dra.sock"), python=False)[0]
        yield {level: (callers[level], servers[level].pid) for level in levels}
    finally:
        for caller in callers.values():
            caller.close()
        for proc in servers.values():
            _stop(proc)


def main(argv: list[str] | None = None) -> int:
    latency_ms = api_latency_ms(argv, __doc__.split("\n")[0])
    claims = _Claims()
    work = _workload(claims)
    with tempfile.TemporaryDirectory(prefix="bench-floor-", dir="/tmp") as d:
        tmp = Path(d)
        api_proc, api = start_api_server(tmp, claims, latency_ms)
        try:
            with floor_servers(tmp, api) as floors:
                rows = _measure(work, floors, api_proc.pid)
                name = next(iter(floors.values()))[0].name
        finally:
            _stop(api_proc)
    title = (
        f"the floor: the agent's gRPC server and servicer with only part of a prepare behind "
        f"them (claim GET over TLS, API server latency {latency_ms:g} ms), {name}"
    )
    print_table(title, rows)
    return 0


def _measure(work: _Workload, floors: dict[str, tuple[_Caller, int]], api_pid: int) -> list[Row]:
    for caller, _ in floors.values():
        _sequence(caller, work.warm, work.batch)
    times = sequences_in_turns({level: (caller, work.seq) for level, (caller, _) in floors.items()})
    runs = concurrent_in_turns(floors, work.conc, rounds=ROUNDS, api_pid=api_pid)
    rows = []
    for level in floors:
        prep, unprep = times[level]
        rates = [rate for rate, _ in runs[level]]
        cpu = [cpu_ms["agent"] for _, cpu_ms in runs[level]]
        rows += [
            Row(f"{level}: prepare p50 ({len(work.seq)} in sequence; the agent's target <= 1.5 ms)",
                statistics.median(prep), "ms", ""),
            Row(f"{level}: prepare p99", _pct(prep, 0.99), "ms", ""),
            Row(f"{level}: unprepare p50 (the agent's target <= 0.5 ms)",
                statistics.median(unprep), "ms", ""),
            Row(f"{level}: prepares/s at concurrency 16 (the agent's target >= 1,500)",
                statistics.median(rates), "/s", ""),
            Row(f"{level}: its CPU per prepare at concurrency 16",
                statistics.median(cpu), "ms", ""),
        ]  # fmt: skip
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
