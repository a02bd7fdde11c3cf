"""A Preparer in dynamic MIG mode on a simulated node whose NVML state (MIG instances, MIG mode)
lives in a directory, for the dynamic MIG prepare tests: a second one opened over the same
directory is the agent restarted.

Discovery is the agent's: NVML through ``nvml.discover`` with the marks of GPUs taken out of MIG
mode laid over it (``modeswitch.discover_with_marks``), so the targets are what the agent's would
be.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dra_driver import cdi
from dra_driver.gpus import nvml
from dra_driver.gpus.info import Inventory
from dra_driver.gpus.migmanager import MigManager
from dra_driver.mig import modeswitch
from dra_driver.mig.instances import DynamicMig
from dra_driver.mig.targets import dynamic_targets
from dra_driver.node.wiring import prepare_steps
from dra_driver.prepare import ClaimRef, Preparer
from dra_driver.prepare.state.checkpoint import Checkpoint
from dra_driver.sim.fakedriver import make_fake_driver
from dra_driver.sim.nvml import SimulatedNode, simulated_nvml
from tests.claimdata import ClaimStore
from tests.nodestorage import open_node_storage

VENDOR = "k8s.gpu.nvidia.com"


@dataclass
class DynamicNode:
    node: SimulatedNode
    preparer: Preparer
    store: ClaimStore
    specs: cdi.CdiSpecDir
    checkpoint: Checkpoint
    manager: MigManager
    files: cdi.DriverFiles
    mig_off: modeswitch.MigOffMarks  # the marks of GPUs taken out of MIG mode (the step's)

    def ref(self, claim: dict[str, Any]) -> ClaimRef:
        meta = claim["metadata"]
        return ClaimRef(namespace=meta["namespace"], name=meta["name"], uid=meta["uid"])

    def raw(self) -> Inventory:
        """What NVML reports now."""
        return nvml.discover(driver_root=Path("/"), sysfs_root=self.node.sysfs_root)

    def inventory(self) -> Inventory:
        """What the agent's discovery shows: NVML with the marks laid over it."""
        return modeswitch.discover_with_marks(self.raw, self.mig_off)

    def spec_nodes(self, uid: str) -> list[str]:
        """The device nodes of the claim's CDI spec (one device)."""
        spec = json.loads(self.specs.path_for(uid).read_bytes())
        (device,) = spec["devices"]
        return [n["path"] for n in device["containerEdits"]["deviceNodes"]]

    def rediscover(self) -> None:
        self.preparer.set_targets(dynamic_targets(self.inventory()), self.files)


@contextmanager
def open_node(
    tmp: Path, spec: str, store: ClaimStore | None = None, **preparer: Any
) -> Iterator[DynamicNode]:
    """The node ``spec`` over ``tmp`` (its MIG state in ``tmp/plugin``); ``preparer``: more
    Preparer arguments (consumable shares, an enforcer)."""
    state = tmp / "plugin/simulated-mig.json"
    with simulated_nvml(spec, node_name="node1", state_path=state) as node:
        raw = nvml.discover(driver_root=Path("/"), sysfs_root=node.sysfs_root)
        if not (tmp / "driver-root").exists():
            make_fake_driver(tmp, gpu_uuids=[g.uuid for g in raw.gpus])
            (tmp / "boot_id").write_text("boot-1\n")
        files = cdi.find_driver_files(
            driver_root=tmp / "driver-root",
            driver_version=raw.gpus[0].driver_version,
            proc_root=tmp / "proc",
        )
        specs, checkpoint, locks = open_node_storage(
            tmp, vendor=VENDOR, boot_id_path=tmp / "boot_id"
        )
        manager = MigManager()
        marks = modeswitch.MigOffMarks(tmp / "plugin" / modeswitch.MARKS_DIRECTORY)
        claims = store or ClaimStore()
        prepare = Preparer(
            driver_name="gpu.nvidia.com",
            node_name="node1",
            cdi_vendor=VENDOR,
            targets=dynamic_targets(modeswitch.overlay(raw, marks.read())),
            files=files,
            specs=specs,
            checkpoint=checkpoint,
            locks=locks,
            claims=claims,
            steps=prepare_steps(mig=DynamicMig(manager), **preparer),
        )
        try:
            yield DynamicNode(node, prepare, claims, specs, checkpoint, manager, files, marks)
        finally:
            prepare.close()
            checkpoint.close()
            locks.close()
