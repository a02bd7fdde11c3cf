"""The agent's image as the tests and the bench use it: built by ``make image``'s script with
podman, once per set of inputs (tagged by their digest, so a session whose inputs did not change
reuses the image the last one built), and copied into a private podman store a node namespace
can run it from.

The tag is ``localhost/gpu-dra:test-<digest>``, the digest over every file the build reads
(Dockerfile, the build scripts, pyproject.toml, constraints.txt, README.md, dra_driver/). Older
test images are removed but for the newest few.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.podman import missing

REPO = Path(__file__).resolve().parent.parent
INPUTS = ("Dockerfile", ".dockerignore", "pyproject.toml", "constraints.txt", "README.md",
          "hack/build-image.sh", "hack/build-local-base.sh")  # fmt: skip
REPOSITORY = "localhost/gpu-dra"
LOCAL_BASE = "localhost/gpu-dra-base:bookworm"
KEEP = 3  # test images kept (other worktrees may be testing theirs)
# the hook `make hook` builds for this machine: the image compiles its own (.dockerignore)
IGNORED = {"dra_driver/cdi/hook/gpu-dra-cdi-hook"}


def inputs_digest() -> str:
    """sha256 of the build's inputs: paths and bytes, in a fixed order."""
    digest = hashlib.sha256()
    files = [REPO / name for name in INPUTS]
    files += sorted(
        p
        for p in (REPO / "dra_driver").rglob("*")
        if p.is_file()
        and "__pycache__" not in p.parts
        and str(p.relative_to(REPO)) not in IGNORED
        and not p.name.endswith((".pyc", ".so"))
    )
    for path in files:
        digest.update(str(path.relative_to(REPO)).encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def test_tag() -> str:
    return f"{REPOSITORY}:test-{inputs_digest()[:16]}"


def _podman(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["podman", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def present(tag: str) -> bool:
    return _podman("image", "exists", tag).returncode == 0


def why_not_buildable() -> str:
    """Why the image cannot be built and run here ("" when it can): root and podman, and a
    base: the official one present or pullable, else mmdebstrap for the local Debian one."""
    reason = missing()
    if reason:
        return reason
    if present(test_tag()) or present(LOCAL_BASE) or shutil.which("mmdebstrap"):
        return ""
    default = ""
    for line in (REPO / "Dockerfile").read_text().splitlines():
        if line.startswith("ARG BASE_IMAGE="):
            default = line.partition("=")[2]
    if present(default) or _podman("pull", "-q", default, timeout=300).returncode == 0:
        return ""
    return (
        f"the base {default.split('@')[0]} cannot be pulled (no registry) and mmdebstrap, "
        "which builds the local base (hack/build-local-base.sh), is not installed"
    )


def build(conf: Path) -> str:
    """The image of this checkout (built unless an image of the same inputs exists), podman
    reading ``conf`` (tests/podman.py): its tag."""
    tag = test_tag()
    if present(tag):
        return tag
    run = subprocess.run(
        ["bash", str(REPO / "hack/build-image.sh")],
        env={**os.environ, "ENGINE": "podman", "IMAGE": tag, "CONTAINERS_CONF": str(conf)},
        capture_output=True, text=True, timeout=1500, check=False,
    )  # fmt: skip
    if run.returncode != 0:
        raise AssertionError(f"make image failed:\n{run.stdout[-4000:]}\n{run.stderr[-4000:]}")
    _prune(keep=tag)
    return tag


def _prune(*, keep: str) -> None:
    listed = _podman("images", "--format", "json", REPOSITORY).stdout
    tagged = [
        (image.get("Created", 0), name)
        for image in json.loads(listed or "[]")
        for name in image.get("Names") or []
        if name.startswith(f"{REPOSITORY}:test-") and name != keep
    ]
    for _, name in sorted(tagged, reverse=True)[KEEP - 1 :]:
        _podman("rmi", name)


@dataclass(frozen=True)
class Facts:
    size_bytes: int
    layers: int
    user: str


def facts(tag: str) -> Facts:
    (inspected,) = json.loads(_podman("image", "inspect", tag).stdout)
    return Facts(
        size_bytes=int(inspected["Size"]),
        layers=len(inspected["RootFS"]["Layers"]),
        user=str(inspected["Config"].get("User", "")),
    )


def store_options(directory: Path) -> list[str]:
    """podman's global options for a private store in ``directory``, seen the same from this
    machine and from a node namespace (whose /var/lib and /run are its own tmpfs)."""
    return ["--root", str(directory / "storage"), "--runroot", str(directory / "run"),
            "--tmpdir", str(directory / "tmp")]  # fmt: skip


def load_into(directory: Path, tag: str) -> list[str]:
    """``tag`` copied into a private store in ``directory``; that store's podman options."""
    options = store_options(directory)
    archive = directory / "image.tar"
    for args in (
        ("save", "-q", "-o", str(archive), tag),
        (*options, "load", "-q", "-i", str(archive)),
    ):
        run = _podman(*args, timeout=300)
        assert run.returncode == 0, run.stderr
    archive.unlink()
    return options


def remove_store(directory: Path) -> None:
    """Everything of the private store in ``directory``, its mounts first."""
    _podman(*store_options(directory), "rm", "-a", "-f")
    _podman(*store_options(directory), "rmi", "-a", "-f")  # unmounts its layers
    shutil.rmtree(directory, ignore_errors=True)


def standins_on_path_python(bindir: Path) -> None:
    """The fake driver's Python stand-ins (nvidia-smi, ...) started by ``python3`` from PATH:
    their shebang names this machine's interpreter, which the image has not."""
    for tool in bindir.iterdir():
        text = tool.read_bytes()
        if text.startswith(b"#!/") and b"python" in text.split(b"\n", 1)[0]:
            tool.write_bytes(b"#!/usr/bin/env python3\n" + text.split(b"\n", 1)[1])


PROPAGATION = {"None": "rprivate", "HostToContainer": "rslave", "Bidirectional": "rshared"}


@dataclass(frozen=True)
class PodImage:
    """The built image in a private store, run by podman in a node namespace as the kubelet
    runs the DaemonSet's container: its command, env, security context, hostPath volumes at
    their mountPaths (recursive binds, with their propagation), emptyDirs, the token files."""

    tag: str
    options: list[str]  # podman's global options for the private store
    conf: Path  # containers.conf (tests/podman.py)

    def podman(self) -> list[str]:
        return ["env", f"CONTAINERS_CONF={self.conf}", "podman", *self.options]

    def runtime(self, pod: dict[str, Any], container: dict[str, Any], *, work: Path) -> list[str]:
        """The command the node runs to start the pod (tests/podsim.py's ``node.runtime``)."""
        context = container.get("securityContext") or {}
        argv = ["run", "--rm", "--pull=never", "--name", f"gpu-dra-{work.name}",
                "--network=host"]  # fmt: skip  # the pod network: this machine's
        if context.get("privileged"):
            argv.append("--privileged")
        if "runAsUser" in context:
            argv += ["--user", f"{context['runAsUser']}:{context.get('runAsGroup', 0)}"]
        if context.get("readOnlyRootFilesystem"):
            argv += ["--read-only", "--read-only-tmpfs=false"]  # no tmpfs the kubelet adds not
        for name, value in pod["env"].items():
            argv += ["--env", f"{name}={value}"]
        create = []
        for volume in pod["volumes"]:
            if volume["create"]:  # DirectoryOrCreate: the kubelet makes it, podman would not
                create.append(volume["host_path"])
            options = [PROPAGATION[volume["propagation"]]]
            if volume["read_only"]:
                options.append("ro")
            argv += [
                "--volume",
                f"{volume['host_path']}:{volume['mount_path']}:{','.join(options)}",
            ]
        for path in pod["empty_dirs"]:
            argv += ["--tmpfs", path]
        for path, source in pod["files"].items():
            argv += ["--volume", f"{source}:{path}:ro"]
        command, args = container["command"], container.get("args", [])
        argv += ["--entrypoint", json.dumps(command), self.tag, *args]
        make = f"mkdir -p {' '.join(map(shlex.quote, create))} && " if create else ""
        return ["sh", "-c", make + 'exec "$@"', "sh", *self.podman(), *argv]
