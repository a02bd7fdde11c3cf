"""What the kubelet plugin needs to know of the node: names, directories, the driver root and
the CDI hook, as plain values (node/ fills them from its Config).

Flow position: node/wiring.py -> :class:`PluginSettings` -> server.KubeletPlugin.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

# The health stream (health_stream.py). The kubelet shows a device Unknown once this long passed
# without a report of it; 30 s is its own default (pkg/kubelet/cm/dra/healthinfo.go
# DefaultHealthTimeout), announced in every report's health_check_timeout_seconds.
HEALTH_TIMEOUT_S = 30
# How often the full list is re-sent (--health-report-interval): at most half the timeout, so
# one lost or late report never turns a healthy device Unknown.
DEFAULT_HEALTH_REPORT_INTERVAL_S = 10.0
MIN_HEALTH_REPORT_INTERVAL_S = 0.1
MAX_HEALTH_REPORT_INTERVAL_S = HEALTH_TIMEOUT_S / 2


@dataclass(frozen=True, kw_only=True)
class PluginSettings:
    """The settings of one kubelet plugin."""

    node_name: str
    driver_name: str
    cdi_vendor: str  # CDI vendor for claim specs (``k8s.<driver>``)
    nvidia_driver_root: Path  # the driver root as the host sees it (specs name host paths)
    driver_root_in_container: Path  # the driver root as this process sees it (scanned)
    kubelet_registrar_directory_path: Path
    plugin_data_dir: Path  # our directory under the kubelet plugins directory
    checkpoint_path: Path
    cdi_root: Path
    cdi_hook: str  # "builtin", "none", or the host path of a hook binary (cdi/hook)
    hook_dir: Path  # where the builtin CDI hook is installed (a host path)
    mig_mode: Literal["static", "dynamic"] = "static"
    pod_uid: str | None = None
    unprepare_on_exit: bool = False  # docs/migration.md: switching back to NVIDIA's driver
    nvidia_namespace: str = "nvidia-dra-driver-gpu"  # NVIDIA's MPS daemons of adopted claims
    # Simulated GPUs (--simulate): their device nodes are made (cdi/devnodes.py) only inside a
    # simulated driver install that has its own dev/, never in the node's /dev, where no driver
    # module exists to give them numbers (a chart with `simulate` on a cluster without GPUs).
    simulated_gpus: bool = False
