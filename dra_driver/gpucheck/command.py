"""``gpu-dra gpu-check``'s command line: flags -> a Machine -> run_check -> the report files.

The CLI (cli.py) calls :func:`main` with the simulated GPUs it may import and this package may
not: the twins every GPU is compared with, and for ``--simulate`` the simulated machine (a
simulated NVML below pynvml, a fake driver tree of ELF stand-ins, its sysfs and proc). The
same code path then runs on real and simulated GPUs.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack
from pathlib import Path

from dra_driver.gpucheck import mpscheck
from dra_driver.gpucheck import report as reports
from dra_driver.gpucheck.check import Machine, Options, Twins, run_check
from dra_driver.quantity import QuantityError

SimulatedMachine = Callable[[str, Path], AbstractContextManager[Machine]]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gpu-dra gpu-check",
        description="Read-only check of this machine's NVIDIA GPUs and driver as the agent sees "
        "them: discovery compared with the simulated profile of the same product, MIG tables, "
        "driver files and the CDI spec, a CUDA load through that spec, health and telemetry "
        "queries. Changes no GPU setting (docs/gpu-check.md).",
    )
    p.add_argument("--out", type=Path, help="directory for the report (default: a new temp dir)")
    p.add_argument(
        "--driver-root",
        type=Path,
        action="append",
        default=[],
        help="a driver root to try first (repeatable); /, /usr/local/nvidia and "
        "/run/nvidia/driver are always tried",
    )
    p.add_argument("--simulate", help="simulated GPUs instead of NVML, e.g. h100:1")
    p.add_argument("--probe", type=Path, help="a prebuilt probe (default: built with cc)")
    p.add_argument("--driver-name", default="gpu.nvidia.com")
    p.add_argument(
        "--mps",
        nargs="?",
        const="",
        metavar="MEMORY[,PERCENT]",
        help="also check that MPS enforces a share's limits on the first GPU: start an MPS "
        "control daemon of the check's own, give it the share's limits as the agent does, run "
        "a client that allocates and runs a kernel, quit the daemon (default share: a quarter "
        "of the GPU's memory in GiB and 25%% of its threads, e.g. --mps 20Gi,25)",
    )
    return p


def main(argv: Sequence[str], *, twins: Twins, simulate: SimulatedMachine) -> int:
    """Run the check; print the summary and where the report is. Exit status 0 when every
    section ran (skipped ones included), 1 when one failed, 2 for bad flags."""
    p = parser()
    args = p.parse_args(list(argv))
    share = None
    if args.mps:
        try:
            share = mpscheck.parse_share(args.mps)
        except (ValueError, QuantityError) as exc:
            p.error(f"--mps {args.mps}: {exc}")
    out = args.out or Path(tempfile.mkdtemp(prefix="gpu-check-"))
    options = Options(
        driver_name=args.driver_name,
        probe=args.probe,
        mps=args.mps is not None,
        mps_share=share,
    )
    with tempfile.TemporaryDirectory(prefix="gpu-check-work-") as tmp, ExitStack() as stack:
        work = Path(tmp)
        if args.simulate:
            machine = stack.enter_context(simulate(args.simulate, work / "machine"))
        else:
            machine = Machine(driver_roots=tuple(args.driver_root))
        (work / "check").mkdir()
        report = run_check(machine, twins=twins, options=options, work=work / "check")
    report_path, _ = reports.write(report, out)
    sys.stdout.write(reports.summary(report))
    print(f"report: {report_path}")
    failed = [
        name
        for name, entry in report["sections"].items()
        if "error" in entry or entry.get("ok") is False
    ]
    return 1 if failed else 0


__all__ = ["SimulatedMachine", "main", "parser"]
