"""Telemetry: the CPU of a sampling pass, the time of a /metrics scrape, the agent's memory.

Rows:
* a sampling pass over 8 simulated H100 (telemetry.Telemetry.sample with gpus/readings.py's
  NvmlReader: 128 NVML calls through pynvml into the simulated library, then the exposition
  formatted for the scrapes, the DCGM-compatible series included as by default), process CPU
  time per pass, median of 5 rounds of 200 passes: <= 4 ms. Shown for information: the NVML
  reads alone, and the NVML calls per pass.
* ``GET /metrics`` over real HTTP from the real agent process (``python -m dra_driver
  --simulate h100:64 --metrics-port ...``, kubeconfig to the local API server), 64 devices,
  every metric of the agent, median of 200 scrapes, with the DCGM-compatible series (the
  default) and without (``--dcgm-metrics false``): plain on a new connection each, and with gzip
  (``Accept-Encoding: gzip``) over one kept HTTP/1.1 connection, as Prometheus scrapes: each
  <= 5 ms. Shown for information: p99, the exposition's size plain and gzipped, the CPU of
  formatting and deflating the 64 devices' telemetry (paid once per sample, in the sampling
  thread, not by scrapes: a scrape with gzip sends it as kept, metrics.Rendered) and the size
  the agent keeps it at.
* the agent's RSS as the DaemonSet runs it (a Pod's ServiceAccount files, in-cluster TLS) with
  metrics and telemetry on, as the chart's defaults have them (8 simulated H100, 2 in MIG mode;
  the same node as bench_publish), median of 3: <= 60 MiB. Next to it, the same agent with
  metrics off (bench_publish's configuration), so the difference is what metrics cost.
"""

from __future__ import annotations

import http.client
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.bench_publish import AGENT_SPEC, _rss_mib, wait_for
from bench.table import Row, print_table, scaled
from dra_driver.gpus import nvml
from dra_driver.gpus.readings import NvmlReader
from dra_driver.sim.localapi import FakeKubeApi, free_port
from dra_driver.sim.nvml import simulated_nvml
from dra_driver.telemetry.sampler import Telemetry

NODE = "bench-node"
PASSES = scaled(200, 10)  # sampling passes per measurement (5 measurements; 1 short)
MEASUREMENTS = scaled(5, 1)
SCRAPES = scaled(200, 10)
WARMUP = scaled(20, 2)
CPU_RUNS = scaled(20, 2)
RSS_RUNS = scaled(3, 1)


def bench_sampling() -> list[Row]:
    with simulated_nvml("h100:8", node_name=NODE) as node:
        inventory = nvml.discover(driver_root=Path("/"), sysfs_root=node.sysfs_root)
        reader = NvmlReader()
        telemetry = Telemetry(node_name=NODE, inventory=inventory, read=reader, dcgm=True)
        try:
            telemetry.sample()  # handles looked up, unsupported queries learnt
            node.library.calls.clear()
            telemetry.sample()
            calls = len(node.library.calls)
            passes, reads = [], []
            for _ in range(MEASUREMENTS):
                started = time.process_time()
                for _ in range(PASSES):
                    telemetry.sample()
                passes.append((time.process_time() - started) / PASSES * 1000)
                started = time.process_time()
                for _ in range(PASSES):
                    reader.read(telemetry.targets)
                reads.append((time.process_time() - started) / PASSES * 1000)
        finally:
            reader.close()
    pass_ms = statistics.median(passes)
    return [
        Row(
            f"sampling pass, 8 simulated H100: CPU per pass (median of {MEASUREMENTS} x {PASSES})",
            pass_ms,
            "ms",
            "<= 4 ms",
            pass_ms <= 4,
        ),
        Row(
            "  of which NVML reads (pynvml + simulated library)", statistics.median(reads), "ms", ""
        ),
        Row("  NVML calls per pass", calls, "", ""),
    ]


def _scrape(port: int, kept: http.client.HTTPConnection | None = None) -> tuple[float, bytes]:
    """One GET /metrics: (seconds, the body as sent). On a new connection, plain; on ``kept``,
    with ``Accept-Encoding: gzip`` (the body is then gzipped)."""
    started = time.perf_counter()
    connection = kept or http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("GET", "/metrics", headers={"Accept-Encoding": "gzip"} if kept else {})
        response = connection.getresponse()
        body = response.read()
        if response.status != 200:
            raise RuntimeError(f"/metrics answered {response.status}: {body[:200]!r}")
        if kept and response.getheader("Content-Encoding") != "gzip":
            raise RuntimeError("/metrics did not gzip for Accept-Encoding: gzip")
    finally:
        if kept is None:
            connection.close()
    return time.perf_counter() - started, body


def _agent(
    tmp: Path, api: FakeKubeApi, *, spec: str, extra: list[str], in_cluster: bool
) -> subprocess.Popen[bytes]:
    work = tmp / f"agent-{time.monotonic_ns()}"
    for d in ("plugins", "plugins_registry", "cdi"):
        (work / d).mkdir(parents=True)
    cmd = [
        sys.executable, "-m", "dra_driver", "--node-name", NODE, "--simulate", spec,
        "--kubelet-plugins-directory-path", str(work / "plugins"),
        "--kubelet-registrar-directory-path", str(work / "plugins_registry"),
        "--cdi-root", str(work / "cdi"), "--healthcheck-port", "0", *extra,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
    if in_cluster:
        cmd, pod_env = api.in_cluster_command(cmd, workdir=work)
        env.update(pod_env)
    else:
        cmd += ["--kubeconfig", str(api.write_kubeconfig(work / "kubeconfig"))]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)


def _stop(proc: subprocess.Popen[bytes]) -> str:
    proc.terminate()
    try:
        _, err = proc.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return err.decode(errors="replace")


def bench_scrape(tmp: Path, *, dcgm: bool) -> list[Row]:
    api = FakeKubeApi().start()
    api.add_node(NODE)
    port = free_port()
    extra = ["--metrics-port", str(port), "--dcgm-metrics", "true" if dcgm else "false"]
    proc = _agent(tmp, api, spec="h100:64", extra=extra, in_cluster=False)
    times: list[float] = []
    gzip_times: list[float] = []
    body = gzipped = b""
    problem = ""
    try:
        up = wait_for(lambda: _answers(port) or proc.poll() is not None, 30)
        up = up and proc.poll() is None
        # the first sample is there when its timestamp is
        sampled = up and wait_for(lambda: b"last_sample_timestamp" in _body(port), 30)
        if not sampled:
            problem = f"the agent did not serve telemetry (exit code {proc.poll()})"
        else:
            for _ in range(WARMUP):  # warm-up: connections, the server's threads
                _scrape(port)
            for _ in range(SCRAPES):
                elapsed, body = _scrape(port)
                times.append(elapsed)
            kept = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            try:
                for i in range(WARMUP + SCRAPES):  # the first WARMUP: warm-up
                    elapsed, gzipped = _scrape(port, kept)
                    if i >= WARMUP:
                        gzip_times.append(elapsed)
            finally:
                kept.close()
    finally:
        err = _stop(proc)
        api.stop()
    if problem:
        print(problem, *err.strip().splitlines()[-5:], sep="\n  ", file=sys.stderr)
    median_ms, p99_ms = _median_p99_ms(times)
    gzip_median_ms, gzip_p99_ms = _median_p99_ms(gzip_times)
    series = "with DCGM series (default)" if dcgm else "--dcgm-metrics false"
    format_ms, kept_kib = _format_cpu_ms(dcgm=dcgm)
    return [
        Row(
            f"GET /metrics, agent with 64 simulated GPUs, {series}, over HTTP "
            f"(median of {SCRAPES})",
            median_ms,
            "ms",
            "<= 5 ms",
            median_ms <= 5,
        ),
        Row("  p99", p99_ms, "ms", ""),
        Row("  exposition size", len(body) / 1024, "KiB", ""),
        Row(
            f"GET /metrics with gzip, 64 simulated GPUs, {series}, one kept connection "
            f"(median of {SCRAPES})",
            gzip_median_ms,
            "ms",
            "<= 5 ms",
            gzip_median_ms <= 5,
        ),
        Row("  p99", gzip_p99_ms, "ms", ""),
        Row("  exposition size gzipped", len(gzipped) / 1024, "KiB", ""),
        Row(
            "  formatting and deflating the 64 devices' telemetry, once per sample (CPU)",
            format_ms,
            "ms",
            "",
        ),
        Row("  the telemetry's exposition as the agent keeps it (deflated)", kept_kib, "KiB", ""),
    ]


def _median_p99_ms(times: list[float]) -> tuple[float, float]:
    if not times:
        return float("inf"), float("inf")
    return statistics.median(times) * 1000, sorted(times)[int(len(times) * 0.99) - 1] * 1000


def _answers(port: int) -> bool:
    try:
        _scrape(port)
    except (OSError, RuntimeError):
        return False
    return True


def _body(port: int) -> bytes:
    """The exposition; empty while the agent does not answer."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("GET", "/metrics")
        return connection.getresponse().read()
    except OSError:
        return b""
    finally:
        connection.close()


def _format_cpu_ms(*, dcgm: bool) -> tuple[float, float]:
    """CPU of formatting and deflating the telemetry of 64 devices (a cache miss), median of 20;
    and the size of what the agent keeps of it (KiB)."""
    with simulated_nvml("h100:64", node_name=NODE) as node:
        inventory = nvml.discover(driver_root=Path("/"), sysfs_root=node.sysfs_root)
        reader = NvmlReader()
        telemetry = Telemetry(node_name=NODE, inventory=inventory, read=reader, dcgm=dcgm)
        try:
            telemetry.sample()
            costs = []
            for i in range(CPU_RUNS):
                change = {("gpu-0", 13): i}
                telemetry.set_health_providers(xid_counts=lambda c=change: c)  # a change
                started = time.process_time()
                kept = telemetry.exposition()
                costs.append((time.process_time() - started) * 1000)
        finally:
            reader.close()
    return statistics.median(costs), len(kept.data) / 1024


def bench_rss(tmp: Path) -> list[Row]:
    rows = []
    for label, metrics_on in (
        ("metrics + telemetry on (chart defaults)", True),
        ("metrics off", False),
    ):
        api = FakeKubeApi(tls_dir=tmp / f"tls-{len(rows)}").start()
        api.add_node(NODE)
        rss: list[float] = []
        try:
            for _ in range(RSS_RUNS):
                args = ["--metrics-port", str(free_port())] if metrics_on else []
                proc = _agent(tmp, api, spec=AGENT_SPEC, extra=args, in_cluster=True)
                try:
                    ok = wait_for(
                        lambda p=proc, a=api: bool(a.slices()) or p.poll() is not None, 20
                    )
                    if ok and api.slices():
                        time.sleep(2.0)  # start-up settles; the first telemetry samples ran
                        rss.append(_rss_mib(proc.pid))
                finally:
                    err = _stop(proc)
                for s in api.slices():
                    api._state.objects.pop(("resourceslices", "", s["metadata"]["name"]), None)
                if not rss:
                    print("agent run failed", *err.strip().splitlines()[-5:], sep="\n  ")
                    break
        finally:
            api.stop()
        value = statistics.median(rss) if len(rss) == RSS_RUNS else float("inf")
        name = f"agent RSS in-cluster, 8 simulated H100 (2 MIG), {label}, median of {RSS_RUNS}"
        rows.append(
            Row(name, value, "MiB", "<= 60 MiB", value <= 60)
            if metrics_on
            else Row(name, value, "MiB", "")
        )
    return rows


def main() -> int:
    with tempfile.TemporaryDirectory(
        prefix="bench-telemetry-", dir="/tmp"
    ) as tmp:  # short socket paths
        rows = [
            *bench_sampling(),
            *bench_scrape(Path(tmp), dcgm=True),
            *bench_scrape(Path(tmp), dcgm=False),
            *bench_rss(Path(tmp)),
        ]
    return 0 if print_table("Telemetry", rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
