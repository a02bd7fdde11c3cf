"""What one agent reports, read from its ``/metrics``: the HTTP GET (:func:`scrape`), the
exposition parsed into ``gpu-dra status`` rows (:func:`agent_devices`, with
``prometheus_client.parser``), and the node-local report (:func:`node_report`).

Place in the flow: the node-local source of ``gpu-dra status`` (the default, ``--metrics-url``);
the cluster-wide source (``cluster.py``) reads each node's agent with the same two functions.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from dataclasses import replace
from typing import Any

from dra_driver.errors import MetricsUnavailable
from dra_driver.telemetry.status.report import DeviceStatus, Holder, Report

CHART_METRICS_PORT = 8080
DEFAULT_METRICS_URL = f"http://127.0.0.1:{CHART_METRICS_PORT}/metrics"
SCRAPE_TIMEOUT_S = 3.0

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


__all__ = [
    "CHART_METRICS_PORT",
    "DEFAULT_METRICS_URL",
    "SCRAPE_TIMEOUT_S",
    "agent_devices",
    "node_report",
    "scrape",
]
