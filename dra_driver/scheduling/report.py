"""``explain``'s output: the result as plain JSON for tools (``-o json|yaml``), and the human
report (the allocation, or per request why each device was rejected, grouped across nodes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TextIO

from dra_driver.scheduling import allocator
from dra_driver.scheduling.explanation import ExplainResult

JSON = dict[str, Any]


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
    if r.binding_conditions:
        out["bindingConditions"] = list(r.binding_conditions)
    if r.binding_failure_conditions:
        out["bindingFailureConditions"] = list(r.binding_failure_conditions)
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
                if r.binding_conditions:
                    notes.append("bindingConditions " + ", ".join(r.binding_conditions))
                if r.binding_failure_conditions:
                    notes.append(
                        "bindingFailureConditions " + ", ".join(r.binding_failure_conditions)
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
    # (driver, device, reasons) -> the nodes where that device has those reasons, each once (a
    # pool may name a device twice: it is invalid then, and both copies have the same verdict)
    grouped: dict[tuple[str, str], dict[tuple[str, str, tuple[str, ...]], list[str]]] = {}
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
                nodes = grouped[key].setdefault((v.driver, v.device, v.reasons), [])
                if node_result.node not in nodes:
                    nodes.append(node_result.node)
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
        drivers = {driver for driver, _, _ in grouped[key]}
        for (driver, device, reasons), nodes in grouped[key].items():
            node_col = str(len(nodes)) if len(nodes) > 1 else nodes[0]
            shown = f"{driver}/{device}" if len(drivers) > 1 else device
            why_rows.append((shown, node_col, "; ".join(reasons) if reasons else "usable"))
        out.write("\n")
        _table(why_rows, out, indent="  ")
    if result.notes:
        out.write("\n")
    for note in result.notes:
        out.write(f"note: {note}\n")
