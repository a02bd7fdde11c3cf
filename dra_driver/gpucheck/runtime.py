"""A container runtime of the check's own, just enough to load CUDA through a CDI spec.

Place in the flow: after the driver-files part (driverroot.py) has made the spec the agent
would write for a GPU; this is what containerd or CRI-O would then do with it, on this machine.
:func:`container_script` turns the spec into a shell script (pure); :func:`load_cuda` runs it
with ``unshare --mount`` in a private mount namespace (root only), where it

1. mounts a tmpfs over an empty directory: the container's root, holding only a copy of this
   machine's dynamic loader and C library (the glibc family, :data:`GLIBC`), the probe
   (probe.c) and an ``/etc/ld.so.conf``, as a minimal image would: no driver file at all;
2. applies the spec as a runtime does: ``/proc``, ``/sys`` (read-only) and ``/dev/null``, then
   each of the spec's mounts (bind, then read-only), each device node (bound from its host
   path), its environment, and its ``createContainer`` hooks, run with the OCI state on standard
   input and a bundle whose ``config.json`` names the root;
3. runs the probe chrooted into that root (it dlopens libcuda.so.1 and libnvidia-ml.so.1 and
   calls cuInit, cuDeviceGetCount, cuDeviceGetName, nvmlInit_v2, nvmlDeviceGetCount_v2), and
   ``nvidia-smi -L`` from the spec's mounts.

A library the driver needs that the spec did not mount shows up as the probe's ``load ... fail``
line. Nothing outside the namespace changes: every mount goes when the namespace ends, and the
GPU is only read from. The probe comes from ``--probe`` or is built here with ``cc``.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

PROBE_SOURCE = Path(__file__).resolve().parent / "probe.c"
PROBE_IN_ROOT = "/bin/gpu-check-probe"
GLIBC = (
    "libc.so.6",
    "libm.so.6",
    "libdl.so.2",
    "libpthread.so.0",
    "librt.so.1",
    "libgcc_s.so.1",
)
"""What a minimal image has besides the loader: the C library and the libraries NVIDIA's
driver libraries are linked against (libcuda.so needs libm, libdl, libpthread and librt)."""
LOADERS = ("lib64/ld-linux-x86-64.so.2", "lib/ld-linux-aarch64.so.1")
LIB_DIRS = (
    "lib/x86_64-linux-gnu",
    "usr/lib/x86_64-linux-gnu",
    "lib/aarch64-linux-gnu",
    "usr/lib/aarch64-linux-gnu",
    "lib64",
    "usr/lib64",
)
_MARK = "@@gpu-check"
# mount and chroot live in sbin on some systems, which a non-root PATH may lack
_PATH = ":".join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin", "/usr/bin", "/bin"])


def _which(tool: str) -> str | None:
    return shutil.which(tool, path=_PATH)


def system_libraries(host: Path = Path("/")) -> list[tuple[str, str]]:
    """(host file, path in the container) for the loader and the :data:`GLIBC` libraries this
    machine has, each at the path the machine's own loader looks for it."""
    pairs = [(str(host / p), "/" + p) for p in LOADERS if (host / p).exists()]
    for name in GLIBC:
        for directory in LIB_DIRS:
            if (host / directory / name).exists():
                pairs.append((str(host / directory / name), f"/{directory}/{name}"))
                break
    return pairs


def build_probe(out: Path) -> Path:
    """Compile probe.c with the machine's ``cc`` into ``out``; OSError/CalledProcessError
    when there is no compiler or it fails."""
    target = out / "gpu-check-probe"
    subprocess.run(
        ["cc", "-O1", "-o", str(target), str(PROBE_SOURCE)],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return target


def _q(text: str) -> str:
    return shlex.quote(text)


def container_script(
    spec: Mapping[str, Any],
    *,
    root: Path,
    bundle: Path,
    probe: Path,
    system: Sequence[tuple[str, str]],
    nvidia_smi_note: str | None = None,
) -> str:
    """The shell script that builds the container at ``root`` from ``spec`` and runs the probe
    and ``nvidia-smi -L`` in it, printing ``@@gpu-check <step>`` before each step's output and
    ``@@gpu-check rc <n>`` after it. With ``nvidia_smi_note`` (why it cannot run there, e.g. a
    script the minimal root has no interpreter for) that step prints the note instead and
    counts as run. Pure: the spec's paths are quoted, nothing is run."""
    edits = [spec.get("containerEdits", {})]
    edits += [d.get("containerEdits", {}) for d in spec.get("devices", [])]
    r = _q(str(root))
    lines = [
        "set -u",
        f"step() {{ echo '{_MARK}' \"$1\"; }}",
        f"done_() {{ echo '{_MARK} rc' \"$1\"; }}",
        "step setup",
        f"mount -t tmpfs -o mode=0755 gpu-check-root {r} || exit 90",
        f"mkdir -p {r}/bin {r}/etc/ld.so.conf.d {r}/dev {r}/proc {r}/sys {r}/tmp {r}/usr/bin",
        f"printf 'include /etc/ld.so.conf.d/*.conf\\n' > {r}/etc/ld.so.conf",
    ]
    for host, inside in system:
        target = _q(str(root) + inside)
        lines += [f'mkdir -p "$(dirname {target})"', f"cp -L {_q(host)} {target}"]
    lines += [
        f"cp {_q(str(probe))} {r}{PROBE_IN_ROOT}",
        f"mount -t proc proc {r}/proc",
        f"mount -t sysfs -o ro,nosuid,nodev,noexec sysfs {r}/sys",
        f": > {r}/dev/null && mount --bind /dev/null {r}/dev/null",
        "done_ 0",
        "step mounts",
        "failed=0",
    ]
    env: list[str] = []
    hooks: list[Mapping[str, Any]] = []
    for edit in edits:
        env += list(edit.get("env", []))
        hooks += list(edit.get("hooks", []))
        for node in edit.get("deviceNodes", []):
            host, target = _q(node.get("hostPath", node["path"])), _q(str(root) + node["path"])
            lines.append(
                f'mkdir -p "$(dirname {target})" && : > {target} && '
                f"mount --bind {host} {target} || {{ echo 'device node' {host}; failed=1; }}"
            )
        for mount in edit.get("mounts", []):
            host, target = _q(mount["hostPath"]), _q(str(root) + mount["containerPath"])
            make = (
                f"mkdir -p {target}"
                if Path(mount["hostPath"]).is_dir()
                else (f'mkdir -p "$(dirname {target})" && : > {target}')
            )
            lines.append(
                f"{make} && mount --bind {host} {target} && "
                f"mount -o remount,bind,ro,nosuid,nodev {target} "
                f"|| {{ echo 'mount' {host}; failed=1; }}"
            )
    lines += ["done_ $failed", "step hooks", "failed=0"]
    state = json.dumps(
        {"ociVersion": "1.0.2", "id": "gpu-check", "status": "creating", "bundle": str(bundle)}
    )
    for hook in hooks:
        args = [_q(a) for a in hook.get("args", [])[1:]]
        lines.append(
            f"printf '%s' {_q(state)} | {_q(hook['path'])} {' '.join(args)} "
            f"|| {{ echo 'hook' {_q(hook['path'])} {_q(' '.join(hook.get('args', [])[1:2]))}; "
            "failed=1; }"
        )
    chroot = _which("chroot") or "chroot"
    run = f"env -i PATH=/usr/bin:/bin {' '.join(_q(e) for e in env)} {_q(chroot)} {r}"
    lines += [
        "done_ $failed",
        "step probe",
        f"{run} {PROBE_IN_ROOT} 2>&1; done_ $?",
        "step nvidia-smi",
        f"echo {_q('not run: ' + nvidia_smi_note)}; done_ 0"
        if nvidia_smi_note
        else f"{run} /usr/bin/nvidia-smi -L 2>&1; done_ $?",
    ]
    return "\n".join(lines) + "\n"


def parse_output(text: str) -> dict[str, Any]:
    """The script's output by step: ``{step: {"rc": n, "output": [lines]}}``."""
    steps: dict[str, Any] = {}
    current: dict[str, Any] | None = None
    for line in text.splitlines():
        if line.startswith(_MARK + " rc "):
            if current is not None:
                current["rc"] = int(line.split()[-1])
            current = None
        elif line.startswith(_MARK + " "):
            current = {"rc": None, "output": []}
            steps[line.split(" ", 1)[1]] = current
        elif current is not None:
            current["output"].append(line)
    return steps


def unavailable() -> str | None:
    """Why the load cannot run here (not root, no unshare), or None."""
    if os.geteuid() != 0:
        return "needs root: a private mount namespace and bind mounts (run the check as root)"
    for tool in ("unshare", "mount", "chroot"):
        if _which(tool) is None:
            return f"needs {tool} (util-linux / coreutils)"
    return None


def load_cuda(
    spec: Mapping[str, Any],
    *,
    probe: Path,
    work: Path,
    timeout_s: float = 60,
    nvidia_smi_note: str | None = None,
) -> dict[str, Any]:
    """Run the container of ``spec`` (see the module docstring) in ``work``, an empty directory
    (the caller removes it); returns the steps' output, the script's text, and ``ok``: every
    step exited 0. ``nvidia_smi_note``: see :func:`container_script`."""
    root, bundle = work / "root", work / "bundle"
    root.mkdir()
    bundle.mkdir()
    (bundle / "config.json").write_text(
        json.dumps({"ociVersion": "1.0.2", "root": {"path": str(root)}})
    )
    script = container_script(
        spec,
        root=root,
        bundle=bundle,
        probe=probe,
        system=system_libraries(),
        nvidia_smi_note=nvidia_smi_note,
    )
    (work / "container.sh").write_text(script)
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", str(work / "container.sh")],
        env={**os.environ, "PATH": _PATH},
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    steps = parse_output(done.stdout)
    return {
        "ok": done.returncode == 0
        and bool(steps)
        and all(step.get("rc") == 0 for step in steps.values()),
        "steps": steps,
        "stderr": done.stderr.splitlines()[-20:],
        "script": script,
    }


__all__ = [
    "GLIBC",
    "PROBE_SOURCE",
    "build_probe",
    "container_script",
    "load_cuda",
    "parse_output",
    "system_libraries",
    "unavailable",
]
