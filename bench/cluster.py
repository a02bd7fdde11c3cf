"""The cluster side of the prepare benches (bench_prepare, bench_grpc_floor,
bench_dynamic_mig_prepare): the stand-in API server in a process of its own, as a real one would
be (dra_driver/sim/localapi/, so its work does not count as the plugin's), the claims it
holds, and the prepare bench's workload over them; and how the benches start and stop their
helper processes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from bench.table import scaled
from dra_driver._proto.dra_v1 import api_pb2 as v1
from dra_driver.prepare import device_targets
from dra_driver.sim.fakedriver import simulated_inventory
from dra_driver.sim.localapi import FakeKubeApi
from tests.claimdata import allocated_claim

NODE = "node1"
SIMULATE = "h100:32,h100:32:mig=1g.10gb*7"
TOKEN = "bench-token"
DEFAULT_API_LATENCY_MS = 0.5


# The stand-in API server process. Its sleeps are made exact (timer slack 1 us instead of 50 us,
# prctl PR_SET_TIMERSLACK) so that a GET is answered after the latency asked for; when stopped
# it prints the latencies its GETs of one object were answered with (request line read -> answer
# written), which the table reports.
_API_SERVER = """
import ctypes, json, statistics, sys
from pathlib import Path
from dra_driver.sim.localapi import FakeKubeApi
ctypes.CDLL(None, use_errno=True).prctl(29, 1000, 0, 0, 0)  # PR_SET_TIMERSLACK, in ns
s = json.loads(Path(sys.argv[1]).read_text())
api = FakeKubeApi(tls_dir=Path(s["tls_dir"]), token=s["token"], get_latency_s=s["latency_s"])
api.add_node(s["node"])
for claim in json.loads(Path(s["claims"]).read_text()):
    api.add_claim(claim)
api.start()
print(api.port, flush=True)
sys.stdin.read()
api.stop()
print(json.dumps(sorted(api.get_seconds)), flush=True)
"""


class _Claims:
    """Claims created up front, handed to the API server process before it starts."""

    def __init__(self) -> None:
        self.objects: list[dict[str, Any]] = []

    def make(self, prefix: str, devices: list[str], count: int) -> list[v1.Claim]:
        """``count`` 1-device claims, the i-th on ``devices[i % len(devices)]``."""
        refs = []
        for i in range(count):
            claim = allocated_claim(
                name=f"{prefix}-{i}", devices=[devices[i % len(devices)]], node=NODE
            )
            self.objects.append(claim)
            meta = claim["metadata"]
            refs.append(v1.Claim(namespace=meta["namespace"], name=meta["name"], uid=meta["uid"]))
        return refs


@dataclass(frozen=True)
class _Workload:
    warm: list[v1.Claim]
    seq: list[v1.Claim]
    conc: list[v1.Claim]
    cycles: list[v1.Claim]  # the first ``settle`` before RSS is read, then the rest
    python: list[v1.Claim]  # the comparison run through a Python client
    batch: int  # claims prepared before they are unprepared again (each on its own device)
    settle: int  # cycles run before the RSS growth over the rest is measured


def _start(
    argv: list[str], *, env: dict[str, str] | None = None, stderr: IO[str] | None = None
) -> tuple[subprocess.Popen[str], str]:
    """Run ``argv``; return it and the first line it prints."""
    proc = subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if not line:
        sys.exit(f"{argv[:3]}: the process did not start")
    return proc, line


def _stop(proc: subprocess.Popen[str]) -> str:
    """Stop the process (its stdin closed); what it printed after its first line."""
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.close()
    with proc.stdout:
        out = proc.stdout.read()
    proc.wait(timeout=15)
    return out


def _workload(claims: _Claims) -> _Workload:
    names = sorted(device_targets(simulated_inventory(SIMULATE, node_name=NODE)))
    gpus = [n for n in names if "-mig-" not in n]
    return _Workload(
        warm=claims.make("warm", gpus, len(gpus)),
        seq=claims.make("seq", gpus, scaled(192, 32)),
        conc=claims.make("conc", names[:200], scaled(200, 32)),  # distinct devices
        cycles=claims.make("cycle", gpus, scaled(1088, 48)),
        python=claims.make("python", gpus, scaled(192, 16)),
        batch=len(gpus),
        settle=scaled(88, 16),
    )


def api_latency_ms(argv: list[str] | None, description: str) -> float:
    """The ``--api-latency-ms`` argument of a bench that uses the stand-in API server."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--api-latency-ms",
        type=float,
        default=float(os.environ.get("BENCH_API_LATENCY_MS", DEFAULT_API_LATENCY_MS)),
        help="time the API server takes to answer a GET [BENCH_API_LATENCY_MS]",
    )
    return float(parser.parse_args(argv).api_latency_ms)


def start_api_server(
    tmp: Path, claims: _Claims, latency_ms: float
) -> tuple[subprocess.Popen[str], FakeKubeApi]:
    """The stand-in API server process holding ``claims``, answering a GET after
    ``latency_ms``; and a FakeKubeApi naming its address, token and TLS files (not started:
    for a client's kubeconfig or a Pod's ServiceAccount files)."""
    (tmp / "claims.json").write_text(json.dumps(claims.objects))
    settings = {
        "tls_dir": str(tmp / "tls"), "token": TOKEN, "node": NODE,
        "latency_s": latency_ms / 1000, "claims": str(tmp / "claims.json"),
    }  # fmt: skip
    (tmp / "api.json").write_text(json.dumps(settings))
    proc, port = _start([sys.executable, "-c", _API_SERVER, str(tmp / "api.json")])
    return proc, FakeKubeApi(tls_dir=tmp / "tls", token=TOKEN, port=int(port))
