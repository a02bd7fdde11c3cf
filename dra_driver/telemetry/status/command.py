"""The ``gpu-dra status`` command: its flags, the source they choose (node-local, ``agent.py``;
cluster-wide with ``--kubeconfig``, ``cluster.py``), printing the report once or, with ``--watch``,
again every N seconds until Ctrl-C, and the exit code.

Place in the flow: the top of the tool; ``cli.py`` runs :func:`main` for ``gpu-dra status``. It
builds the one I/O client the cluster-wide source needs (``kube.clusterreads.ClusterClient``),
imported only then, so the node-local mode loads no Kubernetes client.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TextIO

from dra_driver.errors import ConfigError, DraError, MetricsUnavailable
from dra_driver.paths import DEFAULT_DRIVER_NAME
from dra_driver.telemetry.status.agent import DEFAULT_METRICS_URL, node_report
from dra_driver.telemetry.status.cluster import DEFAULT_AGENT_SELECTOR, cluster_report
from dra_driver.telemetry.status.report import formatted


def watch(
    show: Callable[[], str],
    *,
    interval_s: float,
    out: TextIO,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Print ``show()`` every ``interval_s`` until Ctrl-C (then 0). A failure of one refresh is
    shown in place of the table and the next refresh tries again."""
    clear = "\033[H\033[2J" if out.isatty() else ""
    try:
        while True:
            try:
                text = show()
            except DraError as exc:
                text = f"error: {exc}"
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            out.write(f"{clear}Every {interval_s:g}s: gpu-dra status    {stamp}\n\n{text}\n")
            out.flush()
            sleep(interval_s)
    except KeyboardInterrupt:
        out.write("\n")
        return 0


def main(argv: Sequence[str]) -> int:
    """``gpu-dra status``; returns the exit code (0 ok, 1 nothing could be read, 2 bad flags)."""
    parser = argparse.ArgumentParser(
        prog="gpu-dra status",
        description="Show every GPU and MIG device with its health, the claim and pod holding "
        "it, and its latest utilisation, memory, temperature and power. Node-local by default "
        "(the agent's /metrics); cluster-wide with --kubeconfig.",
    )
    parser.add_argument(
        "--metrics-url",
        default=os.environ.get("GPU_DRA_METRICS_URL", DEFAULT_METRICS_URL),
        help=f"the agent's metrics endpoint (node-local mode; default {DEFAULT_METRICS_URL}, "
        "or $GPU_DRA_METRICS_URL)",
    )
    parser.add_argument(
        "--kubeconfig",
        type=Path,
        help="cluster-wide: read slices, claims and the agents' pods with this kubeconfig",
    )
    parser.add_argument("--driver-name", default=DEFAULT_DRIVER_NAME)
    parser.add_argument(
        "--agent-selector",
        default=DEFAULT_AGENT_SELECTOR,
        help="label selector of the agent pods (cluster-wide)",
    )
    parser.add_argument(
        "-n", "--namespace", default="", help="namespace of the agent pods (default: all)"
    )
    parser.add_argument("-o", "--output", choices=("table", "json", "yaml"), default="table")
    parser.add_argument(
        "-w",
        "--watch",
        type=float,
        nargs="?",
        const=2.0,
        metavar="SECONDS",
        help="show it again every SECONDS (default 2) until Ctrl-C",
    )
    args = parser.parse_args(list(argv))
    if args.watch is not None and not args.watch > 0:
        parser.error("--watch: SECONDS must be greater than 0")
    try:
        show = _source(args)
        if args.watch is not None:
            return watch(show, interval_s=args.watch, out=sys.stdout)
        print(show())
    except DraError as exc:
        print(f"gpu-dra status: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigError) else 1
    return 0


def _source(args: argparse.Namespace) -> Callable[[], str]:
    output = args.output
    if args.kubeconfig is None:
        url = args.metrics_url

        def local() -> str:
            try:
                return formatted(node_report(url), output)
            except MetricsUnavailable as exc:
                raise MetricsUnavailable(
                    f"the agent's metrics: {exc}. Is the agent running on this node with "
                    "--metrics-port (the chart's metricsPort)? From elsewhere use kubectl "
                    "port-forward to the agent pod, or --kubeconfig for the whole cluster."
                ) from exc

        return local
    from dra_driver.kube.clusterreads import ClusterClient  # noqa: PLC0415  (node-local: none)

    kube = ClusterClient.from_config(kubeconfig=args.kubeconfig)

    def cluster() -> str:
        report = cluster_report(
            kube,
            driver_name=args.driver_name,
            agent_selector=args.agent_selector,
            namespace=args.namespace,
        )
        return formatted(report, output)

    return cluster


__all__ = ["main", "watch"]
