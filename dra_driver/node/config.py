"""The node agent's configuration: a frozen value built by cli.py from flags and environment.

Validation happens once, at start, and every error names the flag it came from (ConfigError).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from dra_driver.devices import MIG_MODES, MigMode, TaintEffect
from dra_driver.errors import ConfigError
from dra_driver.health.decisions import DEFAULT_FATAL_XIDS, DEFAULT_IGNORED_XIDS, EFFECTS
from dra_driver.node.cpuaffinity import CPU_AFFINITIES
from dra_driver.node.shutdown import DEFAULT_SHUTDOWN_TIMEOUT_S
from dra_driver.paths import (
    DEFAULT_CDI_HOOK,
    DEFAULT_CDI_ROOT,
    DEFAULT_DRIVER_NAME,
    DEFAULT_DRIVER_ROOT,
    DEFAULT_PLUGINS_DIR,
    DEFAULT_REGISTRAR_DIR,
    simulated_faults_path,
    simulated_mig_state_path,
)
from dra_driver.plugin.settings import (
    DEFAULT_HEALTH_REPORT_INTERVAL_S,
    MAX_HEALTH_REPORT_INTERVAL_S,
    MIN_HEALTH_REPORT_INTERVAL_S,
)
from dra_driver.sharing.shares import SharesMode, parse_mode

PULL_POLICIES = ("Always", "IfNotPresent", "Never")  # a container's imagePullPolicy

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


def validate_dns_subdomain(flag: str, value: str, *, max_len: int = 253) -> str:
    """Return ``value`` if it is a lowercase DNS subdomain of at most ``max_len`` characters."""
    if not value:
        raise ConfigError(flag, "must not be empty")
    if len(value) > max_len:
        raise ConfigError(flag, f"{value!r} is longer than {max_len} characters")
    if not _DNS_SUBDOMAIN.match(value):
        raise ConfigError(
            flag,
            f"{value!r} is not a valid DNS subdomain (lowercase letters, digits, '-' and '.', "
            "starting and ending with a letter or digit)",
        )
    return value


@dataclass(frozen=True, kw_only=True)
class Config:
    """Validated settings of one node agent process."""

    node_name: str
    driver_name: str = DEFAULT_DRIVER_NAME
    nvidia_driver_root: Path = DEFAULT_DRIVER_ROOT
    # Where this process sees the driver root (the chart mounts the host's driver root at
    # /driver-root, because a host's / cannot be mounted over the container's /). CDI specs
    # name host paths (nvidia_driver_root); discovery and file scans read container paths.
    container_driver_root: Path | None = None
    kubelet_registrar_directory_path: Path = DEFAULT_REGISTRAR_DIR
    kubelet_plugins_directory_path: Path = DEFAULT_PLUGINS_DIR
    cdi_root: Path = DEFAULT_CDI_ROOT
    # "builtin" (our hook, installed into plugin_data_dir/bin), "none", or the host path of an
    # nvidia-cdi-hook compatible binary (cdihook/__init__.py).
    cdi_hook: str = DEFAULT_CDI_HOOK
    simulate: str | None = None
    mig_mode: MigMode = "static"  # devices/ "MIG modes"
    kubeconfig: Path | None = None
    pod_uid: str | None = None
    pod_namespace: str = "default"
    # where NVIDIA's DRA driver runs its MPS control daemons (adopted claims: docs/migration.md)
    nvidia_namespace: str = "nvidia-dra-driver-gpu"
    healthcheck_port: int = 51515
    metrics_port: int = 0
    log_format: str = "json"
    log_level: str = "info"
    cpu_affinity: str = "all"  # cpuaffinity.py: all, or one CPU for every thread
    rediscover_interval_s: float = 60.0
    # Seconds from SIGTERM until the process ends itself whatever is still running (shutdown.py)
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S
    # Seconds between telemetry samples (GPU and MIG readings on /metrics); 0 turns them off.
    telemetry_interval_s: float = 10.0
    # Also expose the samples under dcgm-exporter's names and labels (telemetry/dcgm.py).
    dcgm_metrics: bool = True
    # The node's label on the DCGM series: dcgm-exporter's Hostname (its next release: hostname).
    dcgm_host_label: str = "Hostname"
    # After a prepare, write the claim's status.devices entries (KEP-4817, claimstatus/).
    claim_status: bool = True
    # GPU health (health/decisions.py, health/monitor.py)
    health_ignored_xids: frozenset[int] = DEFAULT_IGNORED_XIDS
    health_fatal_xids: frozenset[int] = DEFAULT_FATAL_XIDS
    health_taint_effect: TaintEffect = "NoSchedule"
    health_fatal_taint_effect: TaintEffect = "NoSchedule"
    health_check_interval_s: float = 10.0
    health_xid_quiet_period_s: float = 300.0
    health_min_change_interval_s: float = 10.0
    # Seconds between full health reports to the kubelet (plugin/health_stream.py)
    health_report_interval_s: float = DEFAULT_HEALTH_REPORT_INTERVAL_S
    # Consumable shares (KEP-5075, shares.py): disabled, unlimited, memory, compute or a number
    # of shares. Valid here; agent.py refuses them without MPS (mps_image): MPS enforces
    # each share's limits.
    consumable_shares: str = "disabled"
    # MPS (mpsdaemon.py): the image the control daemons' Deployments run (None: MPS is refused)
    # and how long a prepare waits for a new daemon to answer.
    mps_image: str | None = None
    mps_start_timeout_s: float = 30.0
    # What the daemons' pods pull the image with: the Secrets of a private registry (names, in
    # the agent's namespace) and the pull policy (None: the cluster's default for the tag).
    mps_image_pull_secrets: tuple[str, ...] = ()
    mps_image_pull_policy: str | None = None
    # Unprepare every prepared claim on a clean stop (switching back to NVIDIA's driver:
    # docs/migration.md).
    unprepare_on_exit: bool = False

    def __post_init__(self) -> None:
        validate_dns_subdomain("--node-name (NODE_NAME)", self.node_name)
        validate_dns_subdomain("--driver-name (DRIVER_NAME)", self.driver_name, max_len=63)
        for secret in self.mps_image_pull_secrets:
            validate_dns_subdomain("--mps-image-pull-secrets (MPS_IMAGE_PULL_SECRETS)", secret)
        if self.mps_image_pull_policy not in (None, *PULL_POLICIES):
            raise ConfigError(
                "--mps-image-pull-policy (MPS_IMAGE_PULL_POLICY)",
                f"{self.mps_image_pull_policy!r} is not one of {', '.join(PULL_POLICIES)}",
            )
        for flag, path in (
            ("--nvidia-driver-root (NVIDIA_DRIVER_ROOT)", self.nvidia_driver_root),
            (
                "--kubelet-registrar-directory-path (KUBELET_REGISTRAR_DIRECTORY_PATH)",
                self.kubelet_registrar_directory_path,
            ),
            (
                "--kubelet-plugins-directory-path (KUBELET_PLUGINS_DIRECTORY_PATH)",
                self.kubelet_plugins_directory_path,
            ),
            ("--cdi-root (CDI_ROOT)", self.cdi_root),
            ("--container-driver-root (CONTAINER_DRIVER_ROOT)", self.driver_root_in_container),
        ):
            if not path.is_absolute():
                raise ConfigError(flag, f"{str(path)!r} must be an absolute path")
        if self.cdi_hook not in ("builtin", "none") and not self.cdi_hook.startswith("/"):
            raise ConfigError(
                "--cdi-hook (CDI_HOOK)",
                f"{self.cdi_hook!r}: use builtin, none, or the absolute host path of a hook",
            )
        if self.mig_mode not in MIG_MODES:
            raise ConfigError(
                "--mig-mode (MIG_MODE)", f"{self.mig_mode!r}: use {' or '.join(MIG_MODES)}"
            )
        validate_dns_subdomain("--pod-namespace (POD_NAMESPACE)", self.pod_namespace, max_len=63)
        validate_dns_subdomain(
            "--nvidia-namespace (NVIDIA_NAMESPACE)", self.nvidia_namespace, max_len=63
        )
        if self.pod_uid is not None and not _UUID.match(self.pod_uid):
            raise ConfigError("--pod-uid (POD_UID)", f"{self.pod_uid!r} is not a lowercase UUID")
        for flag, port in (
            ("--healthcheck-port (HEALTHCHECK_PORT)", self.healthcheck_port),
            ("--metrics-port (METRICS_PORT)", self.metrics_port),
        ):
            if not 0 <= port <= 65535:
                raise ConfigError(flag, f"{port} is not a TCP port (0 disables, 1-65535)")
        if self.telemetry_interval_s != 0 and not 1 <= self.telemetry_interval_s <= 86400:
            raise ConfigError(
                "--telemetry-interval (TELEMETRY_INTERVAL)",
                f"{self.telemetry_interval_s:g} s: use 0 (off) or 1 to 86400 s",
            )
        if self.log_format not in ("json", "text"):
            raise ConfigError("--log-format (LOG_FORMAT)", f"{self.log_format!r}: use json or text")
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise ConfigError(
                "--log-level (LOG_LEVEL)", f"{self.log_level!r}: use debug, info, warning or error"
            )
        if not re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", self.dcgm_host_label) or (
            self.dcgm_host_label.startswith("__")
        ):
            raise ConfigError(
                "--dcgm-host-label (DCGM_HOST_LABEL)",
                f"{self.dcgm_host_label!r} is not a Prometheus label name (e.g. Hostname)",
            )
        if self.cpu_affinity not in CPU_AFFINITIES:
            raise ConfigError(
                "--cpu-affinity (CPU_AFFINITY)",
                f"{self.cpu_affinity!r}: use {' or '.join(CPU_AFFINITIES)}",
            )
        self._validate_health()
        try:
            parse_mode(self.consumable_shares)
        except ValueError as exc:
            raise ConfigError(
                "--consumable-shares (CONSUMABLE_SHARES)", f"{self.consumable_shares!r}: {exc}"
            ) from None
        if not 0 < self.mps_start_timeout_s <= 600:
            raise ConfigError(
                "--mps-start-timeout (MPS_START_TIMEOUT)",
                f"{self.mps_start_timeout_s:g} s: use more than 0 and at most 600 s",
            )

    @property
    def shares_mode(self) -> SharesMode:
        """``consumable_shares`` parsed (validated at construction)."""
        return parse_mode(self.consumable_shares)

    def _validate_health(self) -> None:
        for flag, effect in (
            ("--health-taint-effect (HEALTH_TAINT_EFFECT)", self.health_taint_effect),
            (
                "--health-fatal-taint-effect (HEALTH_FATAL_TAINT_EFFECT)",
                self.health_fatal_taint_effect,
            ),
        ):
            if effect not in EFFECTS:
                raise ConfigError(
                    flag, f"{effect!r} is not a taint effect: use {', '.join(EFFECTS)}"
                )
        for flag, xids in (
            ("--health-ignored-xids (HEALTH_IGNORED_XIDS)", self.health_ignored_xids),
            ("--health-fatal-xids (HEALTH_FATAL_XIDS)", self.health_fatal_xids),
        ):
            bad = sorted(x for x in xids if not 0 < x < 2**32)
            if bad:
                raise ConfigError(flag, f"{bad} are not XID numbers (positive integers)")
        if not self.health_check_interval_s > 0:
            raise ConfigError(
                "--health-check-interval (HEALTH_CHECK_INTERVAL)",
                f"{self.health_check_interval_s} must be greater than 0",
            )
        interval_s = self.health_report_interval_s
        if not MIN_HEALTH_REPORT_INTERVAL_S <= interval_s <= MAX_HEALTH_REPORT_INTERVAL_S:
            raise ConfigError(
                "--health-report-interval (HEALTH_REPORT_INTERVAL)",
                f"{interval_s:g} s: use {MIN_HEALTH_REPORT_INTERVAL_S:g} to "
                f"{MAX_HEALTH_REPORT_INTERVAL_S:g} s (the kubelet shows a device Unknown "
                "30 s after its last report)",
            )
        for flag, seconds in (
            ("--health-xid-quiet-period (HEALTH_XID_QUIET_PERIOD)", self.health_xid_quiet_period_s),
            (
                "--health-min-change-interval (HEALTH_MIN_CHANGE_INTERVAL)",
                self.health_min_change_interval_s,
            ),
        ):
            if not seconds >= 0:
                raise ConfigError(flag, f"{seconds} must not be negative (0 turns it off)")

    @property
    def driver_root_in_container(self) -> Path:
        """The driver root as this process sees it (defaults to the host path)."""
        return self.container_driver_root or self.nvidia_driver_root

    @property
    def plugin_data_dir(self) -> Path:
        """Our own directory under the kubelet plugins directory (sockets, checkpoint, locks)."""
        return self.kubelet_plugins_directory_path / self.driver_name

    @property
    def hook_dir(self) -> Path:
        """Where the builtin CDI hook is installed: a host path (mounted at the same path)."""
        return self.plugin_data_dir / "bin"

    @property
    def checkpoint_path(self) -> Path:
        # not checkpoint.json: NVIDIA's plugin reads that name (prepare/switchover.py)
        return self.plugin_data_dir / "gpu-dra-checkpoint.json"

    @property
    def simulated_faults_path(self) -> Path:
        """With ``--simulate``: the file ``gpu-dra simulate-event`` appends faults to."""
        return simulated_faults_path(self.plugin_data_dir)

    @property
    def mps_dir(self) -> Path:
        """Where MPS control daemons keep their directories (a host path, same in the pod)."""
        return self.plugin_data_dir / "mps"

    @property
    def simulated_mig_state_path(self) -> Path:
        """With ``--simulate``: the file the simulated node keeps its MIG instances in."""
        return simulated_mig_state_path(self.plugin_data_dir)

    @property
    def cdi_vendor(self) -> str:
        """CDI vendor for claim specs: ``k8s.<driver>`` (``k8s.gpu.nvidia.com``)."""
        return f"k8s.{self.driver_name}"
