"""``make demo``: the whole node flow on simulated GPUs, no GPU and no cluster needed.

1. Starts a local API server (the one the tests use) unless ``KUBECONFIG`` names a cluster.
2. Runs the real node agent process on a simulated node (``DEMO_SIMULATE``) and shows, as a
   table, the ResourceSlices the API server stored.
3. Acts as the kubelet: registers over the registration socket (GetInfo).
4. GPU health: makes simulated GPU 0 fall off the bus (``gpu-dra simulate-event --lost``, XID
   79), shows its taints in the stored slice and the Node Events, then resets it and shows them
   gone.
5. Allocates a claim with the ``gpu-dra explain`` allocator against the stored slices, calls
   NodePrepareResources over dra.sock and shows the answer, the CDI spec and the agent's log.
6. Ends with ``gpu-dra status`` of the node, read from the agent's ``/metrics``: every GPU and MIG
   device with the claim and pod holding it and its simulated readings; then unprepares the
   claim, stops the agent with SIGTERM and says that both sockets are gone.
7. Sharing and dynamic MIG (local API server only, and root only: each MPS daemon gets a tmpfs):
   starts the agent again on ``SHARING_SIMULATE`` with ``--consumable-shares compute``, MPS on
   (``--mps-image``; the stand-in kubelet of localkubelet.py runs its daemon Deployments as
   processes) and ``--mig-mode dynamic``. Two claims of 20Gi with 30% and 50% of the compute are
   allocated shares of gpu-0 by the explain allocator (shareIDs and consumedCapacity are the
   scheduler's) and a third the 3g.40gb placement of the GPU in MIG mode; one
   NodePrepareResources over dra.sock prepares all three. It shows gpu-0's one MPS daemon
   (Deployment and process), each share's CDI device and MPS limits, and the MIG instance
   prepare created; then unprepares them and shows the daemon and the instance gone. Last, a
   claim of the whole gpu-1 (in MIG mode): prepare takes it out of MIG mode, unprepare puts it
   back.

Against a real cluster (``KUBECONFIG`` set) steps 1-4 publish to that cluster and step 5 only
explains the allocation: writing a claim's allocation is the scheduler's job there. Step 7 is
skipped there: it would create Deployments and claims in that cluster.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from dra_driver._proto.dra_v1 import api_pb2 as dra_pb2
from dra_driver._proto.dra_v1 import api_pb2_grpc as dra_grpc
from dra_driver._proto.pluginregistration_v1 import api_pb2 as reg_pb2
from dra_driver._proto.pluginregistration_v1 import api_pb2_grpc as reg_grpc
from dra_driver.cdi import CdiSpecDir
from dra_driver.devices import table
from dra_driver.devices.classes import default_device_classes
from dra_driver.errors import MetricsUnavailable
from dra_driver.kube import KubeClient
from dra_driver.scheduling import explain
from dra_driver.sim.localapi import free_port

if TYPE_CHECKING:
    from dra_driver.gpus.info import Inventory

DEMO_NODE = "demo-node"
# The demo node: four H100 (two per PCIe root), an A100 80GB in MIG mode with pre-created
# instances, and an L4. Every example in examples/resourceclaims/ must be satisfiable on it.
DEMO_SIMULATE = "h100:4,a100-80gb:1:mig=3g.40gb+2g.20gb+1g.10gb+1g.10gb,l4:1"
# Step 7's node: an H100 to share, and an H100 in MIG mode without MIG devices (dynamic MIG).
SHARING_SIMULATE = "h100:1,h100:1:mig"
DRIVER = "gpu.nvidia.com"
MPS_NAMESPACE = "gpu-dra"
REPO = Path(__file__).resolve().parent.parent


def _claim(
    name: str,
    request: str,
    device_class: str,
    *,
    selector: str | None = None,
    capacity: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A ResourceClaim of one device of ``device_class``, as a user would write it."""
    exactly: dict[str, Any] = {"deviceClassName": device_class}
    if selector is not None:
        exactly["selectors"] = [{"cel": {"expression": selector}}]
    if capacity is not None:
        exactly["capacity"] = {"requests": capacity}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"devices": {"requests": [{"name": request, "exactly": exactly}]}},
    }


# What a user would write: one GPU with at least 40 GiB of memory.
DEMO_CLAIM = _claim(
    "demo-gpu",
    "gpu",
    "gpu.nvidia.com",
    selector="device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('40Gi')) >= 0",
)


def _share_claim(name: str, compute_percent: int) -> dict[str, Any]:
    """20Gi of GPU memory and ``compute_percent`` of its compute, as consumable shares."""
    return _claim(
        name, "gpu", "gpu.nvidia.com", capacity={"memory": "20Gi", "compute": str(compute_percent)}
    )


# A MIG device of profile 3g.40gb: under --mig-mode dynamic, created by prepare.
MIG_CLAIM = _claim(
    "demo-mig",
    "mig",
    "mig.nvidia.com",
    selector="device.attributes['gpu.nvidia.com'].profile == '3g.40gb'",
)

T = TypeVar("T")


def _step(text: str) -> None:
    print(f"\n\033[1m==> {text}\033[0m" if sys.stdout.isatty() else f"\n==> {text}", flush=True)


def _wait_for(what: str, probe: Callable[[], T | None], *, timeout_s: float = 20.0) -> T:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.05)
    raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")


@contextmanager
def _local_api_server(workdir: Path) -> Iterator[tuple[Path, Any]]:
    """The local API server from dra_driver/sim/localapi.py with a Node, and a kubeconfig for it."""
    from dra_driver.sim.localapi import FakeKubeApi  # noqa: PLC0415  (only the local demo needs it)

    api = FakeKubeApi().start()
    try:
        api.add_node(DEMO_NODE)
        yield api.write_kubeconfig(workdir / "kubeconfig"), api
    finally:
        api.stop()


def _fake_driver_root(workdir: Path) -> Path:
    """A driver install laid out like a real one, so the CDI spec shows real mounts."""
    from dra_driver.sim.fakedriver import make_fake_driver  # noqa: PLC0415

    return make_fake_driver(workdir / "driver").root


def main() -> int:
    real_cluster = bool(os.environ.get("KUBECONFIG"))
    node = os.environ.get("NODE_NAME", DEMO_NODE) if real_cluster else DEMO_NODE
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gpu-dra-demo-")))
        if real_cluster:
            kubeconfig = Path(os.environ["KUBECONFIG"])
            _step(f"Publishing to the cluster of KUBECONFIG={kubeconfig} as node {node}")
            fake_api = None
        else:
            _step("Starting a local API server (no cluster needed; KUBECONFIG unset)")
            kubeconfig, fake_api = stack.enter_context(_local_api_server(workdir))
            print(f"    serving at {fake_api.url}")
        driver_root = _fake_driver_root(workdir)
        metrics_port = free_port()
        _step(f"Starting the node agent on simulated GPUs: --simulate {DEMO_SIMULATE}")
        command, plugins, registry, cdi_root = _agent_command(
            node, DEMO_SIMULATE, kubeconfig=kubeconfig, driver_root=driver_root, workdir=workdir
        )
        command += [
            "--metrics-port", str(metrics_port), "--telemetry-interval", "1",
            # Quick health checks and a short flapping limit keep the health step short.
            "--health-check-interval", "0.5", "--health-min-change-interval", "1",
        ]  # fmt: skip
        print("    " + " ".join(command[2:]))
        log_path = workdir / "agent.log"
        with log_path.open("w") as log_file:
            agent = subprocess.Popen(command, stderr=log_file)
        shown = False
        try:
            rc = _run(agent, kubeconfig=kubeconfig, node=node, registry=registry,
                      plugins=plugins, cdi_root=cdi_root, fake_api=fake_api, log_path=log_path,
                      metrics_url=f"http://127.0.0.1:{metrics_port}/metrics")  # fmt: skip
            shown = True
        finally:
            if agent.poll() is None:
                agent.send_signal(signal.SIGTERM)
                agent.wait(timeout=15)
            if not shown:
                _step("Agent log (structured logs, --log-format text)")
                print(log_path.read_text().rstrip())
        if agent.returncode not in (0, -signal.SIGTERM):
            print(f"agent exited with {agent.returncode}", file=sys.stderr)
            return 1
        if rc != 0:
            return rc
        _step(
            "Sharing and dynamic MIG: the agent with --consumable-shares, MPS, --mig-mode dynamic"
        )
        if fake_api is None:
            print("    skipped against a real cluster: it would create MPS daemon Deployments and")
            print("    claims there (it runs with the local API server only: unset KUBECONFIG)")
            return 0
        if os.geteuid() != 0:
            print("    skipped: not root. Each MPS control daemon gets a tmpfs mounted on its shm")
            print("    directory, which needs root (run `sudo make demo` to see this step)")
            return 0
        return _sharing(workdir / "sharing", fake_api=fake_api, driver_root=driver_root)
    return 0


def _run(
    agent: subprocess.Popen[bytes],
    *,
    kubeconfig: Path,
    node: str,
    registry: Path,
    plugins: Path,
    cdi_root: Path,
    fake_api: Any,
    log_path: Path,
    metrics_url: str,
) -> int:
    kube = KubeClient.from_config(kubeconfig=kubeconfig)

    def stored_slices() -> list[dict[str, Any]] | None:
        if agent.poll() is not None:
            raise RuntimeError(f"the agent exited with {agent.returncode}; see its log below")
        items = list(kube.list_slices(driver_name=DRIVER, node_name=node).items)
        return items or None

    slices = _wait_for("the first ResourceSlice", stored_slices)
    time.sleep(0.3)  # let a multi-slice pool finish
    slices = stored_slices() or slices
    _step(f"ResourceSlices stored by the API server for node {node}")
    print(table.render(table.device_rows(slices)))

    reg_socket = registry / f"{DRIVER}-reg.sock"
    dra_socket = plugins / DRIVER / "dra.sock"
    _wait_for("the registration socket", reg_socket.exists)
    _step(f"Kubelet: GetInfo over {reg_socket}")
    with grpc.insecure_channel(f"unix://{reg_socket}") as channel:
        registration = reg_grpc.RegistrationStub(channel)
        info = registration.GetInfo(reg_pb2.InfoRequest(), timeout=1)
        print(f"    type={info.type} name={info.name}\n    endpoint={info.endpoint}")
        print(f"    supported_versions={list(info.supported_versions)}")
        registration.NotifyRegistrationStatus(
            reg_pb2.RegistrationStatus(plugin_registered=True), timeout=5
        )

    _health(stored_slices, plugins=plugins, node=node, fake_api=fake_api)

    _step("Scheduler (gpu-dra explain's allocator): one GPU with >= 40Gi of memory")
    result = explain.allocate(DEMO_CLAIM, default_device_classes(DRIVER), slices, node=node)
    if result.chosen is None:
        print("    not satisfiable on this node")
        return 1
    allocation = explain.result_json(result)["allocation"]["claims"][0]["allocation"]
    for r in allocation["devices"]["results"]:
        print(f"    request {r['request']} -> {r['driver']}/{r['pool']}/{r['device']}")
    if fake_api is None:
        print("    (real cluster: the scheduler allocates claims there)")
        _show_status(metrics_url, log_path, claim=None)
        return 0

    claim = json.loads(json.dumps(DEMO_CLAIM))
    claim["metadata"]["uid"] = str(uuid.uuid4())
    claim["status"] = {
        "allocation": {
            **allocation,
            "nodeSelector": {
                "nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
                ]
            },
        },
        "reservedFor": [{"resource": "pods", "name": "demo-pod", "uid": str(uuid.uuid4())}],
    }
    fake_api.add_claim(claim)  # the scheduler's write, done by hand here
    request = dra_pb2.Claim(namespace="default", name="demo-gpu", uid=claim["metadata"]["uid"])
    _step(f"Kubelet: NodePrepareResources over {dra_socket}")
    with grpc.insecure_channel(f"unix://{dra_socket}") as channel:
        dra = dra_grpc.DRAPluginStub(channel)
        started = time.perf_counter()
        answer = dra.NodePrepareResources(
            dra_pb2.NodePrepareResourcesRequest(claims=[request]), timeout=45
        )
        took_ms = (time.perf_counter() - started) * 1000
        for uid, entry in answer.claims.items():
            print(f"    claim {uid}: error={entry.error!r} ({took_ms:.1f} ms)")
            for d in entry.devices:
                print(
                    f"      device {d.pool_name}/{d.device_name} requests={list(d.request_names)}"
                )
                print(f"        cdi_device_ids={list(d.cdi_device_ids)}")
        specs = sorted(cdi_root.glob("*.json"))
        for spec in specs:
            _step(f"CDI spec written for the container runtime: {spec}")
            print(_readable_json(json.loads(spec.read_text())))
        _show_status(metrics_url, log_path, claim="demo-gpu")
        undone = dra.NodeUnprepareResources(
            dra_pb2.NodeUnprepareResourcesRequest(claims=[request]), timeout=45
        )
        print(
            f"\n    then NodeUnprepareResources: error={undone.claims[request.uid].error!r}; "
            f"CDI specs left: {[p.name for p in cdi_root.glob('*.json')]}"
        )

    agent.send_signal(signal.SIGTERM)
    agent.wait(timeout=15)
    print(f"    and SIGTERM: exit code {agent.returncode}; registration socket exists: "
          f"{reg_socket.exists()}, DRA socket exists: {dra_socket.exists()}")  # fmt: skip
    return 0 if not answer.claims[request.uid].error else 1


def _agent_command(
    node: str, simulate: str, *, kubeconfig: Path, driver_root: Path, workdir: Path
) -> tuple[list[str], Path, Path, Path]:
    """The agent's command line over ``workdir``: (argv, plugins, registry, CDI root)."""
    plugins, registry, cdi_root = workdir / "plugins", workdir / "registry", workdir / "cdi"
    command = [
        sys.executable, "-m", "dra_driver",
        "--node-name", node, "--simulate", simulate, "--kubeconfig", str(kubeconfig),
        "--nvidia-driver-root", str(driver_root),
        "--kubelet-plugins-directory-path", str(plugins),
        "--kubelet-registrar-directory-path", str(registry),
        "--cdi-root", str(cdi_root), "--healthcheck-port", "0", "--log-format", "text",
    ]  # fmt: skip
    return command, plugins, registry, cdi_root


def _register(reg_socket: Path) -> None:
    """What the kubelet does with a new plugin: GetInfo, then NotifyRegistrationStatus."""
    with grpc.insecure_channel(f"unix://{reg_socket}") as channel:
        registration = reg_grpc.RegistrationStub(channel)
        registration.GetInfo(reg_pb2.InfoRequest(), timeout=1)
        registration.NotifyRegistrationStatus(
            reg_pb2.RegistrationStatus(plugin_registered=True), timeout=5
        )


def _allocated(claim: dict[str, Any], allocation: dict[str, Any], node: str) -> dict[str, Any]:
    """``claim`` with the scheduler's write: its allocation on ``node``, reserved for a pod."""
    out: dict[str, Any] = json.loads(json.dumps(claim))
    out["metadata"]["uid"] = str(uuid.uuid4())
    out["status"] = {
        "allocation": {
            **allocation,
            "nodeSelector": {
                "nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
                ]
            },
        },
        "reservedFor": [
            {
                "resource": "pods",
                "name": f"{claim['metadata']['name']}-pod",
                "uid": str(uuid.uuid4()),
            }
        ],
    }
    return out


def _sharing(workdir: Path, *, fake_api: Any, driver_root: Path) -> int:
    """Step 7: shares of gpu-0 enforced by one MPS daemon, and a dynamic MIG device, prepared
    and unprepared through the real agent (local API server, root)."""
    from dra_driver.sim.localkubelet import DeploymentKubelet  # noqa: PLC0415  (local demo only)

    node = DEMO_NODE
    workdir.mkdir()
    kubeconfig = workdir.parent / "kubeconfig"
    command, plugins, registry, cdi_root = _agent_command(
        node, SHARING_SIMULATE, kubeconfig=kubeconfig, driver_root=driver_root, workdir=workdir
    )
    command += [
        "--consumable-shares", "compute", "--mig-mode", "dynamic",
        "--mps-image", "gpu-dra:demo", "--pod-namespace", MPS_NAMESPACE,
    ]  # fmt: skip
    print("    " + " ".join(command[2:]))
    print(
        "    (the stand-in kubelet of dra_driver/sim/localkubelet.py runs the Deployments the agent"
    )
    print("    creates for MPS control daemons, as processes of the fake driver root's daemon)")
    kubelet = DeploymentKubelet(fake_api, node_name=node, log_dir=workdir / "pods").start()
    log_path = workdir / "agent.log"
    with log_path.open("w") as log_file:
        agent = subprocess.Popen(command, stderr=log_file)
    kube = KubeClient.from_config(kubeconfig=kubeconfig)
    shown = False
    try:
        rc = _prepare_shared(agent, kube=kube, kubelet=kubelet, fake_api=fake_api, node=node,
                             plugins=plugins, registry=registry, cdi_root=cdi_root)  # fmt: skip
        shown = True
    finally:
        if agent.poll() is None:
            agent.send_signal(signal.SIGTERM)
            agent.wait(timeout=15)
        kubelet.stop()
        kube.close()
        _unmount_left(workdir)
        if not shown:
            _step("Agent log (structured logs, --log-format text)")
            print(log_path.read_text().rstrip())
    if agent.returncode not in (0, -signal.SIGTERM):
        print(f"agent exited with {agent.returncode}", file=sys.stderr)
        return 1
    return rc


def _prepare_shared(
    agent: subprocess.Popen[bytes],
    *,
    kube: KubeClient,
    kubelet: Any,
    fake_api: Any,
    node: str,
    plugins: Path,
    registry: Path,
    cdi_root: Path,
) -> int:
    def shareable_slices() -> list[dict[str, Any]] | None:
        if agent.poll() is not None:
            raise RuntimeError(f"the agent exited with {agent.returncode}; see its log below")
        items = list(kube.list_slices(driver_name=DRIVER, node_name=node).items)
        devices = [d for item in items for d in item["spec"].get("devices") or ()]
        if any(d["name"] == "gpu-0" and d.get("allowMultipleAllocations") for d in devices):
            return items
        return None

    slices = _wait_for("the agent's shareable gpu-0 in the stored slices", shareable_slices)
    time.sleep(0.3)  # let a multi-slice pool finish
    slices = shareable_slices() or slices
    reg_socket = registry / f"{DRIVER}-reg.sock"
    _wait_for("the registration socket", reg_socket.exists)
    _register(reg_socket)
    devices = [d for item in slices for d in item["spec"].get("devices") or ()]
    shared = [d["name"] for d in devices if d.get("allowMultipleAllocations")]
    whole = [d["name"] for d in devices if not d.get("allowMultipleAllocations")]
    print(f"    published {len(devices)} devices: {', '.join(shared)} with "
          f"allowMultipleAllocations (consumable shares); gpu-1 whole and {len(whole) - 1} MIG "
          "placements of it (dynamic MIG, allocated whole)")  # fmt: skip

    _step("Scheduler (gpu-dra explain's allocator): two 20Gi shares (30% and 50% of the compute) "
          "and a 3g.40gb MIG device")  # fmt: skip
    wanted = [_share_claim("demo-share-a", 30), _share_claim("demo-share-b", 50), MIG_CLAIM]
    result = explain.allocate(wanted, default_device_classes(DRIVER), slices, node=node)
    if result.chosen is None:
        print("    not satisfiable on this node")
        return 1
    allocations = [a["allocation"] for a in explain.result_json(result)["allocation"]["claims"]]
    claims = [_allocated(c, a, node) for c, a in zip(wanted, allocations, strict=True)]
    for claim in claims:
        for r in claim["status"]["allocation"]["devices"]["results"]:
            share = (f" shareID={r['shareID']} consumedCapacity={r['consumedCapacity']}"
                     if r.get("shareID") else "")  # fmt: skip
            print(f"    {claim['metadata']['name']}: {r['pool']}/{r['device']}{share}")
        fake_api.add_claim(claim)  # the scheduler's write, done by hand here
    requests = [
        dra_pb2.Claim(namespace="default", name=c["metadata"]["name"], uid=c["metadata"]["uid"])
        for c in claims
    ]
    dra_socket = plugins / DRIVER / "dra.sock"
    specs = CdiSpecDir(cdi_root, vendor=f"k8s.{DRIVER}")
    _step(f"Kubelet: NodePrepareResources of the three claims over {dra_socket}")
    with grpc.insecure_channel(f"unix://{dra_socket}") as channel:
        dra = dra_grpc.DRAPluginStub(channel)
        try:
            started = time.perf_counter()
            answer = dra.NodePrepareResources(
                dra_pb2.NodePrepareResourcesRequest(claims=requests), timeout=45
            )
            took_ms = (time.perf_counter() - started) * 1000
            errors = [answer.claims[r.uid].error for r in requests if answer.claims[r.uid].error]
            print(f"    {len(requests)} claims prepared in {took_ms:.0f} ms; errors: {errors}")
            print(f"    MPS daemon Deployments: {_deployments(fake_api)}; daemon processes "
                  f"running: {sorted(name for _, name in kubelet.running())}")  # fmt: skip
            for r, claim in zip(requests, claims, strict=True):
                path = specs.path_for(r.uid)
                if path.exists():
                    _show_share_spec(claim["metadata"]["name"], json.loads(path.read_text()))
            print(f"    MIG instances now: {_mig_instances(plugins)}")
        finally:  # the daemon and the instance outlive the agent: always unprepare
            undone = dra.NodeUnprepareResources(
                dra_pb2.NodeUnprepareResourcesRequest(claims=requests), timeout=45
            )
        errors += [undone.claims[r.uid].error for r in requests if undone.claims[r.uid].error]
    _step("Kubelet: NodeUnprepareResources of the three claims")
    _wait_for("the MPS daemon to stop", lambda: not kubelet.running(), timeout_s=10)
    print(f"    errors: {errors}; MPS daemon Deployments: {_deployments(fake_api)}; daemon "
          f"processes running: {sorted(n for _, n in kubelet.running())}")  # fmt: skip
    print(f"    MIG instances now: {_mig_instances(plugins)}; CDI specs left: "
          f"{[p.name for p in cdi_root.glob('*.json')]}")  # fmt: skip
    if errors:
        return 1
    return _whole_gpu(slices, fake_api=fake_api, node=node, plugins=plugins, specs=specs)


def _whole_gpu(
    slices: list[dict[str, Any]], *, fake_api: Any, node: str, plugins: Path, specs: CdiSpecDir
) -> int:
    """Step 7, last part: the whole gpu-1 (in MIG mode, dynamic) prepared out of MIG mode."""
    _step("Scheduler: the whole gpu-1, a GPU in MIG mode (every counter of gpu-1-counter-set)")
    devices = {d["name"]: d for item in slices for d in item["spec"].get("devices") or ()}
    uuid_ = devices["gpu-1"]["attributes"]["uuid"]["string"]
    wanted = _claim(
        "demo-whole-gpu",
        "gpu",
        "gpu.nvidia.com",
        selector=f"device.attributes['gpu.nvidia.com'].uuid == '{uuid_}'",
    )
    result = explain.allocate([wanted], default_device_classes(DRIVER), slices, node=node)
    if result.chosen is None:
        print("    not satisfiable on this node")
        return 1
    (allocation,) = [a["allocation"] for a in explain.result_json(result)["allocation"]["claims"]]
    claim = _allocated(wanted, allocation, node)
    for r in claim["status"]["allocation"]["devices"]["results"]:
        print(f"    {claim['metadata']['name']}: {r['pool']}/{r['device']}")
    fake_api.add_claim(claim)
    ref = dra_pb2.Claim(namespace="default", name="demo-whole-gpu", uid=claim["metadata"]["uid"])
    dra_socket = plugins / DRIVER / "dra.sock"
    _step("Kubelet: NodePrepareResources, then NodeUnprepareResources, of the whole gpu-1")
    with grpc.insecure_channel(f"unix://{dra_socket}") as channel:
        dra = dra_grpc.DRAPluginStub(channel)
        try:
            answer = dra.NodePrepareResources(
                dra_pb2.NodePrepareResourcesRequest(claims=[ref]), timeout=45
            )
            errors = [answer.claims[ref.uid].error] if answer.claims[ref.uid].error else []
            print(f"    prepared; errors: {errors}; gpu-1 in MIG mode: {_mig_mode(plugins)}")
            path = specs.path_for(ref.uid)
            if path.exists():
                (device,) = json.loads(path.read_text())["devices"]
                nodes = [n["path"] for n in device["containerEdits"]["deviceNodes"]]
                print(f"    CDI device {device['name']}: device nodes {nodes}")
        finally:  # the GPU stays out of MIG mode until unprepared: always unprepare
            undone = dra.NodeUnprepareResources(
                dra_pb2.NodeUnprepareResourcesRequest(claims=[ref]), timeout=45
            )
        errors += [undone.claims[ref.uid].error] if undone.claims[ref.uid].error else []
    print(f"    unprepared; errors: {errors}; gpu-1 in MIG mode: {_mig_mode(plugins)}")
    return 0 if not errors else 1


def _mig_mode(plugins: Path) -> bool:
    """Whether gpu-1 of the simulated node is in MIG mode now, as NVML says (not the marks)."""
    return next(g.mig_enabled for g in _sharing_node(plugins).gpus if g.minor == 1)


def _sharing_node(plugins: Path) -> Inventory:
    """Step 7's GPUs now, as the agent's NVML sees them: discovery in this process over the
    simulated MIG state the agent keeps (config.py)."""
    from dra_driver.gpus import nvml  # noqa: PLC0415
    from dra_driver.paths import simulated_mig_state_path  # noqa: PLC0415
    from dra_driver.sim.nvml import simulated_nvml  # noqa: PLC0415

    state = simulated_mig_state_path(plugins / DRIVER)
    with simulated_nvml(SHARING_SIMULATE, node_name=DEMO_NODE, state_path=state) as sim:
        return nvml.discover(driver_root=Path("/"), sysfs_root=sim.sysfs_root)


def _unmount_left(workdir: Path) -> None:
    """Unmount what a failed step left under ``workdir`` (an MPS daemon's tmpfs), so the demo's
    directory can be removed; says so, as nothing should be left."""
    prefix = str(workdir) + "/"
    for line in reversed(Path("/proc/self/mountinfo").read_text().splitlines()):
        mount = line.split(" ")[4]
        if mount.startswith(prefix):
            print(f"    left mounted, unmounting: {mount}", file=sys.stderr)
            subprocess.run(["umount", "--lazy", mount], check=False)


def _deployments(fake_api: Any) -> list[str]:
    return [d["metadata"]["name"] for d in fake_api.objects("deployments")]


def _show_share_spec(claim: str, spec: dict[str, Any]) -> None:
    """A claim's CDI devices: name, MPS environment, MIG capability nodes."""
    for device in spec["devices"]:
        edits = device["containerEdits"]
        print(f"    {claim}: CDI device {device['name']}")
        for line in edits.get("env") or ():
            if line.startswith("CUDA_MPS_"):
                print(f"        {line}")
        caps = [n["path"] for n in edits.get("deviceNodes") or () if "nvidia-caps" in n["path"]]
        if caps:
            print(f"        MIG capability device nodes (of the instance prepare made): {caps}")


def _mig_instances(plugins: Path) -> list[str]:
    """The MIG instances of step 7's node now (device name and MIG UUID)."""
    from dra_driver.devices import mig_instance_name  # noqa: PLC0415

    return [
        f"{mig_instance_name(gpu, m)} ({m.uuid})"
        for gpu in _sharing_node(plugins).gpus
        for m in gpu.mig_instances
    ]


def _show_status(metrics_url: str, log_path: Path, *, claim: str | None) -> None:
    """The agent's log so far, then ``gpu-dra status`` of the node (once the agent's telemetry
    has sampled ``claim`` holding its device)."""
    from dra_driver.telemetry import status  # noqa: PLC0415

    def sampled() -> bool:
        try:
            text = status.scrape(metrics_url)
        except MetricsUnavailable:
            return False
        return "gpu_dra_gpu_info" in text and (claim is None or f'"{claim}"' in text)

    _wait_for("the agent's telemetry", sampled)
    _step("Agent log so far (structured logs, --log-format text)")
    print(log_path.read_text().rstrip())
    _step(f"gpu-dra status --metrics-url {metrics_url}")
    status.main(["--metrics-url", metrics_url])


def _health(
    stored_slices: Callable[[], list[dict[str, Any]] | None],
    *,
    plugins: Path,
    node: str,
    fake_api: Any,
) -> None:
    """A GPU falls off the bus and is reset: its taints come and go in the stored slice."""
    from dra_driver.sim.faults import main as simulate_event_main  # noqa: PLC0415

    def taints_of_gpu_0() -> list[dict[str, Any]]:
        for item in stored_slices() or ():
            for device in item["spec"].get("devices") or ():
                if device["name"] == "gpu-0":
                    return list(device.get("taints") or ())
        return []

    def both_taints() -> list[dict[str, Any]] | None:
        found = taints_of_gpu_0()
        return found if len(found) == 2 else None

    where = ["--kubelet-plugins-directory-path", str(plugins), "--driver-name", DRIVER]
    _step("GPU health: GPU 0 falls off the bus (gpu-dra simulate-event --gpu 0 --lost)")
    simulate_event_main(["--gpu", "0", "--lost", *where])
    for taint in _wait_for("the gpu-0 taints", both_taints):
        print(f"    gpu-0 taint: {json.dumps(taint)}")
    _step("GPU health: GPU 0 is reset (gpu-dra simulate-event --gpu 0 --reset)")
    simulate_event_main(["--gpu", "0", "--reset", *where])
    _wait_for("gpu-0 without taints", lambda: not taints_of_gpu_0())
    print(f"    gpu-0 taints: {taints_of_gpu_0()}")
    if fake_api is None:
        return

    def events() -> list[dict[str, Any]]:
        found = fake_api.objects("events")
        return sorted(found, key=lambda e: int(e["metadata"]["resourceVersion"]))

    _wait_for("the DeviceHealthy Event", lambda: events()[-1]["reason"] == "DeviceHealthy")
    for event in events():
        print(f"    Event on Node {node}: {event['type']} {event['reason']}: {event['message']}")


def _readable_json(value: Any, indent: str = "") -> str:
    """JSON with one line per list entry: long CDI specs stay scannable."""
    nested = (dict, list)
    if isinstance(value, dict) and any(
        isinstance(v, dict) or (isinstance(v, list) and any(isinstance(x, nested) for x in v))
        for v in value.values()
    ):
        inner = indent + "  "
        items = [f"{inner}{json.dumps(k)}: {_readable_json(v, inner)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + f"\n{indent}}}"
    if isinstance(value, list) and value and any(isinstance(v, (dict, list)) for v in value):
        inner = indent + "  "
        items = [f"{inner}{_readable_json(v, inner)}" for v in value]
        return "[\n" + ",\n".join(items) + f"\n{indent}]"
    return json.dumps(value)


if __name__ == "__main__":
    raise SystemExit(main())
