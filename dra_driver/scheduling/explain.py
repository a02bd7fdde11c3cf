"""``gpu-dra explain``: what the scheduler would allocate for a claim, or why it cannot.

Reads a ResourceClaim, ResourceClaimTemplate or Pod (with its claims) from YAML, DeviceClasses
(default: the chart's, ``dra_driver.devices.classes``), and an inventory: simulated GPUs built by
the real discovery pipeline (``--simulate``), a file of ResourceSlices, or the live cluster, whose
ResourceClaims (the devices in use) and DeviceTaintRules are read too. Runs the allocator
(``scheduling.allocator``) per node and prints the allocation, or per request why every device was
rejected, naming the claims that hold the devices in use. Exit code 0: satisfiable, 1: not
satisfiable, 2: input error.

This module is the I/O edge of the scheduling package: files, stdin, the cluster; the rest is pure.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import yaml

from dra_driver.devices.classes import DEFAULT_DRIVER_NAME, default_device_classes
from dra_driver.errors import DraError, ExplainError, KubeForbidden
from dra_driver.scheduling import allocator
from dra_driver.scheduling.allocator import (
    AllocationResult,
    Claim,
    DeviceClass,
    DeviceTaintRule,
    Node,
    Slice,
)
from dra_driver.scheduling.environment import NEWEST_VERSION, SUPPORTED_VERSIONS

if TYPE_CHECKING:
    from dra_driver.devices import MigMode

JSON = dict[str, Any]
EXIT_SATISFIABLE, EXIT_UNSATISFIABLE, EXIT_INPUT_ERROR = 0, 1, 2
DEFAULT_SIMULATED_NODE = "simulated-node"


@dataclass(frozen=True)
class ExplainResult:
    """The outcome for a set of claims over every node of an inventory."""

    claims: tuple[str, ...]
    satisfiable: bool
    chosen: AllocationResult | None  # the first satisfiable node in name order
    satisfiable_nodes: tuple[str, ...]
    nodes: tuple[AllocationResult, ...]  # every node checked (diagnosed when none fits)
    notes: tuple[str, ...] = ()  # about the inputs: what was read from the cluster


# ---------------------------------------------------------------------------------------------
# Library API


def allocate(
    claims: JSON | Sequence[JSON],
    classes: Sequence[JSON],
    slices: Sequence[JSON],
    *,
    allocated: Sequence[JSON] = (),
    taint_rules: Sequence[JSON] = (),
    node: str | None = None,
    notes: Sequence[str] = (),
    k8s_version: str = NEWEST_VERSION,
) -> ExplainResult:
    """Allocate ``claims`` (JSON, allocated together) on the nodes of ``slices``.

    ``allocated``: ResourceClaims with ``status.allocation`` (others are ignored): their devices,
    counters and capacity are in use, and a claim of ``claims`` among them keeps its allocation.
    ``taint_rules``: DeviceTaintRules, whose taints are added to the devices they select.
    ``node`` limits the check to one node; ``notes`` are passed through to the result. Selectors
    compile as new expressions of an API server of ``k8s_version`` (``environment.py``). Raise
    ExplainError (or CelCompileError) for bad input.
    """
    claim_objs = [claims] if isinstance(claims, dict) else list(claims)
    parsed = [allocator.parse_claim(c) for c in claim_objs]
    class_map = _classes(classes)
    parsed_slices = [allocator.parse_slice(s) for s in slices]
    state = allocator.allocated_state(allocated)
    rules = [allocator.parse_device_taint_rule(r) for r in taint_rules]
    return explain_parsed(
        parsed,
        class_map,
        parsed_slices,
        allocated=state,
        taint_rules=rules,
        node=node,
        notes=notes,
        k8s_version=k8s_version,
    )


def explain_parsed(
    claims: Sequence[Claim],
    classes: dict[str, DeviceClass],
    slices: Sequence[Slice],
    *,
    allocated: allocator.AllocatedState | None = None,
    taint_rules: Sequence[DeviceTaintRule] = (),
    node: str | None = None,
    notes: Sequence[str] = (),
    k8s_version: str = NEWEST_VERSION,
) -> ExplainResult:
    keys = tuple(c.key for c in claims)
    allocator.compile_selectors(claims, classes, k8s_version=k8s_version)
    slices = allocator.apply_taint_rules(slices, taint_rules, classes=classes)
    by_node: dict[str, list[Slice]] = {}
    shared: list[Slice] = []
    for s in slices:
        if s.node_name:
            by_node.setdefault(s.node_name, []).append(s)
        else:
            shared.append(s)
    names = sorted(by_node) if node is None else [node]
    if not names:
        names = [""]  # only cluster-wide slices: any node will do

    def allocate_all(*, diagnose: bool) -> list[allocator.AllocationResult]:
        return [
            allocator.allocate(
                claims,
                classes=classes,
                slices=by_node.get(name, []) + shared,
                node=Node(name, {"kubernetes.io/hostname": name}),
                allocated=allocated,
                diagnose=diagnose,
            )
            for name in names
        ]

    results = allocate_all(diagnose=False)
    fitting = tuple(r.node for r in results if r.satisfiable)
    if not fitting:  # only then is every device's "why not" worth its cost
        results = allocate_all(diagnose=True)
    chosen = next((r for r in results if r.satisfiable), None)
    return ExplainResult(keys, bool(fitting), chosen, fitting, tuple(results), tuple(notes))


def _classes(objs: Sequence[JSON]) -> dict[str, DeviceClass]:
    out: dict[str, DeviceClass] = {}
    for obj in objs:
        cls = allocator.parse_device_class(obj)
        out[cls.name] = cls
    return out


# ---------------------------------------------------------------------------------------------
# Inputs


def load_documents(source: str, *, stdin: TextIO | None = None) -> list[JSON]:
    """YAML (or JSON) documents from a file or ``-``; a ``kind: List`` is expanded."""
    if source == "-":
        text = (stdin or sys.stdin).read()
        label = "<stdin>"
    else:
        try:
            text = Path(source).read_text(encoding="utf-8")
        except OSError as exc:
            raise ExplainError(f"{source}: cannot read: {exc.strerror or exc}") from exc
        label = source
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f"{label}:{mark.line + 1}:{mark.column + 1}" if mark else label
        raise ExplainError(f"{where}: invalid YAML: {exc.problem}") from exc
    except yaml.YAMLError as exc:
        raise ExplainError(f"{label}: invalid YAML: {exc}") from exc
    out: list[JSON] = []
    for i, doc in enumerate(docs):
        if not isinstance(doc, dict):
            raise ExplainError(f"{label}: document {i + 1} is not an object")
        if doc.get("kind") == "List" or (
            str(doc.get("kind", "")).endswith("List") and "items" in doc
        ):
            out.extend(item for item in doc.get("items") or [] if isinstance(item, dict))
        else:
            out.append(doc)
    return out


def claims_from_documents(
    docs: Iterable[JSON], *, label: str, known: Mapping[str, JSON] | None = None
) -> list[JSON]:
    """The claims to allocate together: ResourceClaims, templates, and those Pods reference.

    ``known``: claims that exist already (the cluster's, or those of ``--allocated``), by
    ``namespace/name``. A Pod's ``resourceClaimName`` must be in the input or in ``known``. Its
    ``resourceClaimTemplateName`` becomes one claim per Pod, named as the Pod's
    ``status.resourceClaimStatuses`` says (the known claim itself when there is one), else
    ``<pod>-<claim>``, as the control plane generates it.
    """
    docs = list(docs)
    known = known or {}
    claims = {_name(d): d for d in docs if d.get("kind") == "ResourceClaim"}
    templates = {_name(d): d for d in docs if d.get("kind") == "ResourceClaimTemplate"}
    pods = [d for d in docs if d.get("kind") == "Pod" or d.get("kind") in _WORKLOADS]
    out: list[JSON] = list(claims.values())
    used_templates: set[str] = set()
    taken: set[str] = set()

    def add_known(key: str) -> None:
        if key not in taken:
            taken.add(key)
            out.append(known[key])

    for pod in pods:
        spec = _pod_spec(pod)
        namespace = str((pod.get("metadata") or {}).get("namespace") or "default")
        generated_names = {
            str(s.get("name")): str(s["resourceClaimName"])
            for s in (pod.get("status") or {}).get("resourceClaimStatuses") or []
            if isinstance(s, dict) and s.get("resourceClaimName")
        }
        for ref in spec.get("resourceClaims") or []:
            claim_name = ref.get("resourceClaimName")
            if claim_name and claim_name not in claims:
                if f"{namespace}/{claim_name}" not in known:
                    raise ExplainError(
                        f"{label}: {pod.get('kind')} {_name(pod)} uses ResourceClaim "
                        f"{claim_name!r}, which is not in the input"
                        + (f" nor in namespace {namespace} of the cluster" if known else "")
                    )
                add_known(f"{namespace}/{claim_name}")
            template = ref.get("resourceClaimTemplateName")
            if template:
                name = generated_names.get(str(ref.get("name")))
                if name and f"{namespace}/{name}" in known:
                    used_templates.add(template)
                    add_known(f"{namespace}/{name}")
                    continue
                if template not in templates:
                    raise ExplainError(
                        f"{label}: {pod.get('kind')} {_name(pod)} uses ResourceClaimTemplate "
                        f"{template!r}, which is not in the input"
                    )
                used_templates.add(template)
                generated = dict(templates[template])
                generated["metadata"] = {
                    **(generated.get("metadata") or {}),
                    "name": name or f"{_name(pod)}-{ref.get('name')}",
                }
                out.append(generated)
    out.extend(t for name, t in templates.items() if name not in used_templates)
    if not out:
        raise ExplainError(
            f"{label}: no ResourceClaim, ResourceClaimTemplate or Pod with resourceClaims found"
        )
    return out


_WORKLOADS = ("Deployment", "StatefulSet", "Job", "DaemonSet", "ReplicaSet")


def _pod_spec(obj: JSON) -> JSON:
    spec = obj.get("spec") or {}
    if obj.get("kind") in _WORKLOADS:
        spec = ((spec.get("template") or {}).get("spec")) or {}
    return spec if isinstance(spec, dict) else {}


def _name(obj: JSON) -> str:
    return str((obj.get("metadata") or {}).get("name", ""))


def simulated_slices(
    spec: str,
    *,
    node_name: str,
    driver_name: str = DEFAULT_DRIVER_NAME,
    consumable_shares: str = "disabled",
    mig_mode: MigMode = "static",
) -> list[JSON]:
    """The ResourceSlices our driver would publish for simulated GPUs ``spec`` on ``node_name``
    with ``--mig-mode mig_mode`` (the simulated MIG devices count as the driver's own),
    shareable as ``consumable_shares`` (a ``--consumable-shares`` value) says.

    Runs the real pipeline: simulated NVML -> nvml.discover -> devices -> shares -> slices.
    """
    from dra_driver.devices import (  # noqa: PLC0415 - only this path needs them
        mig_instance_name,
        node_devices,
    )
    from dra_driver.publish.slices import build_slices, to_api_objects  # noqa: PLC0415
    from dra_driver.sharing.shares import parse_mode, shareable  # noqa: PLC0415
    from dra_driver.sim.nvml import discover_simulated  # noqa: PLC0415

    try:
        mode = parse_mode(consumable_shares)
    except ValueError as exc:
        raise ExplainError(f"--consumable-shares {consumable_shares!r}: {exc}") from None
    inventory = discover_simulated(spec, node_name=node_name)
    devices = shareable(
        node_devices(
            inventory,
            driver_name=driver_name,
            mig_mode=mig_mode,
            managed_mig=frozenset(
                mig_instance_name(g, m) for g in inventory.gpus for m in g.mig_instances
            ),
        ),
        mode,
    )
    pool = build_slices(devices, driver_name=driver_name, node_name=node_name)
    objs = to_api_objects(pool, node_uid="simulated")
    for i, obj in enumerate(objs):
        meta = obj["metadata"]
        meta["name"] = f"{meta.get('generateName', 'slice-')}{i:05d}"
    return objs


@dataclass(frozen=True)
class ClusterState:
    """What ``--kubeconfig`` reads: what the scheduler sees, as plain v1-shape JSON."""

    slices: list[JSON]
    classes: list[JSON]
    claims: list[JSON]  # every ResourceClaim, allocated or not
    taint_rules: list[JSON]
    notes: tuple[str, ...]


def read_cluster(kubeconfig: Path | None) -> ClusterState:
    """Slices, DeviceClasses, ResourceClaims (all namespaces) and DeviceTaintRules from the
    cluster, through ``dra_driver.kube.KubeClient``, with the user's credentials.

    DeviceTaintRules that the cluster does not serve, or that these credentials may not list,
    are skipped with a note; ResourceClaims that may not be listed are an ExplainError: without
    them every device would look free.
    """
    from dra_driver.kube import KubeClient  # noqa: PLC0415 - the only path that talks to the API

    client = KubeClient.from_config(kubeconfig=kubeconfig)
    try:
        slices = client.list_all_slices()
        classes = client.list_device_classes()
        try:
            claims = client.list_resource_claims()
        except KubeForbidden as exc:
            raise ExplainError(
                "these credentials may not list resourceclaims.resource.k8s.io in all "
                "namespaces (403); explain needs them to know which devices are in use. "
                "Without that permission, use --slices and --allocated with files exported by "
                "someone who has it"
            ) from exc
        try:
            rules = client.list_device_taint_rules()
        except KubeForbidden:
            rules = None
            rules_note = (
                "DeviceTaintRules: these credentials may not list "
                "devicetaintrules.resource.k8s.io; only the slices' own taints were applied"
            )
        else:
            rules_note = (
                "DeviceTaintRules: not served by this cluster; only the slices' own taints apply"
                if rules is None
                else f"{_count(len(rules), 'DeviceTaintRule')} applied"
            )
    finally:
        client.close()
    allocated = sum(1 for c in claims if (c.get("status") or {}).get("allocation") is not None)
    notes = (
        f"read from the cluster: {_count(len(slices), 'ResourceSlice')}, "
        f"{_count(len(classes), 'DeviceClass', 'DeviceClasses')}, "
        f"{_count(len(claims), 'ResourceClaim')} ({allocated} allocated)",
        rules_note,
    )
    return ClusterState(slices, classes, claims, list(rules or ()), notes)


def _count(n: int, singular: str, plural: str = "") -> str:
    return f"{n} {singular if n == 1 else plural or singular + 's'}"


def _claim_key(obj: JSON) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace') or 'default'}/{meta.get('name', '')}"


# ---------------------------------------------------------------------------------------------
# Output


def result_json(result: ExplainResult) -> JSON:
    """The result as plain JSON for tools (``-o json|yaml``)."""
    chosen = None
    if result.chosen is not None:
        chosen = {
            "node": result.chosen.node,
            "claims": [
                {
                    "claim": a.claim,
                    **({"alreadyAllocated": True} if a.existing else {}),
                    "allocation": {
                        "devices": {
                            "results": [_device_result(r) for r in a.results],
                            "config": list(a.config),
                        },
                        **({"nodeSelector": a.node_selector} if a.node_selector else {}),
                    },
                }
                for a in result.chosen.allocations
            ],
        }
    return {
        "claims": list(result.claims),
        "satisfiable": result.satisfiable,
        "nodesChecked": len(result.nodes),
        "satisfiableNodes": list(result.satisfiable_nodes),
        "allocation": chosen,
        **({"notes": list(result.notes)} if result.notes else {}),
        "nodes": [
            {
                "node": r.node,
                "satisfiable": r.satisfiable,
                **({"error": r.error} if r.error else {}),
                **({"notes": list(r.notes)} if r.notes else {}),
                "requests": [
                    {
                        "claim": d.claim,
                        "request": d.request,
                        "deviceClass": d.device_class,
                        "wanted": d.wanted,
                        "summary": d.summary,
                        **({"allMatchingTaken": True} if d.all_taken else {}),
                        "devices": [
                            {
                                "driver": v.driver,
                                "pool": v.pool,
                                "device": v.device,
                                "usable": not v.reasons,
                                "reasons": list(v.reasons),
                                **({"inUseBy": list(v.in_use_by)} if v.in_use_by else {}),
                            }
                            for v in d.verdicts
                        ],
                    }
                    for d in r.diagnoses
                ],
            }
            for r in result.nodes
            if not result.satisfiable or r.satisfiable
        ],
    }


def _device_result(r: allocator.DeviceResult) -> JSON:
    out: JSON = {"request": r.request, "driver": r.driver, "pool": r.pool, "device": r.device}
    if r.admin_access:
        out["adminAccess"] = True
    if r.tolerations:
        out["tolerations"] = [{k: v for k, v in vars(t).items() if v} for t in r.tolerations]
    if r.share_id:
        out["shareID"] = r.share_id
    if r.consumed_capacity:
        out["consumedCapacity"] = dict(r.consumed_capacity)
    return out


def _table(rows: Sequence[Sequence[str]], out: TextIO, indent: str = "") -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        cells = [c.ljust(w) for c, w in zip(row, widths, strict=True)]
        out.write(indent + "  ".join(cells).rstrip() + "\n")


_SUMMARIES_SHOWN = 10


def _names(nodes: Sequence[str], limit: int = 3) -> str:
    return ", ".join(nodes[:limit]) + (", ..." if len(nodes) > limit else "")


def render_table(result: ExplainResult, out: TextIO) -> None:
    """The human report: the allocation, or per request why each device was rejected."""
    claims = ", ".join(result.claims)
    total = len(result.nodes)
    if result.satisfiable and result.chosen is not None:
        where = (
            f"node {result.chosen.node}"
            if total == 1
            else (
                f"{len(result.satisfiable_nodes)} of {total} nodes; "
                f"first in name order: {result.chosen.node}"
            )
        )
        out.write(f"Claim {claims}: satisfiable on {where}\n\n")
        rows = [("CLAIM", "REQUEST", "DEVICE", "POOL", "DRIVER", "NOTES")]
        for a in result.chosen.allocations:
            for r in a.results:
                notes = []
                if a.existing:
                    notes.append("already allocated")
                if r.admin_access:
                    notes.append("adminAccess")
                if r.consumed_capacity:
                    notes.append(
                        "consumes " + ", ".join(f"{k}={v}" for k, v in r.consumed_capacity.items())
                    )
                rows.append((a.claim, r.request, r.device, r.pool, r.driver, "; ".join(notes)))
        _table(rows, out)
        footnotes = (*result.chosen.notes, *result.notes)
        if footnotes:
            out.write("\n")
        for note in footnotes:
            out.write(f"note: {note}\n")
        return
    where = f"node {result.nodes[0].node}" if total == 1 else f"any of {total} nodes"
    out.write(f"Claim {claims}: NOT satisfiable on {where}\n")
    errors: dict[str, list[str]] = {}
    for node_result in result.nodes:
        if node_result.error:
            errors.setdefault(node_result.error, []).append(node_result.node)
        for note in node_result.notes:
            errors.setdefault(f"note: {note}", []).append(node_result.node)
    for message, nodes in errors.items():
        out.write(f"\n{message}" + (f"  ({len(nodes)} nodes)" if total > 1 else "") + "\n")
    # Group per request, then identical summaries and (device, reasons) across nodes.
    order: list[tuple[str, str]] = []
    grouped: dict[tuple[str, str], dict[tuple[str, tuple[str, ...]], list[str]]] = {}
    headers: dict[tuple[str, str], tuple[str, dict[str, list[str]]]] = {}
    all_taken: dict[tuple[str, str], int] = {}
    for node_result in result.nodes:
        for d in node_result.diagnoses:
            key = (d.claim, d.request)
            if key not in grouped:
                order.append(key)
                grouped[key] = {}
                headers[key] = (f"class {d.device_class}, wants {d.wanted}", {})
            headers[key][1].setdefault(d.summary, []).append(node_result.node)
            all_taken[key] = all_taken.get(key, 0) + d.all_taken
            for v in d.verdicts:
                grouped[key].setdefault((v.device, v.reasons), []).append(node_result.node)
    for key in order:
        info, summaries = headers[key]
        out.write(f"\nrequest {key[1]} of claim {key[0]} ({info}):\n")
        checked = sum(len(nodes) for nodes in summaries.values())
        if checked > 1 and all_taken[key]:
            on = f"all {checked}" if all_taken[key] == checked else f"{all_taken[key]} of {checked}"
            out.write(f"  on {on} nodes, allocated claims hold every matching device\n")
        ranked = sorted(summaries.items(), key=lambda item: (-len(item[1]), item[0]))
        for summary, nodes in ranked[:_SUMMARIES_SHOWN]:
            where = (
                ""
                if total == 1
                else f"  (node {nodes[0]})"
                if len(nodes) == 1
                else f"  ({len(nodes)} nodes: {_names(nodes)})"
            )
            out.write(f"  {summary}{where}\n")
        if len(ranked) > _SUMMARIES_SHOWN:
            out.write(f"  ... {len(ranked) - _SUMMARIES_SHOWN} more (-o json has every node's)\n")
        why_rows = [("DEVICE", "NODES" if total > 1 else "NODE", "WHY NOT")]
        for (device, reasons), nodes in grouped[key].items():
            node_col = str(len(nodes)) if len(nodes) > 1 else nodes[0]
            why_rows.append((device, node_col, "; ".join(reasons) if reasons else "usable"))
        out.write("\n")
        _table(why_rows, out, indent="  ")
    if result.notes:
        out.write("\n")
    for note in result.notes:
        out.write(f"note: {note}\n")


# ---------------------------------------------------------------------------------------------
# Command


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


def main(argv: list[str], *, stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    """Run ``gpu-dra explain``; return 0 (satisfiable), 1 (not satisfiable) or 2 (input error)."""
    out = stdout or sys.stdout
    err = stderr or sys.stderr
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed usage
        return EXIT_INPUT_ERROR if exc.code else EXIT_SATISFIABLE
    try:
        result = _run(args)
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


def _run(args: argparse.Namespace) -> ExplainResult:
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
        node = node or DEFAULT_SIMULATED_NODE
        slices = simulated_slices(
            args.simulate,
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
    known = {_claim_key(c): c for c in allocated}
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


def entry() -> None:  # pragma: no cover - console convenience
    raise SystemExit(main(sys.argv[1:]))
