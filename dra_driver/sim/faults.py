"""Faults for simulated GPUs, and ``gpu-dra simulate-event``, which injects them from outside.

:class:`SimulatedFault` is what can happen to a simulated GPU; sim/nvml (health.py) carries it out
(``node.library.health.inject(fault)`` in the same process). The command appends one line to
the simulated node's inbox
(``<kubelet plugins dir>/<driver>/simulated-faults.jsonl``, config.simulated_faults_path); the
agent's simulated NVML (sim/nvml/health.py) reads it within 20 ms and the health monitor sees the
fault through NVML as it would see the real thing. Runs on the node or in the agent's pod (the
chart sets the directory and driver variables there). A module of its own so that the agent
loads it only when a fault arrives.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dra_driver.errors import SimulationSpecError
from dra_driver.paths import DEFAULT_DRIVER_NAME, DEFAULT_PLUGINS_DIR, simulated_faults_path

FAULT_KINDS = ("xid", "ecc", "lost", "reset", "temperature", "hang", "row-remap-failure")


@dataclass(frozen=True, kw_only=True)
class SimulatedFault:
    """One thing that happens to a simulated GPU (docs/simulate.md "Faults").

    ``kind``: ``xid`` (an XID event; ``gpu_instance_id``/``compute_instance_id`` attribute it to
    a MIG device), ``ecc`` (a double-bit ECC error: XID 48, the event, the volatile uncorrected
    count up, and retired pages (before Ampere) or remapped rows pending), ``lost`` (XID 79, then
    every query answers GPU_IS_LOST), ``reset`` (a GPU reset: answers again, volatile ECC counts
    and pending pages/rows cleared), ``temperature`` (``celsius``), ``hang`` (every call on the
    GPU blocks for ``seconds``), ``row-remap-failure`` (NVML's remapped rows report a failure, on
    Ampere and later, until a reset: the GPU serviced). ``gpu`` is the NVML index (= the minor,
    ``gpu-<minor>``).
    """

    kind: str
    gpu: int
    xid: int = 0
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None
    celsius: int = 0
    seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise SimulationSpecError(
                f"unknown fault {self.kind!r}; expected one of {', '.join(FAULT_KINDS)}"
            )
        if self.gpu < 0:
            raise SimulationSpecError(f"GPU index {self.gpu} is negative")
        if self.kind == "xid" and self.xid <= 0:
            raise SimulationSpecError("an xid fault needs a positive XID number")
        if self.kind == "hang" and self.seconds <= 0:
            raise SimulationSpecError("a hang fault needs seconds > 0")

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SimulatedFault:
        """A fault from one inbox line's object; SimulationSpecError when it is not one."""
        known = {"kind", "gpu", "xid", "gpu_instance_id", "compute_instance_id", "celsius",
                 "seconds"}  # fmt: skip
        unknown = set(data) - known
        if unknown:
            raise SimulationSpecError(f"unknown fault fields {sorted(unknown)}")
        try:
            return cls(**{k: v for k, v in data.items()})
        except TypeError as exc:
            raise SimulationSpecError(f"bad fault {dict(data)!r}: {exc}") from exc

    def to_json(self) -> str:
        """One inbox line (without the newline)."""
        fields: dict[str, object] = {"kind": self.kind, "gpu": self.gpu}
        if self.kind == "xid":
            fields["xid"] = self.xid
        for name in ("gpu_instance_id", "compute_instance_id"):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        if self.kind == "temperature":
            fields["celsius"] = self.celsius
        if self.kind == "hang":
            fields["seconds"] = self.seconds
        return json.dumps(fields, separators=(",", ":"))


def append_fault(inbox: Path, fault: SimulatedFault) -> None:
    """Append ``fault`` to a simulated node's inbox (one write, atomic with O_APPEND)."""
    inbox.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(inbox, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, (fault.to_json() + "\n").encode())
    finally:
        os.close(fd)


def main(argv: Sequence[str]) -> int:
    """``gpu-dra simulate-event``: append a fault to a running simulated node's inbox."""
    parser = argparse.ArgumentParser(
        prog="gpu-dra simulate-event",
        description="Make something happen to a GPU of an agent running with --simulate (on "
        "this node, or in its pod): the agent sees it through NVML as it would see the real "
        "thing. Details: docs/simulate.md.",
    )
    parser.add_argument("--gpu", type=int, required=True, help="GPU index (gpu-<index>)")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--xid", type=int, help="a critical XID event with this number")
    what.add_argument("--ecc", action="store_true", help="a double-bit ECC error (XID 48)")
    what.add_argument("--lost", action="store_true", help="the GPU falls off the bus (XID 79)")
    what.add_argument("--reset", action="store_true", help="a GPU reset: the GPU is back")
    what.add_argument("--temperature", type=int, metavar="CELSIUS", help="the GPU temperature")
    what.add_argument("--hang", type=float, metavar="SECONDS", help="NVML calls on it hang")
    what.add_argument(
        "--row-remap-failure", action="store_true", help="remapping a memory row failed"
    )
    parser.add_argument("--gpu-instance", type=int, help="with --xid: the MIG GPU instance id")
    parser.add_argument("--compute-instance", type=int, help="with --xid: its compute instance")
    parser.add_argument(
        "--kubelet-plugins-directory-path",
        default=os.environ.get("KUBELET_PLUGINS_DIRECTORY_PATH", str(DEFAULT_PLUGINS_DIR)),
        help="the agent's --kubelet-plugins-directory-path [KUBELET_PLUGINS_DIRECTORY_PATH]",
    )
    parser.add_argument(
        "--driver-name",
        default=os.environ.get("DRIVER_NAME", DEFAULT_DRIVER_NAME),
        help="the agent's --driver-name [DRIVER_NAME]",
    )
    parser.add_argument("--inbox", type=Path, help="the inbox file (default: from the above)")
    args = parser.parse_args(list(argv))
    plugin_dir = Path(args.kubelet_plugins_directory_path) / args.driver_name
    inbox = args.inbox or simulated_faults_path(plugin_dir)
    if not inbox.parent.is_dir():
        print(
            f"gpu-dra simulate-event: {inbox.parent} does not exist: is an agent running with "
            "--simulate and the same --kubelet-plugins-directory-path and --driver-name?",
            file=sys.stderr,
        )
        return 2
    kind = next(
        k
        for k in FAULT_KINDS
        if getattr(args, k.replace("-", "_")) is not None
        and getattr(args, k.replace("-", "_")) is not False
    )
    try:
        fault = SimulatedFault(
            kind=kind,
            gpu=args.gpu,
            xid=args.xid or 0,
            gpu_instance_id=args.gpu_instance,
            compute_instance_id=args.compute_instance,
            celsius=args.temperature or 0,
            seconds=args.hang or 0.0,
        )
    except SimulationSpecError as exc:
        print(f"gpu-dra simulate-event: {exc}", file=sys.stderr)
        return 2
    append_fault(inbox, fault)
    print(f"{fault.to_json()} -> {inbox}")
    return 0
