"""GPUs this driver took out of MIG mode for a whole-GPU claim (dynamic MIG), and how discovery
sees them meanwhile.

Place in the flow: in ``--mig-mode=dynamic`` a partitionable GPU that can leave MIG mode without
a reset also offers itself whole (``gpu-<minor>``, consuming every counter;
devices/partitionable.py). Prepare
of that device takes the GPU out of MIG mode and unprepare puts it back (prepare/, through
miginstances.DynamicMig). While the GPU is out of MIG mode, NVML reports neither MIG mode nor
its GPU-instance profiles, yet the node must keep publishing the same partitionable GPU (the
scheduler allocated the whole GPU out of its counters; flipping to a plain GPU and back would
rewrite the slices twice and lose the placements). So:

* before the GPU leaves MIG mode, a **mark** is written durably:
  ``<plugin dir>/mig-off/<GPU UUID>.json`` with the GPU's profiles and placement tables as
  discovery last read them (:meth:`MigOffMarks.write`);
* discovery's inventory goes through :func:`overlay`: a GPU out of MIG mode that has a mark is
  shown as the partitionable GPU it was (MIG mode on, the marked profiles, no MIG devices), so
  publishing, prepare's targets and health see no change;
* the mark is removed only after the GPU is back in MIG mode. A mark no recorded claim's whole
  GPU stands for (a crash after the claim's record went, a reboot that dropped every claim) is
  found by reconcile, which puts the GPU back into MIG mode and removes the mark.

Reading marks is I/O on a small directory; :func:`overlay` is pure.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from dra_driver.fsutil import fsync_dir, replace_file
from dra_driver.gpus.info import GpuInfo, Inventory, MigPlacement, MigProfile

log = logging.getLogger(__name__)

MARKS_DIRECTORY = "mig-off"  # under the plugin's data directory (beside the checkpoint)
_VERSION = 1


def _profile_json(profile: MigProfile) -> dict[str, Any]:
    return {
        "profile_id": profile.profile_id,
        "name": profile.name,
        "slice_count": profile.slice_count,
        "memory_bytes": profile.memory_bytes,
        "multiprocessors": profile.multiprocessors,
        "copy_engines": profile.copy_engines,
        "decoders": profile.decoders,
        "encoders": profile.encoders,
        "jpeg_engines": profile.jpeg_engines,
        "ofa_engines": profile.ofa_engines,
        "instance_count": profile.instance_count,
        "placements": [[p.start, p.size] for p in profile.placements],
    }


def _profile(data: Mapping[str, Any]) -> MigProfile:
    return MigProfile(
        profile_id=int(data["profile_id"]),
        name=str(data["name"]),
        slice_count=int(data["slice_count"]),
        memory_bytes=int(data["memory_bytes"]),
        multiprocessors=int(data["multiprocessors"]),
        copy_engines=int(data["copy_engines"]),
        decoders=int(data["decoders"]),
        encoders=int(data["encoders"]),
        jpeg_engines=int(data["jpeg_engines"]),
        ofa_engines=int(data["ofa_engines"]),
        instance_count=int(data["instance_count"]),
        placements=tuple(MigPlacement(int(s), int(n)) for s, n in data["placements"]),
    )


class MigOffMarks:
    """The marks in one directory (``<plugin dir>/mig-off``). Callers serialise changes to one
    GPU's mark (prepare/ holds its MIG-mode lock); reads may run alongside."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def path(self, gpu_uuid: str) -> Path:
        return self.directory / f"{gpu_uuid}.json"

    def write(self, gpu: GpuInfo) -> None:
        """Mark ``gpu`` (in MIG mode now, with its profiles) as about to leave MIG mode;
        durable before this returns (OSError on failure)."""
        data = {
            "version": _VERSION,
            "gpu_uuid": gpu.uuid,
            "profiles": [_profile_json(p) for p in gpu.mig_profiles],
        }
        replace_file(self.path(gpu.uuid), (json.dumps(data, indent=1) + "\n").encode())

    def remove(self, gpu_uuid: str) -> None:
        """Remove the mark (the GPU is back in MIG mode); durable. No mark: nothing to do."""
        path = self.path(gpu_uuid)
        try:
            path.unlink()
        except FileNotFoundError:
            return
        fsync_dir(self.directory)

    def uuids(self) -> frozenset[str]:
        """The GPUs that have a mark (readable or not)."""
        try:
            names = [p.name for p in self.directory.iterdir()]
        except FileNotFoundError:
            return frozenset()
        return frozenset(n[: -len(".json")] for n in names if n.endswith(".json"))

    def read(self) -> dict[str, tuple[MigProfile, ...]]:
        """GPU UUID -> the profiles its mark keeps. A mark that cannot be read is logged and
        left out here (its GPU is then shown as NVML reports it; reconcile still finds it by
        :meth:`uuids`)."""
        marks: dict[str, tuple[MigProfile, ...]] = {}
        for uuid in sorted(self.uuids()):
            path = self.path(uuid)
            try:
                data = json.loads(path.read_text())
                if data.get("version") != _VERSION or data.get("gpu_uuid") != uuid:
                    raise ValueError(f"not a version {_VERSION} mark of GPU {uuid}")
                marks[uuid] = tuple(_profile(p) for p in data["profiles"])
            except FileNotFoundError:
                continue  # removed since the listing: the GPU is back in MIG mode
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.error(
                    "cannot read the mark of a GPU taken out of MIG mode",
                    extra={"path": str(path), "reason": str(exc)},
                )
        return marks


def overlay(inventory: Inventory, marks: Mapping[str, tuple[MigProfile, ...]]) -> Inventory:
    """``inventory`` with every MIG-capable GPU that is out of MIG mode and marked shown as the
    partitionable GPU it was: MIG mode on, the marked profiles, no MIG devices. Pure; returns
    ``inventory`` itself when nothing is marked."""
    if not marks:
        return inventory
    shown = tuple(
        replace(gpu, mig_enabled=True, mig_pending=True, mig_profiles=profiles, mig_instances=())
        if (profiles := marks.get(gpu.uuid)) and gpu.mig_capable and not gpu.mig_enabled
        else gpu
        for gpu in inventory.gpus
    )
    if shown == inventory.gpus:
        return inventory
    return replace(inventory, gpus=shown)


def discover_with_marks(discover: Callable[[], Inventory], marks: MigOffMarks) -> Inventory:
    """``discover()`` (NVML) with the marks laid over it (:func:`overlay`). The marks are read
    before and after NVML is asked, so a GPU seen out of MIG mode is shown as it was even when
    its mark was made during the pass (prepare marks before the mode changes) or removed during
    it (unprepare removes the mark after the GPU is back)."""
    before = marks.read()
    inventory = discover()
    return overlay(inventory, {**before, **marks.read()})
