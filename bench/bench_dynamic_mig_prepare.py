"""Prepare/unprepare of dynamic MIG devices (``--mig-mode=dynamic``): each prepare creates the
device's GPU instance at its placement and its compute instance, each unprepare destroys them.

The path is bench_prepare.py's: the agent as the chart's DaemonSet runs it, in-cluster, gRPC over
its real Unix socket from the kubelet-like native caller (or the Python one where it cannot be
built), the claim fetched over TLS from the local API server in its own process, the CDI spec and
the checkpoint fsync'd; on top, the claim is recorded ``PrepareStarted`` (fsync'd) before the
instance is made, and the simulated NVML keeps its MIG state in a file it replaces atomically on
every change (GPU instance, then compute instance), as the node's state must outlive the agent
(not synced: real instances do not outlive a reboot either). Simulated node: 8 x
A100 40GB in MIG mode without instances; the claims take turns over every placement of the
1g.5gb, 2g.10gb and 3g.20gb profiles.

Targets: prepare of a dynamic MIG device p50 <= 10 ms including creation; unprepare p50 <= 10 ms
including destruction.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

from bench.bench_prepare import (
    NODE,
    TOKEN,
    _agent,
    _callers,
    _Claims,
    _pct,
    _prepare_request,
    _start,
    _stop,
    _timed,
    _unprepare_request,
)
from bench.table import Row, print_table, scaled
from dra_driver.mig.targets import dynamic_slots, dynamic_targets, is_placement
from dra_driver.sim.fakedriver import simulated_inventory
from dra_driver.sim.localapi import FakeKubeApi

SIMULATE = "a100-40gb:8:mig"
PROFILES = ("1g.5gb", "2g.10gb", "3g.20gb")
ROUNDS = scaled(150, 6)
API_LATENCY_MS = 0.5


def main() -> int:
    inventory = simulated_inventory(SIMULATE, node_name=NODE)
    targets = dynamic_targets(inventory)
    names = sorted(
        n
        for gpu in inventory.gpus
        for n, slot in dynamic_slots(gpu).items()
        if n in targets and is_placement(targets[n]) and slot.profile.name in PROFILES
    )
    claims = _Claims()
    warm = claims.make("warm", names, scaled(8, 2))
    measured = claims.make("dyn", names, ROUNDS)
    from bench.bench_prepare import _API_SERVER  # noqa: PLC0415

    with tempfile.TemporaryDirectory(prefix="bench-dynmig-", dir="/tmp") as d:
        tmp = Path(d)
        (tmp / "claims.json").write_text(json.dumps(claims.objects))
        settings = {
            "tls_dir": str(tmp / "tls"), "token": TOKEN, "node": NODE,
            "latency_s": API_LATENCY_MS / 1000, "claims": str(tmp / "claims.json"),
        }  # fmt: skip
        (tmp / "api.json").write_text(json.dumps(settings))
        api_proc, port = _start([sys.executable, "-c", _API_SERVER, str(tmp / "api.json")])
        api = FakeKubeApi(tls_dir=tmp / "tls", token=TOKEN, port=int(port))
        try:
            with (tmp / "agent.log").open("w") as agent_log:
                agent, dra_socket = _agent(
                    tmp / "node",
                    api,
                    agent_log,
                    simulate=SIMULATE,
                    extra_args=("--mig-mode", "dynamic"),
                )
                caller, python = _callers(str(dra_socket))
                try:
                    for c in warm:
                        _timed(caller, _prepare_request(c), c)
                        _timed(caller, _unprepare_request(c), c)
                    prep_ms, unprep_ms = [], []
                    for c in measured:
                        prep_ms.append(_timed(caller, _prepare_request(c), c) * 1000)
                        unprep_ms.append(_timed(caller, _unprepare_request(c), c) * 1000)
                    state = json.loads(
                        (tmp / "node/plugins/gpu.nvidia.com/simulated-mig.json").read_text()
                    )
                finally:
                    caller.close()
                    if python is not None:
                        python.close()
                    agent.terminate()
                    agent.wait(timeout=15)
            log_text = (tmp / "agent.log").read_text()
        finally:
            _stop(api_proc)
    created = log_text.count('"msg": "destroyed a MIG instance"')
    if created != len(warm) + len(measured) or any(state["gpus"].values()):
        sys.exit(f"not every prepare created and destroyed its instance:\n{log_text[-2000:]}")
    p50, u50 = statistics.median(prep_ms), statistics.median(unprep_ms)
    rows = [
        Row(f"dynamic MIG prepare p50 ({ROUNDS}, creating)", p50, "ms", "<= 10 ms", p50 <= 10),
        Row("dynamic MIG prepare p99", _pct(prep_ms, 0.99), "ms", ""),
        Row(f"dynamic MIG unprepare p50 ({ROUNDS}, destroying)", u50, "ms", "<= 10 ms", u50 <= 10),
        Row("dynamic MIG unprepare p99", _pct(unprep_ms, 0.99), "ms", ""),
    ]
    title = (
        f"dynamic MIG prepare/unprepare over dra.sock (simulated NVML, PrepareStarted fsync'd; "
        f"API server latency {API_LATENCY_MS:g} ms), {caller.name}"
    )
    return 0 if print_table(title, rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
