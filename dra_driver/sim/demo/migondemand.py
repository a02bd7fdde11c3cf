"""Step 7 of ``make demo``: MIG on demand through the real agent (local API server only). An
H100 that is not in MIG mode (``MIG_ON_DEMAND_SIMULATE``) under ``--mig-mode dynamic`` is
published partitionable; a ``3g.40gb`` claim allocated by the explain allocator is prepared on
it, which turns MIG mode on and creates the MIG device, and unprepared, which destroys it and
turns MIG mode off again. The MIG mode is shown as NVML reports it at each point."""

from __future__ import annotations

import json
import subprocess
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
from dra_driver.sim.demo import DEMO_NODE, DRIVER, MIG_ON_DEMAND_SIMULATE
from dra_driver.sim.demo.cluster import (
    agent_command,
    allocated,
    register,
    resource_claim,
    run_agent,
)
from dra_driver.sim.demo.console import step, wait_for

if TYPE_CHECKING:
    from dra_driver.gpus.info import GpuInfo

MIG_CLAIM = resource_claim(
    "demo-mig-on-demand",
    "mig",
    "mig.nvidia.com",
    selector="device.attributes['gpu.nvidia.com'].profile == '3g.40gb'",
)


def run_mig_on_demand(workdir: Path, *, fake_api: Any, driver_root: Path) -> int:
    """Step 7: the agent with ``--mig-mode dynamic`` on an H100 not in MIG mode; a 3g.40gb
    claim prepared and unprepared on it."""
    workdir.mkdir()
    kubeconfig = workdir.parent / "kubeconfig"
    command, plugins, registry, cdi_root = agent_command(
        DEMO_NODE,
        MIG_ON_DEMAND_SIMULATE,
        kubeconfig=kubeconfig,
        driver_root=driver_root,
        workdir=workdir,
    )
    command += ["--mig-mode", "dynamic"]
    print("    " + " ".join(command[2:]))
    print(f"    gpu-0 in MIG mode: {_gpu(plugins).mig_enabled} (as NVML reports it)")
    kube = KubeClient.from_config(kubeconfig=kubeconfig)
    return run_agent(
        command,
        workdir / "agent.log",
        lambda agent: _prepare(agent, kube=kube, fake_api=fake_api, plugins=plugins,
                               registry=registry, cdi_root=cdi_root),
        cleanup=kube.close,
    )  # fmt: skip


def _prepare(
    agent: subprocess.Popen[bytes],
    *,
    kube: KubeClient,
    fake_api: Any,
    plugins: Path,
    registry: Path,
    cdi_root: Path,
) -> int:
    def partitionable_slices() -> list[dict[str, Any]] | None:
        if agent.poll() is not None:
            raise RuntimeError(f"the agent exited with {agent.returncode}; see its log below")
        items = list(kube.list_slices(driver_name=DRIVER, node_name=DEMO_NODE).items)
        sets = [c["name"] for item in items for c in item["spec"].get("sharedCounters") or ()]
        return items if "gpu-0-counter-set" in sets else None

    slices = wait_for("the agent's partitionable gpu-0 in the stored slices", partitionable_slices)
    time.sleep(0.3)  # let a multi-slice pool finish
    slices = partitionable_slices() or slices
    reg_socket = registry / f"{DRIVER}-reg.sock"
    wait_for("the registration socket", reg_socket.exists)
    register(reg_socket)
    devices = [d for item in slices for d in item["spec"].get("devices") or ()]
    placements = [d["name"] for d in devices if d["name"] != "gpu-0"]
    print(f"    published gpu-0 whole and {len(placements)} MIG placements of it, all consuming "
          "gpu-0-counter-set, though gpu-0 is not in MIG mode")  # fmt: skip

    step("Scheduler (gpu-dra explain's allocator): a 3g.40gb MIG device")
    result = explain.allocate([MIG_CLAIM], default_device_classes(DRIVER), slices, node=DEMO_NODE)
    if result.chosen is None:
        print("    not satisfiable on this node")
        return 1
    (allocation,) = [a["allocation"] for a in explain.result_json(result)["allocation"]["claims"]]
    claim = allocated(MIG_CLAIM, allocation, DEMO_NODE)
    for r in claim["status"]["allocation"]["devices"]["results"]:
        print(f"    {claim['metadata']['name']}: {r['pool']}/{r['device']}")
    fake_api.add_claim(claim)  # the scheduler's write, done by hand here
    meta = claim["metadata"]
    ref = dra_pb2.Claim(namespace="default", name=meta["name"], uid=meta["uid"])
    dra_socket = plugins / DRIVER / "dra.sock"
    specs = CdiSpecDir(cdi_root, vendor=f"k8s.{DRIVER}")
    step("Kubelet: NodePrepareResources, then NodeUnprepareResources, of the 3g.40gb claim")
    with grpc.insecure_channel(f"unix://{dra_socket}") as channel:
        dra = dra_grpc.DRAPluginStub(channel)
        try:
            answer = dra.NodePrepareResources(
                dra_pb2.NodePrepareResourcesRequest(claims=[ref]), timeout=45
            )
            errors = [answer.claims[ref.uid].error] if answer.claims[ref.uid].error else []
            gpu = _gpu(plugins)
            print(f"    prepared; errors: {errors}; gpu-0 in MIG mode: {gpu.mig_enabled}; "
                  f"MIG devices: {_instances(gpu)}")  # fmt: skip
            path = specs.path_for(ref.uid)
            if path.exists():
                (device,) = json.loads(path.read_text())["devices"]
                nodes = [n["path"] for n in device["containerEdits"]["deviceNodes"]]
                print(f"    CDI device {device['name']}: device nodes {nodes}")
        finally:  # the instance and the MIG mode outlive the agent: always unprepare
            undone = dra.NodeUnprepareResources(
                dra_pb2.NodeUnprepareResourcesRequest(claims=[ref]), timeout=45
            )
        errors += [undone.claims[ref.uid].error] if undone.claims[ref.uid].error else []
    gpu = _gpu(plugins)
    print(f"    unprepared; errors: {errors}; gpu-0 in MIG mode: {gpu.mig_enabled}; "
          f"MIG devices: {_instances(gpu)}")  # fmt: skip
    return 0 if not errors else 1


def _gpu(plugins: Path) -> GpuInfo:
    """gpu-0 now, as the agent's NVML sees it: discovery in this process over the simulated MIG
    state the agent keeps (config.py)."""
    from dra_driver.gpus import nvml  # noqa: PLC0415
    from dra_driver.paths import simulated_mig_state_path  # noqa: PLC0415
    from dra_driver.sim.nvml import simulated_nvml  # noqa: PLC0415

    state = simulated_mig_state_path(plugins / DRIVER)
    with simulated_nvml(MIG_ON_DEMAND_SIMULATE, node_name=DEMO_NODE, state_path=state) as sim:
        (gpu,) = nvml.discover(driver_root=Path("/"), sysfs_root=sim.sysfs_root).gpus
    return gpu


def _instances(gpu: GpuInfo) -> list[str]:
    from dra_driver.devices import mig_instance_name  # noqa: PLC0415

    return [f"{mig_instance_name(gpu, m)} ({m.uuid})" for m in gpu.mig_instances]
