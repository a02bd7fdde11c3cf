"""Spare CDI spec files (cdi.CdiSpecDir keeps removed specs for reuse): what tests check of them."""

from __future__ import annotations

import fcntl
import os
import re
from pathlib import Path

# The name of a spare of the default vendor's claim specs.
SPARE_NAME = re.compile(r"\.k8s\.gpu\.nvidia\.com-claim_spare\.[0-9a-f]{8}\.tmp")


def spares_in(cdi_dir: Path) -> list[Path]:
    return sorted(p for p in cdi_dir.iterdir() if SPARE_NAME.fullmatch(p.name))


def held(path: Path) -> bool:
    """Whether an open file description other than the one made here holds the flock that
    marks a spare as some plugin's own (this process's other descriptors count too)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also drops the lock if it was taken here
    return False
