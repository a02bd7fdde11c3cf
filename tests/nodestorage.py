"""The files a Preparer keeps on a node, for the tests and benches that build a Preparer without
a KubeletPlugin: laid out under one directory as the agent lays them out (CDI specs in ``cdi/``,
the checkpoint and the claim locks in ``plugin/``), and opened."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from dra_driver import cdi
from dra_driver.prepare.state.checkpoint import Checkpoint, ClaimLocks


class NodeStorage(NamedTuple):
    specs: cdi.CdiSpecDir
    checkpoint: Checkpoint
    locks: ClaimLocks


def open_node_storage(root: Path, *, vendor: str, boot_id_path: Path) -> NodeStorage:
    """The CDI spec directory (created), the checkpoint and the claim locks under ``root``, open;
    the checkpoint reads the node's boot ID from ``boot_id_path``."""
    specs = cdi.CdiSpecDir(root / "cdi", vendor=vendor)
    specs.ensure()
    checkpoint = Checkpoint(root / "plugin/gpu-dra-checkpoint.json", boot_id_path=boot_id_path)
    checkpoint.open()
    locks = ClaimLocks(root / "plugin/claims.lock")
    locks.open()
    return NodeStorage(specs, checkpoint, locks)
