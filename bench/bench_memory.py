"""Where the agent's megabytes go: RSS after each group of modules the agent imports, in the
order the agent's own imports bring them in, and what the agent's Python objects hold once it
runs (tracemalloc, by package).

Both parts run in a fresh interpreter each, as the agent does (``python -m dra_driver``): the
import part imports the modules step by step and reads VmRSS after each; the running part
starts the real agent code (``run_agent``, 8 simulated H100 with 2 in MIG mode, against the
local API server, run in this process so its modules do not count, through a Configuration
built as the in-cluster loader builds it) under
tracemalloc and groups the live allocations by the package that made them. For information:
the targets are the agent RSS rows of bench_publish and bench_prepare.
"""

from __future__ import annotations

import json
import subprocess
import sys

from bench.table import Row, print_table
from dra_driver.sim.localapi import FakeKubeApi

# What each step adds, in the order the agent's imports bring them in.
STEPS = (
    ("interpreter (python -c pass)", ()),
    ("ssl + urllib3 (TLS, HTTP)", ("ssl", "urllib3")),
    ("grpc (C core) + protobuf", ("grpc", "google.protobuf")),
    ("generated DRA/health/registration messages", ("dra_driver.plugin.kubelet",)),
    ("kubernetes client: configuration, rest, in-cluster loader", ("dra_driver.kube",)),
    ("pynvml + discovery", ("pynvml", "dra_driver.gpus.nvml")),
    ("the rest of the agent", ("dra_driver.node.agent", "dra_driver.cli")),
)

_IMPORTS = """
import json, os, sys
def rss():
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
out = []
for name, modules in json.loads(sys.argv[1]):
    for module in modules:
        __import__(module)
    out.append([name, rss(), len(sys.modules)])
print(json.dumps(out))
"""

_RUNNING = """
import json, shutil, sys, threading, time, tracemalloc, tempfile
from collections import Counter
from pathlib import Path
tracemalloc.start()
from dra_driver import kube  # first: it decides which parts of the client load
from kubernetes.client.configuration import Configuration
from dra_driver.node.agent import run_agent
from dra_driver.node.config import Config
tmp = Path(tempfile.mkdtemp(prefix="bench-memory-"))
url = sys.argv[1]
kube.KubeClient.from_config = classmethod(  # as the in-cluster loader configures the client
    lambda cls, **kw: cls(Configuration(host=url, api_key={"BearerToken": "Bearer t"}))
)
def published():
    client = kube.KubeClient(Configuration(host=url))
    try:
        return client.list_slices(driver_name="gpu.nvidia.com", node_name="node1").items
    finally:
        client.close()
config = Config(node_name="node1", simulate="h100:6,h100:2:mig=1g.10gb*7",
                kubelet_plugins_directory_path=tmp / "plugins",
                kubelet_registrar_directory_path=tmp / "registry", cdi_root=tmp / "cdi",
                metrics_port=0, healthcheck_port=0, log_level="error")
stop = threading.Event()
result = {}
def measure():
    while not published():
        time.sleep(0.05)
    time.sleep(0.5)
    by_package = Counter()
    for stat in tracemalloc.take_snapshot().statistics("filename"):
        name = stat.traceback[0].filename
        if "site-packages/" in name:
            key = name.split("site-packages/")[1].split("/")[0].removesuffix(".py")
        elif "/dra_driver/" in name:
            key = "dra_driver"
        elif name.startswith("<frozen"):
            key = "code objects of imported modules"
        else:
            key = "standard library"
        by_package[key] += stat.size
    result.update(by_package)
    stop.set()
threading.Thread(target=measure, daemon=True).start()
try:
    run_agent(config, stop=stop)
finally:
    shutil.rmtree(tmp, ignore_errors=True)
print(json.dumps(result))
"""


def _run(script: str, *args: str) -> object:
    done = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        sys.exit(f"memory probe failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    steps = _run(_IMPORTS, json.dumps(STEPS))
    assert isinstance(steps, list)
    rows = []
    previous = 0.0
    for name, rss, modules in steps:
        rows.append(Row(f"+ {name} ({modules} modules loaded)", rss - previous, "MiB", ""))
        previous = rss
    rows.append(Row("RSS with every module the agent imports", previous, "MiB", ""))
    ok = print_table("agent RSS by import step (fresh interpreter)", rows)
    api = FakeKubeApi().start()  # in this process: its own modules do not count
    api.add_node("node1")
    try:
        running = _run(_RUNNING, api.url)
    finally:
        api.stop()
    assert isinstance(running, dict)
    total = sum(running.values())
    live = [
        Row(f"{name}", size / 2**20, "MiB", "")
        for name, size in sorted(running.items(), key=lambda kv: -kv[1])[:8]
    ]
    live.append(Row("all Python allocations (tracemalloc)", total / 2**20, "MiB", ""))
    print()
    ok &= print_table(
        "agent's live Python allocations by package (8 simulated H100, 2 in MIG mode)", live
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
