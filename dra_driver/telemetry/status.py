"""``gpu-dra status``: every GPU and MIG device with its health, the claim and pod holding it, and
its latest readings, for one node or the whole cluster.

Node-local (the default) reads one agent's ``/metrics`` (``--metrics-url``, by default
``http://127.0.0.1:8080/metrics``, the chart's ``metricsPort`` seen from the node itself or through
``kubectl port-forward``) and shows what that agent reports: its devices (``gpu_dra_gpu_info``),
the claims and pods holding them (``gpu_dra_device_claim_info``, as of the agent's last telemetry
sample), the health state where the agent's health watcher reports one, and the readings.

Cluster-wide (``--kubeconfig``) uses the caller's own credentials (``STATUS_PERMISSIONS`` in
kube/permissions.py):

1. the driver's ResourceSlices: the published devices of every node, with their taints;
2. the ResourceClaims of all namespaces: which claim holds which device (its allocation results)
   and the pods it is reserved for (``status.reservedFor``);
3. the agent's pods (``--agent-selector``, by default the chart's labels, in all namespaces or
   ``--namespace``): a running pod's endpoint is ``http://<pod IP>:<its container port named
   "metrics">/metrics``. Each is read when reachable from where the command runs (inside the
   cluster network: a node, a debug pod; usually not from a laptop), and its readings merged
   in. Pods that cannot be listed (RBAC) or reached leave their nodes without readings, and a
   note under the table says why.

The exposition is parsed with ``prometheus_client.parser``. Output: ``-o table`` (default),
``json`` or ``yaml``; ``--watch N`` shows it again every N seconds until Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol, TextIO

from dra_driver.errors import ConfigError, DraError, KubeError, MetricsUnavailable
from dra_driver.paths import DEFAULT_DRIVER_NAME

CHART_METRICS_PORT = 8080
DEFAULT_METRICS_URL = f"http://127.0.0.1:{CHART_METRICS_PORT}/metrics"
DEFAULT_AGENT_SELECTOR = "app.kubernetes.io/name=gpu-dra,app.kubernetes.io/component=kubelet-plugin"
SCRAPE_TIMEOUT_S = 3.0
COLUMNS = ("NODE", "DEVICE", "TYPE", "HEALTH", "CLAIM", "POD", "UTIL", "MEMORY", "TEMP", "POWER")


@dataclass(frozen=True)
class Holder:
    """A claim holding a device, and the pods it is reserved for."""

    namespace: str
    name: str
    pods: tuple[str, ...] = ()
    # the driver's status.devices entry of this device in the claim (KEP-4817): its conditions
    # and data (GPU/MIG UUID, index, product, profile); None when the claim has none
    device_status: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class DeviceStatus:
    """One row: a device as the slices, the claims and its agent describe it (each optional)."""

    node: str
    device: str
    type: str = ""  # gpu or mig
    profile: str = ""
    product: str = ""
    mig_enabled: bool = False
    published: bool | None = None  # in a ResourceSlice; None: not known (node-local)
    health: str = ""  # the agent's health state; empty: not reported
    taints: tuple[str, ...] = ()  # key=value:Effect, from the slice
    claims: tuple[Holder, ...] = ()
    utilization_ratio: float | None = None
    memory_used_bytes: float | None = None
    memory_total_bytes: float | None = None
    temperature_celsius: float | None = None
    power_usage_watts: float | None = None
    power_limit_watts: float | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"node": self.node, "device": self.device, "type": self.type}
        if self.profile:
            out["profile"] = self.profile
        if self.product:
            out["product"] = self.product
        if self.type == "gpu":
            out["migEnabled"] = self.mig_enabled
        if self.published is not None:
            out["published"] = self.published
        out["health"] = self.health or None
        out["taints"] = list(self.taints)
        out["claims"] = [
            {"namespace": h.namespace, "name": h.name, "pods": list(h.pods)}
            | ({"deviceStatus": dict(h.device_status)} if h.device_status is not None else {})
            for h in self.claims
        ]
        for key, value in (
            ("utilization", self.utilization_ratio),
            ("memoryUsedBytes", self.memory_used_bytes),
            ("memoryTotalBytes", self.memory_total_bytes),
            ("temperatureCelsius", self.temperature_celsius),
            ("powerWatts", self.power_usage_watts),
            ("powerLimitWatts", self.power_limit_watts),
        ):
            out[key] = None if value is None else _number(value)
        return out


@dataclass(frozen=True)
class Report:
    devices: tuple[DeviceStatus, ...]
    notes: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "devices": [d.to_json() for d in self.devices],
            "notes": list(self.notes),
        }


# -- reading an agent's metrics ------------------------------------------------------------------

_VALUES = {
    "gpu_dra_gpu_utilization_ratio": "utilization_ratio",
    "gpu_dra_gpu_memory_used_bytes": "memory_used_bytes",
    "gpu_dra_gpu_memory_total_bytes": "memory_total_bytes",
    "gpu_dra_gpu_temperature_celsius": "temperature_celsius",
    "gpu_dra_gpu_power_usage_watts": "power_usage_watts",
    "gpu_dra_gpu_power_limit_watts": "power_limit_watts",
}


def scrape(url: str, *, timeout_s: float = SCRAPE_TIMEOUT_S) -> str:
    """GET ``url`` (an agent's /metrics); MetricsUnavailable says why it could not be read."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as answer:  # noqa: S310 (http only)
            return str(answer.read().decode())
    except urllib.error.HTTPError as exc:
        with exc:
            body = exc.read().decode(errors="replace").strip().splitlines()
        reason = f": {body[0]}" if body else ""
        raise MetricsUnavailable(f"{url} answered HTTP {exc.code}{reason}") from exc
    except urllib.error.URLError as exc:
        raise MetricsUnavailable(f"cannot reach {url}: {exc.reason}") from exc
    except (OSError, ValueError) as exc:  # timeouts, resets, a malformed URL
        raise MetricsUnavailable(f"cannot read {url}: {exc}") from exc


def agent_devices(text: str) -> list[DeviceStatus]:
    """The devices one agent's exposition reports, in its order. Raises MetricsUnavailable when
    ``text`` is not the Prometheus text format."""
    from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415

    rows: dict[tuple[str, str], DeviceStatus] = {}
    values: dict[tuple[str, str], dict[str, Any]] = {}
    holders: dict[tuple[str, str], dict[tuple[str, str], list[str]]] = {}
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as exc:
        raise MetricsUnavailable(f"not Prometheus metrics: {exc}") from exc
    for family in families:
        for sample in family.samples:
            labels = sample.labels
            key = (labels.get("node", ""), labels.get("device", ""))
            if sample.name == "gpu_dra_gpu_info":
                rows[key] = DeviceStatus(
                    node=key[0],
                    device=key[1],
                    type=labels.get("type", ""),
                    profile=labels.get("profile", ""),
                    product=labels.get("product", ""),
                    mig_enabled=labels.get("mig_enabled") == "true",
                )
            elif sample.name in _VALUES:
                values.setdefault(key, {})[_VALUES[sample.name]] = sample.value
            elif sample.name == "gpu_dra_gpu_health" and sample.value == 1:
                values.setdefault(key, {})["health"] = labels.get("state", "")
            elif sample.name == "gpu_dra_device_claim_info":
                claim = (labels.get("claim_namespace", ""), labels.get("claim_name", ""))
                pods = holders.setdefault(key, {}).setdefault(claim, [])
                if labels.get("pod_name"):
                    pods.append(labels["pod_name"])
    out = []
    for key, row in rows.items():
        claims = tuple(
            Holder(ns, name, tuple(pods)) for (ns, name), pods in holders.get(key, {}).items()
        )
        out.append(replace(row, claims=claims, **values.get(key, {})))
    return out


def node_report(url: str) -> Report:
    """What the agent at ``url`` reports (node-local mode)."""
    devices = agent_devices(scrape(url))
    notes = () if devices else (f"{url} reports no GPU telemetry (is it a gpu-dra agent?)",)
    return Report(tuple(devices), notes)


# -- the cluster ---------------------------------------------------------------------------------


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


# -- output ----------------------------------------------------------------------------------------


def table(report: Report) -> str:
    """The report as an aligned table, notes below it."""
    from dra_driver.devices.table import render  # noqa: PLC0415

    rows = [
        (
            d.node,
            d.device,
            _type(d),
            _health(d),
            ",".join(f"{h.namespace}/{h.name}" if h.namespace else h.name for h in d.claims) or "-",
            ",".join(p for h in d.claims for p in h.pods) or "-",
            "-" if d.utilization_ratio is None else f"{100 * d.utilization_ratio:.0f}%",
            _memory(d),
            "-" if d.temperature_celsius is None else f"{d.temperature_celsius:.0f} C",
            _power(d),
        )
        for d in report.devices
    ]
    text = render(rows, COLUMNS) if rows else "no devices"
    return "\n".join([text, *(f"note: {n}" for n in report.notes)])


def _type(d: DeviceStatus) -> str:
    if d.type == "mig":
        return f"mig {d.profile}".rstrip()
    if d.mig_enabled:
        return "gpu (MIG mode)"
    return d.type or "-"


def _health(d: DeviceStatus) -> str:
    parts = [d.health] if d.health else []
    parts += [f"taint {t}" for t in d.taints]
    return "; ".join(parts) or "-"


def _memory(d: DeviceStatus) -> str:
    gib = 1024**3
    if d.memory_total_bytes is None:
        return "-"
    total = d.memory_total_bytes / gib
    if d.memory_used_bytes is None:
        return f"-/{total:.1f} GiB"
    return f"{d.memory_used_bytes / gib:.1f}/{total:.1f} GiB"


def _power(d: DeviceStatus) -> str:
    if d.power_usage_watts is None:
        return "-"
    if d.power_limit_watts is None:
        return f"{d.power_usage_watts:.0f} W"
    return f"{d.power_usage_watts:.0f}/{d.power_limit_watts:.0f} W"


def _number(value: float) -> float | int:
    return int(value) if float(value).is_integer() else value


def formatted(report: Report, output: str) -> str:
    if output == "json":
        return json.dumps(report.to_json(), indent=2)
    if output == "yaml":
        import yaml  # noqa: PLC0415

        return str(yaml.safe_dump(report.to_json(), sort_keys=False)).rstrip("\n")
    return table(report)


# -- the command ---------------------------------------------------------------------------------


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


__all__ = [
    "CHART_METRICS_PORT",
    "DEFAULT_AGENT_SELECTOR",
    "DEFAULT_METRICS_URL",
    "DeviceStatus",
    "Holder",
    "Report",
    "agent_devices",
    "cluster_report",
    "formatted",
    "main",
    "node_report",
    "scrape",
    "table",
    "watch",
]
