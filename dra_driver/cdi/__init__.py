"""CDI specs for prepared claims: what a container gets, and how the spec reaches the disk.

Sits at the end of the node flow, in three steps:

- ``driverfiles``: what of the NVIDIA driver install a container needs, scanned once at start
  (``driverpaths``: where a driver root's files and programs are, links followed in the root);
- ``devnodes``: the device nodes a spec names, made where missing (as nvidia-modprobe does);
- ``spec``: what one claim's spec says (its devices' nodes, names and the shared edits), as bytes;
- ``specdir``: the spec directory: atomic writes, removal, listing, spares.

``hook/`` is the static CDI hook the specs name. This package re-exports the names the rest of
the driver uses, so callers write ``cdi.CdiSpecDir``, ``cdi.DriverFiles``, ...
"""

from __future__ import annotations

from dra_driver.cdi.devnodes import ensure_device_nodes
from dra_driver.cdi.driverfiles import (
    BASE,
    CONTAINER_LIB_DIR,
    DEFAULT_CAPABILITIES,
    DRIVER_CAPABILITIES,
    DeviceNode,
    DriverFiles,
    Link,
    Mount,
    find_driver_files,
    read_mig_cap_minors,
)
from dra_driver.cdi.driverpaths import file_kind, find_driver_library, find_driver_tool
from dra_driver.cdi.spec import (
    CDI_CLASS,
    ClaimDevice,
    ClaimSpecEncoder,
    cdi_device_id,
    cdi_device_name,
    device_names_in_spec,
    gpu_nodes,
    mig_nodes,
    minimum_version,
)
from dra_driver.cdi.specdir import CdiSpecDir, PendingSpec

__all__ = [
    "BASE",
    "CDI_CLASS",
    "CONTAINER_LIB_DIR",
    "DEFAULT_CAPABILITIES",
    "DRIVER_CAPABILITIES",
    "CdiSpecDir",
    "ClaimDevice",
    "ClaimSpecEncoder",
    "DeviceNode",
    "DriverFiles",
    "Link",
    "Mount",
    "PendingSpec",
    "cdi_device_id",
    "cdi_device_name",
    "device_names_in_spec",
    "ensure_device_nodes",
    "file_kind",
    "find_driver_files",
    "find_driver_library",
    "find_driver_tool",
    "gpu_nodes",
    "mig_nodes",
    "minimum_version",
    "read_mig_cap_minors",
]
