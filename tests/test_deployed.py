"""The deployed form is the test: the agent as the chart's DaemonSet runs it, on a node as the
kubelet sets it up, and a container started from the CDI devices it returns loads the driver.

For the chart's default values (driver installed on the host, libraries in the Debian multiarch
directory or in /usr/lib64 as on RHEL-family hosts) and for the GPU operator's layout (driver
root /run/nvidia/driver with its own dev/), each test:

1. renders the chart with the real ``helm`` and takes the DaemonSet's container: command, env
   (downward API fields resolved), volumes and volume mounts;
2. builds a node in a private mount namespace (tests/podsim.py): the driver's files at their host
   paths (stand-in libraries that are real ELF shared objects with the right sonames, built here
   with the C compiler), GPU device nodes, the kubelet's directories, the CDI directory;
3. runs the real agent in a Pod made from that container: its own root (the machine's userland as
   the image, without the node's driver files), every hostPath volume at its mountPath, an
   emptyDir /tmp, the ServiceAccount token, in-cluster API access to the local API server;
4. acts as the kubelet: registration over the registration socket, NodePrepareResources over
   the DRA socket for two claims (the second asks for the ``video`` driver capability and for
   time slicing: the agent runs the driver root's nvidia-smi, the fake driver's stand-in, from
   its read-only ``/driver-root``, and sets Default again on unprepare), and reads the GPUs'
   telemetry from the metrics port;
5. starts containers with podman + runc through the returned CDI device IDs, in the node's mount
   namespace. A program in the container dlopen()s libcuda.so.1, libcuda.so and
   libnvidia-ml.so.1 and calls a function of each. The container images hold a real glibc
   loader copied from this machine, laid out like a Debian image or like a RHEL-family image
   (everything in /usr/lib64, no multiarch directory). The libraries sit in
   /usr/local/nvidia/lib64, a directory neither loader searches by default; the loader's own
   trace (LD_DEBUG) must show they were found through the loader cache the CDI hook refreshed.

Needs root, podman, runc, unshare/nsenter, a C compiler and helm; skips saying which is missing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from dra_driver import cdi
from dra_driver._proto.dra_v1 import api_pb2 as v1
from dra_driver._proto.dra_v1 import api_pb2_grpc as v1_grpc
from dra_driver._proto.pluginregistration_v1 import api_pb2 as reg
from dra_driver._proto.pluginregistration_v1 import api_pb2_grpc as reg_grpc
from dra_driver.sim.elfdriver import build_libraries
from dra_driver.sim.fakedriver import (
    make_device_nodes,
    make_fake_driver,
    read_nvidia_smi_calls,
    read_time_slices,
    simulated_inventory,
)
from dra_driver.sim.localapi import FakeKubeApi, free_port
from dra_driver.sim.profiles import DRIVER_VERSION
from tests import exposition
from tests.claimdata import allocated_claim, opaque
from tests.image import PodImage, standins_on_path_python
from tests.podman import BUSYBOX, busybox_rootfs, containers_conf, missing, podman_env
from tests.test_chart import CHART, HELM, NAMESPACE, RELEASE

REPO = Path(__file__).resolve().parent.parent
PODSIM = REPO / "tests" / "podsim.py"
MULTIARCH = "usr/lib/x86_64-linux-gnu"
NODE = "gpu-node-1"


def _missing() -> str:
    basic = missing("unshare", "nsenter", "cc", "mount")
    if basic:
        return basic
    if HELM is None:
        return "helm not on PATH nor at .tools/bin/helm (run `make helm`)"
    if not Path(f"/{MULTIARCH}/libc.so.6").exists():
        return f"this test copies glibc from /{MULTIARCH} (x86_64 Debian or Ubuntu)"
    if not cdi_hook_built():
        return "the CDI hook is not built (make hook)"
    return ""


def cdi_hook_built() -> bool:
    from dra_driver.cdi import hook  # noqa: PLC0415

    return hook.PACKAGED_BINARY.is_file()


pytestmark = [
    pytest.mark.podman,
    pytest.mark.helm,
    pytest.mark.skipif(bool(_missing()), reason=_missing() or "-"),
]

# --- stand-in driver libraries: real ELF objects (sim/elfdriver.py) -------------------------

PROBE_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
/* argv: library:function pairs. Prints "ok LIB FUNC RESULT PATH" or "fail LIB ERROR". */
int main(int argc, char **argv) {
    int failures = 0;
    for (int i = 1; i < argc; i++) {
        char lib[256], fn[256];
        if (sscanf(argv[i], "%255[^:]:%255s", lib, fn) != 2) return 2;
        void *handle = dlopen(lib, RTLD_NOW);
        if (!handle) { printf("fail %s %s\n", lib, dlerror()); failures++; continue; }
        int (*f)(unsigned int) = (int (*)(unsigned int))dlsym(handle, fn);
        if (!f) { printf("fail %s %s\n", lib, dlerror()); failures++; continue; }
        Dl_info info;
        dladdr((void *)f, &info);
        printf("ok %s %s %d %s\n", lib, fn, f(0), info.dli_fname);
    }
    return failures;
}
"""


@dataclass(frozen=True)
class Builds:
    libraries: dict[str, bytes]
    probe: Path


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> Builds:
    out = tmp_path_factory.mktemp("elf")
    libraries = build_libraries(out)
    (out / "probe.c").write_text(PROBE_C)
    probe = out / "gpuprobe"
    subprocess.run(["cc", "-O1", "-o", probe, out / "probe.c"], check=True)
    return Builds(libraries=libraries, probe=probe)


# --- container images ------------------------------------------------------------------------


def make_image(base: Path, *, flavour: str, probe: Path) -> Path:
    """A container root: busybox, the probe and glibc copied from this machine (no ldconfig: the
    hook brings the host's), laid
    out as a Debian image (multiarch directory) or a RHEL-family one (/usr/lib64 only, which
    this loader finds through its cache alone, as none of its default directories exist)."""
    root = base / f"rootfs-{flavour}-{uuid.uuid4().hex[:6]}"
    libdir = root / (MULTIARCH if flavour == "debian" else "usr/lib64")
    for d in ("bin", "sbin", "etc/ld.so.conf.d", "dev", "proc", "sys", "tmp"):
        (root / d).mkdir(parents=True, exist_ok=True)
    libdir.mkdir(parents=True)
    for name in ("libc.so.6", "ld-linux-x86-64.so.2"):
        shutil.copy2(Path("/") / MULTIARCH / name, libdir / name)
    loader = "/" + str((libdir / "ld-linux-x86-64.so.2").relative_to(root))
    if flavour == "debian":
        (root / "lib64").mkdir()
        (root / "lib64/ld-linux-x86-64.so.2").symlink_to(loader)
    else:
        (root / "lib64").symlink_to("usr/lib64")
    shutil.copy2(BUSYBOX, root / "bin/busybox")
    (root / "bin/sh").symlink_to("busybox")
    shutil.copy2(probe, root / "bin/gpuprobe")
    (root / "etc/ld.so.conf").write_text("include /etc/ld.so.conf.d/*.conf\n")
    (root / "etc/ld.so.conf.d/system.conf").write_text(f"/{libdir.relative_to(root)}\n")
    subprocess.run(["/sbin/ldconfig", "-r", str(root)], check=True)  # the image's own cache
    return root


# --- the chart's DaemonSet -------------------------------------------------------------------


def daemonset_container(*values: str) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The agent container and the pod's volumes (by name) as the chart renders them."""
    assert HELM is not None
    out = subprocess.run(
        [HELM, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, *values],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
    pod = ds["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    return container, {v["name"]: v for v in pod["volumes"]}


def container_env(
    container: dict[str, Any], *, pod_uid: str, node: str = NODE, namespace: str = NAMESPACE
) -> dict[str, str]:
    fields = {"spec.nodeName": node, "metadata.namespace": namespace, "metadata.uid": pod_uid}
    env = {}
    for entry in container["env"]:
        if "value" in entry:
            env[entry["name"]] = str(entry["value"])
        else:
            env[entry["name"]] = fields[entry["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


@dataclass(frozen=True)
class ApiAccess:
    """How the agent's Pod reaches the API server: in-cluster (KUBERNETES_SERVICE_HOST/PORT on
    loopback, a ServiceAccount token and the server's CA)."""

    port: int
    token: str
    ca_file: Path

    @classmethod
    def of(cls, api: FakeKubeApi) -> ApiAccess:
        assert api.tls_dir is not None  # in-cluster clients insist on TLS
        return cls(port=api.port, token=api.token or "", ca_file=api.tls_dir / "ca.crt")


@dataclass(frozen=True)
class PodSource:
    """The agent's Pod as the API server holds it (the DaemonSet controller made it): its
    container and volumes, and the downward-API fields the kubelet would resolve."""

    container: dict[str, Any]
    volumes: dict[str, dict[str, Any]]
    node: str
    namespace: str
    uid: str

    @classmethod
    def of(cls, pod: dict[str, Any]) -> PodSource:
        spec = pod["spec"]
        (container,) = spec["containers"]
        return cls(
            container=container,
            volumes={v["name"]: v for v in spec["volumes"]},
            node=spec["nodeName"],
            namespace=pod["metadata"]["namespace"],
            uid=pod["metadata"]["uid"],
        )


@dataclass
class Node:
    """The node namespace's process, the agent inside it, and the paths the test reaches."""

    process: subprocess.Popen[bytes]
    pid: int
    kubelet_dir: Path  # what the node has at /var/lib/kubelet
    cdi_dir: Path  # what the node has at the chart's cdiRoot
    log: Path

    def outside(self, node_path: str) -> Path:
        """A path under the node's /var/lib/kubelet as this process reaches it."""
        return self.kubelet_dir / Path(node_path).relative_to("/var/lib/kubelet")

    def podman(self, *args: str, conf: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["nsenter", f"--mount=/proc/{self.pid}/ns/mnt", "podman", *args],
            env=podman_env(conf),
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def image_dirs() -> list[str]:
    """What the agent's image holds: the system's userland, this Python and this checkout."""
    dirs = ["/usr", "/bin", "/lib", "/lib64", "/sbin", "/etc"]
    python, venv = (os.path.realpath(p) for p in (sys.base_prefix, sys.prefix))
    for path in (python, str(REPO), venv):
        if not any(path == d or path.startswith(d + "/") for d in dirs):
            dirs.append(path)
    return [d for d in dirs if os.path.lexists(d)]


LAYOUTS = {
    # name: (helm --set values, host library directory, driver root on the host)
    "host-multiarch": ((), MULTIARCH, "/"),
    "host-lib64": ((), "usr/lib64", "/"),
    "gpu-operator": (("--set", "nvidiaDriverRoot=/run/nvidia/driver"), MULTIARCH,
                     "/run/nvidia/driver"),
}  # fmt: skip


def start_node(
    work: Path,
    *,
    layout: str,
    builds: Builds,
    api: FakeKubeApi | ApiAccess,
    simulate: str = "h100:2",
    extra_values: tuple[str, ...] = (),
    image: PodImage | None = None,
    pod: PodSource | None = None,
    env_overrides: dict[str, str] | None = None,
    gpus: int = 2,
    host_state: Path | None = None,
) -> tuple[Node, dict[str, Any]]:
    """The node with the driver installed per ``layout`` and the chart's agent Pod on it: the
    machine's userland as the image, or with ``image`` podman running the built image. The Pod
    is the chart's rendered DaemonSet's, or ``pod``: one the API server holds (a real cluster's
    DaemonSet controller made it), its environment changed by ``env_overrides`` only."""
    values, lib_dir, driver_root = LAYOUTS[layout]
    access = api if isinstance(api, ApiAccess) else ApiAccess.of(api)
    if pod is None:
        # Simulated GPUs (no GPU here): the only value changed from the layout's, but for the
        # ports: the pod shares this machine's network, where other runs may hold the defaults.
        container, volumes = daemonset_container(
            *values, *extra_values, "--set", f"simulate={simulate}",
            "--set", f"healthcheckPort={free_port()}", "--set", f"metricsPort={free_port()}",
        )  # fmt: skip
        env = container_env(container, pod_uid=str(uuid.uuid4()))
    else:
        container, volumes = pod.container, pod.volumes
        env = container_env(container, pod_uid=pod.uid, node=pod.node, namespace=pod.namespace)
    env.update(env_overrides or {})
    operator = driver_root != "/"
    fake = make_fake_driver(
        work / "driver",
        gpu_minors=range(gpus),
        lib_dir=lib_dir,
        library_bytes=lambda lib: builds.libraries[lib],
        device_nodes=operator,  # a driver container's root has its dev/; a host install does not
    )
    for leftover in (fake.root / lib_dir).glob("libc.so*"):
        leftover.unlink()  # the fake tree's "unrelated library" would shadow the host's libc
    if image is not None:  # the stand-in tools run with the image's python3, not this one
        standins_on_path_python(fake.root / "usr/bin")
    # What the node keeps on its disk across restarts of the Pod: ``host_state`` (default: work)
    state = host_state or work
    kubelet_dir, cdi_dir = state / "k", state / "cdi"
    kubelet_dir.mkdir(exist_ok=True)  # a test may leave state there first (a switched node)
    # the kubelet creates it (type: Directory); a real one (tests/cluster) did already
    (kubelet_dir / "plugins_registry").mkdir(exist_ok=True)
    cdi_dir.mkdir(exist_ok=True)
    binds = [[str(kubelet_dir), "/var/lib/kubelet"], [str(cdi_dir), env["CDI_ROOT"]]]
    overlays: list[list[str]] = []
    if operator:
        binds.append([str(fake.root), driver_root])
    else:
        host_dev = work / "host-dev"
        make_device_nodes(host_dev, gpu_minors=range(gpus))
        overlays += [
            [str(fake.root / lib_dir), f"/{lib_dir}"],
            [str(fake.root / "usr/bin"), "/usr/bin"],
            [str(host_dev), "/dev"],
        ]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    account = work / "serviceaccount"
    account.mkdir()
    (account / "token").write_text(access.token)
    (account / "namespace").write_text(env.get("POD_NAMESPACE", NAMESPACE))
    shutil.copyfile(access.ca_file, account / "ca.crt")
    secrets = "/var/run/secrets/kubernetes.io/serviceaccount"
    env.update(
        KUBERNETES_SERVICE_HOST="127.0.0.1",
        KUBERNETES_SERVICE_PORT=str(access.port),
        PATH=f"{Path(sys.executable).parent}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        HOME="/root",
        PYTHONDONTWRITEBYTECODE="1",
        # Where the stand-in nvidia-smi keeps what it was told (a real one leaves that in the
        # GPU): the driver root is read-only in the pod, the plugin data dir is not.
        FAKE_NVIDIA_SMI_DIR=f"{env['KUBELET_PLUGINS_DIRECTORY_PATH']}/gpu.nvidia.com",
    )
    plan: dict[str, Any] = {
        "node": {
            "tmpfs": ["/run", "/var/lib"],  # the machine's own state stays out of the node
            "overlays": overlays,
            "binds": binds,
            "ready": str(work / "node.pid"),
        },
        "pod": {
            "root": str(work / "podroot"),
            "image": image_dirs(),
            "volumes": [
                {
                    "host_path": volumes[name]["hostPath"]["path"],
                    "mount_path": m["mountPath"],
                    "read_only": bool(m.get("readOnly")),
                    "create": volumes[name]["hostPath"].get("type") == "DirectoryOrCreate",
                    "propagation": m.get("mountPropagation", "None"),
                }
                for name, m in mounts.items()
                if "hostPath" in volumes[name]
            ],
            "empty_dirs": [m["mountPath"] for n, m in mounts.items() if "emptyDir" in volumes[n]],
            "files": {f"{secrets}/{f.name}": str(f) for f in account.iterdir()},
            "argv": [*container["command"], *container.get("args", [])],
            "env": env,
        },
    }
    if image is not None:
        for name in ("PATH", "HOME", "PYTHONDONTWRITEBYTECODE"):  # the image's own
            del env[name]
        plan["node"]["runtime"] = image.runtime(plan["pod"], container, work=work)
    (work / "podroot").mkdir()
    plan_path = work / "plan.json"
    plan_path.write_text(json.dumps(plan))
    log = work / "node.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", sys.executable,
             str(PODSIM), "node", str(plan_path)],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    ready = work / "node.pid"
    deadline = time.monotonic() + 20
    while not ready.exists() or not ready.read_text().strip():  # created, then written
        assert process.poll() is None, log.read_text()
        assert time.monotonic() < deadline, "the node namespace did not come up"
        time.sleep(0.05)
    node = Node(process, int(ready.read_text()), kubelet_dir, cdi_dir, log)
    return node, {"env": env, "volumes": volumes, "container": container}


def register(node: Node, *, timeout_s: float = 30) -> Path:
    """The kubelet's registration: GetInfo, then NotifyRegistrationStatus. The DRA socket."""
    deadline = time.monotonic() + timeout_s
    while True:
        sockets = list((node.kubelet_dir / "plugins_registry").glob("*-reg.sock"))
        if sockets:
            break
        assert node.process.poll() is None, node.log.read_text()
        assert time.monotonic() < deadline, f"no registration socket:\n{node.log.read_text()}"
        time.sleep(0.05)
    with grpc.insecure_channel(f"unix://{sockets[0]}") as channel:
        stub = reg_grpc.RegistrationStub(channel)
        info = stub.GetInfo(reg.InfoRequest(), timeout=5)
        assert info.name == "gpu.nvidia.com"
        stub.NotifyRegistrationStatus(reg.RegistrationStatus(plugin_registered=True), timeout=5)
    return node.outside(info.endpoint)


PROBE_ARGS = ("libcuda.so.1:cuInit", "libcuda.so:cuInit", "libnvidia-ml.so.1:nvmlInit_v2",
              "libnvcuvid.so.1:cuvidGetDecoderCaps")  # fmt: skip
LIB = cdi.CONTAINER_LIB_DIR


def run_probe(
    node: Node, *, work: Path, builds: Builds, flavour: str, cdi_ids: list[str]
) -> subprocess.CompletedProcess[str]:
    conf = containers_conf(work)
    rootfs = make_image(work, flavour=flavour, probe=builds.probe)
    return node.podman(
        "run", "--rm", "--network=none", "--env", "LD_DEBUG=libs",
        *(f"--device={i}" for i in cdi_ids), "--rootfs", str(rootfs),
        "/bin/gpuprobe", *PROBE_ARGS, conf=conf,
    )  # fmt: skip


_LOADER_LINE = re.compile(r"^\s*\d+:\t")


def found_through_cache(trace: str, library: str) -> bool:
    """The loader's trace says it looked ``library`` up in its cache and took our directory.
    Only the loader's lines (``<pid>:<tab>...``, on stderr) are read: a container log
    interleaves them with the program's stdout in no fixed order."""
    lines = [line for line in trace.splitlines() if _LOADER_LINE.match(line)]
    for i, line in enumerate(lines):
        if f"find library={library} " in line:
            rest = [x.split(":", 1)[-1].strip() for x in lines[i + 1 : i + 3]]
            return rest == ["search cache=/etc/ld.so.cache", f"trying file={LIB}/{library}"]
    return False


@pytest.fixture
def work() -> Iterator[Path]:
    # short: the agent's socket paths must fit 108 bytes seen from here too
    with tempfile.TemporaryDirectory(prefix="dd-", dir="/tmp") as d:
        yield Path(d)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_container_prepared_by_the_deployed_agent_loads_the_driver(
    layout: str, work: Path, builds: Builds
) -> None:
    api = FakeKubeApi(tls_dir=work / "tls", token="agent-token").start()
    node = None
    try:
        api.add_node(NODE)
        plain = api.add_claim(allocated_claim(name="plain", node=NODE, devices=["gpu-0"]))
        # also time slicing: nvidia-smi is run from the pod's view of the driver root
        video_config = opaque(
            {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
             "driverCapabilities": ["compute", "utility", "video"],
             "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}}
        )  # fmt: skip
        video = api.add_claim(
            allocated_claim(name="video", node=NODE, devices=["gpu-1"], configs=[video_config])
        )
        node, deployed = start_node(work, layout=layout, builds=builds, api=api)
        dra_socket = register(node)
        refs = [
            v1.Claim(namespace="default", name=c["metadata"]["name"], uid=c["metadata"]["uid"])
            for c in (plain, video)
        ]
        with grpc.insecure_channel(f"unix://{dra_socket}") as channel:
            stub = v1_grpc.DRAPluginStub(channel)
            answer = stub.NodePrepareResources(
                v1.NodePrepareResourcesRequest(claims=refs), timeout=30
            )
            ids = {}
            for ref in refs:
                entry = answer.claims[ref.uid]
                assert entry.error == "", f"{entry.error}\n{node.log.read_text()}"
                ids[ref.name] = [i for d in entry.devices for i in d.cdi_device_ids]
            spec_files = sorted(p.name for p in node.cdi_dir.glob("*.json"))
            assert len(spec_files) == 2
            smi_dir = node.kubelet_dir / "plugins" / "gpu.nvidia.com"
            video_gpu = simulated_inventory("h100:2", node_name=NODE).gpus[1].uuid
            assert read_nvidia_smi_calls(smi_dir) == [
                f"compute-policy -i {video_gpu} --set-timeslice 3"
            ], node.log.read_text()

            # Every host path a spec names is the node's, never the agent's /driver-root.
            spec = json.loads((node.cdi_dir / spec_files[0]).read_text())
            host_paths = [m["hostPath"] for m in spec["containerEdits"]["mounts"]]
            root_prefix = "" if LAYOUTS[layout][2] == "/" else LAYOUTS[layout][2]
            assert f"{root_prefix}/{LAYOUTS[layout][1]}/libcuda.so.{DRIVER_VERSION}" in host_paths
            assert not any(
                p.startswith(deployed["env"]["CONTAINER_DRIVER_ROOT"]) for p in host_paths
            )

            runs = {
                (name, flavour): run_probe(
                    node, work=work, builds=builds, flavour=flavour, cdi_ids=ids[name]
                )
                for name, flavour in (("plain", "debian"), ("plain", "rhel"), ("video", "debian"))
            }
            for (name, flavour), run in runs.items():
                where = (
                    f"{layout}, claim {name}, {flavour} image:\n{run.stdout}\n{run.stderr[-3000:]}"
                )
                lines = run.stdout.splitlines()
                assert f"ok libcuda.so.1 cuInit 0 {LIB}/libcuda.so.1" in lines, where
                # the development name resolves too (libcuda.so -> .so.1 -> .so.<version>); the
                # loader hands back the object it already has, named as first loaded
                assert any(x.startswith(f"ok libcuda.so cuInit 0 {LIB}/") for x in lines), where
                assert f"ok libnvidia-ml.so.1 nvmlInit_v2 0 {LIB}/libnvidia-ml.so.1" in lines, where
                # found through the cache the hook refreshed, not a default search path
                assert found_through_cache(run.stderr, "libcuda.so.1"), where
                assert found_through_cache(run.stderr, "libnvidia-ml.so.1"), where
                has_video = f"ok libnvcuvid.so.1 cuvidGetDecoderCaps 0 {LIB}/libnvcuvid.so.1"
                if name == "video":
                    assert has_video in lines, where
                    assert run.returncode == 0, where
                else:
                    assert has_video not in lines, where
                    assert any(x.startswith("fail libnvcuvid.so.1") for x in lines), where
                    assert run.returncode == 1, where  # exactly the one missing library

            # The chart's metrics endpoint serves the simulated GPUs' telemetry.
            url = f"http://127.0.0.1:{deployed['env']['METRICS_PORT']}/metrics"
            with urllib.request.urlopen(url, timeout=5) as scraped:
                series = exposition.parse(scraped.read().decode())
            info = exposition.find(series, "gpu_dra_gpu_info", node=NODE)
            assert sorted(dict(k)["device"] for k in info) == ["gpu-0", "gpu-1"]
            assert exposition.find(series, "gpu_dra_gpu_temperature_celsius", device="gpu-0")

            undone = stub.NodeUnprepareResources(
                v1.NodeUnprepareResourcesRequest(claims=refs), timeout=30
            )
            assert all(undone.claims[r.uid].error == "" for r in refs)
            assert read_time_slices(smi_dir) == {video_gpu: 0}  # Default again
        assert not list(node.cdi_dir.glob("*.json"))
        assert node.stop() == 0, node.log.read_text()
        assert not list((node.kubelet_dir / "plugins_registry").glob("*.sock"))
    finally:
        if node is not None:
            node.stop()
        api.stop()


def test_the_deployed_agent_runs_an_mps_daemon_its_containers_are_clients_of(
    work: Path, builds: Builds
) -> None:
    """MPS as the chart deploys it: the agent (in-cluster API access, MPS_IMAGE from the chart,
    nvidia-smi from its read-only /driver-root) creates the daemon's Deployment; the stand-in
    kubelet runs it in the node's mount namespace; the tmpfs the agent mounts in its pod reaches
    the node through the plugin directory's Bidirectional mount, where podman's container and
    the daemon see it; unprepare removes all of it."""
    from dra_driver.sim.fakedriver import read_compute_modes, read_mps_control_calls  # noqa: PLC0415
    from dra_driver.sim.localkubelet import DeploymentKubelet  # noqa: PLC0415

    api = FakeKubeApi(tls_dir=work / "tls", token="agent-token").start()
    node = None
    kubelet = None
    try:
        api.add_node(NODE)
        config = opaque(
            {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
             "sharing": {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 40}}}
        )  # fmt: skip
        claim = api.add_claim(
            allocated_claim(name="mps", node=NODE, devices=["gpu-1"], configs=[config])
        )
        uid = claim["metadata"]["uid"]
        node, deployed = start_node(work, layout="host-multiarch", builds=builds, api=api)
        assert deployed["env"]["MPS_IMAGE"] == deployed["container"]["image"]
        plugin_dir = f"{deployed['env']['KUBELET_PLUGINS_DIRECTORY_PATH']}/gpu.nvidia.com"
        enter = ["nsenter", f"--mount=/proc/{node.pid}/ns/mnt", "--"]
        kubelet = DeploymentKubelet(
            api, node_name=NODE, log_dir=work / "pods", enter=enter,
            # where the stand-ins keep what they were told (the node's /usr/bin is read-only)
            extra_env={"FAKE_NVIDIA_SMI_DIR": plugin_dir},
        ).start()  # fmt: skip
        dra_socket = register(node)
        state_dir = node.outside(plugin_dir)
        shm = f"{plugin_dir}/mps/{uid}/shm"

        def node_mounts() -> list[str]:
            lines = Path(f"/proc/{node.pid}/mountinfo").read_text().splitlines()
            return [x.split(" ")[4] for x in lines if x.split(" ")[4].startswith(plugin_dir + "/")]

        ref = v1.Claim(namespace="default", name="mps", uid=uid)
        gpu = simulated_inventory("h100:2", node_name=NODE).gpus[1].uuid
        with grpc.insecure_channel(f"unix://{dra_socket}") as channel:
            stub = v1_grpc.DRAPluginStub(channel)
            answer = stub.NodePrepareResources(
                v1.NodePrepareResourcesRequest(claims=[ref]), timeout=60
            )
            entry = answer.claims[uid]
            assert entry.error == "", f"{entry.error}\n{node.log.read_text()}"
            cdi_ids = [i for d in entry.devices for i in d.cdi_device_ids]
            (deployment,) = api.objects("deployments")
            assert deployment["metadata"]["namespace"] == NAMESPACE
            assert (NAMESPACE, f"mps-{uid}") in kubelet.running()
            told = [c.split(" ", 1)[1] for c in read_mps_control_calls(state_dir)]
            assert told == [f"start {gpu}", "get_server_list",
                            "set_default_active_thread_percentage 40"]  # fmt: skip
            assert read_compute_modes(state_dir) == {gpu: "EXCLUSIVE_PROCESS"}
            assert node_mounts() == [shm]  # mounted in the pod, seen on the node

            conf = containers_conf(work)
            rootfs = busybox_rootfs(work / "busybox")
            script = (
                'echo "env $CUDA_MPS_PIPE_DIRECTORY"; '
                "[ -S /tmp/nvidia-mps/control ] && echo control-socket-ok; "
                "grep ' /dev/shm ' /proc/mounts | cut -d' ' -f3; "
                "echo from-container > /dev/shm/hello && echo shm-writable"
            )
            run = node.podman(
                "run", "--rm", "--network=none", *(f"--device={i}" for i in cdi_ids),
                "--rootfs", str(rootfs), "/bin/busybox", "sh", "-c", script, conf=conf,
            )  # fmt: skip
            assert run.returncode == 0, run.stderr
            assert run.stdout.splitlines() == [
                "env /tmp/nvidia-mps", "control-socket-ok", "tmpfs", "shm-writable"
            ]  # fmt: skip
            seen = subprocess.run(
                [*enter, "cat", f"{shm}/hello"], capture_output=True, text=True, check=True
            )
            assert seen.stdout == "from-container\n"  # the daemon's tmpfs, on the node

            undone = stub.NodeUnprepareResources(
                v1.NodeUnprepareResourcesRequest(claims=[ref]), timeout=60
            )
            assert undone.claims[uid].error == ""
        assert api.objects("deployments") == []
        deadline = time.monotonic() + 10
        while kubelet.running():
            assert time.monotonic() < deadline, "the daemon still runs"
            time.sleep(0.05)
        assert node_mounts() == []
        assert not (state_dir / "mps" / uid).exists()
        assert read_compute_modes(state_dir) == {gpu: "DEFAULT"}
        assert read_mps_control_calls(state_dir)[-2:] == [
            f"{plugin_dir}/mps/{uid}/pipe quit", f"{plugin_dir}/mps/{uid}/pipe exit 0"
        ]  # fmt: skip
        assert node.stop() == 0, node.log.read_text()
    finally:
        if kubelet is not None:
            kubelet.stop()


def start_dynamic_mig_node(work: Path, *, builds: Builds, api: FakeKubeApi, simulate: str) -> Node:
    """The chart's pod with ``mig.mode=dynamic`` (GPU Operator layout) on simulated ``simulate``
    GPUs."""
    node, _ = start_node(
        work, layout="gpu-operator", builds=builds, api=api, simulate=simulate,
        extra_values=("--set", "mig.mode=dynamic"),
    )  # fmt: skip
    return node


def test_the_deployed_agent_creates_and_destroys_a_dynamic_mig_device_on_the_nodes_disk(
    work: Path, builds: Builds
) -> None:
    """``mig.mode=dynamic``: the pod's agent creates the claim's MIG device on prepare and keeps
    the simulated node's instances in its plugin directory, a hostPath on the node (so they
    outlive the pod, as real instances outlive the agent); unprepare destroys it."""
    api = FakeKubeApi(tls_dir=work / "tls", token="agent-token").start()
    node = None
    try:
        api.add_node(NODE)
        device = "gpu-1-mig-3g20gb-9-4"
        claim = api.add_claim(allocated_claim(name="dynmig", node=NODE, devices=[device]))
        node = start_dynamic_mig_node(work, builds=builds, api=api, simulate="a100-40gb:2:mig")
        dra_socket = register(node)
        ref = v1.Claim(namespace="default", name="dynmig", uid=claim["metadata"]["uid"])
        state = node.kubelet_dir / "plugins/gpu.nvidia.com/simulated-mig.json"
        gpu1 = simulated_inventory("a100-40gb:2", node_name=NODE).gpus[1].uuid
        with grpc.insecure_channel(f"unix://{dra_socket}") as channel:
            stub = v1_grpc.DRAPluginStub(channel)
            answer = stub.NodePrepareResources(
                v1.NodePrepareResourcesRequest(claims=[ref]), timeout=30
            )
            assert answer.claims[ref.uid].error == "", node.log.read_text()
            made = json.loads(state.read_text())["gpus"][gpu1]
            assert [(i["profile_id"], i["start"], len(i["compute_instances"])) for i in made] == [
                (9, 4, 1)
            ]
            undone = stub.NodeUnprepareResources(
                v1.NodeUnprepareResourcesRequest(claims=[ref]), timeout=30
            )
            assert undone.claims[ref.uid].error == "", node.log.read_text()
            assert json.loads(state.read_text())["gpus"][gpu1] == []
        assert node.stop() == 0, node.log.read_text()
    finally:
        if node is not None:
            node.stop()
        api.stop()


def test_the_deployed_agent_takes_a_whole_gpu_out_of_mig_mode_with_its_mark_on_the_nodes_disk(
    work: Path, builds: Builds
) -> None:
    """``mig.mode=dynamic`` on H100s: the pod's agent prepares the whole gpu-1 out of MIG mode,
    its mark written under the node's plugin directory (a hostPath: it outlives the pod, as the
    GPU's MIG mode does), and unprepare puts the GPU back and removes the mark."""
    api = FakeKubeApi(tls_dir=work / "tls", token="agent-token").start()
    node = None
    try:
        api.add_node(NODE)
        claim = api.add_claim(allocated_claim(name="whole", node=NODE, devices=["gpu-1"]))
        node = start_dynamic_mig_node(work, builds=builds, api=api, simulate="h100:2:mig")
        dra_socket = register(node)
        ref = v1.Claim(namespace="default", name="whole", uid=claim["metadata"]["uid"])
        plugin_dir = node.kubelet_dir / "plugins/gpu.nvidia.com"
        gpu1 = simulated_inventory("h100:2", node_name=NODE).gpus[1].uuid
        mark = plugin_dir / "mig-off" / f"{gpu1}.json"

        def mig_mode() -> dict[str, int]:
            modes: dict[str, int] = json.loads((plugin_dir / "simulated-mig.json").read_text())[
                "mig_mode"
            ][gpu1]
            return modes

        with grpc.insecure_channel(f"unix://{dra_socket}") as channel:
            stub = v1_grpc.DRAPluginStub(channel)
            answer = stub.NodePrepareResources(
                v1.NodePrepareResourcesRequest(claims=[ref]), timeout=30
            )
            assert answer.claims[ref.uid].error == "", node.log.read_text()
            assert mig_mode() == {"current": 0, "pending": 0}
            assert "7g.80gb" in [p["name"] for p in json.loads(mark.read_text())["profiles"]]
            undone = stub.NodeUnprepareResources(
                v1.NodeUnprepareResourcesRequest(claims=[ref]), timeout=30
            )
            assert undone.claims[ref.uid].error == "", node.log.read_text()
            assert mig_mode() == {"current": 1, "pending": 1}
            assert not mark.exists()
        assert node.stop() == 0, node.log.read_text()
    finally:
        if node is not None:
            node.stop()
        api.stop()


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc/*/stat's parent field)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue  # ended meanwhile
            parents[int(entry.name)] = int(stat.rpartition(")")[2].split()[1])
    found, todo = [], [pid]
    while todo:
        above = todo.pop()
        children = [p for p, parent in parents.items() if parent == above]
        found += children
        todo += children
    return found


def test_the_deployed_agent_keeps_every_thread_on_one_cpu_when_the_values_say_so(
    work: Path, builds: Builds
) -> None:
    """``cpuAffinity=one``: the pod's agent, every one of its threads (gRPC's, ours), runs on
    the highest-numbered CPU the pod may use, and says so in its log. (And the chart's
    interpreter settings reach it: it runs as ``python -OO``, as every test here runs it.)"""
    allowed = os.sched_getaffinity(0)  # the pod's, as the node namespace inherits it
    if len(allowed) < 2:
        pytest.skip("this machine gives the pod one CPU: nothing to choose")
    api = FakeKubeApi(tls_dir=work / "tls", token="agent-token").start()
    node = None
    try:
        api.add_node(NODE)
        node, _ = start_node(
            work, layout="gpu-operator", builds=builds, api=api,
            extra_values=("--set", "cpuAffinity=one"),
        )  # fmt: skip
        register(node)
        (agent,) = [
            p
            for p in _descendants(node.process.pid)
            if b"gpu-dra-kubelet-plugin" in Path(f"/proc/{p}/cmdline").read_bytes()
        ]
        cpus = {
            tid: re.findall(r"Cpus_allowed_list:\s*(\S+)", Path(f"/proc/{agent}/task/{tid}/status")
                            .read_text())[0]
            for tid in os.listdir(f"/proc/{agent}/task")
        }  # fmt: skip
        assert b"\0PYTHONOPTIMIZE=2\0" in b"\0" + Path(f"/proc/{agent}/environ").read_bytes()
        assert len(cpus) > 5, cpus  # gRPC's threads and the agent's own
        assert set(cpus.values()) == {str(max(allowed))}, cpus
        assert node.stop() == 0, node.log.read_text()
        lines = [json.loads(s) for s in node.log.read_text().splitlines() if s.startswith("{")]
        assert {"msg": "the agent runs on one CPU (--cpu-affinity one)", "cpu": max(allowed)} in [
            {k: line.get(k) for k in ("msg", "cpu")} for line in lines
        ]
    finally:
        if node is not None:
            node.stop()
        api.stop()
