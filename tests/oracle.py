"""The kube-scheduler as an oracle: ``draoracle`` (hack/kube/draoracle, built by ``make kube``)
runs ``k8s.io/dynamic-resource-allocation`` v0.37.2's structured allocator and CEL environment as
the kube-scheduler 1.37 sets them up; this module runs it and ``gpu-dra explain``'s engine on the
same inputs and puts both answers in one comparable shape.

One oracle process answers a whole batch (``run_oracle``): starting it costs more than a case.

Inputs are what the API server would hand the scheduler: v1 objects with defaults applied
(``api_defaults``: ``allocationMode: ExactCount``, ``count: 1``, tolerations' ``operator:
Equal``), ResourceClaimTemplates turned into the claims the controller makes of them.

Answers (``Outcome``): ``allocated`` with per claim the results (request, driver, pool, device,
admin access, tolerations, consumed capacity, binding conditions; a share ID only as "set": the
scheduler draws it at random), configs and nodeSelector; ``unsatisfiable``; or ``error`` (the
scheduler gives up: a CEL runtime error, an invalid input), with the message for the reader.
"""

from __future__ import annotations

import copy
import json
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dra_driver.errors import DraError
from dra_driver.scheduling import explanation
from dra_driver.scheduling.report import result_json
from tests.kubebins import kube_bin

JSON = dict[str, Any]
ORACLE = "draoracle"
NODE = "node1"
ORACLE_TIMEOUT_S = 300


@dataclass(frozen=True)
class Case:
    """Claims to allocate together on one node, over slices, classes and claims in use."""

    id: str
    slices: list[JSON]
    classes: list[JSON]
    claims: list[JSON]
    allocated: list[JSON] = field(default_factory=list)
    node: str = NODE

    def oracle_input(self) -> JSON:
        return {
            "id": self.id,
            "node": {"name": self.node, "labels": node_labels(self.node)},
            "slices": list(self.slices),
            "classes": list(self.classes),
            "claims": [api_defaults(as_claim(c)) for c in self.claims],
            "allocated": [api_defaults(as_claim(c)) for c in self.allocated],
        }


@dataclass(frozen=True)
class Outcome:
    """One side's answer, in the shape both can give."""

    kind: str  # "allocated", "unsatisfiable" or "error"
    claims: tuple[JSON, ...] = ()  # per claim: {"results", "config", "nodeSelector"}
    message: str = ""  # the error or unschedulable message, for the reader (never compared)

    def comparable(self) -> JSON:
        return {"kind": self.kind, "claims": list(self.claims)}


def node_labels(node: str) -> dict[str, str]:
    """The labels explain gives a node (``explanation.explain_parsed``), given to both sides."""
    return {"kubernetes.io/hostname": node}


def run_oracle(*, allocate: Sequence[JSON] = (), cel: Sequence[JSON] = ()) -> JSON:
    """Run draoracle once on a batch; its whole answer (``features``, ``allocate``, ``cel``)."""
    binary = kube_bin(ORACLE) / ORACLE
    proc = subprocess.run(
        [str(binary)],
        input=json.dumps({"allocate": list(allocate), "cel": list(cel)}),
        capture_output=True,
        text=True,
        timeout=ORACLE_TIMEOUT_S,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{ORACLE} exited {proc.returncode}: {proc.stderr.strip()}")
    answer: JSON = json.loads(proc.stdout)
    return answer


def oracle_outcomes(cases: Sequence[Case]) -> list[Outcome]:
    """The scheduler's answer for each case, from one oracle run."""
    answers = run_oracle(allocate=[c.oracle_input() for c in cases])["allocate"]
    assert [a["id"] for a in answers] == [c.id for c in cases]
    return [_oracle_outcome(a) for a in answers]


def _oracle_outcome(answer: JSON) -> Outcome:
    if answer.get("error"):
        return Outcome("error", message=answer["error"])
    allocations = answer.get("allocations")
    if not allocations:
        return Outcome("unsatisfiable", message=answer.get("unschedulable", ""))
    return Outcome("allocated", tuple(_allocation(a) for a in allocations))


def explain_outcome(case: Case) -> Outcome:
    """``gpu-dra explain``'s answer for the case (its Python API, as the CLI calls it)."""
    try:
        result = explanation.allocate(
            case.claims,
            case.classes,
            case.slices,
            allocated=case.allocated,
            node=case.node,
        )
    except DraError as exc:  # an unknown class, a selector that does not compile
        return Outcome("error", message=str(exc))
    if result.satisfiable:
        chosen = result_json(result)["allocation"]
        return Outcome("allocated", tuple(_allocation(c["allocation"]) for c in chosen["claims"]))
    (node,) = result.nodes
    if node.error:  # a CEL runtime error, an 'All' request over an incomplete pool
        return Outcome("error", message=node.error)
    return Outcome("unsatisfiable")


def _allocation(allocation: JSON) -> JSON:
    devices = allocation.get("devices") or {}
    return {
        "results": [_result(r) for r in devices.get("results") or []],
        "config": _clean(devices.get("config") or []),
        "nodeSelector": _clean(allocation.get("nodeSelector")),
    }


def _result(result: JSON) -> JSON:
    out = {k: result[k] for k in ("request", "driver", "pool", "device")}
    if result.get("adminAccess"):
        out["adminAccess"] = True
    for key in ("tolerations", "bindingConditions", "bindingFailureConditions"):
        if result.get(key):
            out[key] = _clean(result[key])
    if result.get("shareID"):
        out["shareID"] = "<set>"  # a random UUID in the scheduler
    if result.get("consumedCapacity"):
        out["consumedCapacity"] = dict(result["consumedCapacity"])
    return out


def _clean(value: Any) -> Any:
    """``value`` without empty fields (Go's ``omitempty`` and Python's explicit empties)."""
    if isinstance(value, dict):
        cleaned = {k: _clean(v) for k, v in value.items()}
        return {k: v for k, v in cleaned.items() if v not in (None, "", [], {})}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


# -- what the API server would hand the scheduler --------------------------------------------


def as_claim(obj: JSON) -> JSON:
    """A ResourceClaim as the resourceclaim controller makes it of a template (others as they
    are); a namespace where it has none (``default``, as kubectl creates it)."""
    obj = copy.deepcopy(obj)
    meta = obj.setdefault("metadata", {})
    meta.setdefault("namespace", "default")
    if obj.get("kind") == "ResourceClaimTemplate":
        return {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
            "spec": (obj.get("spec") or {}).get("spec") or {},
        }
    obj.setdefault("apiVersion", "resource.k8s.io/v1")
    obj.setdefault("kind", "ResourceClaim")
    return obj


def api_defaults(obj: JSON) -> JSON:
    """``obj`` with the defaults the API server's v1 defaulting sets on requests and
    tolerations (the allocator reads the defaulted fields)."""
    obj = copy.deepcopy(obj)
    for request in ((obj.get("spec") or {}).get("devices") or {}).get("requests") or []:
        for exact in [request.get("exactly"), *(request.get("firstAvailable") or [])]:
            if not exact:
                continue
            exact.setdefault("allocationMode", "ExactCount")
            if exact["allocationMode"] == "ExactCount":
                exact.setdefault("count", 1)
            for toleration in exact.get("tolerations") or []:
                toleration.setdefault("operator", "Equal")
    return obj


def named_slices(slices: Sequence[JSON]) -> list[JSON]:
    """Slices as the API server stores them: ``generateName`` made a name (``<prefix>NNNNN``)."""
    out = []
    for i, original in enumerate(slices):
        s = copy.deepcopy(original)
        meta = s.setdefault("metadata", {})
        if not meta.get("name"):
            meta["name"] = f"{meta.get('generateName', 'slice-')}{i:05d}"
            meta.pop("generateName", None)
        out.append(s)
    return out


def difference(case: Case, ours: Outcome, theirs: Outcome) -> str:
    """A readable report of one case the two sides answer differently."""
    return (
        f"case {case.id}: explain and the kube-scheduler differ\n"
        f"  explain:   {json.dumps(ours.comparable(), sort_keys=True)} {ours.message}\n"
        f"  scheduler: {json.dumps(theirs.comparable(), sort_keys=True)} {theirs.message}\n"
        f"  input: {json.dumps(case.oracle_input(), sort_keys=True)[:6000]}"
    )
