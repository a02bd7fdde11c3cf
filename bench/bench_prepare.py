"""Prepare/unprepare of the node agent, measured the way the kubelet drives it, against an API
server that looks like a cluster's.

Real path end to end: the agent process exactly as the chart's DaemonSet runs it (``python -m
dra_driver``, in-cluster configuration from the ServiceAccount files, JSON log lines at level info
written to a file as a container log is, Prometheus metrics on), gRPC over its real Unix socket,
the claim fetched over TLS with a bearer token from the local API server
(dra_driver/sim/localapi.py,
in its own process as a real API server would be, so its work does not count as ours), which
answers a GET ``--api-latency-ms`` after it arrived (default 0.5 ms; env BENCH_API_LATENCY_MS), a
real API server's latency for it: the stand-in's own work counts toward it, a sleep makes up the
rest, and the table reports the latency measured in the server; the CDI spec (on a tmpfs, as the
chart's /var/run/cdi is on a node, where /run is one) and the checkpoint (on the disk) written
with fsync. Simulated node: 64 x H100, 32 of them in MIG mode with 7 x 1g.10gb each (256
devices), so 200 claims can hold 200 distinct devices at once. For information, a second agent
started with ``--cpu-affinity one`` repeats the concurrency-16 prepares.

The caller is the kubelet's part: a compiled gRPC client (bench/caller/kubelet_caller.cc, built
by ``make bench``), as the kubelet is a compiled (Go) gRPC client. A Python gRPC client spends
about 0.3 ms of CPU of its own per call on a small node, which would count against the agent;
the same 200 prepares through one are shown for comparison. Where the native caller cannot be
built, everything is measured through the Python client, and the table says so.

Targets: 200 prepares in sequence p50 <= 1.5 ms, p99 <= 4 ms; >= 1,500 prepares/s at concurrency
16 (200 claims, distinct devices); unprepare p50 <= 0.5 ms; agent RSS after 1,000
prepare/unprepare cycles <= 60 MiB, growth over them <= 1 MiB.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

import grpc

from bench.table import Row, print_table
from dra_driver._proto.dra_v1 import api_pb2 as v1
from dra_driver.fsutil import in_memory_fs
from dra_driver.prepare import device_targets
from dra_driver.sim.fakedriver import make_fake_driver, simulated_inventory
from dra_driver.sim.localapi import FakeKubeApi
from tests.claimdata import allocated_claim

NODE = "node1"
SIMULATE = "h100:32,h100:32:mig=1g.10gb*7"
TOKEN = "bench-token"
DEFAULT_API_LATENCY_MS = 0.5


def _cpu_s(pid: int) -> float:
    """CPU time (user + system) the process has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_bytes(pid: int) -> int:
    """Resident memory of the agent process."""
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


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
    cycles: list[v1.Claim]
    python: list[v1.Claim]  # the comparison run through a Python client
    batch: int  # claims prepared before they are unprepared again (each on its own device)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


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
    out = proc.stdout.read()
    proc.wait(timeout=15)
    return out


def _workload(claims: _Claims) -> _Workload:
    names = sorted(device_targets(simulated_inventory(SIMULATE, node_name=NODE)))
    gpus = [n for n in names if "-mig-" not in n]
    return _Workload(
        warm=claims.make("warm", gpus, len(gpus)),
        seq=claims.make("seq", gpus, 192),
        conc=claims.make("conc", names[:200], 200),  # 200 distinct devices
        cycles=claims.make("cycle", gpus, 1088),
        python=claims.make("python", gpus, 192),
        batch=len(gpus),
    )


def _agent(
    tmp: Path,
    api: FakeKubeApi,
    log_file: IO[str],
    *,
    simulate: str = SIMULATE,
    extra_args: tuple[str, ...] = (),
    cdi_root: Path | None = None,
) -> tuple[subprocess.Popen[str], Path]:
    """The agent as the DaemonSet runs it, in-cluster (ServiceAccount files in a private mount
    namespace); returns it once its DRA socket answers, with that socket's path."""
    fake = make_fake_driver(tmp)
    plugins = tmp / "plugins"
    argv = [
        sys.executable, "-m", "dra_driver", "--node-name", NODE, "--simulate", simulate,
        *extra_args,
        "--nvidia-driver-root", str(fake.root),
        "--kubelet-plugins-directory-path", str(plugins),
        "--kubelet-registrar-directory-path", str(tmp / "registry"),
        "--cdi-root", str(cdi_root or tmp / "cdi"),
        "--metrics-port", str(_free_port()), "--healthcheck-port", "0",
        "--log-format", "json", "--log-level", "info",  # the chart's defaults
    ]  # fmt: skip
    for d in ("plugins", "registry", "cdi"):
        (tmp / d).mkdir(parents=True, exist_ok=True)
    argv, pod_env = api.in_cluster_command(argv, workdir=tmp)
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"} | pod_env
    proc = subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log_file, env=env
    )
    socket = plugins / "gpu.nvidia.com" / "dra.sock"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and proc.poll() is None:
        if socket.exists():
            try:
                with grpc.insecure_channel(f"unix://{socket}") as channel:
                    grpc.channel_ready_future(channel).result(timeout=1)
                return proc, socket
            except grpc.FutureTimeoutError:
                pass
        time.sleep(0.05)
    proc.kill()
    sys.exit(f"the agent did not serve {socket} (exit {proc.poll()}); see its log")


@contextlib.contextmanager
def _tmpfs_dir() -> Iterator[Path | None]:
    """A directory on a tmpfs for the CDI specs, as on a node: the chart's ``cdiRoot``
    /var/run/cdi is /run/cdi, and /run is a tmpfs on every systemd distribution (the runtime
    reads its specs from there; they are gone at a reboot, as the prepared claims are). None
    where this machine has no tmpfs at /dev/shm (the specs then go to the bench's disk
    directory, and file creation on ext4 costs the agent more)."""
    if not in_memory_fs(Path("/dev/shm")):
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="bench-prepare-cdi-", dir="/dev/shm") as d:
        yield Path(d)


def _free_port() -> int:
    from dra_driver.sim.localapi import free_port  # noqa: PLC0415

    return free_port()


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


def main(argv: list[str] | None = None) -> int:
    latency_ms = api_latency_ms(argv, __doc__.split("\n")[0])
    claims = _Claims()
    work = _workload(claims)
    with tempfile.TemporaryDirectory(prefix="bench-prepare-", dir="/tmp") as d:
        tmp = Path(d)
        # The API server, the agent and the caller (the kubelet's part) are three processes,
        # as on a node: none of them competes for another's interpreter lock. ``api``: the
        # same server's ServiceAccount files and address, for the agent's Pod environment.
        api_proc, api = start_api_server(tmp, claims, latency_ms)
        try:
            with (
                (tmp / "agent.log").open("w") as agent_log,
                _tmpfs_dir() as cdi_root,
            ):
                agent, dra_socket = _agent(tmp / "node", api, agent_log, cdi_root=cdi_root)
                callers = _callers(str(dra_socket))
                try:
                    rows = _measure(
                        work,
                        caller=callers[0],
                        python=callers[1],
                        agent_pid=agent.pid,
                        api_pid=api_proc.pid,
                    )
                finally:
                    for caller in callers:
                        if caller is not None:
                            caller.close()
                    agent.terminate()
                    agent.wait(timeout=15)
            log_text = (tmp / "agent.log").read_text()
            rows += _on_one_cpu(tmp, api, work, api_pid=api_proc.pid)
        finally:
            get_s = json.loads(_stop(api_proc) or "[]")
    if get_s:
        rows += [
            Row("the API server's answer time for a claim GET, p50 (measured in it)",
                statistics.median(get_s) * 1000, "ms", ""),
            Row("the API server's answer time for a claim GET, p99",
                _pct(get_s, 0.99) * 1000, "ms", ""),
        ]  # fmt: skip
    # every prepare was logged, as in production (the warm-up claims once per caller)
    expected = sum(map(len, (work.warm, work.seq, work.conc, work.cycles)))
    if callers[1] is not None:
        expected += len(work.warm) + len(work.python)
    if log_text.count('"msg": "prepared claim"') != expected:
        sys.exit(f"the agent did not log {expected} prepares:\n{log_text[-2000:]}")
    title = (
        f"prepare/unprepare over dra.sock (fsync'd CDI + checkpoint; claim GET over TLS, "
        f"API server latency {latency_ms:g} ms), {callers[0].name}"
    )
    return 0 if print_table(title, rows) else 1


def _callers(dra_socket: str, *, python: bool = True) -> tuple[_Caller, _Caller | None]:
    """The kubelet-like native caller, and (``python``) a Python one for comparison; only the
    Python one (for everything) when the native one cannot be built here."""
    if NATIVE_CALLER.is_file() and os.access(NATIVE_CALLER, os.X_OK):
        return _NativeCaller(NATIVE_CALLER, dra_socket), (
            _PythonCaller(dra_socket) if python else None
        )
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


def _sequence(
    caller: _Caller, claims: list[v1.Claim], batch: int
) -> tuple[list[float], list[float]]:
    """Prepares in sequence (ms); every ``batch`` claims (one per device) are unprepared again, so
    1-device claims never collide."""
    prep_ms: list[float] = []
    unprep_ms: list[float] = []
    for i in range(0, len(claims), batch):
        chunk = claims[i : i + batch]
        prep_ms.extend(_timed(caller, _prepare_request(c), c) * 1000 for c in chunk)
        unprep_ms.extend(_timed(caller, _unprepare_request(c), c) * 1000 for c in chunk)
    return prep_ms, unprep_ms


def _concurrent(
    caller: _Caller, claims: list[v1.Claim], *, agent_pid: int, api_pid: int
) -> tuple[float, dict[str, float]]:
    """``claims`` prepared at concurrency 16 (each on its own device), then unprepared: the
    prepares per second, and the CPU per prepare of the agent and of the API server (ms)."""
    requests = [_prepare_request(c) for c in claims]
    cpu_before = {name: _cpu_s(pid) for name, pid in (("agent", agent_pid), ("api", api_pid))}
    conc_s, answers = caller.parallel(16, requests)
    cpu_ms = {
        name: (_cpu_s(pid) - cpu_before[name]) * 1000 / len(requests)
        for name, pid in (("agent", agent_pid), ("api", api_pid))
    }
    for claim, answer in zip(claims, answers, strict=True):
        _check(claim, PREPARE, answer)
    for c in claims:
        _timed(caller, _unprepare_request(c), c)
    return len(claims) / conc_s, cpu_ms


def _on_one_cpu(tmp: Path, api: FakeKubeApi, work: _Workload, *, api_pid: int) -> list[Row]:
    """The concurrency-16 prepares again, from a second agent started with ``--cpu-affinity
    one`` (dra_driver/node/cpuaffinity.py), for information: the chart's default is ``all``."""
    if len(os.sched_getaffinity(0)) < 2:
        return []
    with (tmp / "agent-one-cpu.log").open("w") as log_file, _tmpfs_dir() as cdi_root:
        agent, dra_socket = _agent(
            tmp / "node-one-cpu", api, log_file, cdi_root=cdi_root,
            extra_args=("--cpu-affinity", "one"),
        )  # fmt: skip
        caller = _callers(str(dra_socket), python=False)[0]
        try:
            _sequence(caller, work.warm, work.batch)
            rate, cpu_ms = _concurrent(caller, work.conc, agent_pid=agent.pid, api_pid=api_pid)
        finally:
            caller.close()
            agent.terminate()
            agent.wait(timeout=15)
    return [
        Row("prepares/s at concurrency 16, the agent on one CPU (--cpu-affinity one)", rate,
            "/s", ""),
        Row("CPU per prepare at concurrency 16: the agent on one CPU", cpu_ms["agent"], "ms", ""),
    ]  # fmt: skip


def _measure(
    work: _Workload, *, caller: _Caller, python: _Caller | None, agent_pid: int, api_pid: int
) -> list[Row]:
    idle_mib = _rss_bytes(agent_pid) / 2**20
    # warm-up: connections, first discovery of the API version
    _sequence(caller, work.warm, work.batch)
    if python is not None:
        _sequence(python, work.warm, work.batch)
    prep_ms: list[float] = []
    unprep_ms: list[float] = []
    py_ms: list[float] = []
    step = 16
    for i in range(0, len(work.seq), step):
        prepared, unprepared = _sequence(caller, work.seq[i : i + step], step)
        prep_ms += prepared
        unprep_ms += unprepared
        if python is not None:
            # For comparison, as many prepares through a Python client, taking turns with the
            # native caller so both see the same machine: the difference is that client's own
            # work per call, which the kubelet does not have.
            py_ms += _sequence(python, work.python[i : i + step], step)[0]

    rate, cpu_ms = _concurrent(caller, work.conc, agent_pid=agent_pid, api_pid=api_pid)

    # memory over 1,000 prepare/unprepare cycles
    busy_mib = _rss_bytes(agent_pid) / 2**20
    _sequence(caller, work.cycles[:88], work.batch)
    rss_before = _rss_bytes(agent_pid)
    _sequence(caller, work.cycles[88:], work.batch)
    rss_after = _rss_bytes(agent_pid)
    growth_mib = (rss_after - rss_before) / 2**20
    after_mib = rss_after / 2**20

    p50, p99 = statistics.median(prep_ms), _pct(prep_ms, 0.99)
    u50 = statistics.median(unprep_ms)
    rows = [
        Row("prepare p50 (192 in sequence)", p50, "ms", "<= 1.5 ms", p50 <= 1.5),
        Row("prepare p99 (192 in sequence)", p99, "ms", "<= 4 ms", p99 <= 4.0),
        Row("prepares/s at concurrency 16 (200 claims)", rate, "/s", ">= 1,500", rate >= 1500),
        Row("CPU per prepare at concurrency 16: the agent", cpu_ms["agent"], "ms", ""),
        Row(
            "CPU per prepare at concurrency 16: the stand-in API server (same 2 cores)",
            cpu_ms["api"],
            "ms",
            "",
        ),
        Row("unprepare p50", u50, "ms", "<= 0.5 ms", u50 <= 0.5),
        Row("unprepare p99", _pct(unprep_ms, 0.99), "ms", ""),
        Row("agent RSS, idle after start", idle_mib, "MiB", ""),
        Row("agent RSS after the prepares above", busy_mib, "MiB", ""),
        Row("agent RSS after 1,000 prepare/unprepare cycles", after_mib, "MiB", "<= 60 MiB",
            after_mib <= 60.0),
        Row("RSS growth over those cycles", growth_mib, "MiB", "<= 1 MiB", growth_mib <= 1.0),
    ]  # fmt: skip
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
