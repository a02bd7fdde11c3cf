"""Where the agent's files live on a node: the kubelet's directories, the CDI directory, the driver
root, and the files a simulated node keeps in the plugin's data directory; the defaults of the
flags that name them.

Below every part that reads or writes those paths (node/config.py builds the agent's Config from
them; the simulated node's fault injector, the demo and ``gpu-dra status`` find files with them),
so none of those imports the node's configuration.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_DRIVER_NAME = "gpu.nvidia.com"
DEFAULT_REGISTRAR_DIR = Path("/var/lib/kubelet/plugins_registry")
DEFAULT_PLUGINS_DIR = Path("/var/lib/kubelet/plugins")
DEFAULT_CDI_ROOT = Path("/var/run/cdi")
DEFAULT_DRIVER_ROOT = Path("/")
DEFAULT_CDI_HOOK = "builtin"


def simulated_faults_path(plugin_data_dir: Path) -> Path:
    """Where a simulated node reads injected faults (docs/simulate.md "Faults")."""
    return plugin_data_dir / "simulated-faults.jsonl"


def simulated_mig_state_path(plugin_data_dir: Path) -> Path:
    """Where a simulated node keeps its MIG instances, so they outlive an agent restart
    (sim/nvml/ SimulatedMigInstances)."""
    return plugin_data_dir / "simulated-mig.json"
