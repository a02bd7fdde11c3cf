"""The ``--simulate`` spec: which GPUs a simulated node has, parsed and checked before use.

The first thing a simulated node is made from (``install.simulated_nvml`` parses, then
``node.build_node`` gives the GPUs their identities). Pure: no NVML, no files. Hardware facts
come from sim/profiles.py.

Spec syntax (documented for users in docs/simulate.md)::

    spec   := group ("," group)*
    group  := product [":" count] (":" option)*
    option := "mig" | "mig=" layout | "mig-pending" | "addressing=" ("hmm" | "ats")
            | "numa=" (node | "none") | "fail" | "no-events"
    layout := entry ("+" entry)*          entry := profile ["*" count]

e.g. ``h100:8``, ``a100-80gb:2,l4:1``, ``a100-40gb:1:mig=3g.20gb+2g.10gb+1g.5gb``,
``h100:1:mig=1g.10gb*7``. A layout entry that does not start with a digit belongs to the previous
profile name, so ``mig=1g.5gb+me+3g.20gb`` reads as ``1g.5gb+me`` and ``3g.20gb``. Instances
take the first free placement of their profile's placement table, in the order given; earlier
choices are revisited when a later instance would not fit. ``fail`` makes every NVML query on
that GPU return NVML_ERROR_GPU_IS_LOST (the fault hook for tests); ``no-events`` makes the GPU
refuse NVML event registration (NOT_SUPPORTED), as GPUs without event support do. ``numa=``
overrides the NUMA node the sysfs tree reports for the group's GPUs; ``none`` writes -1, as the
kernel does for a device without NUMA affinity. By default the first half of the node's PCIe
root complexes (and their GPUs) sit on NUMA node 0 and the second half on node 1, as on a
two-socket server.
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import replace as _replace

from dra_driver.errors import SimulationSpecError
from dra_driver.sim.profiles import (
    GpuInstanceProfile,
    HardwareProfile,
    hardware_profile,
    known_keys,
)

MAX_GPUS = 64
"""More GPUs than any real node has; a typo like ``h100:800`` is an error, not a long wait."""

TOTAL_SLICES = 8  # memory slices of the A100/H100/H200 MIG layout
TOTAL_COMPUTE_SLICES = 7

_ADDRESSING = {"hmm": 1, "ats": 2}  # NVML_DEVICE_ADDRESSING_MODE_HMM / _ATS
_OPTIONS = (
    "mig",
    "mig=<layout>",
    "mig-pending",
    "addressing=hmm|ats",
    "numa=<node>|none",
    "fail",
    "no-events",
)
NO_NUMA_NODE = -1
"""What the kernel writes to ``numa_node`` for a device without NUMA affinity."""
MAX_NUMA_NODE = 1023  # Linux: MAX_NUMNODES is at most 1 << 10


@dataclass(frozen=True)
class MigPlacementSpec:
    """A MIG instance to pre-create: its GPU-instance profile and first memory slice."""

    profile: GpuInstanceProfile
    start: int


@dataclass(frozen=True)
class SimulatedGpuSpec:
    """One GPU of a spec, before node-specific identities (UUID, PCI address) are assigned."""

    hardware: HardwareProfile
    mig_enabled: bool = False
    mig_pending: bool = False
    mig_instances: tuple[MigPlacementSpec, ...] = ()
    addressing_mode: int | None = None
    numa_node: int | None = None  # None: by position (see build_node); NO_NUMA_NODE: none
    fail: bool = False
    events: bool = True  # False: NVML event registration answers NOT_SUPPORTED


@dataclass(frozen=True)
class SimulationSpec:
    """A parsed ``--simulate`` spec: the node's GPUs in NVML index order."""

    gpus: tuple[SimulatedGpuSpec, ...]


def parse_spec(spec: str) -> SimulationSpec:
    """Parse a ``--simulate`` spec; raise SimulationSpecError naming the bad part."""
    if not spec.strip():
        raise SimulationSpecError("empty --simulate spec; expected e.g. 'h100:8' or 'l4:1,t4:2'")
    gpus: list[SimulatedGpuSpec] = []
    for position, group in enumerate(spec.split(","), start=1):
        gpus.extend(_parse_group(group.strip(), position=position))
        if len(gpus) > MAX_GPUS:
            raise SimulationSpecError(f"spec {spec!r} asks for more than {MAX_GPUS} GPUs")
    return SimulationSpec(gpus=tuple(gpus))


def _parse_group(group: str, *, position: int) -> list[SimulatedGpuSpec]:
    where = f"group {position} ({group!r})"
    if not group:
        raise SimulationSpecError(f"group {position} is empty (two commas in a row?)")
    parts = group.split(":")
    hardware = hardware_profile(parts[0].strip())
    if hardware is None:
        raise SimulationSpecError(
            f"{where}: unknown GPU {parts[0]!r}; known: {', '.join(known_keys())}"
        )
    options = parts[1:]
    count = 1
    if options and options[0].isdigit():
        count = int(options[0])
        options = options[1:]
    gpu = SimulatedGpuSpec(hardware=hardware)
    for option in options:
        gpu = _apply_option(gpu, option.strip(), where=where)
    return [gpu] * count


def _apply_option(gpu: SimulatedGpuSpec, option: str, *, where: str) -> SimulatedGpuSpec:
    name, _, value = option.partition("=")
    if name in ("mig", "mig-pending") and not gpu.hardware.mig_capable:
        raise SimulationSpecError(
            f"{where}: {gpu.hardware.key} ({gpu.hardware.product_name}) does not support MIG"
        )
    if option == "mig":
        return _replace(gpu, mig_enabled=True, mig_pending=True)
    if name == "mig" and value:
        layout = _place(gpu.hardware, value, where=where)
        return _replace(gpu, mig_enabled=True, mig_pending=True, mig_instances=layout)
    if option == "mig-pending":
        return _replace(gpu, mig_pending=True)
    if name == "addressing" and value.lower() in _ADDRESSING:
        return _replace(gpu, addressing_mode=_ADDRESSING[value.lower()])
    if name == "numa" and value.lower() == "none":
        return _replace(gpu, numa_node=NO_NUMA_NODE)
    if name == "numa" and value.isascii() and value.isdigit() and int(value) <= MAX_NUMA_NODE:
        return _replace(gpu, numa_node=int(value))
    if option == "fail":
        return _replace(gpu, fail=True)
    if option == "no-events":
        return _replace(gpu, events=False)
    raise SimulationSpecError(
        f"{where}: unknown option {option!r}; expected a GPU count or one of {', '.join(_OPTIONS)}"
    )


def _layout_names(layout: str, *, where: str) -> list[str]:
    """Split ``3g.20gb+1g.5gb+me*2`` into profile names, re-joining ``+me``-style suffixes."""
    entries: list[str] = []
    for token in layout.split("+"):
        if not token:
            raise SimulationSpecError(f"{where}: empty entry in MIG layout {layout!r}")
        if token[0].isdigit() or not entries:
            entries.append(token)
        else:
            entries[-1] += "+" + token
    names: list[str] = []
    for entry in entries:
        name, star, repeat = entry.partition("*")
        if star and not (repeat.isdigit() and int(repeat) > 0):
            raise SimulationSpecError(f"{where}: bad repeat count in MIG layout entry {entry!r}")
        names.extend([name] * (int(repeat) if star else 1))
    return names


def _place(hardware: HardwareProfile, layout: str, *, where: str) -> tuple[MigPlacementSpec, ...]:
    """Place the layout's instances on their profiles' possible placements, or explain why not.

    Each instance takes the first free placement in the profile's table; when a later instance
    then finds no room, earlier choices are revisited (so ``3g+2g+1g+1g`` fits with the 3g at
    slice 4, as NVML places it), and the layout is refused only if no arrangement exists.
    """
    profiles: list[GpuInstanceProfile] = []
    for name in _layout_names(layout, where=where):
        profile = hardware.gpu_instance_profile(name)
        if profile is None:
            known = ", ".join(p.name for p in hardware.gpu_instance_profiles)
            raise SimulationSpecError(
                f"{where}: {hardware.key} has no MIG profile {name!r}; it has: {known}"
            )
        if profiles.count(profile) >= profile.instance_count:
            raise SimulationSpecError(
                f"{where}: MIG layout {layout!r} does not fit: {hardware.key} allows at most "
                f"{profile.instance_count} instance(s) of {name}"
            )
        profiles.append(profile)
    compute = sum(p.slice_count for p in profiles)
    if compute > TOTAL_COMPUTE_SLICES:
        raise SimulationSpecError(
            f"{where}: MIG layout {layout!r} does not fit: it needs {compute} compute slices, "
            f"a GPU has {TOTAL_COMPUTE_SLICES}"
        )
    starts = _arrange(profiles, used=frozenset())
    if starts is None:
        tables = "; ".join(
            f"{p.name} {{{','.join(map(str, p.placement_starts))}}}:{p.placement_size}"
            for p in dict.fromkeys(profiles)
        )
        raise SimulationSpecError(
            f"{where}: MIG layout {layout!r} does not fit: no combination of possible "
            f"placements holds all instances on {TOTAL_SLICES} memory slices ({tables})"
        )
    return tuple(
        MigPlacementSpec(profile=p, start=s) for p, s in zip(profiles, starts, strict=True)
    )


def _arrange(profiles: list[GpuInstanceProfile], *, used: frozenset[int]) -> list[int] | None:
    """Placement starts for ``profiles`` avoiding ``used`` memory slices; None if impossible."""
    if not profiles:
        return []
    first, rest = profiles[0], profiles[1:]
    for start in first.placement_starts:
        span = frozenset(range(start, start + first.placement_size))
        if span & used:
            continue
        arranged = _arrange(rest, used=used | span)
        if arranged is not None:
            return [start, *arranged]
    return None
