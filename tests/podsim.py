"""A node and a Pod as the kubelet would set them up, out of Linux mount namespaces (root only).

``python tests/podsim.py node PLAN`` is started by the test under ``unshare --mount``: that
namespace is the node. It mounts what the node has on its host paths (a tmpfs over /run and
/var/lib, the kubelet's directories, the driver's files under their host paths, the GPU device
nodes), then starts the pod: ``unshare --mount`` again, ``python tests/podsim.py pod PLAN``, which
builds the Pod's root file system in a tmpfs the way a container runtime does for the agent's
image and the DaemonSet's volumes, and chroots into it to exec the container's command with the
container's environment. The node process stays up (the test runs podman in its namespace with
``nsenter``) and passes SIGTERM on to the pod.

The plan (JSON) says everything; nothing here knows the chart:

* ``node.tmpfs``: paths that get a fresh tmpfs (the host's state stays out of the test);
* ``node.binds``: ``[source, target]``: a test directory shown at a host path;
* ``node.overlays``: ``[extra, target]``: ``extra``'s files added to a host directory
  (read-only overlay), e.g. the driver's libraries in /usr/lib/x86_64-linux-gnu;
* ``node.runtime``: optional; a command that starts the pod itself (podman with the built
  image), run in place of this file's ``pod`` and sent the same signals;
* ``pod.root``: an empty directory that becomes the Pod's root;
* ``pod.image``: host directories that make up the agent's image (bound without submounts, so the
  node's overlays are not in the image);
* ``pod.volumes``: ``{host_path, mount_path, read_only, create, propagation}`` from the
  DaemonSet's hostPath volumes and volumeMounts (``HostToContainer``: the pod's copy is a slave;
  ``Bidirectional``: the node's host path is a shared mount the pod's copy is a peer of);
  ``pod.empty_dirs``: emptyDir mount paths;
* ``pod.files``: ``{path: source}`` copied into the Pod (the ServiceAccount token files);
* ``pod.argv`` and ``pod.env``: the container's command and environment.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True)


def node(plan: dict[str, Any], plan_path: str) -> int:
    for target in plan["node"]["tmpfs"]:
        Path(target).mkdir(parents=True, exist_ok=True)
        _mount("-t", "tmpfs", "tmpfs", target)
    for extra, target in plan["node"]["overlays"]:
        _mount("-t", "overlay", "overlay", "-o", f"lowerdir={extra}:{target}", target)
        if target == "/dev":  # what the overlay hid and podman needs: its lock memory
            _mount("-t", "tmpfs", "tmpfs", "/dev/shm")
    for source, target in plan["node"]["binds"]:
        Path(target).mkdir(parents=True, exist_ok=True)
        _mount("--bind", source, target)
    # A Bidirectional volume's host path is a shared mount: the pod's bind of it joins its peer
    # group, so what the pod mounts below it appears on the node (every other mount is private,
    # so the pod's namespace keeps the node's propagation unchanged).
    for volume in plan["pod"]["volumes"]:
        if volume["propagation"] == "Bidirectional":
            Path(volume["host_path"]).mkdir(parents=True, exist_ok=True)
            _mount("--bind", volume["host_path"], volume["host_path"])
            _mount("--make-shared", volume["host_path"])
    Path(plan["node"]["ready"]).write_text(str(os.getpid()))
    # A container runtime in the node instead (tests/test_deployed_image.py: podman runs the
    # built image), or this file's own stand-in of one.
    runtime = plan["node"].get("runtime") or [
        "unshare", "--mount", "--propagation", "unchanged", sys.executable, __file__, "pod",
        plan_path,
    ]  # fmt: skip
    pod = subprocess.Popen(runtime)

    def forward(signum: int, frame: object) -> None:
        pod.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    return pod.wait()


def pod(plan: dict[str, Any]) -> None:
    spec = plan["pod"]
    root = Path(spec["root"])
    _mount("-t", "tmpfs", "tmpfs", str(root))
    # emptyDirs first: an image directory may lie below one (a checkout under /tmp, say)
    for path in spec["empty_dirs"]:
        target = root / path.lstrip("/")
        target.mkdir(parents=True, exist_ok=True)
        _mount("-t", "tmpfs", "tmpfs", str(target))
    for directory in spec["image"]:
        target = root / directory.lstrip("/")
        if os.path.islink(directory):  # merged /usr: /bin -> usr/bin
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(os.readlink(directory))
            continue
        target.mkdir(parents=True, exist_ok=True)
        _mount("--bind", directory, str(target))  # no submounts: the node's overlays stay out
        _mount("-o", "remount,bind,ro", str(target))
    for name in ("proc", "sys", "run", "var"):
        (root / name).mkdir(exist_ok=True)
    _mount("-t", "proc", "proc", str(root / "proc"))
    _mount("--rbind", "/sys", str(root / "sys"))
    _mount("-t", "tmpfs", "tmpfs", str(root / "run"))
    (root / "var/run").symlink_to("../run")
    for volume in spec["volumes"]:
        host = Path(volume["host_path"])
        if volume["create"]:
            host.mkdir(parents=True, exist_ok=True)
        elif not host.is_dir():
            raise SystemExit(f"hostPath {host} does not exist (type Directory)")
        target = root / volume["mount_path"].lstrip("/")
        target.mkdir(parents=True, exist_ok=True)
        _mount("--rbind", str(host), str(target))  # the kubelet binds hostPaths recursively
        if volume["read_only"]:
            _mount("-o", "remount,bind,ro", str(target))
        if volume["propagation"] == "HostToContainer":
            _mount("--make-rslave", str(target))
    for path, source in spec["files"].items():
        target = root / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
    os.chroot(root)
    os.chdir("/")
    os.execvpe(spec["argv"][0], spec["argv"], spec["env"])


def main() -> int:
    role, plan_path = sys.argv[1], sys.argv[2]
    plan = json.loads(Path(plan_path).read_text())
    if role == "node":
        return node(plan, plan_path)
    pod(plan)
    return 1  # not reached: pod() execs


if __name__ == "__main__":
    raise SystemExit(main())
