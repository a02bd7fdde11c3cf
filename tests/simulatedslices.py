"""ResourceSlices of simulated GPUs for explain's tests: ``scheduling.inventory.simulated_slices``
with ``sim``'s discovery, as ``gpu-dra explain --simulate`` runs it (``scheduling`` does not
import ``sim``: the CLI passes the discovery in)."""

from __future__ import annotations

from typing import Any

from dra_driver.devices import MigMode
from dra_driver.devices.classes import DEFAULT_DRIVER_NAME
from dra_driver.scheduling import inventory
from dra_driver.sim.nvml import discover_simulated


def simulated_slices(
    spec: str,
    *,
    node_name: str,
    driver_name: str = DEFAULT_DRIVER_NAME,
    consumable_shares: str = "disabled",
    mig_mode: MigMode = "static",
) -> list[dict[str, Any]]:
    """The slices ``gpu-dra explain --simulate spec --node node_name`` allocates from."""
    return inventory.simulated_slices(
        spec,
        discover=discover_simulated,
        node_name=node_name,
        driver_name=driver_name,
        consumable_shares=consumable_shares,
        mig_mode=mig_mode,
    )
