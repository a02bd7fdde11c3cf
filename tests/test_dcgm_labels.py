"""dcgm-exporter's labels that dashboards and alerts select on: ``err_code``/``err_msg`` on
``DCGM_FI_DEV_XID_ERRORS``, ``dra_mig_profile``/``dra_mig_device_uuid`` on a claimed MIG device,
and the node label under the name the user's dcgm-exporter release uses (``--dcgm-host-label``).
Through the real sampler on simulated GPUs, scraped with prometheus_client's parser."""

from __future__ import annotations

import pytest

from dra_driver.cli import build_config
from dra_driver.errors import ConfigError
from dra_driver.gpus.telemetryvalues import Reading
from dra_driver.metrics import Registry
from dra_driver.sim.fakedriver import simulated_inventory
from dra_driver.telemetry.dcgm import xid_labels
from dra_driver.telemetry.model import ClaimHolder
from dra_driver.telemetry.sampler import Telemetry, telemetry_targets
from tests import exposition


def scrape(telemetry: Telemetry) -> exposition.Series:
    registry = Registry()
    registry.register_formatted(telemetry)
    return exposition.parse(registry.render())


def test_the_xid_series_carries_dcgm_exporters_code_and_message() -> None:
    inventory = simulated_inventory("h100:2", node_name="n")
    counts = {("gpu-1", 79): 1}
    telemetry = Telemetry(node_name="n", inventory=inventory, dcgm=True, read=None)
    telemetry.set_health_providers(xid_counts=lambda: counts)
    series = scrape(telemetry)
    labels = {
        dict(k)["gpu"]: (dict(k)["err_code"], dict(k)["err_msg"], v)
        for k, v in exposition.find(series, "DCGM_FI_DEV_XID_ERRORS").items()
    }
    assert labels == {
        "0": ("0", "No Error", 0.0),
        "1": ("79", "GPU has fallen off the bus", 79.0),
    }


def test_an_xid_without_a_catalogue_entry_is_unknown() -> None:
    assert xid_labels(13) == {"err_code": "13", "err_msg": "Graphics Engine Exception"}
    assert xid_labels(99999) == {"err_code": "99999", "err_msg": "Unknown Error"}


def test_a_claimed_mig_device_carries_its_profile_and_uuid_as_dra_labels() -> None:
    inventory = simulated_inventory("a100-80gb:1:mig=3g.40gb,h100:1", node_name="n")
    targets = {t.name: t for t in telemetry_targets(inventory)}
    mig = next(t for t in targets.values() if t.type == "mig")
    gpu = next(t for t in targets.values() if t.type == "gpu" and not t.mig_enabled)
    holders = {
        mig.name: (ClaimHolder("ml", "c-mig", "u1", ("p1",)),),
        gpu.name: (ClaimHolder("ml", "c-gpu", "u2", ("p2",)),),
    }
    telemetry = Telemetry(
        node_name="n", inventory=inventory, dcgm=True, holders=lambda: holders,
        read=lambda _: {mig.uuid: Reading(memory_used_bytes=1 << 30,
                                          memory_total_bytes=40 << 30)},
    )  # fmt: skip
    telemetry.sample()
    (labels,) = map(dict, exposition.find(scrape(telemetry), "DCGM_FI_DEV_FB_USED", pod="p1"))
    assert labels["dra_mig_profile"] == "3g.40gb"
    assert labels["dra_mig_device_uuid"] == mig.uuid
    assert labels["dra_device_name"] == mig.name
    for claimed_gpu in map(dict, exposition.find(scrape(telemetry), "DCGM_FI_DEV_XID_ERRORS")):
        assert "dra_mig_profile" not in claimed_gpu and "dra_mig_device_uuid" not in claimed_gpu


@pytest.mark.parametrize("host_label", ["Hostname", "hostname"])
def test_the_node_label_takes_the_name_the_users_dcgm_exporter_uses(host_label: str) -> None:
    inventory = simulated_inventory("h100:1", node_name="n")
    (target,) = telemetry_targets(inventory)
    telemetry = Telemetry(
        node_name="n", inventory=inventory, dcgm=True, dcgm_host_label=host_label,
        read=lambda _: {target.uuid: Reading(temperature_celsius=40)},
    )  # fmt: skip
    telemetry.sample()
    (labels,) = map(dict, exposition.find(scrape(telemetry), "DCGM_FI_DEV_GPU_TEMP"))
    assert labels[host_label] == "n"
    assert {"Hostname", "hostname"} - {host_label} & set(labels) == set()


def test_the_host_label_flag_reaches_the_config_and_refuses_a_bad_name() -> None:
    assert build_config(["--node-name", "n"], {"DCGM_HOST_LABEL": "hostname"}).dcgm_host_label == (
        "hostname"
    )
    assert build_config(["--node-name", "n"], {}).dcgm_host_label == "Hostname"
    with pytest.raises(ConfigError, match=r"DCGM_HOST_LABEL.*not a Prometheus label name"):
        build_config(["--node-name", "n"], {"DCGM_HOST_LABEL": "host-name"})
