"""``explain``'s inputs from YAML: documents from a file or stdin (``kind: List`` expanded), and
the claims to allocate together from ResourceClaims, ResourceClaimTemplates and the Pods (or
workloads) that reference them, named as the control plane would name generated claims.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TextIO

import yaml

from dra_driver.errors import ExplainError

JSON = dict[str, Any]


def load_documents(source: str, *, stdin: TextIO | None = None) -> list[JSON]:
    """YAML (or JSON) documents from a file or ``-``; a ``kind: List`` is expanded."""
    label = "<stdin>" if source == "-" else source
    try:
        if source == "-":
            text = (stdin or sys.stdin).read()
        else:
            text = Path(source).read_text(encoding="utf-8")
    except OSError as exc:
        raise ExplainError(f"{source}: cannot read: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ExplainError(
            f"{label}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset "
            f"{exc.start}); expected YAML or JSON"
        ) from exc
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f"{label}:{mark.line + 1}:{mark.column + 1}" if mark else label
        raise ExplainError(f"{where}: invalid YAML: {exc.problem}") from exc
    except yaml.YAMLError as exc:
        raise ExplainError(f"{label}: invalid YAML: {exc}") from exc
    except RecursionError as exc:  # PyYAML composes nodes recursively
        raise ExplainError(f"{label}: YAML nested deeper than explain reads") from exc
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


def claim_key(obj: JSON) -> str:
    """``namespace/name`` of a claim (``default`` when it has no namespace)."""
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace') or 'default'}/{meta.get('name', '')}"
