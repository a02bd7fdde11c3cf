"""The node agent's flags, each with an environment-variable twin, -> a validated Config.

``FLAGS`` is the table (flag, variable, Config field, help, converter, default); ``build_config``
parses a command line with the environment as fallback, reads NVIDIA's variables
(node/nvidiaenv.py), checks a ``--simulate`` spec at once and raises ConfigError naming the flag
and its variable. The commands (cli.py) call it; the chart's tests read ``FLAGS``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dra_driver import __version__
from dra_driver.errors import ConfigError, SimulationSpecError
from dra_driver.health.decisions import (
    DEFAULT_FATAL_XIDS,
    DEFAULT_IGNORED_XIDS,
    format_xids,
    parse_xids,
)
from dra_driver.node.config import Config
from dra_driver.node.nvidiaenv import read_nvidia_environment
from dra_driver.node.shutdown import DEFAULT_SHUTDOWN_TIMEOUT_S
from dra_driver.paths import (
    DEFAULT_CDI_HOOK,
    DEFAULT_CDI_ROOT,
    DEFAULT_DRIVER_NAME,
    DEFAULT_DRIVER_ROOT,
    DEFAULT_PLUGINS_DIR,
    DEFAULT_REGISTRAR_DIR,
)


@dataclass(frozen=True)
class Flag:
    """One agent flag, its environment twin, how to convert it and the Config field it sets."""

    name: str
    env: str
    field: str
    help: str
    convert: Callable[[str], Any] = str
    default: Any = None


def _port(text: str) -> int:
    return int(text, 10)


def _names(text: str) -> tuple[str, ...]:
    """A comma-separated list of names (empty entries dropped)."""
    return tuple(n.strip() for n in text.split(",") if n.strip())


def _bool(text: str) -> bool:
    if text.strip().lower() in ("true", "1", "yes"):
        return True
    if text.strip().lower() in ("false", "0", "no", ""):
        return False
    raise ValueError("must be true or false")


def _seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError("must be greater than 0")
    return value


def _seconds_or_off(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise ValueError("must not be negative (0 turns it off)")
    return value


FLAGS: tuple[Flag, ...] = (
    Flag("--node-name", "NODE_NAME", "node_name", "this node's name (required; the pool name)"),
    Flag(
        "--driver-name", "DRIVER_NAME", "driver_name", "DRA driver name", str, DEFAULT_DRIVER_NAME
    ),
    Flag(
        "--nvidia-driver-root",
        "NVIDIA_DRIVER_ROOT",
        "nvidia_driver_root",
        "where the NVIDIA driver is installed: / for host installs, /run/nvidia/driver for the "
        "GPU operator",
        Path,
        DEFAULT_DRIVER_ROOT,
    ),
    Flag(
        "--container-driver-root",
        "CONTAINER_DRIVER_ROOT",
        "container_driver_root",
        "where the driver root is mounted inside this container (default: same as "
        "--nvidia-driver-root); CDI specs still name host paths",
        Path,
    ),
    Flag(
        "--kubelet-registrar-directory-path",
        "KUBELET_REGISTRAR_DIRECTORY_PATH",
        "kubelet_registrar_directory_path",
        "directory the kubelet watches for plugin registration sockets",
        Path,
        DEFAULT_REGISTRAR_DIR,
    ),
    Flag(
        "--kubelet-plugins-directory-path",
        "KUBELET_PLUGINS_DIRECTORY_PATH",
        "kubelet_plugins_directory_path",
        "parent of this driver's directory (DRA socket, checkpoint)",
        Path,
        DEFAULT_PLUGINS_DIR,
    ),
    Flag(
        "--cdi-root", "CDI_ROOT", "cdi_root", "where CDI specs are written", Path, DEFAULT_CDI_ROOT
    ),
    Flag(
        "--cdi-hook",
        "CDI_HOOK",
        "cdi_hook",
        "the createContainer hook CDI specs name to create the library links and refresh the "
        "container's loader cache: builtin (gpu-dra-cdi-hook, installed into the plugin "
        "directory), none, or the host path of NVIDIA's nvidia-cdi-hook",
        str,
        DEFAULT_CDI_HOOK,
    ),
    Flag(
        "--simulate",
        "SIMULATE",
        "simulate",
        "run on simulated GPUs instead of NVML, e.g. h100:8 or a100-80gb:2:mig=3g.40gb,l4:1",
    ),
    Flag(
        "--mig-mode",
        "MIG_MODE",
        "mig_mode",
        "static: a GPU in MIG mode offers the MIG devices that exist; dynamic: it offers every "
        "MIG profile at every placement as partitionable devices (shared counters, KEP-4815), "
        "unless it has MIG devices this driver did not create",
        str,
        "static",
    ),
    Flag(
        "--kubeconfig",
        "KUBECONFIG",
        "kubeconfig",
        "kubeconfig file; in-cluster configuration when unset",
        Path,
    ),
    Flag("--pod-uid", "POD_UID", "pod_uid", "this pod's UID: enables rolling-update socket names"),
    Flag(
        "--pod-namespace",
        "POD_NAMESPACE",
        "pod_namespace",
        "this pod's namespace: where Events about the node are recorded and MPS daemons run",
        str,
        "default",
    ),
    Flag(
        "--nvidia-namespace",
        "NVIDIA_NAMESPACE",
        "nvidia_namespace",
        "namespace of NVIDIA's DRA driver: the MPS daemons of claims adopted from it, deleted "
        "at their unprepare (docs/migration.md)",
        str,
        "nvidia-dra-driver-gpu",
    ),
    Flag(
        "--healthcheck-port",
        "HEALTHCHECK_PORT",
        "healthcheck_port",
        "port of the HTTP /healthz and /readyz probes (0 disables)",
        _port,
        51515,
    ),
    Flag(
        "--metrics-port",
        "METRICS_PORT",
        "metrics_port",
        "port of the Prometheus /metrics endpoint (0 disables)",
        _port,
        0,
    ),
    Flag("--log-format", "LOG_FORMAT", "log_format", "json or text", str, "json"),
    Flag("--log-level", "LOG_LEVEL", "log_level", "debug, info, warning or error", str, "info"),
    Flag(
        "--cpu-affinity",
        "CPU_AFFINITY",
        "cpu_affinity",
        "all: run on every CPU the agent may use; one: keep every thread on one of them (the "
        "highest-numbered), where the threads' interpreter lock changes hands without waking "
        "another CPU (more prepares per second under load; docs/plugin.md)",
        str,
        "all",
    ),
    Flag(
        "--telemetry-interval",
        "TELEMETRY_INTERVAL",
        "telemetry_interval_s",
        "seconds between telemetry samples of every GPU and MIG device (utilisation, memory, "
        "temperature, power, clocks, ECC; served on /metrics with --metrics-port); 0 disables",
        float,
        10.0,
    ),
    Flag(
        "--dcgm-metrics",
        "DCGM_METRICS",
        "dcgm_metrics",
        "true: also serve the telemetry under NVIDIA dcgm-exporter's names and labels "
        "(DCGM_FI_DEV_*, with the pod and container of each claim; docs/metrics.md); false: "
        "only gpu_dra_*",
        _bool,
        True,
    ),
    Flag(
        "--claim-status",
        "CLAIM_STATUS",
        "claim_status",
        "true: write each prepared claim's status.devices (which GPU; KEP-4817); false: none",
        _bool,
        True,
    ),
    Flag(
        "--dcgm-host-label",
        "DCGM_HOST_LABEL",
        "dcgm_host_label",
        "the node's label on the DCGM-compatible series: Hostname, or hostname (newer exporters)",
        str,
        "Hostname",
    ),
    Flag(
        "--mps-image",
        "MPS_IMAGE",
        "mps_image",
        "image of the MPS control daemon Deployments (the agent's own; the chart sets it); "
        "unset: claims asking for MPS sharing are refused",
    ),
    Flag(
        "--mps-image-pull-secrets",
        "MPS_IMAGE_PULL_SECRETS",
        "mps_image_pull_secrets",
        "comma-separated names of the Secrets (in the agent's namespace) the MPS control "
        "daemons' pods pull --mps-image with (a private registry; the chart passes its "
        "imagePullSecrets)",
        _names,
    ),
    Flag(
        "--mps-image-pull-policy",
        "MPS_IMAGE_PULL_POLICY",
        "mps_image_pull_policy",
        "imagePullPolicy of the MPS control daemons' pods: Always, IfNotPresent or Never "
        "(unset: the cluster's default; the chart passes image.pullPolicy)",
    ),
    Flag(
        "--mps-start-timeout",
        "MPS_START_TIMEOUT",
        "mps_start_timeout_s",
        "seconds a prepare waits for a new MPS control daemon to answer before it fails the "
        "claim and removes the daemon",
        float,
        30.0,
    ),
    Flag(
        "--unprepare-on-exit",
        "UNPREPARE_ON_EXIT",
        "unprepare_on_exit",
        "true: on a clean stop, unprepare every claim this agent holds (its CDI specs, MPS "
        "daemons, time slices, MIG devices), before switching the node back to NVIDIA's "
        "driver, which does not know them (docs/migration.md)",
        _bool,
        False,
    ),
    Flag(
        "--shutdown-timeout",
        "SHUTDOWN_TIMEOUT",
        "shutdown_timeout_s",
        "seconds from SIGTERM until the agent exits, whatever is still stuck",
        _seconds,
        DEFAULT_SHUTDOWN_TIMEOUT_S,
    ),
    Flag(
        "--rediscover-interval",
        "REDISCOVER_INTERVAL",
        "rediscover_interval_s",
        "seconds between GPU re-discovery passes (device changes update the slices)",
        _seconds,
        60.0,
    ),
    Flag(
        "--health-ignored-xids",
        "HEALTH_IGNORED_XIDS",
        "health_ignored_xids",
        "XIDs that do not make a GPU unhealthy (application errors), comma-separated, or none",
        parse_xids,
        DEFAULT_IGNORED_XIDS,
    ),
    Flag(
        "--health-fatal-xids",
        "HEALTH_FATAL_XIDS",
        "health_fatal_xids",
        "XIDs after which a GPU needs a reset: their taint gets --health-fatal-taint-effect and "
        "stays until the GPU is reset; comma-separated, or none",
        parse_xids,
        DEFAULT_FATAL_XIDS,
    ),
    Flag(
        "--health-taint-effect",
        "HEALTH_TAINT_EFFECT",
        "health_taint_effect",
        "effect of the taints of an unhealthy device: NoSchedule, NoExecute or None",
        str,
        "NoSchedule",
    ),
    Flag(
        "--health-fatal-taint-effect",
        "HEALTH_FATAL_TAINT_EFFECT",
        "health_fatal_taint_effect",
        "effect for fatal conditions (GPU lost, double-bit ECC, failed row remapping, fatal "
        "XIDs): NoSchedule, NoExecute (also evicts pods that do not tolerate it) or None",
        str,
        "NoSchedule",
    ),
    Flag(
        "--health-check-interval",
        "HEALTH_CHECK_INTERVAL",
        "health_check_interval_s",
        "seconds between NVML health checks of every GPU (lost, ECC, pending pages/rows, "
        "temperature); events are handled at once",
        _seconds,
        10.0,
    ),
    Flag(
        "--health-xid-quiet-period",
        "HEALTH_XID_QUIET_PERIOD",
        "health_xid_quiet_period_s",
        "seconds without a new XID after which a non-fatal XID's taint is removed (0: only a "
        "GPU reset removes it)",
        _seconds_or_off,
        300.0,
    ),
    Flag(
        "--health-min-change-interval",
        "HEALTH_MIN_CHANGE_INTERVAL",
        "health_min_change_interval_s",
        "seconds a device's health taints stay before they may be removed or changed (flapping "
        "limit; new taints apply at once; 0 turns it off)",
        _seconds_or_off,
        10.0,
    ),
    Flag(
        "--health-report-interval",
        "HEALTH_REPORT_INTERVAL",
        "health_report_interval_s",
        "seconds between full device health reports to the kubelet (health stream v1 and "
        "v1alpha1; changes are sent at once), 0.1 to 15: the kubelet shows a device Unknown 30 s "
        "after its last report",
        _seconds,
        10.0,
    ),
    Flag(
        "--consumable-shares",
        "CONSUMABLE_SHARES",
        "consumable_shares",
        "publish GPUs and MIG devices for several claims at once (KEP-5075): disabled, "
        "unlimited, memory, compute or a number of shares; not yet runnable: the agent refuses "
        "any value but disabled until shares are enforced by MPS (docs/publishing.md)",
        str,
        "disabled",
    ),
)


def _agent_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="gpu-dra node agent: publishes this node's NVIDIA GPUs as ResourceSlices and "
        "serves the kubelet's DRA plugin sockets. Every flag can also be set through the "
        "environment variable named in brackets.",
    )
    for flag in FLAGS:
        shown = format_xids(flag.default) if isinstance(flag.default, frozenset) else flag.default
        default = "" if flag.default is None else f" (default: {shown})"
        parser.add_argument(flag.name, dest=flag.field, help=f"{flag.help} [{flag.env}]{default}")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    return parser


def build_config(
    argv: Sequence[str], environ: Mapping[str, str], *, prog: str = "gpu-dra-kubelet-plugin"
) -> Config:
    """Parse ``argv`` with ``environ`` as fallback into a validated Config (raises ConfigError)."""
    args = _agent_parser(prog).parse_args(list(argv))
    nvidia = read_nvidia_environment(environ)
    environ = nvidia.environ
    values: dict[str, Any] = {}
    for flag in FLAGS:
        raw = getattr(args, flag.field)
        if raw is None:
            raw = environ.get(flag.env) or None
        label = f"{flag.name} ({flag.env})"
        if raw is None:
            if flag.field == "node_name":
                raise ConfigError(label, "is required (the downward API sets NODE_NAME in the pod)")
            if flag.default is not None:
                values[flag.field] = flag.default
            continue
        try:
            values[flag.field] = flag.convert(raw)
        except ValueError as exc:
            raise ConfigError(label, f"{raw!r} is not valid: {exc}") from exc
    if values.get("simulate"):
        # Parse now so a bad spec fails at start with the flag's name, not deep in discovery.
        from dra_driver.sim.nvml import parse_spec  # noqa: PLC0415

        try:
            parse_spec(values["simulate"])
        except SimulationSpecError as exc:
            raise ConfigError("--simulate (SIMULATE)", str(exc)) from exc
    if nvidia.additional_ignored_xids:
        # NVIDIA's variable adds to the list in force, as it adds to its built-in one.
        values["health_ignored_xids"] = (
            values.get("health_ignored_xids", DEFAULT_IGNORED_XIDS) | nvidia.additional_ignored_xids
        )
    return Config(**values)


__all__ = ["FLAGS", "Flag", "build_config"]
