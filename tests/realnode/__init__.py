"""A real node: the real kubelet (not the hollow one) with containerd 2.x and runc, on the test
cluster's control plane (tests/cluster/controlplane.py).

``make containerd`` (hack/containerd.sh) builds containerd, its runc shim, ``ctr`` and the CNI
plugins from their Go modules into ``${GPU_DRA_CONTAINERD_CACHE:-~/.cache/gpu-dra/containerd}/
<version>/bin``; runc is Debian's; the kubelet is ``make kube``'s.

:class:`RealNode` is one mount namespace (the "node") held open by a ``sleep`` process, where
``<work>/k`` is ``/var/lib/kubelet`` (as in the hollow node and the agent Pod's node, so the
kubelet and the agent meet at the registration socket), ``<work>/cdi`` is ``/var/run/cdi`` (the
agent's ``CDI_ROOT``; containerd's ``cdi_spec_dirs``), ``<work>/pods`` is ``/var/log/pods`` and
``/run`` and ``/var/lib`` are the node's own. containerd and the kubelet are started in it with
``nsenter``. The agent runs as the chart's DaemonSet Pod (tests/cluster/gpunode.py ``AgentPod``)
with the GPU operator's layout (driver root ``/run/nvidia/driver``); its fake driver root is
bound at ``/run/nvidia/driver`` in the node too (:meth:`RealNode.attach_driver_root`), so the
host paths its CDI specs name are there when containerd resolves them.

Differences from a node: the Pods use the host network (no CNI network is set up: the CNI
configuration is loopback alone, which is what containerd needs to report the network ready);
images are imported with ``ctr`` from archives made here (no registry); the cgroups are this
machine's v1 hierarchies, so the kubelet runs with ``failCgroupV1: false``.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from dra_driver.sim.localapi import free_port
from tests.cluster import objects
from tests.cluster.controlplane import ControlPlane, Process, tail
from tests.cluster.gpunode import GPU_NODE_LABELS

REPO = Path(__file__).resolve().parent.parent.parent
GO_MOD = REPO / "hack" / "containerd" / "go.mod"
CONTAINERD_PROGRAMS = ("containerd", "containerd-shim-runc-v2", "ctr", "loopback")
IMAGE = "localhost/gpu-dra-realnode:test"  # the Pods' image and the sandbox ("pause") image
DRIVER_ROOT = "/run/nvidia/driver"
CGROUP_FS = Path("/sys/fs/cgroup")


def containerd_version() -> str:
    match = re.search(
        r"^\s*github\.com/containerd/containerd/v2\s+(v\S+)", GO_MOD.read_text(), re.MULTILINE
    )
    if match is None:
        raise RuntimeError(f"{GO_MOD} requires no containerd version")
    return match.group(1)


def containerd_bin_dir() -> Path:
    cache = os.environ.get("GPU_DRA_CONTAINERD_CACHE", "") or str(
        Path.home() / ".cache/gpu-dra/containerd"
    )
    return Path(cache) / containerd_version() / "bin"


def missing(kube_bin: Path) -> str:
    """What this tier lacks here ("" when nothing)."""
    if os.geteuid() != 0:
        return "root (a mount namespace for the node, cgroups for the Pods)"
    for tool in ("unshare", "nsenter", "mount", "runc", "cc"):
        if shutil.which(tool) is None:
            return f"{tool} (Debian: apt-get install runc)" if tool == "runc" else tool
    folder = containerd_bin_dir()
    absent = [p for p in CONTAINERD_PROGRAMS if not os.access(folder / p, os.X_OK)]
    if absent:
        return f"{', '.join(absent)} in {folder} (make containerd)"
    if not os.access(kube_bin / "kubelet", os.X_OK):
        return f"kubelet in {kube_bin} (make kube)"
    return ""


# --- images -------------------------------------------------------------------------------------


def oci_archive(rootfs: Path, out: Path, *, name: str, cmd: list[str]) -> Path:
    """An OCI image layout tarball of ``rootfs`` (one layer) named ``name``: what
    ``ctr images import`` reads. The image's default command is ``cmd``."""

    def blob(data: bytes) -> tuple[str, bytes]:
        return "sha256:" + hashlib.sha256(data).hexdigest(), data

    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for path in sorted(rootfs.rglob("*")):
            tar.add(path, arcname=str(path.relative_to(rootfs)), recursive=False)
    layer_tar = raw.getvalue()
    diff_id = "sha256:" + hashlib.sha256(layer_tar).hexdigest()
    layer_digest, layer = blob(gzip.compress(layer_tar, mtime=0))
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Cmd": cmd, "Env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"]},
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
    }
    config_digest, config_bytes = blob(json.dumps(config).encode())
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": config_digest,
            "size": len(config_bytes),
        },
        "layers": [
            {
                "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                "digest": layer_digest,
                "size": len(layer),
            }
        ],
    }
    manifest_digest, manifest_bytes = blob(json.dumps(manifest).encode())
    index = {
        "schemaVersion": 2,
        "manifests": [
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": manifest_digest,
                "size": len(manifest_bytes),
                "annotations": {"org.opencontainers.image.ref.name": name},
                "platform": {"architecture": "amd64", "os": "linux"},
            }
        ],
    }
    files = {
        "oci-layout": json.dumps({"imageLayoutVersion": "1.0.0"}).encode(),
        "index.json": json.dumps(index).encode(),
    }
    for digest, data in (
        (layer_digest, layer),
        (config_digest, config_bytes),
        (manifest_digest, manifest_bytes),
    ):
        files[f"blobs/sha256/{digest.split(':')[1]}"] = data
    with tarfile.open(out, "w") as tar:
        for arcname, data in files.items():
            info = tarfile.TarInfo(arcname)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out


# --- the node -----------------------------------------------------------------------------------

CONTAINERD_TOML = """\
version = 4
root = "{work}/containerd/root"
state = "/run/containerd"
imports = []
[plugins.'io.containerd.server.v1.grpc']
  address = "{socket}"
[plugins.'io.containerd.cri.v1.runtime']
  cdi_spec_dirs = ["/var/run/cdi"]  # CDI is always on in containerd 2.x
  # No OOM score below containerd's own: lowering one needs CAP_SYS_RESOURCE, which this
  # machine's root lacks (the sandbox's -998 fails in runc: "failed to update
  # /proc/self/oom_score_adj: Permission denied").
  restrict_oom_score_adj = true
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        BinaryName = "{runc}"
        SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["{bin}"]
    conf_dir = "{work}/cni"
[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "{image}"
"""

# The network containerd's CRI needs to call the node's network ready: loopback alone (the Pods
# use the host's network; no bridge, no addresses).
CNI_CONFLIST = {
    "cniVersion": "1.0.0",
    "name": "loopback-only",
    "plugins": [{"type": "loopback"}],
}


@dataclass
class RealNode:
    """The real kubelet and containerd in one mount namespace: the node."""

    name: str
    work: Path
    cluster: ControlPlane
    kube_bin: Path
    containerd_bin: Path
    holder: subprocess.Popen[bytes] | None = None
    containerd: Process | None = None
    kubelet: Process | None = None
    processes: list[Process] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        self.kubelet_dir = self.work / "k"
        self.pod_logs = self.work / "pods"
        self.socket = self.work / "containerd.sock"
        for d in (self.kubelet_dir, self.work / "cdi", self.pod_logs, self.work / "cni"):
            d.mkdir(exist_ok=True)
        self.port = free_port()
        # the node's own cgroup tree (the kubelet's cgroupRoot), removed on stop
        self.cgroup_root = f"/gpu-dra-{self.name}-{os.getpid()}"

    # --- bring-up -------------------------------------------------------------------------------

    def start(self, *, images: list[Path]) -> RealNode:
        self._hold_namespace()
        self._start_containerd()
        for archive in images:
            self.ctr("images", "import", "--local", str(archive))
        self._start_kubelet()
        objects.wait(f"node {self.name} Ready", self._ready, timeout_s=180)
        return self

    def _hold_namespace(self) -> None:
        ready = self.work / "node.pid"
        script = (
            "set -e; mount -t tmpfs tmpfs /run; mount -t tmpfs tmpfs /var/lib; "
            "mkdir -p /var/lib/kubelet /run/cdi /var/log/pods "
            f"{DRIVER_ROOT}; "
            f'mount --bind "{self.kubelet_dir}" /var/lib/kubelet; '
            f'mount --bind "{self.work}/cdi" /run/cdi; '
            f'mount --bind "{self.pod_logs}" /var/log/pods; '
            f'echo $$ > "{ready}"; exec sleep infinity'
        )
        with (self.work / "node.log").open("ab") as out:
            self.holder = subprocess.Popen(
                ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

        def up() -> bool:
            assert self.holder is not None
            if self.holder.poll() is not None:
                raise AssertionError(f"the node namespace exited:\n{tail(self.work / 'node.log')}")
            return ready.exists() and ready.read_text().strip() != ""

        objects.wait("the node namespace", up, timeout_s=20)

    def nsenter(self, *argv: str) -> list[str]:
        assert self.holder is not None
        return ["nsenter", f"--mount=/proc/{self.holder.pid}/ns/mnt", "--", *argv]

    def _env(self) -> dict[str, str]:
        path = f"{self.containerd_bin}:{os.environ.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}"
        return {**os.environ, "PATH": path}

    def _start_containerd(self) -> None:
        config = self.work / "containerd.toml"
        config.write_text(
            CONTAINERD_TOML.format(
                work=self.work,
                socket=self.socket,
                runc=shutil.which("runc"),
                bin=self.containerd_bin,
                image=IMAGE,
            )
        )
        (self.work / "cni" / "10-loopback.conflist").write_text(json.dumps(CNI_CONFLIST))
        argv = self.nsenter(str(self.containerd_bin / "containerd"), "--config", str(config))
        self.containerd = Process("containerd", argv, self.work / "containerd.log", env=self._env())
        self.containerd.start()
        self.processes.append(self.containerd)

        def serving() -> bool:
            assert self.containerd is not None
            self.containerd.check()
            return self.ctr("version", check=False).returncode == 0

        objects.wait("containerd", serving, timeout_s=60)

    def ctr(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            self.nsenter(
                str(self.containerd_bin / "ctr"),
                "--address",
                str(self.socket),
                "--namespace",
                "k8s.io",
                *args,
            ),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            env=self._env(),
        )
        if check and done.returncode != 0:
            raise AssertionError(f"ctr {' '.join(args)}: {done.stdout}\n{done.stderr}")
        return done

    def _cgroup_dirs(self) -> list[Path]:
        """The node's cgroup in every v1 hierarchy mounted here (and the v2 one, if any)."""
        return [
            h / self.cgroup_root.lstrip("/")
            for h in sorted(CGROUP_FS.iterdir())
            if (h / "cgroup.procs").exists()
        ]

    def _start_kubelet(self) -> None:
        for cgroup in self._cgroup_dirs():
            cgroup.mkdir(exist_ok=True)
        identity = self.cluster.pki.client(f"system:node:{self.name}", "system:nodes")
        kubeconfig = self.cluster.kubeconfig(f"node-{self.name}", identity)
        config = self.work / "kubelet.yaml"
        config.write_text(
            json.dumps(
                {
                    "apiVersion": "kubelet.config.k8s.io/v1beta1",
                    "kind": "KubeletConfiguration",
                    "failCgroupV1": False,  # this machine's cgroups are v1
                    "cgroupDriver": "cgroupfs",
                    "cgroupRoot": self.cgroup_root,
                    "containerRuntimeEndpoint": f"unix://{self.socket}",
                    "address": "127.0.0.1",
                    "port": self.port,
                    "readOnlyPort": 0,
                    "healthzPort": 0,
                    "authentication": {
                        "anonymous": {"enabled": True},
                        "webhook": {"enabled": False},
                    },
                    "authorization": {"mode": "AlwaysAllow"},
                    "failSwapOn": False,
                    # a shared build machine: no eviction for its disk or memory
                    "evictionHard": {
                        "memory.available": "1Mi",
                        "nodefs.available": "1%",
                        "imagefs.available": "1%",
                    },
                    "imageGCHighThresholdPercent": 100,
                    "imageGCLowThresholdPercent": 99,
                    "serializeImagePulls": False,
                }
            )
        )
        labels = ",".join(f"{k}={v}" for k, v in GPU_NODE_LABELS.items())
        argv = self.nsenter(
            str(self.kube_bin / "kubelet"),
            f"--config={config}",
            f"--kubeconfig={kubeconfig}",
            f"--hostname-override={self.name}",
            "--root-dir=/var/lib/kubelet",
            f"--node-labels={labels}",
            "--v=2",
        )
        self.kubelet = Process(f"kubelet-{self.name}", argv, self.work / "kubelet.log",
                               env=self._env())  # fmt: skip
        self.kubelet.start()
        self.processes.append(self.kubelet)

    def _ready(self) -> bool:
        for process in self.processes:
            process.check()
        node = objects.get(self.cluster, "Node", self.name)
        ready = node is not None and objects.condition(node, "Ready")
        return bool(ready and ready.get("status") == "True")

    def attach_driver_root(self, plan: Path) -> None:
        """Binds the fake driver root the agent Pod's node has at /run/nvidia/driver (its podsim
        plan names it) at the same path in this node."""
        binds = json.loads(plan.read_text())["node"]["binds"]
        (root,) = [source for source, target in binds if target == DRIVER_ROOT]
        subprocess.run(self.nsenter("mount", "--bind", root, DRIVER_ROOT), check=True)

    # --- reading --------------------------------------------------------------------------------

    def container_log(self, pod: dict[str, str], container: str) -> str:
        """The container's output as the kubelet keeps it (/var/log/pods), CRI framing removed."""
        meta = pod
        folder = self.pod_logs / f"{meta['namespace']}_{meta['name']}_{meta['uid']}" / container
        lines = []
        for log in sorted(folder.glob("*.log")):
            for line in log.read_text(errors="replace").splitlines():
                parts = line.split(" ", 3)  # time stream tag text
                lines.append(parts[3] if len(parts) == 4 else "")
        return "\n".join(lines)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{tail(p.log, 25)}" for p in self.processes)

    # --- teardown -------------------------------------------------------------------------------

    def stop(self) -> None:
        """The kubelet, then every Pod's containers, then containerd and the namespace."""
        if self.kubelet is not None:
            self.kubelet.stop()
        if self.containerd is not None and self.containerd.alive():
            self._remove_containers()
            self.containerd.stop()
        if self.holder is not None:
            self.holder.terminate()
            try:
                self.holder.wait(10)
            except subprocess.TimeoutExpired:
                self.holder.kill()
                self.holder.wait()
            self.holder = None
        for cgroup in self._cgroup_dirs():
            _remove_cgroup_tree(cgroup)

    def _remove_containers(self) -> None:
        """Kills every task containerd runs (their shims exit with them) and deletes the
        containers, so no process of a Pod outlives the test."""
        listed = self.ctr("tasks", "list", "--quiet", check=False).stdout.split()
        for task in listed:
            self.ctr("tasks", "kill", "--signal", "SIGKILL", task, check=False)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            for task in self.ctr("tasks", "list", "--quiet", check=False).stdout.split():
                self.ctr("tasks", "delete", task, check=False)
            if not self.ctr("tasks", "list", "--quiet", check=False).stdout.split():
                break
            time.sleep(0.5)
        for container in self.ctr("containers", "list", "--quiet", check=False).stdout.split():
            self.ctr("containers", "delete", container, check=False)


def _remove_cgroup_tree(top: Path) -> None:
    """rmdir ``top`` and every cgroup under it, deepest first (a cgroup with a process stays)."""
    if not top.is_dir():
        return
    for folder, _, _ in os.walk(top, topdown=False):
        with contextlib.suppress(OSError):
            os.rmdir(folder)
