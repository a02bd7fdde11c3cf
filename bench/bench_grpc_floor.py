"""The floor under bench_prepare: what a prepare and an unprepare cost with only the chosen
libraries' part of the work, measured the same way on the same machine.

bench_prepare's targets (issue 15: prepare p50 <= 1.5 ms, >= 1,500 prepares/s at concurrency
16, unprepare p50 <= 0.5 ms) are for the whole agent. This bench serves the DRA v1 service with
the agent's own gRPC server settings and servicer, and behind it only part of a prepare
(bench/floorserver.py), cumulatively:

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
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
from pathlib import Path

from bench.bench_prepare import (
    _Caller,
    _callers,
    _Claims,
    _concurrent,
    _pct,
    _sequence,
    _start,
    _stop,
    _Workload,
    _workload,
    api_latency_ms,
    start_api_server,
)
from bench.floorserver import LEVELS
from bench.table import Row, print_table
from dra_driver.sim.localapi import AGENT_INTERPRETER_ENV

ROUNDS = 3  # concurrency-16 runs per level, taking turns; the median is reported


def main(argv: list[str] | None = None) -> int:
    latency_ms = api_latency_ms(argv, __doc__.split("\n")[0])
    claims = _Claims()
    work = _workload(claims)
    with tempfile.TemporaryDirectory(prefix="bench-floor-", dir="/tmp") as d:
        tmp = Path(d)
        api_proc, api = start_api_server(tmp, claims, latency_ms)
        kubeconfig = api.write_kubeconfig(tmp / "kubeconfig")
        servers = {}
        callers: dict[str, _Caller] = {}
        try:
            for level in LEVELS:
                state = tmp / level
                state.mkdir()
                servers[level] = _start(
                    [sys.executable, "-m", "bench.floorserver", level, str(state / "dra.sock"),
                     str(state), str(kubeconfig)],
                    env=os.environ | AGENT_INTERPRETER_ENV,
                )[0]  # fmt: skip
                callers[level] = _callers(str(state / "dra.sock"), python=False)[0]
            rows = _measure(work, callers, {k: p.pid for k, p in servers.items()}, api_proc.pid)
        finally:
            for caller in callers.values():
                caller.close()
            for proc in servers.values():
                _stop(proc)
            _stop(api_proc)
    name = next(iter(callers.values())).name
    title = (
        f"the floor: the agent's gRPC server and servicer with only part of a prepare behind "
        f"them (claim GET over TLS, API server latency {latency_ms:g} ms), {name}"
    )
    print_table(title, rows)
    return 0


def _measure(
    work: _Workload, callers: dict[str, _Caller], pids: dict[str, int], api_pid: int
) -> list[Row]:
    prep: dict[str, list[float]] = {level: [] for level in LEVELS}
    unprep: dict[str, list[float]] = {level: [] for level in LEVELS}
    for caller in callers.values():
        _sequence(caller, work.warm, work.batch)
    step = 16
    for i in range(0, len(work.seq), step):
        for level, caller in callers.items():
            prepared, unprepared = _sequence(caller, work.seq[i : i + step], step)
            prep[level] += prepared
            unprep[level] += unprepared
    rates: dict[str, list[float]] = {level: [] for level in LEVELS}
    cpu: dict[str, list[float]] = {level: [] for level in LEVELS}
    for _ in range(ROUNDS):
        for level, caller in callers.items():
            rate, cpu_ms = _concurrent(caller, work.conc, agent_pid=pids[level], api_pid=api_pid)
            rates[level].append(rate)
            cpu[level].append(cpu_ms["agent"])
    rows = []
    for level in LEVELS:
        rows += [
            Row(f"{level}: prepare p50 (192 in sequence; the agent's target <= 1.5 ms)",
                statistics.median(prep[level]), "ms", ""),
            Row(f"{level}: prepare p99", _pct(prep[level], 0.99), "ms", ""),
            Row(f"{level}: unprepare p50 (the agent's target <= 0.5 ms)",
                statistics.median(unprep[level]), "ms", ""),
            Row(f"{level}: prepares/s at concurrency 16 (the agent's target >= 1,500)",
                statistics.median(rates[level]), "/s", ""),
            Row(f"{level}: its CPU per prepare at concurrency 16",
                statistics.median(cpu[level]), "ms", ""),
        ]  # fmt: skip
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
