"""``make cluster``: the test tier's real cluster, for people.

Starts etcd, kube-apiserver, kube-controller-manager, kube-scheduler and two hollow GPU nodes
(the programs ``make kube`` built), installs the chart with ``helm``, runs each node's agent from
the Pod the DaemonSet made, prints the admin kubeconfig's path and waits; Ctrl-C (or SIGTERM)
stops every process and removes the folder (``--keep`` leaves it for a look).
"""

from __future__ import annotations

import argparse
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

from dra_driver.sim.demo import DEMO_SIMULATE
from dra_driver.sim.elfdriver import build_libraries
from tests.cluster import Cluster, simulate_value
from tests.kubebins import bin_dir
from tests.test_deployed import PROBE_C, Builds

GPUS = 6


def main() -> int:
    parser = argparse.ArgumentParser(prog="make cluster", description=__doc__)
    parser.add_argument("--dir", type=Path, default=Path(".cluster"), help="working folder")
    parser.add_argument("--keep", action="store_true", help="keep the folder on exit")
    parser.add_argument("--simulate", default=DEMO_SIMULATE, help="each node's simulated GPUs")
    args = parser.parse_args()
    folder = bin_dir()
    if not (folder / "hollownode").exists():
        print(f"make cluster: no programs in {folder}: run `make kube` first", file=sys.stderr)
        return 2
    work = args.dir.resolve()
    if work.exists():
        print(
            f"make cluster: {work} exists (another cluster, or --keep): remove it", file=sys.stderr
        )
        return 2
    work.mkdir(parents=True)
    elf = work / "elf"
    elf.mkdir()
    libraries = build_libraries(elf)
    (elf / "probe.c").write_text(PROBE_C)
    subprocess.run(["cc", "-O1", "-o", elf / "gpuprobe", elf / "probe.c"], check=True)
    builds = Builds(libraries=libraries, probe=elf / "gpuprobe")
    cluster = Cluster(bin=folder, work=work)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    try:
        cluster.start()
        cluster.install_chart(*simulate_value(args.simulate))
        cluster.start_agents(builds=builds, simulate=args.simulate, gpus=GPUS)
        kubeconfig = cluster.control.admin_kubeconfig
        print(f"cluster up: {', '.join(cluster.nodes)}")
        print(f"  export KUBECONFIG={kubeconfig}")
        print(
            "  kubectl get resourceslices; gpu-dra explain examples/resourceclaims/whole-gpu.yaml"
            f" --kubeconfig {kubeconfig}"
        )
        print(
            f"  logs: {work}/control/logs, {work}/<node>/kubelet.log, {work}/<node>/pod-*/node.log"
        )
        print("Ctrl-C stops it.", flush=True)
        done.wait()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
