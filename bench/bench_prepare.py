"""Prepare/unprepare latency of the kubelet plugin, measured the way the kubelet drives it.

Real path end to end: gRPC over the real Unix socket, the claim fetched by the real Kubernetes
client from the local HTTP API server (tests/kubeapi.py, run in its own process as a real API
server would be, so its work does not count as ours), the CDI spec and the checkpoint written
with fsync into a temporary directory. Simulated GPUs (8 x H100), 1-GPU claims.

Targets: 200 prepares in sequence p50 <= 3 ms, p99 <= 8 ms; 200 prepares at concurrency 16
within 1 s; unprepare p50 <= 2 ms; RSS growth over 1,000 prepare/unprepare cycles <= 2 MiB.
"""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from bench.table import Row, print_table
from dra_driver._proto.dra_v1 import api_pb2 as v1
from dra_driver._proto.dra_v1 import api_pb2_grpc as v1_grpc
from tests.claimdata import allocated_claim
from tests.fakedriver import make_fake_driver

GPUS = 8


def _rss_bytes(pid: int) -> int:
    """Resident memory of the plugin process."""
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


_API_SERVER = """
import json, sys, time
from pathlib import Path
from tests.kubeapi import FakeKubeApi
api = FakeKubeApi()
api.add_node("node1")
for claim in json.loads(Path(sys.argv[1]).read_text()):
    api.add_claim(claim)
api.start()
api.write_kubeconfig(Path(sys.argv[2]))
print("ready", flush=True)
sys.stdin.read()
api.stop()
"""


class _Claims:
    """Claims created up front, handed to the API server process before it starts."""

    def __init__(self) -> None:
        self.objects: list[dict[str, Any]] = []

    def make(self, prefix: str, count: int, *, admin: bool = False) -> list[v1.Claim]:
        refs = []
        for i in range(count):
            claim = allocated_claim(name=f"{prefix}-{i}", devices=[f"gpu-{i % GPUS}"])
            if admin:  # many claims on 8 GPUs at once: admin access may share a device
                claim["status"]["allocation"]["devices"]["results"][0]["adminAccess"] = True
            self.objects.append(claim)
            meta = claim["metadata"]
            refs.append(v1.Claim(namespace=meta["namespace"], name=meta["name"], uid=meta["uid"]))
        return refs


@dataclass(frozen=True)
class _Workload:
    warm: list[v1.Claim]
    seq: list[v1.Claim]
    conc: list[v1.Claim]
    cycles: list[v1.Claim]


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


_PLUGIN_SERVER = """
import json, sys
from pathlib import Path
from dra_driver.config import Config
from dra_driver.kube import KubeClient
from dra_driver.plugin.server import KubeletPlugin
from tests.fakedriver import simulated_inventory
s = json.loads(Path(sys.argv[1]).read_text())
kube = KubeClient.from_config(kubeconfig=Path(s["kubeconfig"]))
plugin = KubeletPlugin(
    config=Config(
        node_name="node1",
        nvidia_driver_root=Path(s["driver_root"]),
        kubelet_registrar_directory_path=Path(s["registry"]),
        kubelet_plugins_directory_path=Path(s["plugins"]),
        cdi_root=Path(s["cdi"]),
    ),
    inventory=simulated_inventory(f"h100:{s['gpus']}", node_name="node1"),
    claims=kube,
    proc_root=Path(s["proc_root"]),
    boot_id_path=Path(s["boot_id"]),
)
plugin.start()
print(plugin.paths.dra, flush=True)
sys.stdin.read()
plugin.stop()
kube.close()
"""


def _start(script: str, *args: str) -> tuple[subprocess.Popen[str], str]:
    """Run ``script`` in its own interpreter; return it and the first line it prints."""
    proc = subprocess.Popen(
        [sys.executable, "-c", script, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if not line:
        sys.exit(f"{script.split(chr(10))[1]}: the process did not start")
    return proc, line


def _stop(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.close()
    proc.wait(timeout=15)


def main() -> int:
    claims = _Claims()
    work = _Workload(
        warm=claims.make("warm", GPUS),
        seq=claims.make("seq", 200),
        conc=claims.make("conc", 200, admin=True),
        cycles=claims.make("cycle", 1100),
    )
    with tempfile.TemporaryDirectory(prefix="bench-prepare-", dir="/tmp") as d:
        tmp = Path(d)
        fake = make_fake_driver(tmp)
        (tmp / "boot_id").write_text("bench\n")
        (tmp / "claims.json").write_text(json.dumps(claims.objects))
        # The API server, the plugin and the caller (the kubelet's part) are three processes,
        # as on a node: none of them competes for another's interpreter lock.
        api, _ = _start(_API_SERVER, str(tmp / "claims.json"), str(tmp / "kubeconfig"))
        settings = {
            "kubeconfig": str(tmp / "kubeconfig"), "driver_root": str(fake.root),
            "registry": str(tmp / "registry"), "plugins": str(tmp / "plugins"),
            "cdi": str(tmp / "cdi"), "proc_root": str(fake.proc_root),
            "boot_id": str(tmp / "boot_id"), "gpus": GPUS,
        }  # fmt: skip
        (tmp / "plugin.json").write_text(json.dumps(settings))
        try:
            plugin, dra_socket = _start(_PLUGIN_SERVER, str(tmp / "plugin.json"))
            try:
                rows = _measure(work, dra_socket=dra_socket, plugin_pid=plugin.pid)
            finally:
                _stop(plugin)
        finally:
            _stop(api)
    return (
        0 if print_table("prepare/unprepare over dra.sock (fsync'd CDI + checkpoint)", rows) else 1
    )


def _measure(work: _Workload, *, dra_socket: str, plugin_pid: int) -> list[Row]:
    ch = grpc.insecure_channel(f"unix://{dra_socket}")
    stub = v1_grpc.DRAPluginStub(ch)

    def prepare(claim: v1.Claim) -> float:
        t0 = time.perf_counter()
        answer = stub.NodePrepareResources(
            v1.NodePrepareResourcesRequest(claims=[claim]), timeout=10
        )
        elapsed = time.perf_counter() - t0
        if answer.claims[claim.uid].error:
            sys.exit(f"prepare failed: {answer.claims[claim.uid].error}")
        return elapsed

    def unprepare(claim: v1.Claim) -> float:
        t0 = time.perf_counter()
        answer = stub.NodeUnprepareResources(
            v1.NodeUnprepareResourcesRequest(claims=[claim]), timeout=10
        )
        elapsed = time.perf_counter() - t0
        if answer.claims[claim.uid].error:
            sys.exit(f"unprepare failed: {answer.claims[claim.uid].error}")
        return elapsed

    # warm-up: connections, first discovery of the API version
    for claim in work.warm:
        prepare(claim)
        unprepare(claim)

    # 200 sequential prepares; each GPU is freed again so 1-GPU claims never collide
    seq_claims = work.seq
    prep_ms: list[float] = []
    unprep_ms: list[float] = []
    for i in range(0, 200, GPUS):
        batch = seq_claims[i : i + GPUS]
        prep_ms.extend(prepare(c) * 1000 for c in batch)
        unprep_ms.extend(unprepare(c) * 1000 for c in batch)

    # 200 prepares at concurrency 16 (admin-access claims, so 200 can be prepared at once)
    conc_claims = work.conc
    t0 = time.perf_counter()
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(prepare, conc_claims))
    conc_s = time.perf_counter() - t0
    for c in conc_claims:
        unprepare(c)

    # memory over 1,000 prepare/unprepare cycles
    cycle_claims = work.cycles
    for c in cycle_claims[:100]:
        prepare(c)
        unprepare(c)
    rss_before = _rss_bytes(plugin_pid)
    for c in cycle_claims[100:]:
        prepare(c)
        unprepare(c)
    growth_mib = (_rss_bytes(plugin_pid) - rss_before) / 2**20
    ch.close()

    p50, p99 = statistics.median(prep_ms), _pct(prep_ms, 0.99)
    u50 = statistics.median(unprep_ms)
    return [
        Row("prepare p50 (200 in sequence)", p50, "ms", "<= 3 ms", p50 <= 3.0),
        Row("prepare p99 (200 in sequence)", p99, "ms", "<= 8 ms", p99 <= 8.0),
        Row("200 prepares at concurrency 16", conc_s, "s", "<= 1 s", conc_s <= 1.0),
        Row("unprepare p50", u50, "ms", "<= 2 ms", u50 <= 2.0),
        Row("unprepare p99", _pct(unprep_ms, 0.99), "ms", ""),
        Row(
            "RSS growth, 1,000 prepare/unprepare cycles",
            growth_mib,
            "MiB",
            "<= 2 MiB",
            growth_mib <= 2.0,
        ),
    ]


if __name__ == "__main__":
    raise SystemExit(main())
