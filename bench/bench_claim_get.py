"""The prepare path's ResourceClaim GET: keepalive.py's reader against the official client.

Is the hand-written keep-alive client (dra_driver/kube/keepalive.py, its HTTP/1.1 reader in
dra_driver/kube/http1.py) still worth its code?
Each GET is the whole ``KubeClient.get_resource_claim`` a prepare makes (headers from the official
client,
the request, the answer, JSON decoding, v1 conversion), against the local API server
(dra_driver/sim/localapi/) run in its own process, as a real API server would be, so its work does
not count as ours. Over HTTP and over HTTPS (the server's own CA; the DaemonSet always uses TLS).

Compared, on one kept-alive connection each, in alternating batches so both see the same machine
phase:

* keepalive: the path kube/ uses (KeepAliveGetter);
* official: the same KubeClient with the claim GET on the official client's transport
  (``rest.RESTClientObject``, urllib3's PoolManager), the path kube/ falls back to;
* typed API, for information: ``ResourceV1Api.read_namespaced_resource_claim``, which also builds
  the client's model objects (kube/ never uses it).

Per GET: CPU time of the calling thread and wall time, the median over batches of each batch's
mean. The rule of issue 10: the hand-written reader stays only while it saves at least 0.1 ms of
CPU per GET over HTTPS; that row has the target, the others are for information.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.table import Row, print_table, scaled
from dra_driver.kube import KubeClient
from tests.claimdata import allocated_claim

CLAIMS = 50
BATCHES = scaled(30, 2)
PER_BATCH = scaled(100, 10)
WARMUP = scaled(300, 10)
MIN_GAIN_MS = 0.1
NAMESPACE = "ns1"

_API_SERVERS = """
import json, sys
from pathlib import Path
from dra_driver.sim.localapi import FakeKubeApi
tmp = Path(sys.argv[1])
claims = json.loads((tmp / "claims.json").read_text())
for name, tls_dir in (("http", None), ("https", tmp / "tls")):
    api = FakeKubeApi(tls_dir=tls_dir)
    for claim in claims:
        api.add_claim(claim)
    api.start()
    api.write_kubeconfig(tmp / f"kubeconfig-{name}")
print("ready", flush=True)
sys.stdin.read()
"""


def _per_get_ms(get: Callable[[int], Any]) -> tuple[float, float]:
    """CPU and wall milliseconds of one batch of GETs, per GET."""
    cpu0, wall0 = time.thread_time(), time.perf_counter()
    for i in range(PER_BATCH):
        get(i)
    cpu, wall = time.thread_time() - cpu0, time.perf_counter() - wall0
    return cpu * 1000 / PER_BATCH, wall * 1000 / PER_BATCH


def _compare(kubeconfig: Path, names: list[str]) -> dict[str, tuple[float, float]]:
    """Median per-GET (CPU ms, wall ms) of each way of getting a claim."""
    from kubernetes.client import (  # noqa: PLC0415  (kube/ trims the package)
        ApiClient,
        ResourceV1Api,
    )

    keepalive = KubeClient.from_config(kubeconfig=kubeconfig)
    official = KubeClient.from_config(kubeconfig=kubeconfig)
    assert keepalive._getter is not None and official._getter is not None
    official._getter.close()
    official._getter = None  # the official client's path, as kube/ falls back to it
    typed = ResourceV1Api(ApiClient(official.configuration))
    ways: dict[str, Callable[[int], Any]] = {
        "keepalive": lambda i: keepalive.get_resource_claim(
            namespace=NAMESPACE, name=names[i % len(names)]
        ),
        "official": lambda i: official.get_resource_claim(
            namespace=NAMESPACE, name=names[i % len(names)]
        ),
        "typed API": lambda i: typed.read_namespaced_resource_claim(
            names[i % len(names)], NAMESPACE, _request_timeout=(3.0, 10.0)
        ),
    }
    try:
        _ = keepalive.resource_api_version, official.resource_api_version
        for get in ways.values():
            got = get(0)
            assert got is not None
            for i in range(WARMUP):
                get(i)
        samples: dict[str, list[tuple[float, float]]] = {way: [] for way in ways}
        for batch in range(BATCHES):
            order = list(ways) if batch % 2 == 0 else list(reversed(ways))
            for way in order:
                samples[way].append(_per_get_ms(ways[way]))
    finally:
        keepalive.close()
        official.close()
    return {
        way: (
            statistics.median(cpu for cpu, _ in values),
            statistics.median(wall for _, wall in values),
        )
        for way, values in samples.items()
    }


def main() -> int:
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="bench-claim-get-") as d:
        tmp = Path(d)
        claims = [
            allocated_claim(name=f"claim-{i}", namespace=NAMESPACE, devices=["gpu-0"])
            for i in range(CLAIMS)
        ]
        (tmp / "claims.json").write_text(json.dumps(claims))
        server = subprocess.Popen(
            [sys.executable, "-c", _API_SERVERS, str(tmp)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert server.stdout is not None
            if server.stdout.readline().strip() != "ready":
                sys.exit("the API server process did not start")
            names = [c["metadata"]["name"] for c in claims]
            for scheme in ("http", "https"):
                measured = _compare(tmp / f"kubeconfig-{scheme}", names)
                for way, (cpu_ms, wall_ms) in measured.items():
                    rows.append(Row(f"{scheme}: {way}, CPU per GET", cpu_ms, "ms", ""))
                    rows.append(Row(f"{scheme}: {way}, wall per GET", wall_ms, "ms", ""))
                gain_cpu = measured["official"][0] - measured["keepalive"][0]
                gain_wall = measured["official"][1] - measured["keepalive"][1]
                target = f">= {MIN_GAIN_MS} ms" if scheme == "https" else ""
                rows.append(
                    Row(
                        f"{scheme}: keepalive's gain, CPU per GET",
                        gain_cpu,
                        "ms",
                        target,
                        gain_cpu >= MIN_GAIN_MS if target else None,
                    )
                )
                rows.append(Row(f"{scheme}: keepalive's gain, wall per GET", gain_wall, "ms", ""))
        finally:
            assert server.stdin is not None
            server.stdin.close()
            server.wait(timeout=15)
    title = (
        f"ResourceClaim GET (median of {BATCHES} batches of {PER_BATCH}, "
        "local API server in its own process)"
    )
    return 0 if print_table(title, rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
