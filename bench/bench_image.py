"""The image users install: its size and layers, and the agent started from it as the chart's
DaemonSet runs it (tests/test_deployed_image.py's pod: podman, the chart's command, env, security
context and hostPath volumes, 8 simulated H100 against the local API server): the time from the
container's start (podman's StartedAt) to the first ResourceSlice the API server stores, and the
agent's RSS in the container once it has published.

Builds the image as the tests do (tests/image.py: once per set of inputs). For information, no
targets. Skips, saying why, where no image can be built here (no root or podman, no base).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from bench.table import Row, print_table
from dra_driver.sim.elfdriver import build_libraries
from dra_driver.sim.localapi import FakeKubeApi
from tests.image import PodImage, build, facts, load_into, remove_store, why_not_buildable
from tests.podman import containers_conf
from tests.test_deployed import NODE, Builds, Node, _missing, start_node
from tests.test_deployed_image import agent_pid

SIMULATE = "h100:8"


def _started_at(image: PodImage, node: Node, name: str) -> float:
    """When podman started the container ``name`` (its StartedAt), as a Unix time."""
    run = subprocess.run(
        ["nsenter", f"--mount=/proc/{node.pid}/ns/mnt", *image.podman(), "inspect",
         "--format", "{{.State.StartedAt}}", name],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    # Go's time: "2026-11-27 20:01:02.123456789 +0000 UTC"
    day, clock, offset, _ = run.stdout.split()
    whole, _, fraction = clock.partition(".")
    stamp = datetime.strptime(f"{day} {whole} {offset}", "%Y-%m-%d %H:%M:%S %z")
    return stamp.timestamp() + float(f"0.{fraction or 0}")


def main() -> int:
    why = _missing() or why_not_buildable()
    if why:
        print(f"skipped: {why}")
        return 0
    store = Path(tempfile.mkdtemp(prefix="ddi-", dir="/tmp"))
    api = None
    node = None
    try:
        conf = containers_conf(store)
        started = time.monotonic()
        tag = build(conf)
        built_s = time.monotonic() - started
        image_facts = facts(tag)
        image = PodImage(tag, load_into(store, tag), conf)
        with tempfile.TemporaryDirectory(prefix="dd-", dir="/tmp") as d:
            work = Path(d)
            (work / "elf").mkdir()
            libraries = build_libraries(work / "elf")
            api = FakeKubeApi(tls_dir=work / "tls", token="agent-token").start()
            api.add_node(NODE)
            node, _ = start_node(
                work, layout="gpu-operator", builds=Builds(libraries, work / "unused"), api=api,
                simulate=SIMULATE, image=image,
            )  # fmt: skip
            deadline = time.monotonic() + 120
            while not api.objects("resourceslices"):
                assert node.process.poll() is None, node.log.read_text()
                assert time.monotonic() < deadline, node.log.read_text()
                time.sleep(0.01)
            first_slice = time.time()
            name = f"gpu-dra-{work.name}"
            to_slice = first_slice - _started_at(image, node, name)
            time.sleep(2)  # settled: the first publish done
            pid = agent_pid(node, image, name)
            status = Path(f"/proc/{pid}/status").read_text()
            rss = int(next(x for x in status.splitlines() if x.startswith("VmRSS:")).split()[1])
            assert node.stop() == 0, node.log.read_text()
            node = None
            api.stop()
            api = None
    finally:
        if node is not None:
            node.stop()
        if api is not None:
            api.stop()
        remove_store(store)
    print_table(
        f"the image ({tag}; built or found in {built_s:.1f} s)",
        [
            Row("image size (podman image inspect)", image_facts.size_bytes / 1e6, "MB", ""),
            Row("image layers", image_facts.layers, "", ""),
            Row(f"container start -> first ResourceSlice ({SIMULATE})", to_slice, "s", ""),
            Row("agent RSS in the container after the first publish", rss / 1024, "MiB", ""),
        ],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
