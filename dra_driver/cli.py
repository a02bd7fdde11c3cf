"""Command line: flags (each with an environment-variable twin) -> Config, then run.

``gpu-dra-kubelet-plugin`` (and ``python -m dra_driver``) runs the node agent; ``gpu-dra`` is the
user's tool with subcommands (``explain``, ``devices``, ``status``, ``simulate-event``,
``gpu-check``, ``kubelet-plugin``). A flag given on the command line wins over its environment
variable; every value is validated at start and an error names the flag and the variable.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from dra_driver import __version__
from dra_driver.errors import ConfigError, DraError
from dra_driver.node.config import Config
from dra_driver.node.flags import FLAGS, build_config
from dra_driver.paths import (
    DEFAULT_DRIVER_NAME,
    DEFAULT_DRIVER_ROOT,
    DEFAULT_PLUGINS_DIR,
)

if TYPE_CHECKING:
    from dra_driver.gpus.info import Inventory


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``gpu-dra-kubelet-plugin``: run the node agent until SIGTERM/SIGINT."""
    try:
        config = build_config(sys.argv[1:] if argv is None else argv, os.environ)
    except ConfigError as exc:
        print(f"gpu-dra-kubelet-plugin: invalid configuration: {exc}", file=sys.stderr)
        return 2
    from dra_driver.node.agent import run_agent  # noqa: PLC0415  (keeps --help fast)

    try:
        return run_agent(config)
    except DraError as exc:
        print(f"gpu-dra-kubelet-plugin: {exc}", file=sys.stderr)
        return 1


def gpu_dra_main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``gpu-dra``: ``explain``, ``devices``, ``status``, ``simulate-event`` or
    ``kubelet-plugin``."""
    args = list(sys.argv[1:] if argv is None else argv)
    commands = {
        "explain": "what the scheduler would allocate for a claim, or why it cannot",
        "devices": "the devices this node (or a --simulate spec) would publish, as a table",
        "status": "each GPU's health, claim, pod, utilisation, memory, temperature and power",
        "simulate-event": "make something happen to a simulated GPU: an XID, an ECC error, ...",
        "gpu-check": "read-only check of this machine's GPUs and driver (docs/gpu-check.md)",
        "kubelet-plugin": "run the node agent (same as gpu-dra-kubelet-plugin)",
    }
    if args and args[0] in ("--version", "version"):
        print(f"gpu-dra {__version__}")
        return 0
    if not args or args[0] in ("-h", "--help") or args[0] not in commands:
        print("usage: gpu-dra [--version] COMMAND [ARGS]\n\ncommands:", file=sys.stderr)
        for name, text in commands.items():
            print(f"  {name:<15} {text}", file=sys.stderr)
        return 0 if args and args[0] in ("-h", "--help") else 2
    command, rest = args[0], args[1:]
    if command == "kubelet-plugin":
        return main(rest)
    return _quiet_on_a_closed_pipe(lambda: _tool(command, rest))


def _quiet_on_a_closed_pipe(run: Callable[[], int]) -> int:
    """``run()``, ending quietly when the reader of our output goes away (``gpu-dra explain …
    | head``): status 141 as after SIGPIPE, no traceback (not for the agent: its sockets keep
    Python's SIGPIPE handling). stdout then goes to /dev/null, else the flush at exit fails."""
    try:
        code = run()
        sys.stdout.flush()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + signal.SIGPIPE
    return code


def _tool(command: str, rest: list[str]) -> int:
    if command == "explain":
        return explain_main(rest)
    if command == "devices":
        return devices_main(rest)
    if command == "status":
        from dra_driver.telemetry.status.command import main as status_main  # noqa: PLC0415

        return status_main(rest)
    if command == "simulate-event":
        from dra_driver.sim.faults import main as simulate_event_main  # noqa: PLC0415

        return simulate_event_main(rest)
    return gpu_check_main(rest)


def gpu_check_main(argv: Sequence[str]) -> int:
    """``gpu-dra gpu-check``: ``gpucheck.command`` with the simulated GPUs it compares with
    (and runs on, with ``--simulate``), which only the CLI and node/ may import."""
    from dra_driver.gpucheck.command import main as gpu_check  # noqa: PLC0415
    from dra_driver.sim.checkmachine import SimulatedTwins, simulated_machine  # noqa: PLC0415

    return gpu_check(argv, twins=SimulatedTwins(), simulate=simulated_machine)


def explain_main(
    argv: Sequence[str], *, stdout: TextIO | None = None, stderr: TextIO | None = None
) -> int:
    """``gpu-dra explain``: ``scheduling.explain`` with simulated GPUs behind ``--simulate``.

    ``scheduling`` sits below ``sim``, so the discovery of simulated GPUs is passed in from here
    (imported only when ``--simulate`` runs it)."""
    from dra_driver.scheduling.explain import main as explain  # noqa: PLC0415

    return int(
        explain(list(argv), stdout=stdout, stderr=stderr, discover_simulated=_discover_simulated)
    )


def _discover_simulated(spec: str, *, node_name: str) -> Inventory:
    from dra_driver.sim.nvml import discover_simulated  # noqa: PLC0415

    return discover_simulated(spec, node_name=node_name)


def devices_main(argv: Sequence[str]) -> int:
    """``gpu-dra devices``: discover (or simulate) GPUs and print what would be published."""
    parser = argparse.ArgumentParser(
        prog="gpu-dra devices",
        description="Show the devices and ResourceSlices this node would publish (nothing is "
        "sent to a cluster).",
    )
    parser.add_argument("--simulate", help="simulated GPUs instead of NVML, e.g. h100:8")
    parser.add_argument("--node-name", default=os.environ.get("NODE_NAME", "node-1"))
    parser.add_argument("--driver-name", default=os.environ.get("DRIVER_NAME", DEFAULT_DRIVER_NAME))
    parser.add_argument(
        "--nvidia-driver-root",
        default=os.environ.get("NVIDIA_DRIVER_ROOT", str(DEFAULT_DRIVER_ROOT)),
    )
    parser.add_argument(
        "--consumable-shares",
        default=os.environ.get("CONSUMABLE_SHARES", "disabled"),
        help="publish the devices shareable (KEP-5075): disabled, unlimited, memory, compute or "
        "a number of shares",
    )
    parser.add_argument(
        "--mig-mode",
        default=os.environ.get("MIG_MODE", "static"),
        help="static or dynamic, as the agent's --mig-mode (MIG devices recorded in this "
        "node's checkpoint count as the driver's own)",
    )
    parser.add_argument(
        "--kubelet-plugins-directory-path",
        default=os.environ.get("KUBELET_PLUGINS_DIRECTORY_PATH", str(DEFAULT_PLUGINS_DIR)),
        help="where the agent keeps its checkpoint (read-only here)",
    )
    parser.add_argument("-o", "--output", choices=("table", "json", "yaml"), default="table")
    args = parser.parse_args(list(argv))
    from contextlib import ExitStack  # noqa: PLC0415

    from dra_driver.devices import table  # noqa: PLC0415
    from dra_driver.mig.dynamic import ManagedMig  # noqa: PLC0415
    from dra_driver.node.discovery import Discovery, first_devices  # noqa: PLC0415
    from dra_driver.publish import slices  # noqa: PLC0415

    try:
        config = Config(
            node_name=args.node_name,
            driver_name=args.driver_name,
            nvidia_driver_root=Path(args.nvidia_driver_root),
            kubelet_plugins_directory_path=Path(args.kubelet_plugins_directory_path),
            simulate=args.simulate,
            consumable_shares=args.consumable_shares,
            mig_mode=args.mig_mode,
        )
        mig = ManagedMig(mig_mode=config.mig_mode, driver_name=config.driver_name, warn=False)
        with ExitStack() as stack:  # the agent's own pipeline (node/discovery.py)
            first = first_devices(config, Discovery(config, stack), mig)
        pool = slices.build_slices(  # as the Publisher builds them (without health's taints)
            first.node_devices,
            driver_name=config.driver_name,
            node_name=config.node_name,
        )
    except DraError as exc:
        print(f"gpu-dra devices: {exc}", file=sys.stderr)
        return 2
    for gpu, foreign in mig.left_static().items():
        print(
            f"gpu-dra devices: {gpu} stays static in dynamic MIG mode: MIG devices the driver "
            f"did not create: {', '.join(foreign)}",
            file=sys.stderr,
        )
    objects = slices.to_api_objects(pool, node_uid="")
    for obj in objects:
        obj["metadata"]["name"] = str(obj["metadata"].get("generateName", "")).rstrip("-")
    if args.output == "table":
        print(table.render(table.device_rows(objects)))
    elif args.output == "json":
        import json  # noqa: PLC0415

        print(json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}, indent=2))
    else:
        import yaml  # noqa: PLC0415

        print(
            yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": objects}, sort_keys=False)
        )
    return 0


# FLAGS: the agent's flag table (node/flags.py), read here by the chart's tests
__all__ = ["FLAGS", "build_config", "devices_main", "explain_main", "gpu_dra_main", "main"]
