"""What the tests that start containers with a real CDI consumer (podman + runc) share."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

BUSYBOX = Path("/bin/busybox")
# podman as this machine runs it: no ulimits to copy, cgroupfs, runc (which runs CDI hooks)
CONTAINERS_CONF = """[containers]
default_ulimits = []
[engine]
cgroup_manager = "cgroupfs"
runtime = "runc"
"""


def missing(*tools: str) -> str:
    """Why containers cannot be started here ("" when they can): root, podman, runc, busybox,
    and any other ``tools``."""
    if os.geteuid() != 0:
        return "needs root (device nodes, mount namespaces, rootful podman)"
    for tool in ("podman", "runc", *tools):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install podman runc busybox-static)"
    if not BUSYBOX.exists():
        return "busybox-static is not installed (/bin/busybox)"
    return ""
