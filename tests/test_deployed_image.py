"""The deployed form with the image users install: ``make image``'s image, built here (podman;
on the official base, or on the local Debian base where no registry is reachable), run by podman
as the chart's DaemonSet says (tests/image.py: its command, env, security context and hostPath
volumes) on a node namespace set up as tests/test_deployed.py sets it up. The agent in the image
registers with the stand-in kubelet, prepares two claims (the second with time slicing: the
driver root's nvidia-smi run by the image's Python), and containers started through the returned
CDI devices load the driver through the cache the image's CDI hook refreshed.

The image is built once per set of inputs (tests/image.py: tagged by their digest) and copied into
a private store for the node namespaces. Skips only where it cannot be built: no root or podman,
or neither a pullable base nor mmdebstrap for the local one.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from dra_driver import __version__
from dra_driver._proto.dra_v1 import api_pb2 as v1
from dra_driver._proto.dra_v1 import api_pb2_grpc as v1_grpc
from dra_driver.sim.fakedriver import read_nvidia_smi_calls, read_time_slices, simulated_inventory
from dra_driver.sim.localapi import FakeKubeApi
from tests.claimdata import allocated_claim, opaque
from tests.image import PodImage, build, facts, load_into, remove_store, why_not_buildable
from tests.podman import containers_conf, podman_env
from tests.test_deployed import (  # noqa: F401 - the module's fixtures
    LIB,
    NODE,
    Builds,
    Node,
    _missing,
    builds,
    found_through_cache,
    register,
    run_probe,
    start_node,
    work,
)

WHY_NOT = _missing() or why_not_buildable()
pytestmark = [
    pytest.mark.podman,
    pytest.mark.helm,
    pytest.mark.skipif(bool(WHY_NOT), reason=WHY_NOT or "-"),
]


@pytest.fixture(scope="module")
def image() -> Iterator[PodImage]:
    store = Path(tempfile.mkdtemp(prefix="ddi-", dir="/tmp"))
    try:
        conf = containers_conf(store)
        tag = build(conf)
        yield PodImage(tag, load_into(store, tag), conf)
    finally:
        remove_store(store)


def test_the_image_runs_gpu_dra_explain_as_its_non_root_default_user(image: PodImage) -> None:
    assert facts(image.tag).user == "65532:65532"
    run = subprocess.run(
        ["podman", "run", "--rm", "--pull=never", "--network=none", "--entrypoint", "sh",
         image.tag, "-c", "id -u; id -g; gpu-dra explain --help"],
        env=podman_env(image.conf), capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    uid, gid, usage = run.stdout.split("\n", 2)
    assert (uid, gid) == ("65532", "65532")
    assert usage.startswith("usage: gpu-dra explain")
    assert "--simulate SPEC" in usage


def test_the_image_tells_its_version_and_lists_its_packages_in_an_sbom(image: PodImage) -> None:
    names = 'print(",".join(sorted(d.name for d in m.distributions())))'
    script = (
        "gpu-dra --version; gpu-dra-webhook --version; "
        f"python3 -c 'import importlib.metadata as m; {names}'; cat /opt/gpu-dra/sbom.cdx.json"
    )
    run = subprocess.run(
        ["podman", "run", "--rm", "--pull=never", "--network=none", "--entrypoint", "sh",
         image.tag, "-c", script],
        env=podman_env(image.conf), capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    version, webhook_version, installed, sbom_text = run.stdout.split("\n", 3)
    assert version == f"gpu-dra {__version__}"
    assert webhook_version == f"gpu-dra-webhook {__version__}"
    sbom = json.loads(sbom_text)
    assert sbom["bomFormat"] == "CycloneDX"

    def norm(name: str) -> str:
        return name.lower().replace("_", "-").replace(".", "-")

    listed = {norm(c["name"]) for c in sbom["components"]}
    # the agent's environment (python3 is the venv's in the image), the SBOM tool not in it
    assert listed - {"gpu-dra"} == {norm(n) for n in installed.split(",")} - {"gpu-dra"}
    assert {"grpcio", "kubernetes", "pydantic"} <= listed
    assert "cyclonedx-bom" not in listed
    inspected = subprocess.run(
        ["podman", "image", "inspect", "--format", "{{index .Labels \"gpu-dra.sbom\"}}", image.tag],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert inspected.stdout.strip() == "/opt/gpu-dra/sbom.cdx.json"


def agent_pid(node: Node, image: PodImage, name: str) -> int:
    """The agent's PID (this machine's view) once podman has started its container."""
    deadline = time.monotonic() + 60
    while True:
        run = subprocess.run(
            ["nsenter", f"--mount=/proc/{node.pid}/ns/mnt", *image.podman(), "inspect",
             "--format", "{{.State.Pid}}", name],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        if run.returncode == 0 and run.stdout.strip() not in ("", "0"):
            return int(run.stdout)
        assert node.process.poll() is None, node.log.read_text()
        assert time.monotonic() < deadline, f"{run.stderr}\n{node.log.read_text()}"
        time.sleep(0.1)


@pytest.mark.parametrize("layout", ["host-multiarch", "gpu-operator"])
def test_a_container_prepared_by_the_agent_in_the_image_loads_the_driver(
    layout: str,
    work: Path,  # noqa: F811
    builds: Builds,  # noqa: F811
    image: PodImage,
) -> None:
    api = FakeKubeApi(tls_dir=work / "tls", token="agent-token").start()
    node = None
    try:
        api.add_node(NODE)
        plain = api.add_claim(allocated_claim(name="plain", node=NODE, devices=["gpu-0"]))
        sliced = opaque(
            {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
             "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}}
        )  # fmt: skip
        video = api.add_claim(
            allocated_claim(name="sliced", node=NODE, devices=["gpu-1"], configs=[sliced])
        )
        node, deployed = start_node(work, layout=layout, builds=builds, api=api, image=image)
        # the agent is the image's: its console script, run by the image's venv Python, as root
        pid = agent_pid(node, image, f"gpu-dra-{work.name}")
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert argv[:2] == [b"/opt/gpu-dra/bin/python3", b"/opt/gpu-dra/bin/gpu-dra-kubelet-plugin"]
        assert Path(f"/proc/{pid}/status").read_text().count("\t0\t0\t0\t0") == 2  # Uid, Gid
        environ = b"\0" + Path(f"/proc/{pid}/environ").read_bytes()
        assert b"\0PYTHONOPTIMIZE=2\0" in environ  # the chart's, beside the image's own
        assert b"\0PYTHONDONTWRITEBYTECODE=1\0" in environ

        dra_socket = register(node)
        refs = [
            v1.Claim(namespace="default", name=c["metadata"]["name"], uid=c["metadata"]["uid"])
            for c in (plain, video)
        ]
        with grpc.insecure_channel(f"unix://{dra_socket}") as channel:
            stub = v1_grpc.DRAPluginStub(channel)
            answer = stub.NodePrepareResources(
                v1.NodePrepareResourcesRequest(claims=refs), timeout=60
            )
            ids = {}
            for ref in refs:
                entry = answer.claims[ref.uid]
                assert entry.error == "", f"{entry.error}\n{node.log.read_text()}"
                ids[ref.name] = [i for d in entry.devices for i in d.cdi_device_ids]
            smi_dir = node.kubelet_dir / "plugins" / "gpu.nvidia.com"
            gpu1 = simulated_inventory("h100:2", node_name=NODE).gpus[1].uuid
            assert read_nvidia_smi_calls(smi_dir) == [
                f"compute-policy -i {gpu1} --set-timeslice 3"
            ], node.log.read_text()
            # the hook the spec runs is the one built in the image, copied to the node
            spec = json.loads(next(node.cdi_dir.glob("*.json")).read_text())
            hooks = [h["path"] for h in spec["containerEdits"].get("hooks", [])]
            assert hooks, spec
            assert all(Path(h).name.startswith("gpu-dra-cdi-hook-") for h in hooks)
            assert deployed["env"]["CDI_HOOK"]

            for name in ("plain", "sliced"):
                run = run_probe(node, work=work, builds=builds, flavour="debian", cdi_ids=ids[name])
                where = f"{layout}, claim {name}:\n{run.stdout}\n{run.stderr[-3000:]}"
                lines = run.stdout.splitlines()
                assert f"ok libcuda.so.1 cuInit 0 {LIB}/libcuda.so.1" in lines, where
                assert f"ok libnvidia-ml.so.1 nvmlInit_v2 0 {LIB}/libnvidia-ml.so.1" in lines, where
                assert found_through_cache(run.stderr, "libcuda.so.1"), where

            undone = stub.NodeUnprepareResources(
                v1.NodeUnprepareResourcesRequest(claims=refs), timeout=60
            )
            assert all(undone.claims[r.uid].error == "" for r in refs)
            assert read_time_slices(smi_dir) == {gpu1: 0}  # Default again
        assert not list(node.cdi_dir.glob("*.json"))
        assert node.stop() == 0, node.log.read_text()
        assert not list((node.kubelet_dir / "plugins_registry").glob("*.sock"))
    finally:
        if node is not None:
            node.stop()
        api.stop()
