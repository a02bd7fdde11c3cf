"""What prepare's state needs to know of the node: names, directories, the driver root and the
CDI hook, as plain values (node/ fills them from its Config).

Flow position: node/wiring.py -> :class:`StateSettings` -> nodestate.PrepareState.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, kw_only=True)
class StateSettings:
    """The settings of one node's prepare state."""

    node_name: str
    driver_name: str
    cdi_vendor: str  # CDI vendor for claim specs (``k8s.<driver>``)
    nvidia_driver_root: Path  # the driver root as the host sees it (specs name host paths)
    driver_root_in_container: Path  # the driver root as this process sees it (scanned)
    plugin_data_dir: Path  # our directory under the kubelet plugins directory
    checkpoint_path: Path
    cdi_root: Path
    cdi_hook: str  # "builtin", "none", or the host path of a hook binary (cdi/hook)
    hook_dir: Path  # where the builtin CDI hook is installed (a host path)
    unprepare_on_exit: bool = False  # docs/migration.md: switching back to NVIDIA's driver
    # Simulated GPUs (--simulate): their device nodes are made (cdi/devnodes.py) only inside a
    # simulated driver install that has its own dev/, never in the node's /dev, where no driver
    # module exists to give them numbers (a chart with `simulate` on a cluster without GPUs).
    simulated_gpus: bool = False
