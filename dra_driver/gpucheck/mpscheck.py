"""``gpu-check --mps``: does MPS on this machine enforce the limits the agent gives a share?

Place in the flow: after the CUDA load (runtime.py), the part of sharing/ that a share's
containers rely on, run for real: the limits an ``mpsConfig`` or a consumable share asks for
(``sharing.mps.Limits.commands``, ``sharing.shares.share_env``) given to NVIDIA's MPS. The check

1. starts the driver's ``nvidia-cuda-mps-control`` in the foreground as its own child, serving
   the first GPU (``CUDA_VISIBLE_DEVICES``), on pipe and log directories of its own (no compute
   mode change, no GPU setting; another daemon on the node is not touched);
2. waits until it answers, and sends it the commands the agent's MPS step sends for the share
   (the default active thread percentage and the GPU's pinned memory limit), reading both back;
3. runs the probe (probe.c, ``mps``) as that daemon's client with the environment a share's CDI
   device gives (``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=<uuid>=<MiB>M``,
   ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``): it reports the multiprocessors it sees, its memory,
   how much it could allocate in steps, and how long a small kernel took;
4. quits the daemon whatever happened (``quit``; terminated, then killed, if it does not go).

Before the daemon starts, the probe runs once with the same environment but no daemon behind
its pipe directory, which is CUDA without MPS: the reference for the kernel's time, and the
proof that the environment alone limits nothing. The report sets what was allowed against what
was reached: ``enforced.memory`` when the client allocated something but no more than its limit,
``enforced.threads`` when its kernel took at least half as much longer than without MPS as the
thread limit predicts (None: not measured).
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dra_driver.quantity import parse_quantity
from dra_driver.sharing import mps, shares

STEP_MIB = 256
"""The probe's allocation step: 80 steps for a 20 GiB share."""
KERNEL_ITERATIONS = 1 << 20
"""Dependent FMAs per thread of the probe's kernel: a few milliseconds on a Hopper GPU."""
READY_TIMEOUT_S = 20.0
COMMAND_TIMEOUT_S = 10.0
QUIT_TIMEOUT_S = 10.0
_ANSWER_LINE = "value "
MIB = 1 << 20


@dataclass(frozen=True)
class Share:
    """The share the check gives the probe: its memory in MiB and thread percentage."""

    memory_mib: int
    thread_percentage: int

    def __post_init__(self) -> None:
        if self.memory_mib < 1:
            raise ValueError(f"an MPS share's memory must be at least 1 MiB, not {self.memory_mib}")
        if not 1 <= self.thread_percentage <= 100:
            raise ValueError(
                f"an MPS share's thread percentage must be 1..100, not {self.thread_percentage}"
            )


def default_share(memory_bytes: int) -> Share:
    """A quarter of the GPU's memory in whole GiB (at least 1 GiB) and 25 % of its threads."""
    return Share(memory_mib=max(1, memory_bytes // 4 >> 30) << 10, thread_percentage=25)


def parse_share(text: str) -> Share:
    """``MEMORY[,PERCENT]`` as ``--mps`` takes it: ``20Gi,25`` or ``20480Mi``; ValueError
    naming the problem."""
    memory, _, percent = text.partition(",")
    mib = int(parse_quantity(memory.strip()).value) // MIB
    return Share(memory_mib=mib, thread_percentage=int(percent) if percent.strip() else 25)


def limits(share: Share, *, gpu_uuid: str, memory_bytes: int) -> mps.Limits:
    """The daemon's limits for the share, as the agent's MPS step computes them."""
    config = {
        "defaultActiveThreadPercentage": share.thread_percentage,
        "defaultPinnedDeviceMemoryLimit": f"{share.memory_mib}Mi",
    }
    device = mps.MpsDevice(uuid=gpu_uuid, memory_bytes=memory_bytes, exclusive_gpu=None)
    return mps.limits(config, [device])


def client_env(share: Share, *, gpu_uuid: str) -> tuple[str, ...]:
    """The limits in the environment a share's CDI device gives its containers."""
    consumed = {
        shares.MEMORY: f"{share.memory_mib}Mi",
        shares.COMPUTE: str(share.thread_percentage),
    }
    return shares.share_env(device_uuid=gpu_uuid, consumed=consumed)


def parse_probe(lines: Sequence[str]) -> dict[str, Any]:
    """The probe's ``value`` lines as numbers, its ``call`` lines as return codes."""
    values: dict[str, Any] = {}
    calls: dict[str, int] = {}
    for line in lines:
        words = line.split()
        if line.startswith(_ANSWER_LINE) and len(words) == 3:
            values[words[1]] = float(words[2]) if "." in words[2] else int(words[2])
        elif words[:1] == ["call"] and len(words) >= 3 and words[2].lstrip("-").isdigit():
            calls[words[1]] = int(words[2])
    return {"values": values, "calls": calls, "output": list(lines)}


class ControlDaemon:
    """One ``nvidia-cuda-mps-control -f`` of the check's own, a child process."""

    def __init__(
        self, control: Path, *, gpu_uuid: str, work: Path, library_dir: Path | None = None
    ) -> None:
        self.control = control
        self.pipe_dir, self.log_dir = work / "pipe", work / "log"
        self.pipe_dir.mkdir(parents=True)
        self.log_dir.mkdir()
        # the control daemon starts nvidia-cuda-mps-server, which lies beside it, and the
        # server loads the driver's libcuda: both from the driver root the check found
        path = os.environ.get("PATH", "")
        self.env = {
            **os.environ,
            "PATH": f"{control.parent}:{path}" if path else str(control.parent),
            "CUDA_VISIBLE_DEVICES": gpu_uuid,
            mps.PIPE_ENV: str(self.pipe_dir),
            mps.LOG_ENV: str(self.log_dir),
        }
        if library_dir is not None:
            self.env["LD_LIBRARY_PATH"] = str(library_dir)
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(  # argv is ours: no shell
            [str(self.control), "-f"],
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def send(self, command: str, *, timeout_s: float = COMMAND_TIMEOUT_S) -> dict[str, Any]:
        """One command through the control client: its exit status and reply."""
        try:
            done = subprocess.run(  # argv is ours: no shell
                [str(self.control)],
                input=command + "\n",
                env=self.env,
                capture_output=True,
                text=True,
                timeout=timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return {"command": command, "rc": None, "reply": f"no answer in {timeout_s:g} s"}
        reply = (done.stdout + done.stderr).strip()
        return {"command": command, "rc": done.returncode, "reply": reply}

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> dict[str, Any]:
        """Ask ``get_server_list`` until the daemon answers, it exits, or time is up."""
        start = time.monotonic()
        answer: dict[str, Any] = {}
        while time.monotonic() - start < timeout_s:
            if self.process is not None and self.process.poll() is not None:
                return {"ready": False, "why": f"exited with {self.process.returncode}"}
            answer = self.send("get_server_list", timeout_s=min(COMMAND_TIMEOUT_S, timeout_s))
            if answer["rc"] == 0:
                return {"ready": True, "seconds": round(time.monotonic() - start, 3)}
            time.sleep(0.1)
        return {"ready": False, "why": f"no answer in {timeout_s:g} s: {answer.get('reply')}"}

    def quit(self) -> str:
        """Stop it: ``quit``, then SIGTERM, then SIGKILL. Says which did it."""
        if self.process is None:
            return "not started"
        if self.process.poll() is not None:
            return f"had exited ({self.process.returncode})"
        told = self.send("quit", timeout_s=QUIT_TIMEOUT_S)["rc"] == 0
        for how, stop in (("quit", None), ("terminated", self.process.terminate),
                          ("killed", self.process.kill)):  # fmt: skip
            if stop is None and not told:
                continue  # the daemon did not take the command: no use waiting for it
            if stop is not None:
                stop()
            try:
                self.process.wait(timeout=QUIT_TIMEOUT_S)
                return how
            except subprocess.TimeoutExpired:
                continue
        return "still running"

    def log_tail(self, lines: int = 20) -> list[str]:
        path = self.log_dir / "control.log"
        try:
            return path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return []


def _probe(
    probe: Path,
    *,
    env: Mapping[str, str],
    library_dir: Path | None,
    timeout_s: float,
) -> dict[str, Any]:
    environment = dict(env)
    if library_dir is not None:
        environment["LD_LIBRARY_PATH"] = str(library_dir)
    try:
        done = subprocess.run(  # argv is ours: no shell
            [str(probe), "mps", str(STEP_MIB), str(KERNEL_ITERATIONS)],
            env=environment,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"rc": None, "error": f"no end in {timeout_s:g} s", "values": {}, "calls": {}}
    except OSError as exc:
        return {"rc": None, "error": f"cannot run the probe: {exc}", "values": {}, "calls": {}}
    parsed = parse_probe(done.stdout.splitlines())
    return {"rc": done.returncode, **parsed, "stderr": done.stderr.splitlines()[-10:]}


def verdict(
    share: Share, client: Mapping[str, Any], without_mps: Mapping[str, Any]
) -> dict[str, Any]:
    """Allowed against reached, and whether each limit held (None: not measured)."""
    allowed_bytes = share.memory_mib << 20
    reached = client.get("values", {})
    alone = without_mps.get("values", {})
    allocated = reached.get("allocated")
    memory = None if allocated is None else 0 < allocated <= allowed_bytes
    client_ms, alone_ms = reached.get("kernel_ms"), alone.get("kernel_ms")
    threads = None
    if client_ms is not None and alone_ms:
        # a quarter of the threads: the kernel's waves take about four times as long
        threads = client_ms / alone_ms >= 0.5 * 100 / share.thread_percentage
    alone_allocated = alone.get("allocated")
    return {
        "allowed": {"memory_bytes": allowed_bytes, "thread_percentage": share.thread_percentage},
        "reached": {
            "allocated_bytes": allocated,
            "memory_total_seen_bytes": reached.get("memory_total"),
            "memory_free_seen_bytes": reached.get("memory_free"),
            "multiprocessors": reached.get("multiprocessors"),
            "context_sms": reached.get("context_sms"),
            "kernel_ms": client_ms,
            "without_mps": {
                "allocated_bytes": alone_allocated,
                "context_sms": alone.get("context_sms"),
                "kernel_ms": alone_ms,
            },
        },
        "enforced": {"memory": memory, "threads": threads},
        # the same environment without a daemon: CUDA ignores the limits (as a real H200 did)
        "environment_alone_limits": (
            None if alone_allocated is None else alone_allocated <= allowed_bytes
        ),
    }


def run_mps(
    *,
    control: Path,
    probe: Path,
    gpu_uuid: str,
    memory_bytes: int,
    share: Share,
    library_dir: Path | None,
    work: Path,
    timeout_s: float = 120,
    ready_timeout_s: float = READY_TIMEOUT_S,
) -> dict[str, Any]:
    """The whole ``mps`` section (module docstring) in ``work``, an empty directory the caller
    removes. ``ok``: the daemon answered and took every command, the limited client ran and
    its memory limit held, and the daemon is gone. Never leaves the daemon running."""
    daemon = ControlDaemon(control, gpu_uuid=gpu_uuid, work=work, library_dir=library_dir)
    wanted = limits(share, gpu_uuid=gpu_uuid, memory_bytes=memory_bytes)
    entry: dict[str, Any] = {
        "control": str(control),
        "gpu": gpu_uuid,
        "pipe_dir": str(daemon.pipe_dir),
        "client_env": list(client_env(share, gpu_uuid=gpu_uuid)),
    }
    client: dict[str, Any] = {}
    env = {**daemon.env, **dict(e.split("=", 1) for e in entry["client_env"])}
    no_daemon = work / "no-daemon"  # a pipe directory nothing listens in: CUDA without MPS
    no_daemon.mkdir()
    without_mps = _probe(
        probe,
        env={**env, mps.PIPE_ENV: str(no_daemon)},
        library_dir=library_dir,
        timeout_s=timeout_s,
    )
    try:
        daemon.start()
        entry["daemon"] = daemon.wait_ready(ready_timeout_s)
        if entry["daemon"]["ready"]:
            entry["commands"] = [daemon.send(c) for c in wanted.commands()]
            entry["read_back"] = [
                daemon.send("get_default_active_thread_percentage"),
                daemon.send(f"get_default_device_pinned_mem_limit {gpu_uuid}"),
            ]
            client = _probe(probe, env=env, library_dir=library_dir, timeout_s=timeout_s)
    finally:
        entry["quit"] = daemon.quit()
        entry["daemon_log"] = daemon.log_tail()
    entry["probe"] = {"client": client, "without_mps": without_mps}
    entry.update(verdict(share, client, without_mps))
    commands = entry.get("commands", [])
    entry["ok"] = bool(
        entry.get("daemon", {}).get("ready")
        and all(
            c["rc"] == 0 and not c["reply"].startswith(("Invalid", "Unrecognized"))
            for c in commands
        )
        and entry["enforced"]["memory"]
        and entry["quit"] == "quit"
    )
    return entry


__all__ = [
    "KERNEL_ITERATIONS",
    "STEP_MIB",
    "ControlDaemon",
    "Share",
    "client_env",
    "default_share",
    "limits",
    "parse_probe",
    "parse_share",
    "run_mps",
    "verdict",
]
