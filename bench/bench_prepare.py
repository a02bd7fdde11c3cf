"""Prepare/unprepare latency of the kubelet plugin, measured the way the kubelet drives it.

Real path end to end: gRPC over the real Unix socket, the claim fetched by the real Kubernetes
client from the local HTTP API server (dra_driver/localapi.py, run in its own process as a real API
server would be, so its work does not count as ours), the CDI spec and the checkpoint written
with fsync into a temporary directory. Simulated GPUs (8 x H100), 1-GPU claims. The plugin runs
as the chart configures it: JSON log lines at level info (one per prepare and unprepare, written
to a file as a container log would be) and Prometheus metrics on.

The caller is the kubelet's part: a compiled gRPC client (bench/caller/kubelet_caller.cc, built
by ``make bench``), as the kubelet is a compiled (Go) gRPC client. A Python gRPC client spends
about 0.3 ms of CPU of its own per call on a small node, which would count against the plugin;
the same 200 prepares through one are shown for comparison. Where the native caller cannot be
built, everything is measured through the Python client, and the table says so.

Targets: 200 prepares in sequence p50 <= 3 ms, p99 <= 8 ms; 200 prepares at concurrency 16
within 1 s; unprepare p50 <= 2 ms; RSS growth over 1,000 prepare/unprepare cycles <= 2 MiB.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

import grpc

from bench.table import Row, print_table
from dra_driver._proto.dra_v1 import api_pb2 as v1
from dra_driver.gpus.fakedriver import make_fake_driver
from tests.claimdata import allocated_claim

GPUS = 8


def _rss_bytes(pid: int) -> int:
    """Resident memory of the plugin process."""
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


_API_SERVER = """
import json, sys, time
from pathlib import Path
from dra_driver.localapi import FakeKubeApi
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
    python: list[v1.Claim]  # the comparison run through a Python client


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


_PLUGIN_SERVER = """
import json, sys
from pathlib import Path
from dra_driver import log, metrics
from dra_driver.config import Config
from dra_driver.kube import KubeClient
from dra_driver.plugin.server import KubeletPlugin
from dra_driver.prepare import ERROR_TYPES
from dra_driver.gpus.fakedriver import simulated_inventory
s = json.loads(Path(sys.argv[1]).read_text())
log.configure(log_format="json", level="info")  # the chart's logFormat and logLevel
kube = KubeClient.from_config(kubeconfig=Path(s["kubeconfig"]))
plugin = KubeletPlugin(
    metrics=metrics.DriverMetrics(  # the chart's metricsPort turns them on
        metrics.Registry(), driver_name="gpu.nvidia.com", node_name="node1", error_types=ERROR_TYPES
    ),
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


def _start(
    script: str, *args: str, stderr: IO[str] | None = None
) -> tuple[subprocess.Popen[str], str]:
    """Run ``script`` in its own interpreter; return it and the first line it prints."""
    proc = subprocess.Popen(
        [sys.executable, "-c", script, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=stderr,
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
        python=claims.make("python", 200),
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
            with (tmp / "plugin.log").open("w") as plugin_log:
                plugin, dra_socket = _start(
                    _PLUGIN_SERVER, str(tmp / "plugin.json"), stderr=plugin_log
                )
                callers = _callers(dra_socket)
                try:
                    rows = _measure(
                        work, caller=callers[0], python=callers[1], plugin_pid=plugin.pid
                    )
                finally:
                    for caller in callers:
                        if caller is not None:
                            caller.close()
                    _stop(plugin)
            log_text = (tmp / "plugin.log").read_text()
        finally:
            _stop(api)
    # every prepare was logged, as in production (the warm-up claims once per caller)
    expected = sum(map(len, (work.warm, work.seq, work.conc, work.cycles)))
    if callers[1] is not None:
        expected += len(work.warm) + len(work.python)
    if log_text.count('"msg": "prepared claim"') != expected:
        sys.exit(f"the plugin did not log {expected} prepares:\n{log_text[-2000:]}")
    title = f"prepare/unprepare over dra.sock (fsync'd CDI + checkpoint), {callers[0].name}"
    return 0 if print_table(title, rows) else 1


def _callers(dra_socket: str) -> tuple[_Caller, _Caller | None]:
    """The kubelet-like native caller, and a Python one for comparison; only the Python one
    (for everything) when the native one cannot be built here."""
    if NATIVE_CALLER.is_file() and os.access(NATIVE_CALLER, os.X_OK):
        return _NativeCaller(NATIVE_CALLER, dra_socket), _PythonCaller(dra_socket)
    print(
        f"no native gRPC caller at {NATIVE_CALLER} (make bench builds it; needs g++ and "
        "libgrpc++-dev): measuring with the Python caller, whose own work per call counts too",
        file=sys.stderr,
    )
    return _PythonCaller(dra_socket), None


PREPARE = "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources"
UNPREPARE = "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodeUnprepareResources"

# The native caller's binary (Makefile: make bench builds it with hack/build-bench-caller.sh).
NATIVE_CALLER = Path(
    os.environ.get(
        "DRA_BENCH_CALLER", Path(__file__).resolve().parents[1] / ".tools/bin/dra-kubelet-caller"
    )
)


class _Caller(Protocol):
    """Sends serialized requests to the plugin; returns seconds taken and the answer's bytes."""

    name: str

    def call(self, method: str, request: bytes) -> tuple[float, bytes]: ...

    def parallel(
        self, threads: int, calls: list[tuple[str, bytes]]
    ) -> tuple[float, list[bytes]]: ...

    def close(self) -> None: ...


class _NativeCaller:
    """The kubelet's side as the kubelet is: a compiled gRPC client (bench/caller), fed over a
    pipe between calls; it times each call itself."""

    name = "native gRPC caller (C++, like the kubelet's Go client)"

    def __init__(self, binary: Path, dra_socket: str) -> None:
        self._proc = subprocess.Popen(
            [str(binary), dra_socket], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._in, self._out = self._proc.stdin, self._proc.stdout

    def _send(self, method: str, request: bytes) -> None:
        self._in.write(f"{method} {len(request)}\n".encode() + request)

    def _result(self, method: str) -> bytes:
        code, size = (int(x) for x in self._out.readline().split())
        body = self._out.read(size)
        if code != 0:
            sys.exit(f"{method}: gRPC status {code}: {body.decode(errors='replace')}")
        return body

    def call(self, method: str, request: bytes) -> tuple[float, bytes]:
        self._in.write(b"call ")
        self._send(method, request)
        self._in.flush()
        elapsed_ns = int(self._out.readline())
        return elapsed_ns / 1e9, self._result(method)

    def parallel(self, threads: int, calls: list[tuple[str, bytes]]) -> tuple[float, list[bytes]]:
        self._in.write(f"parallel {threads} {len(calls)}\n".encode())
        for method, request in calls:
            self._send(method, request)
        self._in.flush()
        elapsed_ns = int(self._out.readline())
        return elapsed_ns / 1e9, [self._result(method) for method, _ in calls]

    def close(self) -> None:
        self._in.close()
        self._proc.wait(timeout=15)
        self._out.close()


class _PythonCaller:
    """A Python gRPC client (grpcio), timed around each call."""

    name = "Python gRPC caller (grpcio)"

    def __init__(self, dra_socket: str) -> None:
        self._channel = grpc.insecure_channel(f"unix://{dra_socket}")
        self._methods = {m: self._channel.unary_unary(m) for m in (PREPARE, UNPREPARE)}

    def call(self, method: str, request: bytes) -> tuple[float, bytes]:
        t0 = time.perf_counter()
        answer = self._methods[method](request, timeout=10)
        return time.perf_counter() - t0, answer

    def parallel(self, threads: int, calls: list[tuple[str, bytes]]) -> tuple[float, list[bytes]]:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            answers = list(pool.map(lambda c: self._methods[c[0]](c[1], timeout=10), calls))
        return time.perf_counter() - t0, answers

    def close(self) -> None:
        self._channel.close()


def _prepare_request(claim: v1.Claim) -> tuple[str, bytes]:
    return PREPARE, v1.NodePrepareResourcesRequest(claims=[claim]).SerializeToString()


def _unprepare_request(claim: v1.Claim) -> tuple[str, bytes]:
    return UNPREPARE, v1.NodeUnprepareResourcesRequest(claims=[claim]).SerializeToString()


def _check(claim: v1.Claim, method: str, answer: bytes) -> None:
    """Every answer is decoded and must carry this claim without an error."""
    kind = (
        v1.NodePrepareResourcesResponse if method == PREPARE else v1.NodeUnprepareResourcesResponse
    )
    claims = kind.FromString(answer).claims
    if claim.uid not in claims:
        sys.exit(f"{method}: the answer has no entry for claim {claim.uid}")
    if claims[claim.uid].error:
        sys.exit(f"{method} of {claim.name} failed: {claims[claim.uid].error}")
    if method == PREPARE and not claims[claim.uid].devices:
        sys.exit(f"{method} of {claim.name}: no devices in the answer")


def _timed(caller: _Caller, request: tuple[str, bytes], claim: v1.Claim) -> float:
    elapsed, answer = caller.call(*request)
    _check(claim, request[0], answer)
    return elapsed


def _sequence(caller: _Caller, claims: list[v1.Claim]) -> tuple[list[float], list[float]]:
    """Prepares in sequence (ms); each GPU is freed again so 1-GPU claims never collide."""
    prep_ms: list[float] = []
    unprep_ms: list[float] = []
    for i in range(0, len(claims), GPUS):
        batch = claims[i : i + GPUS]
        prep_ms.extend(_timed(caller, _prepare_request(c), c) * 1000 for c in batch)
        unprep_ms.extend(_timed(caller, _unprepare_request(c), c) * 1000 for c in batch)
    return prep_ms, unprep_ms


def _measure(
    work: _Workload, *, caller: _Caller, python: _Caller | None, plugin_pid: int
) -> list[Row]:
    # warm-up: connections, first discovery of the API version
    _sequence(caller, work.warm)
    if python is not None:
        _sequence(python, work.warm)
    prep_ms: list[float] = []
    unprep_ms: list[float] = []
    py_ms: list[float] = []
    for i in range(0, len(work.seq), GPUS):
        prepared, unprepared = _sequence(caller, work.seq[i : i + GPUS])
        prep_ms += prepared
        unprep_ms += unprepared
        if python is not None:
            # For comparison, as many prepares through a Python client, taking turns with the
            # native caller so both see the same machine: the difference is that client's own
            # work per call, which the kubelet does not have.
            py_ms += _sequence(python, work.python[i : i + GPUS])[0]

    # 200 prepares at concurrency 16 (admin-access claims, so 200 can be prepared at once)
    requests = [_prepare_request(c) for c in work.conc]
    conc_s, answers = caller.parallel(16, requests)
    for claim, answer in zip(work.conc, answers, strict=True):
        _check(claim, PREPARE, answer)
    for c in work.conc:
        _timed(caller, _unprepare_request(c), c)

    # memory over 1,000 prepare/unprepare cycles
    _sequence(caller, work.cycles[:100])
    rss_before = _rss_bytes(plugin_pid)
    _sequence(caller, work.cycles[100:])
    growth_mib = (_rss_bytes(plugin_pid) - rss_before) / 2**20

    p50, p99 = statistics.median(prep_ms), _pct(prep_ms, 0.99)
    u50 = statistics.median(unprep_ms)
    rows = [
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
    if py_ms:
        rows.append(
            Row(
                "prepare p50, Python gRPC caller (for comparison)",
                statistics.median(py_ms),
                "ms",
                "",
            )
        )
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
