"""A full GPU's time slice (``GpuConfig`` ``sharing: {strategy: TimeSlicing}``): the boundary to
``nvidia-smi compute-policy`` (nvidia-compat.md "Opaque configuration").

Flow position: prepare/ decides what each GPU's time slice should be (from the checkpoint) and
calls a ``TimeSlicer`` here to set it. ``command`` builds the command line (pure);
``NvidiaSmi`` runs it, from the agent's own view of the driver root (``CONTAINER_DRIVER_ROOT``:
the chart mounts the host's driver root read-only at ``/driver-root``), with a bounded wait. A
failure is a ``TimeSliceFailed`` naming what nvidia-smi said.

nvidia-smi loads ``libnvidia-ml.so.1``, which is under the driver root, not where the agent's
loader looks. ``LD_LIBRARY_PATH`` names a private directory holding only a link to it: the
driver's library directory itself is the host's ``/usr/lib/<arch>`` when the driver is installed
on the host, and putting it on the path would mix the host's C library with the agent's loader.

Time slicing has no effect on MIG devices; deviceconfig.check_supported refuses it there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final, Protocol

from dra_driver import cdi
from dra_driver.errors import PrepareError, TimeSliceFailed

# nvidia-smi compute-policy --set-timeslice takes the interval's number.
INTERVALS: Final = {"Default": 0, "Short": 1, "Medium": 2, "Long": 3}
DEFAULT: Final = "Default"
TIMEOUT_S: Final = 10.0
NVML_SONAME: Final = "libnvidia-ml.so.1"
# What is kept of nvidia-smi's output in an error message.
_MAX_OUTPUT_CHARS = 500


def command(*, nvidia_smi: Path, gpu_uuid: str, interval: str) -> list[str]:
    """The command line that sets ``gpu_uuid``'s time slice to ``interval`` (a name of
    ``INTERVALS``; ValueError otherwise)."""
    if interval not in INTERVALS:
        raise ValueError(
            f"unknown time-slice interval {interval!r} (known: {', '.join(INTERVALS)})"
        )
    return [
        str(nvidia_smi),
        "compute-policy",
        "-i",
        gpu_uuid,
        "--set-timeslice",
        str(INTERVALS[interval]),
    ]


def recorded_interval(config: Mapping[str, Any]) -> str | None:
    """The interval a recorded effective config (checkpoint JSON, deviceconfig.to_json) asks for:
    None when it does not ask for time slicing; ``Default`` when it asks without an interval.
    Read from the JSON, so reading a checkpoint needs no pydantic model."""
    sharing = config.get("sharing")
    if sharing is None or not isinstance(sharing, Mapping):  # None: most configs, told at once
        return None
    if sharing.get("strategy") != "TimeSlicing":
        return None
    slicing = sharing.get("timeSlicingConfig")
    interval = slicing.get("interval", DEFAULT) if isinstance(slicing, Mapping) else DEFAULT
    return str(interval) if interval in INTERVALS else DEFAULT


class TimeSlicer(Protocol):
    """Sets a full GPU's time slice; raises TimeSliceFailed (the GPU's state is then unknown)."""

    def set(self, gpu_uuid: str, interval: str) -> None: ...


class NvidiaSmi:
    """The real TimeSlicer: runs the driver's ``nvidia-smi`` found under ``driver_root`` (the
    agent's view of it), looked up on each call (a driver install may come later than the
    agent)."""

    def __init__(self, driver_root: Path, *, timeout_s: float = TIMEOUT_S) -> None:
        self.driver_root = driver_root
        self.timeout_s = timeout_s
        self._libdir: Path | None = None  # made on first use, removed with this object

    def _nvml_dir(self, nvml: Path) -> Path:
        """A private directory whose only entry links ``libnvidia-ml.so.1`` to ``nvml``."""
        if self._libdir is None:
            self._libdir = Path(tempfile.mkdtemp(prefix="gpu-dra-nvml-"))
            weakref.finalize(self, shutil.rmtree, self._libdir, True)
        link = self._libdir / NVML_SONAME
        if not link.is_symlink() or Path(os.readlink(link)) != nvml:
            tmp = self._libdir / f".{NVML_SONAME}.tmp"
            tmp.unlink(missing_ok=True)
            tmp.symlink_to(nvml)
            tmp.replace(link)
        return self._libdir

    def set(self, gpu_uuid: str, interval: str) -> None:
        argv = command(nvidia_smi=Path("nvidia-smi"), gpu_uuid=gpu_uuid, interval=interval)
        self.run(argv[1:], what=f"time slice {interval} of GPU {gpu_uuid}")

    def run(
        self, args: list[str], *, what: str, error: type[PrepareError] = TimeSliceFailed
    ) -> None:
        """Run nvidia-smi with ``args`` (``what`` says what for, in an error); a failure, a
        timeout or a missing nvidia-smi is ``error`` naming what nvidia-smi said."""
        tool = cdi.find_driver_tool(self.driver_root, "nvidia-smi")
        if tool is None:
            raise error(
                f"cannot set the {what}: nvidia-smi is not under the driver root {self.driver_root}"
            )
        argv = [str(tool), *args]
        env = dict(os.environ)
        nvml = cdi.find_driver_library(self.driver_root, NVML_SONAME)
        if nvml is not None:
            libdir = str(self._nvml_dir(nvml))
            env["LD_LIBRARY_PATH"] = ":".join(p for p in (libdir, env.get("LD_LIBRARY_PATH")) if p)
        what = f"{' '.join(args)} ({what})"
        try:
            done = subprocess.run(  # argv is ours: no shell
                argv,
                env=env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=self.timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise error(f"nvidia-smi {what} did not finish within {self.timeout_s:g} s") from exc
        except OSError as exc:
            raise error(f"cannot run {tool} for {what}: {exc}") from exc
        if done.returncode != 0:
            said = (done.stderr or done.stdout).decode(errors="replace").strip()
            raise error(
                f"nvidia-smi {what} failed with exit status {done.returncode}: "
                f"{said[:_MAX_OUTPUT_CHARS] or '(no output)'}"
            )
