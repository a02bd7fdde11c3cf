"""The CDI hook that makes the driver libraries loadable in any container image.

Where it sits: cdi.py mounts the driver's libraries into one directory of the container
(``cdi.CONTAINER_LIB_DIR``) and names this hook in every claim spec; the container runtime runs
it (OCI ``createContainer``) to create the soname links and refresh the container's loader cache
(``hook.c`` says how). The agent's image ships the hook as a static binary beside this module;
at start the agent copies it into its own host directory (the chart mounts
``<kubelet plugins dir>/<driver>`` at the same path in the pod, so that path is valid on the
host, where the runtime runs hooks). The copy is named by its content, so a rolling update never
rewrites a binary that a starting container may be executing, and is written atomically.

``--cdi-hook`` (``CDI_HOOK``) chooses: ``builtin`` (this hook, the default), ``none`` (no hook:
each link name becomes a mount of its file, and images must search ``CONTAINER_LIB_DIR``
themselves, as NVIDIA's CUDA images do), or the absolute host path of NVIDIA's
``nvidia-cdi-hook``, which takes the same arguments.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from dra_driver.errors import CdiError
from dra_driver.fsutil import replace_file

HOOK_NAME = "gpu-dra-cdi-hook"
BUILTIN = "builtin"
NONE = "none"
PACKAGED_BINARY = Path(__file__).resolve().parent / HOOK_NAME
SOURCE = Path(__file__).resolve().parent / "hook.c"


def install(directory: Path, *, binary: Path = PACKAGED_BINARY) -> Path:
    """Copy ``binary`` into ``directory`` as ``gpu-dra-cdi-hook-<sha256 prefix>`` (0755), fsync'd
    and renamed into place; an identical copy already there is kept. Returns its path."""
    try:
        content = binary.read_bytes()
    except OSError as exc:
        raise CdiError(
            f"the CDI hook binary {binary} cannot be read ({exc.strerror}); build it with "
            "`make hook`, or start with --cdi-hook=none"
        ) from exc
    target = directory / f"{HOOK_NAME}-{hashlib.sha256(content).hexdigest()[:16]}"
    try:
        if target.is_file() and target.read_bytes() == content:
            return target
        replace_file(target, content, mode=0o755)
    except OSError as exc:
        raise CdiError(f"cannot install the CDI hook into {directory}: {exc}") from exc
    return target
