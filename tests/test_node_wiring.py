"""node/wiring.py: the steps a node's configuration asks for, and only their modules."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_a_node_without_dynamic_mig_or_mps_loads_neither(tmp_path: Path) -> None:
    """Static MIG (the chart's default) and no --mps-image: the agent's imports, its discovery
    and its steps load none of dynamic MIG's or the MPS daemons' modules, nor the offline tools'
    cluster reads (together about 190 KB of the agent's memory); the steps that refuse MPS and
    shares are there all the same."""
    script = f"""
import sys
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace
import dra_driver.cli
from dra_driver.node.discovery import Discovery
from dra_driver.node.config import Config
from dra_driver.node.wiring import config_steps
config = Config(node_name="node1")
with ExitStack() as stack:
    Discovery(config, stack)
steps = config_steps(config)(SimpleNamespace(state_dir=Path({str(tmp_path)!r})))
print(" ".join(type(step).__name__ for step in steps))
print(" ".join(sorted(m for m in sys.modules if m.startswith("dra_driver."))))
"""
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False,
        cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    steps, modules = (line.split() for line in run.stdout.splitlines())
    assert steps == ["TimeSliceStep", "MpsStep", "ShareStep"]
    unused = {
        "dra_driver.mig.instances",
        "dra_driver.mig.instance_step",
        "dra_driver.mig.modeswitch",
        "dra_driver.mig.modeswitch_step",
        "dra_driver.sharing.mpsdaemon",
        "dra_driver.sharing.mpsshares",
        "dra_driver.kube.clusterreads",
        "dra_driver.kube.permissions",
    }
    assert unused.isdisjoint(modules), sorted(unused & set(modules))
    assert {"dra_driver.sharing.mps_step", "dra_driver.sharing.share_step"} <= set(modules)


def test_simulated_gpus_make_device_nodes_only_inside_a_simulated_driver_install(
    tmp_path: Path,
) -> None:
    # --simulate: the nodes a spec names are fictional; the agent makes them only inside a
    # simulated install with its own dev/ (GPU operator layout), never in the node's /dev, where
    # no driver module gives them numbers (cdi/devnodes.py); a real node makes them in its /dev.
    from dra_driver.node.config import Config  # noqa: PLC0415
    from dra_driver.node.wiring import state_settings  # noqa: PLC0415
    from dra_driver.prepare.state.nodestate import PrepareState  # noqa: PLC0415
    from dra_driver.sim.nvml import discover_simulated  # noqa: PLC0415

    def dev_root_made_in(driver_root: Path, simulate: str | None) -> Path | None:
        config = Config(
            node_name="node1",
            simulate=simulate,
            nvidia_driver_root=driver_root,
            kubelet_plugins_directory_path=tmp_path / "plugins",
            kubelet_registrar_directory_path=tmp_path / "registry",
            cdi_root=tmp_path / "cdi",
            cdi_hook="none",
        )
        state = PrepareState(
            settings=state_settings(config),
            inventory=discover_simulated("h100:1", node_name="node1"),
            claims=None,  # type: ignore[arg-type]  # not started: no claim is read
            steps=lambda state: [],
        )
        return state.driver_files().dev_root_here

    assert dev_root_made_in(Path("/"), "h100:1") is None
    assert dev_root_made_in(Path("/"), None) == Path("/")
    install = tmp_path / "driver"
    (install / "dev").mkdir(parents=True)
    (install / "dev" / "nvidiactl").touch()
    assert dev_root_made_in(install, "h100:1") == install
