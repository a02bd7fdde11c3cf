"""``gpu-dra gpu-check``: every read-only check of a machine's GPUs and driver, in one run.

Place in the flow: a tool beside the agent (like scheduling/'s ``explain``), running the agent's
own parts on this machine: discovery (gpus/nvml.py) and the devices it would publish (devices/,
publish/slices.py), the NVML questions of nvmlquery.py, the telemetry reader (gpus/readings.py),
the driver-file scan and CDI spec (driverroot.py over cdi/), and a CUDA load through that spec
(runtime.py). Each GPU's answers are compared with its simulated twin (compare.py): the same
questions asked of the simulated profile of the same product, which the CLI installs below
pynvml (:class:`Twins`; only the CLI and node/ may import sim/).

Strictly read-only: no NVML setter is ever called (nvmlquery.Asker refuses them; a test records
every NVML call a simulated run makes), no nvidia-smi option that sets anything is run. The one
process it starts that touches the driver is the probe in a private mount namespace
(runtime.py); only with ``--mps`` (Options.mps) does it start an MPS control daemon of its own,
send it a share's limits, run the probe as its client (allocating device memory, running a
kernel) and quit it (mpscheck.py). Sections that fail are reported; the others still run.
"""

from __future__ import annotations

import dataclasses
import platform
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import pynvml

from dra_driver import __version__, cdi
from dra_driver.devices.pool import node_devices
from dra_driver.errors import DraError
from dra_driver.gpucheck import compare, driverroot, mpscheck, nvmlquery, runtime
from dra_driver.gpus import nvml
from dra_driver.gpus.info import GpuInfo, Inventory
from dra_driver.gpus.readings import NvmlReader
from dra_driver.gpus.telemetryvalues import TelemetryTarget
from dra_driver.publish.slices import build_slices, device_json, to_api_objects
from dra_driver.sharing import mps

REPORT_VERSION = 1
NODE_NAME = "gpu-check"  # the pool name of the ResourceSlices shown (nothing is published)


class Twins(Protocol):
    """The simulated GPUs, given by the CLI: the product key of a product name, and simulated
    GPUs installed below pynvml for a ``--simulate`` spec (yielding their sysfs root), on a
    simulated driver of the given versions (None: the simulated driver's own)."""

    def product_key(self, product_name: str) -> str | None: ...

    def installed(
        self, spec: str, *, driver_version: str | None, cuda_driver_version: int | None
    ) -> AbstractContextManager[Path]: ...


@dataclass(frozen=True)
class Machine:
    """Where the check looks: the driver roots to try (given first; the usual ones are added),
    the sysfs and proc roots, and the ``--simulate`` spec when the GPUs are simulated."""

    driver_roots: tuple[Path, ...] = ()
    sysfs_root: Path = nvml.DEFAULT_SYSFS_ROOT
    proc_root: Path = Path("/proc")
    simulated: str | None = None
    only_given_roots: bool = False  # simulated machines: never the host's own driver


@dataclass(frozen=True)
class Options:
    driver_name: str = "gpu.nvidia.com"
    probe: Path | None = None  # a prebuilt probe (probe.c); None: built with cc
    cuda_timeout_s: float = 60
    mps: bool = False  # the mps section (mpscheck.py): starts an MPS daemon of its own
    mps_share: mpscheck.Share | None = None  # None: mpscheck.default_share of the GPU


@contextmanager
def _section(report: dict[str, Any], name: str) -> Iterator[dict[str, Any]]:
    """One section of the report: timed, and its failure recorded as its ``error`` (the other
    sections still run). A ReadOnlyViolation is a bug in the check and is not caught."""
    entry: dict[str, Any] = {}
    start = time.monotonic()
    try:
        yield entry
    except (DraError, OSError, subprocess.SubprocessError, pynvml.NVMLError, ValueError) as exc:
        entry["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        entry["seconds"] = round(time.monotonic() - start, 3)
        report["sections"][name] = entry


def gpu_facts(gpu: GpuInfo, *, ask: nvmlquery.Asker, driver_name: str) -> dict[str, Any]:
    """One GPU's answers: discovery's, the devices it would publish, MIG, health, telemetry.
    NVML must be initialised."""
    handle = pynvml.nvmlDeviceGetHandleByIndex(gpu.index)
    one = Inventory(gpus=(gpu,))
    devices: dict[str, Any] = {
        "static": [device_json(d) for d in node_devices(one, driver_name=driver_name).devices]
    }
    try:
        dynamic = node_devices(one, driver_name=driver_name, mig_mode="dynamic")
        devices["dynamic"] = [device_json(d) for d in dynamic.devices]
    except DraError as exc:
        devices["dynamic"] = {"error": str(exc)}
    reader = NvmlReader()
    target = TelemetryTarget(
        name=f"gpu-{gpu.minor}",
        uuid=gpu.uuid,
        gpu_minor=gpu.minor,
        type="gpu",
        product_name=gpu.product_name,
        mig_enabled=gpu.mig_enabled,
    )
    start = time.perf_counter()
    try:
        readings = reader.read([target])
    finally:
        reader.close()
    reading = readings.get(gpu.uuid)
    return {
        "discovery": dataclasses.asdict(gpu),
        "devices": devices,
        "mig": nvmlquery.mig_answers(ask, handle),
        "health": nvmlquery.health_answers(ask, handle),
        "telemetry": {
            "reading": None if reading is None else dataclasses.asdict(reading),
            "ms": round((time.perf_counter() - start) * 1000, 3),
        },
    }


def _facts_of_node(
    *, driver_root: Path, sysfs_root: Path, ask: nvmlquery.Asker, driver_name: str
) -> tuple[Inventory, list[dict[str, Any]]]:
    inventory = nvml.discover(driver_root=driver_root, sysfs_root=sysfs_root)
    pynvml.nvmlInit()
    try:
        facts = [gpu_facts(g, ask=ask, driver_name=driver_name) for g in inventory.gpus]
    finally:
        pynvml.nvmlShutdown()
    return inventory, facts


def twin_spec(key: str, discovery: Mapping[str, Any]) -> str:
    """The ``--simulate`` spec of the twin of the GPU discovery reported (``GpuInfo`` as
    JSON): its product, MIG mode and MIG devices (by placement), and the NUMA node the GPU
    sits on (the node's, not the product's). Addressing mode and event support are left to the
    profile: they are what the comparison checks."""
    spec = f"{key}:1"
    if discovery["mig_enabled"]:
        instances = sorted(discovery["mig_instances"], key=lambda m: m["placement"]["start"])
        layout = "+".join(m["profile"]["name"] for m in instances)
        spec += f":mig={layout}" if layout else ":mig"
    elif discovery["mig_pending"]:
        spec += ":mig-pending"
    numa = discovery["numa_node"]
    return spec + f":numa={'none' if numa is None else int(numa)}"


def compare_with_twin(
    facts: Mapping[str, Any], *, twins: Twins, driver_name: str
) -> dict[str, Any]:
    """The twin's spec and every difference between one GPU's ``facts`` (as gpu_facts gives
    them, or read back from a report) and its twin's answers to the same questions. The twin
    runs on the node's driver and CUDA versions (the node's, not the product's), so every
    version the agent derives from them is compared by value."""
    product = facts["discovery"]["product_name"]
    key = twins.product_key(product)
    if key is None:
        return {"spec": None, "error": f"no simulated profile for {product!r}"}
    spec = twin_spec(key, facts["discovery"])
    discovery = facts["discovery"]
    with twins.installed(
        spec,
        driver_version=discovery.get("driver_version"),
        cuda_driver_version=discovery.get("cuda_driver_version"),
    ) as sysfs_root:
        _, twin = _facts_of_node(
            driver_root=Path("/"),
            sysfs_root=sysfs_root,
            ask=nvmlquery.Asker(),
            driver_name=driver_name,
        )
    return {
        "spec": spec,
        "differences": [d.as_json() for d in compare.differences(facts, twin[0])],
    }


def run_check(machine: Machine, *, twins: Twins, options: Options, work: Path) -> dict[str, Any]:
    """Every check, in order; returns the report (report.py writes it). ``work``: an empty
    directory for the probe's build and the container (the caller removes it)."""
    started = time.monotonic()
    report: dict[str, Any] = {
        "gpu_check": REPORT_VERSION,
        "gpu_dra": __version__,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": {"machine": platform.machine(), "kernel": platform.release(),
                 "python": platform.python_version()},
        "simulated": machine.simulated,
        "sections": {},
        "gpus": [],
    }  # fmt: skip
    roots = (
        list(machine.driver_roots)
        if machine.only_given_roots
        else driverroot.driver_roots(machine.driver_roots)
    )
    report["driver_roots"] = [str(r) for r in roots]
    ask = nvmlquery.Asker()
    inventory = Inventory(gpus=())
    with _section(report, "discovery") as entry:
        inventory, facts = _facts_of_node(
            driver_root=roots[0] if roots else Path("/"),
            sysfs_root=machine.sysfs_root,
            ask=ask,
            driver_name=options.driver_name,
        )
        entry["gpus"] = len(inventory.gpus)
        entry["failures"] = [dataclasses.asdict(f) for f in inventory.failures]
        for gpu, gpu_facts_ in zip(inventory.gpus, facts, strict=True):
            report["gpus"].append({"product_name": gpu.product_name, "facts": gpu_facts_})
        # the node's ResourceSlices as the agent would create them (static MIG mode)
        pool = build_slices(
            node_devices(inventory, driver_name=options.driver_name),
            driver_name=options.driver_name,
            node_name=NODE_NAME,
        )
        entry["resource_slices"] = to_api_objects(pool, node_uid="")
    report["nvml_calls"] = [
        {"name": name, "ms": round(seconds * 1000, 3)} for name, seconds in ask.calls
    ]
    with _section(report, "comparison") as entry:
        for record in report["gpus"]:
            record["twin"] = compare_with_twin(
                record["facts"], twins=twins, driver_name=options.driver_name
            )
        entry["differences"] = sum(len(g["twin"].get("differences", [])) for g in report["gpus"])
    first = inventory.gpus[0] if inventory.gpus else None
    minor = first.minor if first else 0
    with _section(report, "driver_files") as entry:
        entry.update(
            driverroot.driver_files_section(
                roots,
                driver_version=first.driver_version if first else None,
                minor=minor,
                proc_root=machine.proc_root,
            )
        )
    with _section(report, "cuda_load") as entry:
        _cuda_load(
            entry,
            roots=roots,
            machine=machine,
            options=options,
            gpu=first,
            work=work,
        )
        if first is None:
            entry.setdefault("note", "NVML found no GPU; the spec names gpu-0")
    if options.mps:
        with _section(report, "mps") as entry:
            _mps(entry, roots=roots, machine=machine, options=options, gpu=first, work=work)
    report["wall_s"] = round(time.monotonic() - started, 3)
    return report


def _cuda_load(
    entry: dict[str, Any],
    *,
    roots: list[Path],
    machine: Machine,
    options: Options,
    gpu: GpuInfo | None,
    work: Path,
) -> None:
    why = runtime.unavailable()
    if not roots:
        why = "no driver root holds libnvidia-ml.so.1"
    if why is not None:
        entry["skipped"] = why
        return
    probe = _probe(options, work)
    if probe is None:
        entry["skipped"] = "no C compiler for the probe and no --probe given"
        return
    files = driverroot.scan(
        roots[0],
        driver_version=gpu.driver_version if gpu else None,
        proc_root=machine.proc_root,
    )
    spec = driverroot.gpu_spec(
        files, minor=gpu.minor if gpu else 0, capabilities=driverroot.CAPABILITY_SETS[0]
    )
    container = Path(tempfile.mkdtemp(prefix="container-", dir=work))
    entry["driver_root"] = str(roots[0])
    note = None
    smi = driverroot.scripts_mounted(spec).get("/usr/bin/nvidia-smi")
    if smi is not None:
        note = (
            f"the spec mounts {smi}, a {driverroot.describe(Path(smi))}, as nvidia-smi: the "
            "minimal root has no interpreter for it (a container with one runs it)"
        )
    entry.update(runtime.load_cuda(spec, probe=probe, work=container,
                                   timeout_s=options.cuda_timeout_s,
                                   nvidia_smi_note=note))  # fmt: skip


def _probe(options: Options, work: Path) -> Path | None:
    """The probe: given, built before in ``work``, built now, or None without a compiler."""
    if options.probe is not None:
        return options.probe
    built = work / "gpu-check-probe"
    if built.exists():
        return built
    return runtime.build_probe(work) if shutil.which("cc") is not None else None


def _mps(
    entry: dict[str, Any],
    *,
    roots: list[Path],
    machine: Machine,
    options: Options,
    gpu: GpuInfo | None,
    work: Path,
) -> None:
    if gpu is None or not roots:
        entry["skipped"] = "no GPU" if gpu is None else "no driver root holds libnvidia-ml.so.1"
        return
    control = cdi.find_driver_tool(roots[0], mps.CONTROL)
    if control is None:
        entry["skipped"] = f"the driver root {roots[0]} has no {mps.CONTROL}"
        return
    probe = _probe(options, work)
    if probe is None:
        entry["skipped"] = "no C compiler for the probe and no --probe given"
        return
    files = driverroot.scan(roots[0], driver_version=gpu.driver_version,
                            proc_root=machine.proc_root)  # fmt: skip
    share = options.mps_share or mpscheck.default_share(gpu.memory_bytes)
    # the daemon's socket path must fit a Unix socket address: a short directory of its own
    with tempfile.TemporaryDirectory(prefix="gpu-check-mps-") as tmp:
        entry.update(
            mpscheck.run_mps(
                control=control,
                probe=probe,
                gpu_uuid=gpu.uuid,
                memory_bytes=gpu.memory_bytes,
                share=share,
                library_dir=driverroot.library_view(files, Path(tmp) / "lib"),
                work=Path(tmp),
                timeout_s=options.cuda_timeout_s,
            )
        )


__all__ = [
    "REPORT_VERSION",
    "Machine",
    "Options",
    "Twins",
    "compare_with_twin",
    "gpu_facts",
    "run_check",
    "twin_spec",
]
