"""The simulated node's MIG state file: the GPU and compute instances and MIG modes that exist.

What makes simulated MIG instances outlive the agent process, as real ones do (mig.py keeps the
instances in memory and rewrites this file, under its lock, before a change becomes visible).
Format::

    {"version": 1, "gpus": {"<GPU UUID>": [{"gpu_instance_id": 2, "profile_id": 9,
      "start": 0, "compute_instances": [{"compute_instance_id": 0, "profile_id": 2}]}]},
     "mig_mode": {"<GPU UUID>": {"current": 1, "pending": 1}}}

``gpus`` names every GPU whose current MIG mode is on (an empty list: no instances);
``mig_mode`` every MIG-capable GPU. Both keys are optional per GPU: a GPU ``mig_mode`` does
not name has the spec's modes (files written before the key existed), and a GPU ``gpus``
does not name has the spec's layout, or no instances when its recorded current mode is off.
UUIDs of other nodes are ignored. A file that cannot be read, or names impossible instances
or modes (instances on a GPU whose MIG mode is off, a mode for a GPU without MIG), is a
SimulationSpecError.
"""

from __future__ import annotations

import json
from dataclasses import replace as _replace
from pathlib import Path
from typing import Any

from dra_driver.errors import SimulationSpecError
from dra_driver.fsutil import replace_file
from dra_driver.sim.nvml.node import (
    SimulatedGpu,
    SimulatedGpuInstance,
    SimulatedMig,
    full_compute_profile,
    gpu_instance_id_at,
    mig_uuid,
    profile_by_id,
)

_STATE_VERSION = 1


def write_state(
    path: Path,
    *,
    gpus: tuple[SimulatedGpu, ...],
    instances: dict[int, tuple[SimulatedGpuInstance, ...]],
    modes: dict[int, tuple[bool, bool]],
) -> None:
    """Replace ``path`` with ``instances`` and ``modes`` of ``gpus``, atomically (rename; not
    synced, see below). The caller holds its lock."""
    # Every GPU in MIG mode is written, those without instances too: none is a state.
    state: dict[str, Any] = {
        "version": _STATE_VERSION,
        "gpus": {
            gpu.uuid: [
                {
                    "gpu_instance_id": gi.id,
                    "profile_id": gi.profile.profile_id,
                    "start": gi.start,
                    "compute_instances": [
                        {
                            "compute_instance_id": ci.compute_instance_id,
                            "profile_id": full_compute_profile(gi),
                        }
                        for ci in gi.compute_instances
                    ],
                }
                for gi in instances[gpu.index]
            ]
            for gpu in gpus
            if modes[gpu.index][0]
        },
        "mig_mode": {
            gpu.uuid: {"current": int(modes[gpu.index][0]), "pending": int(modes[gpu.index][1])}
            for gpu in gpus
            if gpu.spec.hardware.mig_capable
        },
    }
    # Not synced: a crash of a process cannot lose a renamed file, and real MIG instances do
    # not survive what could (a power loss reboots the node, and a reboot clears them).
    replace_file(path, (json.dumps(state, indent=1) + "\n").encode(), durable=False)


def read_state(
    path: Path,
    *,
    gpus: tuple[SimulatedGpu, ...],
    node_name: str,
    instances: dict[int, tuple[SimulatedGpuInstance, ...]],
    modes: dict[int, tuple[bool, bool]],
) -> None:
    """Replace the spec's ``instances`` and ``modes`` with those ``path`` records for this
    node's ``gpus``; SimulationSpecError if invalid."""
    try:
        state = json.loads(path.read_text())
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            raise ValueError(f"not a version {_STATE_VERSION} MIG state file")
        recorded = state["gpus"]
        recorded_modes = state.get("mig_mode", {})  # absent in files of older agents
        if not isinstance(recorded, dict) or not isinstance(recorded_modes, dict):
            raise ValueError("'gpus' or 'mig_mode' is not an object")
        for gpu in gpus:
            if gpu.uuid in recorded_modes:
                modes[gpu.index] = _read_mode(gpu, recorded_modes[gpu.uuid])
                if not modes[gpu.index][0]:
                    instances[gpu.index] = ()  # the spec's layout needs MIG mode on
            if gpu.uuid in recorded:
                instances[gpu.index] = _read_gpu(
                    gpu, recorded[gpu.uuid], node_name=node_name, enabled=modes[gpu.index][0]
                )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SimulationSpecError(f"simulated MIG state {path}: {exc}") from exc


def _read_gpu(
    gpu: SimulatedGpu, entries: Any, *, node_name: str, enabled: bool
) -> tuple[SimulatedGpuInstance, ...]:
    if entries and not enabled:
        raise ValueError(f"GPU {gpu.index} has MIG instances but MIG mode is off")
    found: list[SimulatedGpuInstance] = []
    for entry in entries:
        profile = profile_by_id(gpu, int(entry["profile_id"]))
        start = int(entry["start"])
        if profile is None:
            raise ValueError(f"GPU {gpu.index}: no GPU-instance profile {entry['profile_id']}")
        span = frozenset(range(start, start + profile.placement_size))
        if start not in profile.placement_starts or any(span & i.memory_slices for i in found):
            raise ValueError(f"GPU {gpu.index}: {profile.name} cannot be at slice {start}")
        if int(entry["gpu_instance_id"]) != gpu_instance_id_at(start, profile.placement_size):
            raise ValueError(f"GPU {gpu.index}: wrong GPU-instance id in {entry}")
        instance = SimulatedGpuInstance(
            gpu_index=gpu.index, id=int(entry["gpu_instance_id"]), profile=profile, start=start
        )
        cis = entry["compute_instances"]
        if len(cis) > 1 or any(
            (int(c["compute_instance_id"]), int(c["profile_id"]))
            != (0, full_compute_profile(instance))
            for c in cis
        ):
            raise ValueError(f"GPU {gpu.index}: unsupported compute instances in {entry}")
        mig = SimulatedMig(
            uuid=mig_uuid(node_name, gpu.index, profile, start),
            gpu_instance_id=instance.id,
            compute_instance_id=0,
            profile=profile,
            start=start,
        )
        found.append(_replace(instance, compute_instances=(mig,) if cis else ()))
    return tuple(found)


def _read_mode(gpu: SimulatedGpu, entry: Any) -> tuple[bool, bool]:
    """A GPU's ``mig_mode`` entry of the state file: (current, pending)."""
    if not gpu.spec.hardware.mig_capable:
        raise ValueError(f"GPU {gpu.index} ({gpu.spec.hardware.key}) has no MIG mode")
    if not isinstance(entry, dict):
        raise ValueError(f"GPU {gpu.index}: MIG mode {entry!r} is not an object")
    current, pending = entry["current"], entry["pending"]
    if any(type(value) is not int or value not in (0, 1) for value in (current, pending)):
        raise ValueError(f"GPU {gpu.index}: MIG mode {entry!r} is not 0 or 1")
    return bool(current), bool(pending)
