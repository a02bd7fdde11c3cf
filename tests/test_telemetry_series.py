"""The series the agent exports, as the DaemonSet runs it on simulated GPUs and scraped over HTTP
(parsed with prometheus_client's parser): counters exist at 0 before any event and count the
first one (an XID injected with ``gpu-dra simulate-event``); a prepare and an unprepare change no
device series, only ``gpu_dra_device_claim_info``; every series has ``node``; the DCGM-compatible
series have dcgm-exporter's names and labels, with the pod and container of the claim's pod.
Then the same without the agent: MIG labels, the flag off, holders and the pod mapper."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import grpc
import pytest

from dra_driver._proto.dra_v1 import api_pb2 as v1
from dra_driver._proto.dra_v1 import api_pb2_grpc as v1_grpc
from dra_driver.cli import build_config
from dra_driver.errors import KubeUnavailable
from dra_driver.gpus import nvml
from dra_driver.gpus.readings import NvmlReader
from dra_driver.gpus.telemetryvalues import Reading
from dra_driver.kube import KubeClient
from dra_driver.metrics import Registry
from dra_driver.sim.fakedriver import simulated_inventory
from dra_driver.sim.faults import SimulatedFault
from dra_driver.sim.localapi import FakeKubeApi, free_port
from dra_driver.sim.nvml import SLOWDOWN_C, simulated_nvml
from dra_driver.telemetry.dcgm import DCGM_METRIC_NAMES, dcgm_pci_bus_id
from dra_driver.telemetry.holders import PodMapper, XidHistory, claim_containers
from dra_driver.telemetry.model import ClaimHolder
from dra_driver.telemetry.sampler import Telemetry, telemetry_targets
from tests import exposition
from tests.claimdata import allocated_claim
from tests.test_agent import _in_cluster, _register, _scrape, as_a_pod

NODE = "gpu-node-1"
DCGM_LABELS = {"gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname", "node",
               "DCGM_FI_DRIVER_VERSION"}  # fmt: skip


def pod(name: str, *, claim: str, namespace: str = "default") -> dict[str, Any]:
    """A Pod whose container "main" uses ``claim`` (pod entry "gpu"); "sidecar" uses none."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "nodeName": NODE,
            "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
            "containers": [
                {"name": "main", "image": "x", "resources": {"claims": [{"name": "gpu"}]}},
                {"name": "sidecar", "image": "x"},
            ],
        },
    }


def device_series(series: exposition.Series) -> set[tuple[str, frozenset[tuple[str, str]]]]:
    """Every device series (name and labels, not values): gpu_dra_gpu_* and DCGM_* of GPUs no
    claim holds."""
    return {key for key in series if key[0].startswith("gpu_dra_gpu_")}


@as_a_pod
def test_the_agents_series_stay_put_count_from_zero_and_speak_dcgm(tmp_path: Path) -> None:
    api = FakeKubeApi(tls_dir=tmp_path / "tls", token="sa-token").start()
    try:
        api.add_node(NODE)
        metrics_port = free_port()
        plugins = tmp_path / "plugins"
        command, env = _in_cluster(
            api, tmp_path, simulate="h100:2,a100-80gb:1:mig=3g.40gb", node=NODE,
            extra=("--metrics-port", str(metrics_port), "--telemetry-interval", "1"),
        )  # fmt: skip
        agent = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60

        def scrape(until: Any = None) -> exposition.Series:
            while True:
                try:
                    series = exposition.parse(_scrape(metrics_port)[1])
                except OSError:
                    series = {}
                if series and (until is None or until(series)):
                    return series
                assert agent.poll() is None, agent.stderr.read() if agent.stderr else ""
                assert time.monotonic() < deadline, "timed out waiting for the series"
                time.sleep(0.1)

        def sampled(series: exposition.Series) -> bool:
            return bool(exposition.find(series, "DCGM_FI_DEV_FB_USED"))

        try:
            _register(tmp_path / "registry" / "gpu.nvidia.com-reg.sock")
            before = scrape(sampled)
            # node on every series, the driver's too
            assert {name for name, labels in before if "node" not in dict(labels)} == set()
            assert {dict(labels)["node"] for _, labels in before} == {NODE}
            # Counters from zero: XID and ECC of every device before any event.
            xids = exposition.find(before, "gpu_dra_gpu_xid_errors_total")
            assert sorted(dict(k)["device"] for k in xids) == [
                "gpu-0", "gpu-1", "gpu-2", "gpu-2-mig-3g40gb-9-0",
            ]  # fmt: skip
            assert set(xids.values()) == {0.0}
            ecc = exposition.find(before, "gpu_dra_gpu_ecc_errors_total")
            assert len(ecc) == 6 and set(ecc.values()) == {0.0}  # 3 GPUs x 2 error types
            dcgm_xid = exposition.find(before, "DCGM_FI_DEV_XID_ERRORS")
            assert sorted(dict(k)["gpu"] for k in dcgm_xid) == ["0", "1", "2"]
            assert set(dcgm_xid.values()) == {0.0}
            # dcgm-exporter's names and labels
            # (prometheus_client's parser names counter samples `_total`; the text has none)
            assert set(DCGM_METRIC_NAMES) <= set(exposition.types(_scrape(metrics_port)[1]))
            temps = exposition.find(before, "DCGM_FI_DEV_GPU_TEMP")
            for labels in map(dict, temps):
                assert set(labels) == DCGM_LABELS, labels
                assert labels["device"] == f"nvidia{labels['gpu']}"
                assert labels["Hostname"] == NODE and labels["UUID"].startswith("GPU-")
            fb_used = exposition.find(before, "DCGM_FI_DEV_FB_USED", GPU_I_PROFILE="3g.40gb")
            (mig,) = map(dict, fb_used)
            assert mig["GPU_I_ID"] == "2" and mig["gpu"] == "2"  # the GPU instance id
            parent = dict(next(iter(exposition.find(before, "DCGM_FI_DEV_GPU_TEMP", gpu="2"))))
            assert mig["UUID"] == parent["UUID"]  # a GPU instance carries its GPU's UUID
            assert "GPU_I_ID" not in parent

            # A prepare: only the claim's info series is new.
            api.put("pods", pod("pod-0", claim="c1"))
            claim = api.add_claim(allocated_claim(name="c1", node=NODE, devices=["gpu-0"]))
            uid = claim["metadata"]["uid"]
            dra = plugins / "gpu.nvidia.com" / "dra.sock"
            with grpc.insecure_channel(f"unix://{dra}") as channel:
                stub = v1_grpc.DRAPluginStub(channel)
                ref = v1.Claim(namespace="default", name="c1", uid=uid)
                prepared = stub.NodePrepareResources(
                    v1.NodePrepareResourcesRequest(claims=[ref]), timeout=10
                )
                assert prepared.claims[uid].error == ""
                held = scrape(lambda s: exposition.find(s, "DCGM_FI_DEV_GPU_TEMP", pod="pod-0"))
                (info,) = exposition.find(held, "gpu_dra_device_claim_info")
                assert dict(info) == {
                    "node": NODE, "device": "gpu-0", "uuid": dict(info)["uuid"], "gpu": "0",
                    "claim_namespace": "default", "claim_name": "c1", "claim_uid": uid,
                    "pod_namespace": "default", "pod_name": "pod-0",
                }  # fmt: skip
                assert device_series(held) == device_series(before)
                # The DCGM series of gpu-0 name the pod and the container using the claim.
                (used,) = map(dict, exposition.find(held, "DCGM_FI_DEV_GPU_TEMP", gpu="0"))
                assert {k: used[k] for k in ("pod", "namespace", "container")} == {
                    "pod": "pod-0",
                    "namespace": "default",
                    "container": "main",
                }
                assert used["dra_claim_name"] == "c1" and used["dra_device_name"] == "gpu-0"
                assert not exposition.find(held, "DCGM_FI_DEV_GPU_TEMP", gpu="1", pod="pod-0")

                # An XID: the counter goes from 0 to 1, the DCGM gauge holds its code.
                done = subprocess.run(
                    [str(Path(sys.executable).parent / "gpu-dra"), "simulate-event",
                     "--gpu", "1", "--xid", "13"],
                    env={**os.environ, "KUBELET_PLUGINS_DIRECTORY_PATH": str(plugins)},
                    capture_output=True, text=True, check=False, timeout=30,
                )  # fmt: skip
                assert done.returncode == 0, done.stderr
                xid = scrape(
                    lambda s: any(exposition.find(s, "gpu_dra_gpu_xid_errors_total").values())
                )
                counts = exposition.find(xid, "gpu_dra_gpu_xid_errors_total")
                assert {dict(k)["device"]: v for k, v in counts.items() if v} == {"gpu-1": 1.0}
                assert list(exposition.find(xid, "DCGM_FI_DEV_XID_ERRORS", gpu="1").values()) == [
                    13.0
                ]
                assert list(exposition.find(xid, "DCGM_FI_DEV_XID_ERRORS", gpu="0").values()) == [
                    0.0
                ]

                # An unprepare: the info series goes, the device series stay.
                undone = stub.NodeUnprepareResources(
                    v1.NodeUnprepareResourcesRequest(claims=[ref]), timeout=10
                )
                assert undone.claims[uid].error == ""
            after = scrape(lambda s: not exposition.find(s, "gpu_dra_device_claim_info"))
            assert device_series(after) == device_series(before)
            assert not exposition.find(after, "DCGM_FI_DEV_GPU_TEMP", pod="pod-0")
            # The Pod was read once, not per scrape.
            gets = [r for r in api.requests if r.resource == "pods" and r.verb == "get"]
            assert len(gets) == 1, gets
        finally:
            agent.send_signal(signal.SIGTERM)
            _, stderr = agent.communicate(timeout=20)
        assert agent.returncode == 0, stderr
    finally:
        api.stop()


# -- without the agent ---------------------------------------------------------------------------


def scrape_series(telemetry: Telemetry) -> exposition.Series:
    registry = Registry()
    registry.register_formatted(telemetry)
    return exposition.parse(registry.render())


def test_with_the_flag_off_there_are_no_dcgm_series() -> None:
    assert build_config(["--node-name", "n"], {}).dcgm_metrics is True
    assert build_config(["--node-name", "n", "--dcgm-metrics", "false"], {}).dcgm_metrics is False
    assert build_config(["--node-name", "n"], {"DCGM_METRICS": "false"}).dcgm_metrics is False
    inventory = simulated_inventory("h100:1", node_name="n")
    (target,) = telemetry_targets(inventory)
    read = {target.uuid: Reading(temperature_celsius=40, memory_used_bytes=3 << 20)}
    for dcgm in (True, False):
        telemetry = Telemetry(node_name="n", inventory=inventory, read=lambda _: read, dcgm=dcgm)
        telemetry.set_health_providers(xid_counts=dict)
        telemetry.sample()
        text = telemetry.exposition().text()
        names = {name for name, _ in scrape_series(telemetry)}
        assert ("DCGM_FI_DEV_GPU_TEMP" in names) is dcgm
        assert any(n.startswith("DCGM_") for n in names) is dcgm
        assert ("DCGM_" in text) is dcgm
        assert "gpu_dra_gpu_temperature_celsius" in names


def test_dcgm_counters_keep_dcgm_exporters_names_and_types() -> None:
    inventory = simulated_inventory("h100:1", node_name="n")
    (target,) = telemetry_targets(inventory)
    read = {target.uuid: Reading(energy_millijoules=5000, pcie_replays=0,
                                 remapped_rows_corrected=0, remapped_rows_uncorrected=2,
                                 memory_used_bytes=(3 << 20) + 5, memory_free_bytes=7 << 20,
                                 utilization_ratio=0.07, sm_clock_hertz=1.98e9)}  # fmt: skip
    telemetry = Telemetry(node_name="n", inventory=inventory, read=lambda _: read, dcgm=True)
    telemetry.sample()
    text = telemetry.exposition().text()
    types = exposition.types(text)
    assert types["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"] == "counter"
    assert types["DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS"] == "counter"
    assert types["DCGM_FI_DEV_FB_USED"] == "gauge"
    assert "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION_total" not in text
    series = exposition.parse(text)

    def one(name: str) -> float:
        (value,) = exposition.find(series, name).values()
        return value

    # (prometheus_client's parser names counter samples `_total`; the text has none)
    assert one("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION_total") == 5000  # mJ, as DCGM
    assert "\nDCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{" in text
    assert one("gpu_dra_gpu_energy_joules_total") == 5
    assert one("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS_total") == 2
    assert one("DCGM_FI_DEV_FB_USED") == 3  # MiB, whole
    assert one("DCGM_FI_DEV_FB_FREE") == 7
    assert one("DCGM_FI_DEV_GPU_UTIL") == 7  # percent
    assert one("DCGM_FI_DEV_SM_CLOCK") == 1980  # MHz
    (labels,) = map(dict, exposition.find(series, "DCGM_FI_DEV_FB_USED"))
    assert labels["pci_bus_id"] == dcgm_pci_bus_id(target.pci_bus_id)
    assert labels["modelName"] == "NVIDIA H100 80GB HBM3"


def test_a_shared_device_has_one_dcgm_series_per_pod_and_container() -> None:
    inventory = simulated_inventory("h100:1", node_name="n")
    (target,) = telemetry_targets(inventory)
    uses_g = {"claims": [{"name": "g"}]}
    pods: dict[tuple[str, str], Mapping[str, Any] | None] = {
        ("ns", "a"): {"spec": {"resourceClaims": [{"name": "g", "resourceClaimName": "c"}],
                               "containers": [{"name": "x", "resources": uses_g},
                                              {"name": "y", "resources": uses_g}]}},
        ("ns", "b"): None,  # deleted meanwhile
    }  # fmt: skip
    holders = {"gpu-0": (ClaimHolder("ns", "c", "u1", ("a", "b")),)}
    telemetry = Telemetry(
        node_name="n", inventory=inventory, dcgm=True, holders=lambda: holders,
        read=lambda _: {target.uuid: Reading(temperature_celsius=50)},
        get_pod=lambda ns, name: pods[(ns, name)],
    )  # fmt: skip
    telemetry.sample()
    temps = exposition.find(scrape_series(telemetry), "DCGM_FI_DEV_GPU_TEMP")
    assert sorted((d["pod"], d.get("container", "")) for d in map(dict, temps)) == [
        ("a", "x"), ("a", "y"), ("b", ""),
    ]  # fmt: skip
    assert set(temps.values()) == {50.0}


def test_the_containers_of_a_claim_come_from_the_pod_spec_and_its_template_status() -> None:
    pod_spec = {
        "spec": {
            "resourceClaims": [
                {"name": "direct", "resourceClaimName": "shared"},
                {"name": "made", "resourceClaimTemplateName": "tpl"},
            ],
            "containers": [
                {"name": "a", "resources": {"claims": [{"name": "direct"}]}},
                {"name": "b", "resources": {"claims": [{"name": "made"}]}},
                {"name": "c"},
            ],
        },
        "status": {"resourceClaimStatuses": [{"name": "made", "resourceClaimName": "pod-made-x"}]},
    }
    assert claim_containers(pod_spec, "shared") == ("a",)
    assert claim_containers(pod_spec, "pod-made-x") == ("b",)
    assert claim_containers(pod_spec, "other") == ()
    assert claim_containers({}, "shared") == ()


def test_the_pod_mapper_reads_each_pod_once_and_again_only_after_a_failure() -> None:
    calls: list[tuple[str, str]] = []
    failing = {"flaky"}

    def get_pod(namespace: str, name: str) -> Mapping[str, Any] | None:
        calls.append((namespace, name))
        if name in failing:
            raise KubeUnavailable("down", verb="get", resource="pods")
        main = {"name": "m", "resources": {"claims": [{"name": "g"}]}}
        return {"spec": {"resourceClaims": [{"name": "g", "resourceClaimName": "c"}],
                         "containers": [main]}}  # fmt: skip

    mapper = PodMapper(get_pod)
    holders = {"gpu-0": (ClaimHolder("ns", "c", "u1", ("p", "flaky", "later")),)}
    uses = mapper.refresh(holders)
    assert uses[("u1", "p")].containers == ("m",)
    assert uses[("u1", "flaky")].containers == ()
    assert uses[("u1", "later")].containers == ()  # not asked: the API server just failed
    assert calls == [("ns", "p"), ("ns", "flaky")]
    mapper.refresh(holders)
    assert calls[2:] == [("ns", "flaky")]  # p is known; flaky again, one failing GET per pass
    failing.clear()
    uses = mapper.refresh(holders)
    assert uses[("u1", "flaky")].containers == uses[("u1", "later")].containers == ("m",)
    mapper.refresh({})  # the claim is gone: forgotten
    calls.clear()
    mapper.refresh(holders)
    assert calls == [("ns", "p"), ("ns", "flaky"), ("ns", "later")]


def test_the_last_xid_is_the_one_whose_count_went_up() -> None:
    history = XidHistory()
    assert history.update({}) == ({}, {})
    assert history.update({("gpu-0", 13): 1}) == ({"gpu-0": 1}, {"gpu-0": 13})
    assert history.update({("gpu-0", 13): 1, ("gpu-0", 48): 1}) == ({"gpu-0": 2}, {"gpu-0": 48})
    assert history.update({("gpu-0", 13): 2, ("gpu-0", 48): 1}) == ({"gpu-0": 3}, {"gpu-0": 13})
    assert history.update({("gpu-0", 13): 2, ("gpu-0", 48): 1})[1] == {"gpu-0": 13}  # unchanged


@pytest.mark.parametrize(
    ("nvml", "dcgm"),
    [("0000:1b:00.0", "00000000:1B:00.0"), ("00000000:3B:00.0", "00000000:3B:00.0")],
)
def test_pci_bus_ids_take_dcgms_form(nvml: str, dcgm: str) -> None:
    assert dcgm_pci_bus_id(nvml) == dcgm


def test_a_hot_simulated_gpu_slows_down_and_counts_from_zero() -> None:
    """The readings through pynvml into the simulated GPUs: a temperature fault at the
    slowdown threshold sets the thermal slowdown reasons; the counters are there at 0."""
    with simulated_nvml("h100:2", node_name="n") as node:
        inventory = nvml.discover(driver_root=Path("/"), sysfs_root=node.sysfs_root)
        reader = NvmlReader()
        telemetry = Telemetry(node_name="n", inventory=inventory, read=reader, dcgm=True)
        try:
            telemetry.sample()
            cool = scrape_series(telemetry)
            node.library.health.inject(
                SimulatedFault(kind="temperature", gpu=1, celsius=SLOWDOWN_C)
            )
            telemetry.sample()
            hot = scrape_series(telemetry)
        finally:
            reader.close()
    slowdown = "gpu_dra_gpu_clock_slowdown"
    assert set(exposition.find(cool, slowdown).values()) == {0.0}
    assert len(exposition.find(cool, slowdown)) == 2 * 3  # every reason of every GPU
    active = {
        (dict(k)["device"], dict(k)["reason"])
        for k, v in exposition.find(hot, slowdown).items()
        if v
    }
    assert active == {("gpu-1", "hw_slowdown"), ("gpu-1", "hw_thermal")}
    for name in ("gpu_dra_gpu_remapped_rows_total", "gpu_dra_gpu_pcie_replays_total"):
        assert set(exposition.find(cool, name).values()) == {0.0}, name
    assert list(exposition.find(cool, "gpu_dra_gpu_row_remap_failure").values()) == [0.0, 0.0]
    (temp,) = exposition.find(hot, "DCGM_FI_DEV_GPU_TEMP", gpu="1").values()
    (mem_temp,) = exposition.find(hot, "DCGM_FI_DEV_MEMORY_TEMP", gpu="1").values()
    assert temp == SLOWDOWN_C and mem_temp > temp  # HBM: the memory sensor answers


def test_the_pod_get_answers_none_for_a_pod_that_is_gone(tmp_path: Path) -> None:
    api = FakeKubeApi().start()
    try:
        api.put("pods", pod("pod-0", claim="c1"))
        client = KubeClient.from_config(kubeconfig=api.write_kubeconfig(tmp_path / "kubeconfig"))
        try:
            found = client.get_pod("default", "pod-0")
            assert found is not None
            assert claim_containers(found, "c1") == ("main",)
            assert client.get_pod("default", "gone") is None
        finally:
            client.close()
    finally:
        api.stop()
