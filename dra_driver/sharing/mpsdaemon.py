"""MPS control daemons on this node: starting, adopting and stopping them (the I/O of mps.py).

Flow position: prepare/ -> here -> nvidia-smi (compute mode, timeslice.NvidiaSmi), the
filesystem (directories, a tmpfs), the API server (one Deployment per daemon, kube.KubeClient)
and the daemon's control pipe (the driver root's ``nvidia-cuda-mps-control``).

``start`` of a daemon (mps.MpsDaemon), each step safe to repeat:

1. ``<base>/<owner>/gpus`` names the full GPUs it makes exclusive (written and fsync'd first);
2. those GPUs' compute mode is set to EXCLUSIVE_PROCESS (nvidia-smi ``-c``);
3. the pipe, log and shm directories are made and a tmpfs is mounted on shm;
4. the Deployment is created, or an existing one serving the same devices from the same
   directories is adopted (one that does not is replaced);
5. the daemon is asked ``get_server_list`` through its pipe directory until it answers (bounded
   by ``start_timeout_s``), then told the limits (mps.Limits.commands).

A failure is MpsFailed naming the step and what was said (for a daemon that never answered: the
Deployment's state and the tail of its control log); the caller stops the daemon, which undoes
whatever steps ran. ``stop`` asks the daemon to ``quit``, deletes the Deployment, unmounts the
tmpfs, removes the directories, sets the GPUs of ``gpus`` back to DEFAULT (those no other daemon
of this node lists) and removes the owner's directory last: until then a later ``stop`` (the
agent's reconcile) finds what is left. Only Deployments carrying our labels and directories
under ``base`` named like an owner are ever touched.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path, PurePosixPath
from typing import Any, Final, Protocol, TypeVar

from dra_driver import cdi
from dra_driver.errors import KubeConflict, KubeError, KubeUnavailable, MpsFailed
from dra_driver.fsutil import fsync_dir, replace_file
from dra_driver.sharing import mps
from dra_driver.sharing.timeslice import NvidiaSmi

log = logging.getLogger(__name__)
T = TypeVar("T")

START_TIMEOUT_S: Final = 30.0
CONTROL_TIMEOUT_S: Final = 10.0
_POLL_S: Final = 0.01
_MAX_POLL_S: Final = 0.1
_LOG_TAIL_CHARS: Final = 600
_MOUNTINFO: Final = Path("/proc/self/mountinfo")
_MAX_SOCKET_PATH: Final = 107  # sun_path holds 108 bytes, the last a NUL


class DeploymentApi(Protocol):
    """The API calls a daemon's Deployment needs (kube.KubeClient)."""

    def get_deployment(self, *, namespace: str, name: str) -> dict[str, Any] | None: ...

    def list_deployments(self, *, namespace: str, label_selector: str) -> list[dict[str, Any]]: ...

    def create_deployment(self, *, namespace: str, body: Mapping[str, Any]) -> dict[str, Any]: ...

    def delete_deployment(self, *, namespace: str, name: str) -> bool: ...


def _mounted(path: Path) -> bool:
    """Whether ``path`` is a mount point in this process's mount namespace."""
    target = str(path)
    try:
        text = _MOUNTINFO.read_text()
    except OSError:
        return os.path.ismount(path)
    for line in text.splitlines():
        fields = line.split(" ")
        if len(fields) > 4 and _unescape(fields[4]) == target:
            return True
    return False


def _unescape(field: str) -> str:
    """A mountinfo path field (spaces and the like octal-escaped) as the path."""
    if "\\" not in field:
        return field
    return field.encode().decode("unicode_escape")


def _run(argv: list[str], what: str, *, timeout_s: float = CONTROL_TIMEOUT_S) -> None:
    try:
        done = subprocess.run(  # argv is ours: no shell
            argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout_s, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise MpsFailed(f"{what}: {exc}") from exc
    if done.returncode != 0:
        said = (done.stderr or done.stdout).decode(errors="replace").strip()
        raise MpsFailed(f"{what}: exit status {done.returncode}: {said or '(no output)'}")


class MpsDaemons:
    """Starts, adopts and stops the MPS control daemons of this node. Thread-safe for distinct
    owners (the caller holds the claim's lock)."""

    def __init__(
        self,
        *,
        api: DeploymentApi,
        namespace: str,
        node_name: str,
        driver_name: str,
        image: str,
        base: Path,
        driver_root: Path,
        host_driver_root: Path,
        smi: NvidiaSmi | None = None,
        start_timeout_s: float = START_TIMEOUT_S,
        image_pull_secrets: tuple[str, ...] = (),
        image_pull_policy: str | None = None,
    ) -> None:
        self.api = api
        self.namespace = namespace
        self.node_name = node_name
        self.driver_name = driver_name
        self.image = image
        self.image_pull_secrets = image_pull_secrets
        self.image_pull_policy = image_pull_policy
        self.base = base
        self.driver_root = driver_root  # this process's view
        self.host_driver_root = host_driver_root  # what the daemon's pod mounts
        self.smi = smi or NvidiaSmi(driver_root)
        self.start_timeout_s = start_timeout_s

    # -- start ---------------------------------------------------------------------------------

    def start(self, daemon: mps.MpsDaemon, limits: mps.Limits) -> None:
        """Make ``daemon`` run with ``limits`` (adopting what an earlier start left); MpsFailed
        names the failed step. The caller stops the daemon after a failure."""
        control = self._control_binary()
        what = f"MPS control daemon {daemon.deployment_name}"
        socket = daemon.pipe_dir / mps.CONTROL_SOCKET
        if len(os.fsencode(socket)) > _MAX_SOCKET_PATH:
            raise MpsFailed(
                f"{what}: its control socket {socket} would be longer than a Unix socket path "
                f"may be ({_MAX_SOCKET_PATH} bytes); use a shorter --kubelet-plugins-directory-path"
            )
        try:
            daemon.root.mkdir(parents=True, exist_ok=True)
            fsync_dir(self.base)
            text = "".join(f"{uuid}\n" for uuid in daemon.exclusive_gpus)
            if not daemon.gpus_file.exists() or daemon.gpus_file.read_text() != text:
                replace_file(daemon.gpus_file, text.encode())
        except OSError as exc:
            raise MpsFailed(f"{what}: cannot create {daemon.root}: {exc}") from exc
        for uuid in daemon.exclusive_gpus:
            self._compute_mode(uuid, mps.EXCLUSIVE_PROCESS)
        try:
            for directory in (daemon.pipe_dir, daemon.log_dir, daemon.shm_dir):
                directory.mkdir(exist_ok=True)
            daemon.pipe_dir.chmod(0o755)
        except OSError as exc:
            raise MpsFailed(f"{what}: cannot create its directories: {exc}") from exc
        if not _mounted(daemon.shm_dir):
            _run(
                ["mount", "-t", "tmpfs", "-o", f"size={mps.SHM_SIZE},mode=1777,nosuid,nodev",
                 "tmpfs", str(daemon.shm_dir)],
                f"{what}: cannot mount a tmpfs on {daemon.shm_dir}",
            )  # fmt: skip
        self._ensure_deployment(daemon, control)
        self._wait_and_configure(daemon, limits, what)

    def _control_binary(self) -> Path:
        tool = cdi.find_driver_tool(self.driver_root, mps.CONTROL)
        if tool is None:
            raise MpsFailed(
                f"{mps.CONTROL} is not under the driver root {self.driver_root}: the driver "
                "install has no MPS"
            )
        return tool

    def _compute_mode(self, uuid: str, mode: str) -> None:
        self.smi.run(["-i", uuid, "-c", mode], what=f"compute mode {mode} of GPU {uuid}",
                     error=MpsFailed)  # fmt: skip

    def _ensure_deployment(self, daemon: mps.MpsDaemon, control: Path) -> None:
        rel = PurePosixPath(control.relative_to(self.driver_root))
        body = mps.deployment(
            daemon,
            namespace=self.namespace,
            node_name=self.node_name,
            driver_name=self.driver_name,
            image=self.image,
            host_driver_root=self.host_driver_root,
            control=rel,
            image_pull_secrets=self.image_pull_secrets,
            image_pull_policy=self.image_pull_policy,
        )
        name = daemon.deployment_name
        try:
            existing = _once_more(
                lambda: self.api.get_deployment(namespace=self.namespace, name=name)
            )
            if existing is not None:
                if mps.adoptable(existing, body):
                    log.info("adopted an MPS control daemon", extra={"deployment": name})
                    return
                log.warning(
                    "replacing an MPS control daemon Deployment that serves other devices",
                    extra={"deployment": name},
                )
                _once_more(lambda: self.api.delete_deployment(namespace=self.namespace, name=name))
            try:
                _once_more(lambda: self.api.create_deployment(namespace=self.namespace, body=body))
            except KubeConflict:  # a first try that got through before its answer was lost
                found = self.api.get_deployment(namespace=self.namespace, name=name)
                if found is None or not mps.adoptable(found, body):
                    raise
        except KubeError as exc:
            raise MpsFailed(
                f"MPS control daemon Deployment {self.namespace}/{name}: {exc}"
            ) from exc

    def control(
        self, daemon_pipe_dir: Path, commands: Iterable[str], *, timeout_s: float
    ) -> tuple[bool, str]:
        """Send ``commands`` (one per line) to the daemon listening in ``daemon_pipe_dir``
        through the driver's client; (whether it exited 0, what it said)."""
        env = {**os.environ, mps.PIPE_ENV: str(daemon_pipe_dir)}
        text = "".join(f"{c}\n" for c in commands)
        try:
            done = subprocess.run(  # argv is ours: no shell
                [str(self._control_binary())],
                input=text.encode(),
                env=env,
                capture_output=True,
                timeout=timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return False, f"{mps.CONTROL} did not finish within {timeout_s:g} s"
        except OSError as exc:
            return False, f"cannot run {mps.CONTROL}: {exc}"
        said = (done.stdout + done.stderr).decode(errors="replace").strip()
        return done.returncode == 0, said

    def _wait_and_configure(self, daemon: mps.MpsDaemon, limits: mps.Limits, what: str) -> None:
        """Wait for the daemon's socket and its answer to get_server_list, then set the limits
        (one client run for all: the client sends its input lines one by one)."""
        deadline = time.monotonic() + self.start_timeout_s
        socket = daemon.pipe_dir / mps.CONTROL_SOCKET
        commands = ["get_server_list", *limits.commands()]
        said = "its control socket never appeared"
        pause = _POLL_S
        while True:
            left = deadline - time.monotonic()
            if socket.exists():
                ok, answer = self.control(
                    daemon.pipe_dir, commands, timeout_s=max(0.5, min(left, CONTROL_TIMEOUT_S))
                )
                if ok:
                    return
                said = answer or "(no output)"
                if _refused(answer):  # the daemon answered: a limit was refused
                    raise MpsFailed(
                        f"{what} refused its limits ({'; '.join(commands[1:])}): {said}"
                    )
            if time.monotonic() >= deadline:
                break
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(pause * 2, _MAX_POLL_S)
        raise MpsFailed(
            f"{what} did not answer within {self.start_timeout_s:g} s ({said}); "
            f"{self._diagnosis(daemon)}"
        )

    def _diagnosis(self, daemon: mps.MpsDaemon) -> str:
        """What the Deployment and the daemon's log say, for an error message."""
        parts = []
        try:
            found = self.api.get_deployment(namespace=self.namespace, name=daemon.deployment_name)
            if found is None:
                parts.append("its Deployment does not exist")
            else:
                status = found.get("status") or {}
                parts.append(
                    f"its Deployment has {status.get('readyReplicas', 0) or 0} ready replica(s)"
                )
        except KubeError as exc:
            parts.append(f"its Deployment cannot be read: {exc}")
        logfile = daemon.log_dir / "control.log"
        try:
            tail = logfile.read_text(errors="replace")[-_LOG_TAIL_CHARS:].strip()
        except OSError:
            tail = ""
        parts.append(f"control.log: {tail!r}" if tail else "control.log is empty")
        return "; ".join(parts)

    # -- stop ----------------------------------------------------------------------------------

    def stop(self, owner: str) -> None:
        """Stop the owner's daemon and remove everything it made; safe to repeat, and to call
        for an owner whose start failed half-way. Every step is tried; MpsFailed lists those
        that failed (what is left is found again by ``owners``)."""
        root = mps.daemon_root(self.base, owner)
        name = mps.deployment_name(owner)
        failed: list[str] = []
        pipe, shm = root / "pipe", root / "shm"
        if (pipe / mps.CONTROL_SOCKET).exists():
            ok, said = self.control(pipe, ["quit"], timeout_s=CONTROL_TIMEOUT_S)
            if not ok:  # the Deployment's deletion stops it anyway
                log.warning("an MPS control daemon did not take quit", extra={"deployment": name,
                            "error": said})  # fmt: skip
        try:
            _once_more(lambda: self.api.delete_deployment(namespace=self.namespace, name=name))
        except KubeError as exc:
            failed.append(f"delete Deployment {self.namespace}/{name}: {exc}")
        if _mounted(shm):
            try:
                _run(["umount", str(shm)], f"unmount {shm}")
            except MpsFailed:
                try:
                    _run(["umount", "--lazy", str(shm)], f"unmount {shm}")
                except MpsFailed as exc:
                    failed.append(str(exc))
        if not _mounted(shm):
            for directory in (pipe, root / "log", shm):
                try:
                    shutil.rmtree(directory)
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    failed.append(f"remove {directory}: {exc}")
        gpus = mps.gpus_file(self.base, owner)
        for uuid in self._gpus_to_restore(owner):
            try:
                self._compute_mode(uuid, mps.DEFAULT_COMPUTE_MODE)
            except MpsFailed as exc:
                failed.append(str(exc))
        if failed:
            raise MpsFailed(f"stopping MPS control daemon {name}: {'; '.join(failed)}")
        try:
            gpus.unlink(missing_ok=True)
            root.rmdir()
            fsync_dir(self.base)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise MpsFailed(f"stopping MPS control daemon {name}: remove {root}: {exc}") from exc
        log.info("stopped an MPS control daemon", extra={"deployment": name})

    def _gpus_to_restore(self, owner: str) -> list[str]:
        """The GPUs the owner's ``gpus`` file lists that no other daemon's lists."""
        mine = _read_gpus(mps.gpus_file(self.base, owner))
        if not mine:
            return []
        others: set[str] = set()
        for other in self._owner_dirs() - {owner}:
            others.update(_read_gpus(mps.gpus_file(self.base, other)))
        return [uuid for uuid in mine if uuid not in others]

    # -- what exists ---------------------------------------------------------------------------

    def _owner_dirs(self) -> set[str]:
        try:
            return {p.name for p in self.base.iterdir() if p.is_dir() and mps.is_owner_name(p.name)}
        except FileNotFoundError:
            return set()

    def deployed(self) -> set[str]:
        """Owners of the Deployments of this node's daemons (KubeError when it cannot ask)."""
        items = _once_more(
            lambda: self.api.list_deployments(
                namespace=self.namespace,
                label_selector=mps.selector(self.driver_name, self.node_name),
            )
        )
        owners = (mps.deployment_owner(d, self.driver_name) for d in items)
        return {o for o in owners if o is not None}

    def owners(self) -> set[str]:
        """Every owner something of a daemon exists for: a directory under ``base`` or a
        Deployment of this node (the directories alone when the API cannot be asked)."""
        found = self._owner_dirs()
        try:
            found |= self.deployed()
        except KubeError as exc:
            log.warning("cannot list MPS control daemon Deployments", extra={"error": str(exc)})
        return found


def _once_more(call: Callable[[], T]) -> T:
    """``call()``, tried a second time when the API server could not be reached (a kept-alive
    connection the server had closed fails that way): the client itself never retries
    (kube/), and a prepare should not fail on one dropped connection."""
    try:
        return call()
    except KubeUnavailable as exc:
        log.info("retrying an API call once", extra={"error": str(exc)})
        return call()


def _read_gpus(path: Path) -> list[str]:
    try:
        return path.read_text().split()
    except FileNotFoundError:
        return []


def _refused(answer: str) -> bool:
    """Whether the client's output says the daemon answered and refused a command (rather
    than could not be reached)."""
    lowered = answer.lower()
    return "invalid" in lowered or "unrecognized" in lowered
