"""The cluster-wide source of ``gpu-dra status`` (``--kubeconfig``): every published device of the
driver, the claims holding it, and the readings of each node's agent that can be reached.

It reads, with the caller's own credentials (``STATUS_PERMISSIONS`` in kube/permissions.py):

1. the driver's ResourceSlices: the published devices of every node, with their taints;
2. the ResourceClaims of all namespaces: which claim holds which device (its allocation results)
   and the pods it is reserved for (``status.reservedFor``);
3. the agent's pods (``--agent-selector``, by default the chart's labels, in all namespaces or
   ``--namespace``): a running pod's endpoint is ``http://<pod IP>:<its container port named
   "metrics">/metrics``. Each is read when reachable from where the command runs (inside the
   cluster network: a node, a debug pod; usually not from a laptop), and its readings merged
   in. Pods that cannot be listed (RBAC) or reached leave their nodes without readings, and a
   note under the table says why.

The API server is a :class:`ClusterSource` (``kube.clusterreads.ClusterClient``, which
``command.py`` builds) and each agent is read with ``agent.py``'s functions.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Protocol

from dra_driver.errors import KubeError, MetricsUnavailable
from dra_driver.paths import DEFAULT_DRIVER_NAME
from dra_driver.telemetry.status.agent import agent_devices, scrape
from dra_driver.telemetry.status.report import DeviceStatus, Holder, Report

DEFAULT_AGENT_SELECTOR = "app.kubernetes.io/name=gpu-dra,app.kubernetes.io/component=kubelet-plugin"


class ClusterSource(Protocol):
    """What cluster_report reads from the API server (kube.clusterreads.ClusterClient)."""

    def list_all_slices(self) -> list[dict[str, Any]]: ...
    def list_resource_claims(self) -> list[dict[str, Any]]: ...
    def list_pods(self, *, label_selector: str, namespace: str = "") -> list[dict[str, Any]]: ...


def cluster_report(
    kube: ClusterSource,
    *,
    driver_name: str = DEFAULT_DRIVER_NAME,
    agent_selector: str = DEFAULT_AGENT_SELECTOR,
    namespace: str = "",
    read: Callable[[str], str] = scrape,
) -> Report:
    """Every published device of ``driver_name`` with its claims, merged with the readings of
    each node's agent that can be listed and reached. KubeError when slices or claims cannot be
    listed (without them there is nothing to show)."""
    published: dict[tuple[str, str], DeviceStatus] = {}
    for obj in kube.list_all_slices():
        spec = obj.get("spec") or {}
        if spec.get("driver") != driver_name:
            continue
        node = str(spec.get("nodeName") or (spec.get("pool") or {}).get("name", ""))
        for device in spec.get("devices") or ():
            body = device.get("basic", device)
            attributes = body.get("attributes") or {}
            published[node, str(device.get("name", ""))] = DeviceStatus(
                node=node,
                device=str(device.get("name", "")),
                type=_attribute(attributes, "type", driver_name),
                profile=_attribute(attributes, "profile", driver_name),
                product=_attribute(attributes, "productName", driver_name),
                published=True,
                taints=tuple(_taint(t) for t in body.get("taints") or ()),
            )
    claims = _claims_by_device(kube.list_resource_claims(), driver_name)
    notes: list[str] = []
    agents: dict[tuple[str, str], DeviceStatus] = {}
    for node, answer in _agent_metrics(kube, agent_selector, namespace, read, notes).items():
        try:
            devices = agent_devices(answer)
        except MetricsUnavailable as exc:
            notes.append(f"{node}: {exc}")
            continue
        agents.update(((d.node, d.device), d) for d in devices)
    rows = []
    seen = {key: i for i, key in enumerate(dict.fromkeys([*published, *agents]))}
    for key in sorted(seen, key=lambda k: _device_order(k, seen)):
        row = published.get(key)
        agent = agents.get(key)
        if row is None:
            assert agent is not None
            row = replace(agent, published=False, claims=())
        elif agent is not None:
            row = replace(
                agent,
                type=row.type or agent.type,
                profile=row.profile or agent.profile,
                product=row.product or agent.product,
                published=True,
                taints=row.taints,
            )
        rows.append(replace(row, claims=claims.get(key, ())))
    return Report(tuple(rows), tuple(notes))


def _agent_metrics(
    kube: ClusterSource,
    selector: str,
    namespace: str,
    read: Callable[[str], str],
    notes: list[str],
) -> dict[str, str]:
    """node -> the exposition of that node's agent (the first of its pods that answers)."""
    try:
        pods = kube.list_pods(label_selector=selector, namespace=namespace)
    except KubeError as exc:
        notes.append(
            f"the agent pods cannot be listed ({exc}); readings are left out. Grant 'list pods' "
            "or run `gpu-dra status` on a node (node-local mode)."
        )
        return {}
    if not pods:
        where = f" in namespace {namespace}" if namespace else ""
        notes.append(f"no agent pods match {selector!r}{where}; readings are left out")
        return {}
    urls: dict[str, list[str]] = {}
    for pod in pods:
        name = f"{pod['metadata'].get('namespace', '')}/{pod['metadata'].get('name', '')}"
        node = str((pod.get("spec") or {}).get("nodeName", ""))
        ip = str((pod.get("status") or {}).get("podIP", ""))
        port = _metrics_port(pod)
        if port is None:
            notes.append(f"{node}: pod {name} serves no metrics (the chart's metricsPort is 0)")
        elif not ip or (pod.get("status") or {}).get("phase") != "Running":
            notes.append(f"{node}: pod {name} is not running")
        else:
            host = f"[{ip}]" if ":" in ip else ip
            urls.setdefault(node, []).append(f"http://{host}:{port}/metrics")

    def first_answer(node: str) -> tuple[str, str | None]:
        problems = []
        for url in urls[node]:
            try:
                return node, read(url)
            except MetricsUnavailable as exc:
                problems.append(str(exc))
        notes.append(f"{node}: agent metrics unavailable: {'; '.join(problems)}")
        return node, None

    with ThreadPoolExecutor(max_workers=8) as pool:
        answers = list(pool.map(first_answer, sorted(urls)))
    return {node: text for node, text in answers if text is not None}


def _metrics_port(pod: Mapping[str, Any]) -> int | None:
    for container in (pod.get("spec") or {}).get("containers") or ():
        for port in container.get("ports") or ():
            if port.get("name") == "metrics" and port.get("containerPort"):
                return int(port["containerPort"])
    return None


def _claims_by_device(
    claims: Iterable[Mapping[str, Any]], driver_name: str
) -> dict[tuple[str, str], tuple[Holder, ...]]:
    """(node, device) -> the allocated claims holding it (pool names are node names)."""
    held: dict[tuple[str, str], list[Holder]] = {}
    for claim in claims:
        meta = claim.get("metadata") or {}
        status = claim.get("status") or {}
        allocation = (status.get("allocation") or {}).get("devices") or {}
        pods = tuple(
            str(c.get("name", ""))
            for c in status.get("reservedFor") or ()
            if c.get("resource") == "pods" and not c.get("apiGroup")
        )
        written = {
            (str(e.get("pool", "")), str(e.get("device", ""))): e
            for e in status.get("devices") or ()
            if e.get("driver") == driver_name
        }
        for result in allocation.get("results") or ():
            if result.get("driver") != driver_name:
                continue
            key = (str(result.get("pool", "")), str(result.get("device", "")))
            entry = written.get(key)
            holder = Holder(
                str(meta.get("namespace", "")),
                str(meta.get("name", "")),
                pods,
                None
                if entry is None
                else {"conditions": entry.get("conditions") or [], "data": entry.get("data") or {}},
            )
            if holder not in held.setdefault(key, []):
                held[key].append(holder)
    return {key: tuple(hs) for key, hs in held.items()}


def _attribute(attributes: Mapping[str, Any], name: str, driver: str) -> str:
    value = attributes.get(name, attributes.get(f"{driver}/{name}"))
    if isinstance(value, Mapping):
        for member in ("string", "version", "int", "bool"):
            if member in value:
                return str(value[member])
    return ""


def _taint(taint: Mapping[str, Any]) -> str:
    key, value, effect = (str(taint.get(k) or "") for k in ("key", "value", "effect"))
    return f"{key}={value}:{effect}" if value else f"{key}:{effect}"


def _device_order(key: tuple[str, str], seen: Mapping[tuple[str, str], int]) -> tuple[Any, ...]:
    """Node, GPU minor, the GPU before its MIG devices, then the order the slices (or the
    agent) list them in."""
    node, device = key
    number = device.removeprefix("gpu-").split("-", 1)[0]
    minor = int(number) if number.isdigit() else sys.maxsize
    return node, minor, "-mig-" in device, seen[key]


__all__ = ["DEFAULT_AGENT_SELECTOR", "ClusterSource", "cluster_report"]
