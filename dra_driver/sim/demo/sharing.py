"""Step 8 of ``make demo``: sharing and dynamic MIG through the real agent (local API server and
root only). Two consumable shares of gpu-0 served by one MPS daemon (run by the stand-in kubelet
of localkubelet.py) and a MIG device prepare creates, all prepared by one NodePrepareResources
and unprepared by one NodeUnprepareResources; then the whole gpu-1, taken out of MIG mode by
prepare and put back by unprepare."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from dra_driver._proto.dra_v1 import api_pb2 as dra_pb2
from dra_driver._proto.dra_v1 import api_pb2_grpc as dra_grpc
from dra_driver.cdi import CdiSpecDir
from dra_driver.devices.classes import default_device_classes
from dra_driver.kube import KubeClient
from dra_driver.scheduling import explain
from dra_driver.sim.demo import DEMO_NODE, DRIVER, MPS_NAMESPACE, SHARING_SIMULATE
from dra_driver.sim.demo.cluster import (
    agent_command,
    allocated,
    register,
    resource_claim,
    run_agent,
)
from dra_driver.sim.demo.console import step, wait_for

if TYPE_CHECKING:
    from dra_driver.gpus.info import Inventory


def _share_claim(name: str, compute_percent: int) -> dict[str, Any]:
    """20Gi of GPU memory and ``compute_percent`` of its compute, as consumable shares."""
    return resource_claim(
        name, "gpu", "gpu.nvidia.com", capacity={"memory": "20Gi", "compute": str(compute_percent)}
    )


# A MIG device of profile 3g.40gb: under --mig-mode dynamic, created by prepare.
MIG_CLAIM = resource_claim(
    "demo-mig",
    "mig",
    "mig.nvidia.com",
    selector="device.attributes['gpu.nvidia.com'].profile == '3g.40gb'",
)


def run_sharing(workdir: Path, *, fake_api: Any, driver_root: Path) -> int:
    """Step 8: shares of gpu-0 enforced by one MPS daemon, and a dynamic MIG device, prepared
    and unprepared through the real agent (local API server, root)."""
    from dra_driver.sim.localkubelet import DeploymentKubelet  # noqa: PLC0415  (local demo only)

    node = DEMO_NODE
    workdir.mkdir()
    kubeconfig = workdir.parent / "kubeconfig"
    command, plugins, registry, cdi_root = agent_command(
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
    kube = KubeClient.from_config(kubeconfig=kubeconfig)

    def cleanup() -> None:
        kubelet.stop()
        kube.close()
        _unmount_left(workdir)

    return run_agent(
        command,
        workdir / "agent.log",
        lambda agent: _prepare_shared(agent, kube=kube, kubelet=kubelet, fake_api=fake_api,
                                      node=node, plugins=plugins, registry=registry,
                                      cdi_root=cdi_root),
        cleanup=cleanup,
    )  # fmt: skip


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

    slices = wait_for("the agent's shareable gpu-0 in the stored slices", shareable_slices)
    time.sleep(0.3)  # let a multi-slice pool finish
    slices = shareable_slices() or slices
    reg_socket = registry / f"{DRIVER}-reg.sock"
    wait_for("the registration socket", reg_socket.exists)
    register(reg_socket)
    devices = [d for item in slices for d in item["spec"].get("devices") or ()]
    shared = [d["name"] for d in devices if d.get("allowMultipleAllocations")]
    whole = [d["name"] for d in devices if not d.get("allowMultipleAllocations")]
    print(f"    published {len(devices)} devices: {', '.join(shared)} with "
          f"allowMultipleAllocations (consumable shares); gpu-1 whole and {len(whole) - 1} MIG "
          "placements of it (dynamic MIG, allocated whole)")  # fmt: skip

    step("Scheduler (gpu-dra explain's allocator): two 20Gi shares (30% and 50% of the compute) "
          "and a 3g.40gb MIG device")  # fmt: skip
    wanted = [_share_claim("demo-share-a", 30), _share_claim("demo-share-b", 50), MIG_CLAIM]
    result = explain.allocate(wanted, default_device_classes(DRIVER), slices, node=node)
    if result.chosen is None:
        print("    not satisfiable on this node")
        return 1
    allocations = [a["allocation"] for a in explain.result_json(result)["allocation"]["claims"]]
    claims = [allocated(c, a, node) for c, a in zip(wanted, allocations, strict=True)]
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
    step(f"Kubelet: NodePrepareResources of the three claims over {dra_socket}")
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
    step("Kubelet: NodeUnprepareResources of the three claims")
    wait_for("the MPS daemon to stop", lambda: not kubelet.running(), timeout_s=10)
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
    """Step 8, last part: the whole gpu-1 (in MIG mode, dynamic) prepared out of MIG mode."""
    step("Scheduler: the whole gpu-1, a GPU in MIG mode (every counter of gpu-1-counter-set)")
    devices = {d["name"]: d for item in slices for d in item["spec"].get("devices") or ()}
    uuid_ = devices["gpu-1"]["attributes"]["uuid"]["string"]
    wanted = resource_claim(
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
    claim = allocated(wanted, allocation, node)
    for r in claim["status"]["allocation"]["devices"]["results"]:
        print(f"    {claim['metadata']['name']}: {r['pool']}/{r['device']}")
    fake_api.add_claim(claim)
    ref = dra_pb2.Claim(namespace="default", name="demo-whole-gpu", uid=claim["metadata"]["uid"])
    dra_socket = plugins / DRIVER / "dra.sock"
    step("Kubelet: NodePrepareResources, then NodeUnprepareResources, of the whole gpu-1")
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
    """Step 8's GPUs now, as the agent's NVML sees them: discovery in this process over the
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
