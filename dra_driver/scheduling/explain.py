"""``gpu-dra explain``: what the scheduler would allocate for a claim, or why it cannot.

Reads a ResourceClaim, ResourceClaimTemplate or Pod (with its claims) from YAML, DeviceClasses
(default: the chart's, ``dra_driver.devices.classes``), and an inventory: simulated GPUs built by
the real discovery pipeline (``--simulate``), a file of ResourceSlices, or the live cluster, whose
ResourceClaims (the devices in use) and DeviceTaintRules are read too. Runs the allocator
(``scheduling.allocator``) per node and prints the allocation, or per request why every device was
rejected, naming the claims that hold the devices in use. Exit code 0: satisfiable, 1: not
satisfiable, 2: input error.

This module is the command: flags -> inputs (``documents``, ``inventory``) -> ``explanation`` ->
``report``. ``--simulate`` needs simulated GPUs, which ``sim`` provides: the CLI
(``dra_driver.cli``) passes its discovery in, as ``scheduling`` sits below ``sim``. The names
other modules used from here before the split (``allocate``, ``result_json``, ...) are still
importable from here.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TextIO

import yaml

from dra_driver.devices.classes import DEFAULT_DRIVER_NAME, default_device_classes
from dra_driver.errors import DraError, ExplainError
from dra_driver.scheduling.documents import claim_key, claims_from_documents, load_documents
from dra_driver.scheduling.environment import NEWEST_VERSION, SUPPORTED_VERSIONS
from dra_driver.scheduling.explanation import ExplainResult, allocate, explain_parsed
from dra_driver.scheduling.inventory import (
    ClusterState,
    SimulatedDiscovery,
    read_cluster,
    simulated_slices,
)
from dra_driver.scheduling.report import render_table, result_json

__all__ = [
    "DEFAULT_SIMULATED_NODE",
    "EXIT_INPUT_ERROR",
    "EXIT_SATISFIABLE",
    "EXIT_UNSATISFIABLE",
    "ClusterState",
    "ExplainResult",
    "SimulatedDiscovery",
    "allocate",
    "claims_from_documents",
    "explain_parsed",
    "load_documents",
    "main",
    "read_cluster",
    "render_table",
    "result_json",
    "simulated_slices",
]

EXIT_SATISFIABLE, EXIT_UNSATISFIABLE, EXIT_INPUT_ERROR = 0, 1, 2
DEFAULT_SIMULATED_NODE = "simulated-node"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gpu-dra explain",
        description="Show the allocation the scheduler would make for a claim, or why it cannot.",
    )
    p.add_argument(
        "claim", help="YAML file (or -) with a ResourceClaim, ResourceClaimTemplate or Pod"
    )
    inv = p.add_mutually_exclusive_group(required=True)
    inv.add_argument(
        "--simulate", metavar="SPEC", help="simulated GPUs, e.g. h100:4,a100-40gb:2:mig"
    )
    inv.add_argument(
        "--slices", metavar="FILE", help="ResourceSlices (kubectl get resourceslices -o yaml)"
    )
    inv.add_argument(
        "--kubeconfig",
        metavar="FILE",
        type=Path,
        help="read slices, classes, claims in use and DeviceTaintRules from the cluster",
    )
    p.add_argument("--classes", metavar="FILE", help="DeviceClasses (default: the chart's classes)")
    p.add_argument(
        "--allocated",
        metavar="FILE",
        help="claims already allocated, with status (kubectl get resourceclaims -A -o yaml)",
    )
    p.add_argument(
        "--taint-rules",
        metavar="FILE",
        help="DeviceTaintRules (kubectl get devicetaintrules -o yaml)",
    )
    p.add_argument(
        "--mig-mode",
        choices=("static", "dynamic"),
        default="static",
        help="with --simulate: publish GPUs in MIG mode as the agent's --mig-mode does "
        "(dynamic: every MIG profile at every placement; default %(default)s)",
    )
    p.add_argument("--node", help="check only this node (with --simulate: the node's name)")
    p.add_argument(
        "--consumable-shares",
        default="disabled",
        metavar="MODE",
        help="with --simulate: publish the GPUs as the agent's --consumable-shares MODE does "
        "(disabled, unlimited, memory, compute or a number of shares)",
    )
    p.add_argument(
        "--driver", default=DEFAULT_DRIVER_NAME, help="driver name (default %(default)s)"
    )
    p.add_argument(
        "--k8s-version",
        choices=SUPPORTED_VERSIONS,
        default=NEWEST_VERSION,
        help="compile selectors as this API server version does for new expressions "
        "(default %(default)s)",
    )
    p.add_argument("-o", "--output", choices=("table", "json", "yaml"), default="table")
    return p


def main(
    argv: list[str],
    *,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
    discover_simulated: SimulatedDiscovery | None = None,
) -> int:
    """Run ``gpu-dra explain``; return 0 (satisfiable), 1 (not satisfiable) or 2 (input error).

    ``discover_simulated``: how ``--simulate`` discovers its GPUs (``sim.nvml.discover_simulated``,
    passed by ``dra_driver.cli``); without it ``--simulate`` is an input error."""
    out = stdout or sys.stdout
    err = stderr or sys.stderr
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed usage
        return EXIT_INPUT_ERROR if exc.code else EXIT_SATISFIABLE
    try:
        result = _run(args, discover_simulated)
    except DraError as exc:
        err.write(f"gpu-dra explain: error: {exc}\n")
        return EXIT_INPUT_ERROR
    if args.output == "json":
        out.write(json.dumps(result_json(result), indent=2) + "\n")
    elif args.output == "yaml":
        out.write(yaml.safe_dump(result_json(result), sort_keys=False))
    else:
        render_table(result, out)
    return EXIT_SATISFIABLE if result.satisfiable else EXIT_UNSATISFIABLE


def _run(args: argparse.Namespace, discover_simulated: SimulatedDiscovery | None) -> ExplainResult:
    label = "<stdin>" if args.claim == "-" else args.claim
    docs = load_documents(args.claim)
    classes = load_documents(args.classes) if args.classes else default_device_classes(args.driver)
    allocated = load_documents(args.allocated) if args.allocated else []
    taint_rules = [
        d
        for d in (load_documents(args.taint_rules) if args.taint_rules else [])
        if d.get("kind", "DeviceTaintRule") == "DeviceTaintRule"
    ]
    notes: tuple[str, ...] = ()
    node = args.node
    if args.consumable_shares != "disabled" and not args.simulate:
        raise ExplainError(
            "--consumable-shares only applies to --simulate (slices from a file or the cluster "
            "say for themselves whether their devices are shared)"
        )
    if args.mig_mode != "static" and not args.simulate:
        raise ExplainError(
            "--mig-mode applies to --simulate only: slices read from a file or the cluster "
            "already say how their GPUs are published"
        )
    if args.simulate:
        if discover_simulated is None:
            raise ExplainError(
                "--simulate needs simulated GPUs, which this entry point does not provide "
                "(run gpu-dra explain)"
            )
        node = node or DEFAULT_SIMULATED_NODE
        slices = simulated_slices(
            args.simulate,
            discover=discover_simulated,
            node_name=node,
            driver_name=args.driver,
            consumable_shares=args.consumable_shares,
            mig_mode=args.mig_mode,
        )
    elif args.slices:
        slices = [
            d
            for d in load_documents(args.slices)
            if d.get("kind", "ResourceSlice") == "ResourceSlice"
        ]
    else:
        cluster = read_cluster(args.kubeconfig)
        slices = cluster.slices
        if cluster.classes and not args.classes:
            classes = cluster.classes
        allocated = cluster.claims + allocated
        taint_rules = cluster.taint_rules + taint_rules
        notes = cluster.notes
    known = {claim_key(c): c for c in allocated}
    claim_objs = claims_from_documents(docs, label=label, known=known)
    try:
        return allocate(
            claim_objs,
            classes,
            slices,
            allocated=allocated,
            taint_rules=taint_rules,
            node=node,
            notes=notes,
            k8s_version=args.k8s_version,
        )
    except ExplainError as exc:
        raise type(exc)(f"{label}: {exc}") from exc
