"""Where the agent's megabytes go: RSS after each group of modules the agent imports, in the
order the agent's own imports bring them in, and what the agent's Python objects hold once it
runs (tracemalloc, by package).

Both parts run in a fresh interpreter each, as the agent does (``python -m dra_driver``): the
import part imports the modules step by step and reads VmRSS after each; the running part
starts the real agent code (``run_agent``, 8 simulated H100 with 2 in MIG mode, against the
local API server, run in this process so its modules do not count, through a Configuration
built as the in-cluster loader builds it) under
tracemalloc and groups the live allocations by the package that made them (the simulated NVML
apart: a real node runs NVIDIA's library instead); a third part runs the same agent without
tracemalloc, with metrics and telemetry off and then on, and reads its RSS by mapping from
``/proc/self/smaps`` (libraries by file, the malloc heap, anonymous memory: Python's arenas,
thread stacks). For information: the targets are the agent RSS rows of bench_publish and
bench_prepare.
"""

from __future__ import annotations

import json
import subprocess
import sys

from bench.table import Row, print_table
from dra_driver.sim.localapi import FakeKubeApi, free_port

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
        elif "/dra_driver/sim/" in name:
            key = "dra_driver.sim (simulated NVML: a real node runs libnvidia-ml instead)"
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


# The running agent without tracemalloc, read from /proc/self/smaps once its slices are out
# (and, with metrics on, after 3 telemetry samples of 1 s): RSS by what is mapped.
_MAPPED = """
import json, os, shutil, sys, threading, time, tempfile
from collections import Counter
from pathlib import Path
from dra_driver import kube
from kubernetes.client.configuration import Configuration
from dra_driver.node.agent import run_agent
from dra_driver.node.config import Config
tmp = Path(tempfile.mkdtemp(prefix="bench-memory-"))
url, metrics_port, simulate = sys.argv[1], int(sys.argv[2]), sys.argv[3] or None
kube.KubeClient.from_config = classmethod(
    lambda cls, **kw: cls(Configuration(host=url, api_key={"BearerToken": "Bearer t"}))
)
def published():
    client = kube.KubeClient(Configuration(host=url))
    try:
        return client.list_slices(driver_name="gpu.nvidia.com", node_name="node1").items
    finally:
        client.close()
config = Config(node_name="node1", simulate=simulate,
                kubelet_plugins_directory_path=tmp / "plugins",
                kubelet_registrar_directory_path=tmp / "registry", cdi_root=tmp / "cdi",
                metrics_port=metrics_port, telemetry_interval_s=1.0, healthcheck_port=0,
                log_level="error")
stop = threading.Event()
result = Counter()
def measure():
    while not published():
        time.sleep(0.05)
    time.sleep(3.5 if metrics_port else 0.5)
    path = None
    with open("/proc/self/smaps") as f:
        for line in f:
            words = line.split()
            if "-" in words[0] and len(words) >= 5:
                path = words[5] if len(words) > 5 else "[anonymous]"
            elif words[0] == "Rss:":
                name = os.path.basename(path) if path.startswith("/") else path
                result[name] += int(words[1]) * 1024
    stop.set()
threading.Thread(target=measure, daemon=True).start()
try:
    run_agent(config, stop=stop)
finally:
    shutil.rmtree(tmp, ignore_errors=True)
print(json.dumps(result))
"""


def _mapped_rows(off: dict[str, int], on: dict[str, int]) -> list[Row]:
    """RSS by mapping, metrics off and on: the largest, the rest together, the total."""
    names = sorted(on.keys() | off.keys(), key=lambda n: -max(on.get(n, 0), off.get(n, 0)))
    top = names[:9]
    rows = [
        Row(f"{name}: off / on / +", on.get(name, 0) / 2**20, "MiB", "",
            floor=f"{off.get(name, 0) / 2**20:.1f} / {on.get(name, 0) / 2**20:.1f} / "
                  f"{(on.get(name, 0) - off.get(name, 0)) / 2**20:+.1f}")
        for name in top
    ]  # fmt: skip
    rest_off = sum(v for n, v in off.items() if n not in top)
    rest_on = sum(v for n, v in on.items() if n not in top)
    rows.append(Row("every other mapping (off / on / +)", rest_on / 2**20, "MiB", "",
                    floor=f"{rest_off / 2**20:.1f} / {rest_on / 2**20:.1f} / "
                          f"{(rest_on - rest_off) / 2**20:+.1f}"))  # fmt: skip
    total_off, total_on = sum(off.values()), sum(on.values())
    rows.append(Row("RSS (off / on / +)", total_on / 2**20, "MiB", "",
                    floor=f"{total_off / 2**20:.1f} / {total_on / 2**20:.1f} / "
                          f"{(total_on - total_off) / 2**20:+.1f}"))  # fmt: skip
    return rows


def _run(script: str, *args: str) -> object:
    done = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        sys.exit(f"memory probe failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


SIMULATED = "h100:6,h100:2:mig=1g.10gb*7"


def main() -> int:
    """``--nvml``: the third part on this machine's NVML (a lent GPU) instead of simulated
    GPUs, where its smaps name libnvidia-ml and the driver's own mappings; ``--short``: only
    the third part."""
    simulate = "" if "--nvml" in sys.argv[1:] else SIMULATED
    if "--short" in sys.argv[1:]:
        return _mapped_part(simulate)
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
    print()
    return 0 if ok and _mapped_part(simulate) == 0 else 1


def _mapped_part(simulate: str) -> int:
    api = FakeKubeApi().start()
    api.add_node("node1")
    try:
        off = _run(_MAPPED, api.url, "0", simulate)
        on = _run(_MAPPED, api.url, str(free_port()), simulate)
    finally:
        api.stop()
    assert isinstance(off, dict) and isinstance(on, dict)
    gpus = "8 simulated H100, 2 in MIG mode" if simulate else "this machine's NVML"
    ok = print_table(
        "running agent's RSS by mapping (smaps), metrics and telemetry off / on (1 s samples, "
        f"DCGM series; {gpus})",
        _mapped_rows(off, on),
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
