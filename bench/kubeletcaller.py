"""The kubelet's side of the prepare benches: the callers that send NodePrepareResources and
NodeUnprepareResources to a plugin over its Unix socket, and the timed runs of them (in
sequence, at concurrency 16, several plugins taking turns).

The caller is a compiled gRPC client (bench/caller/kubelet_caller.cc, built by ``make bench``),
as the kubelet is a compiled (Go) gRPC client: a Python gRPC client spends about 0.3 ms of CPU
of its own per call on a small node, which would count against the plugin. Where the native
caller cannot be built, a Python one is used, and the benches say so.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

import grpc

from dra_driver._proto.dra_v1 import api_pb2 as v1

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


def _cpu_s(pid: int) -> float:
    """CPU time (user + system) the process has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def sequences_in_turns(
    turns: Mapping[str, tuple[_Caller, list[v1.Claim]]], step: int = 16
) -> dict[str, tuple[list[float], list[float]]]:
    """For each name, its caller prepares its claims in sequence, ``step`` at a time, and
    unprepares them again; the callers take turns ``step`` claims at a time, so that all see the
    same machine (this VM's pace changes by a third from one minute to the next). Name -> the
    prepare and unprepare times (ms)."""
    times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in turns}
    longest = max(len(claims) for _, claims in turns.values())
    for i in range(0, longest, step):
        for name, (caller, claims) in turns.items():
            if chunk := claims[i : i + step]:
                prepared, unprepared = _sequence(caller, chunk, step)
                times[name][0].extend(prepared)
                times[name][1].extend(unprepared)
    return times


def concurrent_in_turns(
    turns: Mapping[str, tuple[_Caller, int]], claims: list[v1.Claim], *, rounds: int, api_pid: int
) -> dict[str, list[tuple[float, dict[str, float]]]]:
    """``rounds`` runs of ``_concurrent`` for each name (its caller and its plugin's pid), taking
    turns. Name -> each run's prepares per second and CPU per prepare (ms) of the plugin
    ("agent") and of the API server ("api")."""
    runs: dict[str, list[tuple[float, dict[str, float]]]] = {name: [] for name in turns}
    for _ in range(rounds):
        for name, (caller, pid) in turns.items():
            runs[name].append(_concurrent(caller, claims, agent_pid=pid, api_pid=api_pid))
    return runs
