"""Steps 1-6 of ``make demo`` (see the package's docstring) and ``main``, which runs them on the
demo node, then step 7 (sharing.py) on a node of its own."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import grpc

from dra_driver._proto.dra_v1 import api_pb2 as dra_pb2
from dra_driver._proto.dra_v1 import api_pb2_grpc as dra_grpc
from dra_driver._proto.pluginregistration_v1 import api_pb2 as reg_pb2
from dra_driver._proto.pluginregistration_v1 import api_pb2_grpc as reg_grpc
from dra_driver.devices import table
from dra_driver.devices.classes import default_device_classes
from dra_driver.errors import MetricsUnavailable
from dra_driver.kube import KubeClient
from dra_driver.scheduling import explain
from dra_driver.sim.demo import DEMO_NODE, DEMO_SIMULATE, DRIVER
from dra_driver.sim.demo.cluster import agent_command, resource_claim, run_agent
from dra_driver.sim.demo.console import readable_json, step, wait_for
from dra_driver.sim.demo.migondemand import run_mig_on_demand
from dra_driver.sim.demo.sharing import run_sharing
from dra_driver.sim.localapi.server import free_port

# What a user would write: one GPU with at least 40 GiB of memory.
DEMO_CLAIM = resource_claim(
    "demo-gpu",
    "gpu",
    "gpu.nvidia.com",
    selector="device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('40Gi')) >= 0",
)


@contextmanager
def _local_api_server(workdir: Path) -> Iterator[tuple[Path, Any]]:
    """The local API server (dra_driver/sim/localapi/) with a Node, and a kubeconfig for it."""
    from dra_driver.sim.localapi.server import FakeKubeApi  # noqa: PLC0415  (local demo only)

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
            step(f"Publishing to the cluster of KUBECONFIG={kubeconfig} as node {node}")
            fake_api = None
        else:
            step("Starting a local API server (no cluster needed; KUBECONFIG unset)")
            kubeconfig, fake_api = stack.enter_context(_local_api_server(workdir))
            print(f"    serving at {fake_api.url}")
        driver_root = _fake_driver_root(workdir)
        metrics_port = free_port()
        step(f"Starting the node agent on simulated GPUs: --simulate {DEMO_SIMULATE}")
        command, plugins, registry, cdi_root = agent_command(
            node, DEMO_SIMULATE, kubeconfig=kubeconfig, driver_root=driver_root, workdir=workdir
        )
        command += [
            "--metrics-port", str(metrics_port), "--telemetry-interval", "1",
            # Quick health checks and a short flapping limit keep the health step short.
            "--health-check-interval", "0.5", "--health-min-change-interval", "1",
        ]  # fmt: skip
        print("    " + " ".join(command[2:]))
        log_path = workdir / "agent.log"
        rc = run_agent(
            command,
            log_path,
            lambda agent: _run(agent, kubeconfig=kubeconfig, node=node, registry=registry,
                               plugins=plugins, cdi_root=cdi_root, fake_api=fake_api,
                               log_path=log_path,
                               metrics_url=f"http://127.0.0.1:{metrics_port}/metrics"),
        )  # fmt: skip
        if rc != 0:
            return rc
        step("MIG on demand: the agent with --mig-mode dynamic on an H100 not in MIG mode")
        if fake_api is None:
            print("    skipped against a real cluster: it would create a claim there (it runs")
            print("    with the local API server only: unset KUBECONFIG)")
        else:
            rc = run_mig_on_demand(
                workdir / "migondemand", fake_api=fake_api, driver_root=driver_root
            )
            if rc != 0:
                return rc
        step("Sharing and dynamic MIG: the agent with --consumable-shares, MPS, --mig-mode dynamic")
        if fake_api is None:
            print("    skipped against a real cluster: it would create MPS daemon Deployments and")
            print("    claims there (it runs with the local API server only: unset KUBECONFIG)")
            return 0
        if os.geteuid() != 0:
            print("    skipped: not root. Each MPS control daemon gets a tmpfs mounted on its shm")
            print("    directory, which needs root (run `sudo make demo` to see this step)")
            return 0
        return run_sharing(workdir / "sharing", fake_api=fake_api, driver_root=driver_root)
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

    slices = wait_for("the first ResourceSlice", stored_slices)
    time.sleep(0.3)  # let a multi-slice pool finish
    slices = stored_slices() or slices
    step(f"ResourceSlices stored by the API server for node {node}")
    print(table.render(table.device_rows(slices)))

    reg_socket = registry / f"{DRIVER}-reg.sock"
    dra_socket = plugins / DRIVER / "dra.sock"
    wait_for("the registration socket", reg_socket.exists)
    step(f"Kubelet: GetInfo over {reg_socket}")
    with grpc.insecure_channel(f"unix://{reg_socket}") as channel:
        registration = reg_grpc.RegistrationStub(channel)
        info = registration.GetInfo(reg_pb2.InfoRequest(), timeout=1)
        print(f"    type={info.type} name={info.name}\n    endpoint={info.endpoint}")
        print(f"    supported_versions={list(info.supported_versions)}")
        registration.NotifyRegistrationStatus(
            reg_pb2.RegistrationStatus(plugin_registered=True), timeout=5
        )

    _health(stored_slices, plugins=plugins, node=node, fake_api=fake_api)

    step("Scheduler (gpu-dra explain's allocator): one GPU with >= 40Gi of memory")
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
    step(f"Kubelet: NodePrepareResources over {dra_socket}")
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
            step(f"CDI spec written for the container runtime: {spec}")
            print(readable_json(json.loads(spec.read_text())))
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


def _show_status(metrics_url: str, log_path: Path, *, claim: str | None) -> None:
    """The agent's log so far, then ``gpu-dra status`` of the node (once the agent's telemetry
    has sampled ``claim`` holding its device)."""
    from dra_driver.telemetry.status.agent import scrape  # noqa: PLC0415
    from dra_driver.telemetry.status.command import main as status_main  # noqa: PLC0415

    def sampled() -> bool:
        try:
            text = scrape(metrics_url)
        except MetricsUnavailable:
            return False
        return "gpu_dra_gpu_info" in text and (claim is None or f'"{claim}"' in text)

    wait_for("the agent's telemetry", sampled)
    step("Agent log so far (structured logs, --log-format text)")
    print(log_path.read_text().rstrip())
    step(f"gpu-dra status --metrics-url {metrics_url}")
    status_main(["--metrics-url", metrics_url])


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
    step("GPU health: GPU 0 falls off the bus (gpu-dra simulate-event --gpu 0 --lost)")
    simulate_event_main(["--gpu", "0", "--lost", *where])
    for taint in wait_for("the gpu-0 taints", both_taints):
        print(f"    gpu-0 taint: {json.dumps(taint)}")
    step("GPU health: GPU 0 is reset (gpu-dra simulate-event --gpu 0 --reset)")
    simulate_event_main(["--gpu", "0", "--reset", *where])
    wait_for("gpu-0 without taints", lambda: not taints_of_gpu_0())
    print(f"    gpu-0 taints: {taints_of_gpu_0()}")
    if fake_api is None:
        return

    def events() -> list[dict[str, Any]]:
        found = fake_api.objects("events")
        return sorted(found, key=lambda e: int(e["metadata"]["resourceVersion"]))

    wait_for("the DeviceHealthy Event", lambda: events()[-1]["reason"] == "DeviceHealthy")
    for event in events():
        print(f"    Event on Node {node}: {event['type']} {event['reason']}: {event['message']}")
