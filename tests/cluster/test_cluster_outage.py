"""The API server and etcd stopped for 30 s in the middle of a batch of prepares, then started
again: the agents do not crash-loop, no claim is lost or prepared twice, every pod runs, and the
slices come back unchanged. Last of all tests (tests/conftest.py's ``run_order``): it restarts
the control plane's storage under the other tests' feet otherwise."""

from __future__ import annotations

import time
from typing import Any

from tests.cluster import Cluster, journey, objects
from tests.cluster.test_cluster_journey import _claim, _cleanup, _pod

OUTAGE_S = 30.0


def _slice_specs(cluster: Cluster) -> dict[str, Any]:
    return {
        s["metadata"]["name"]: s["spec"]
        for node in sorted(cluster.nodes)
        for s in cluster.slices(node)
    }


def test_an_api_server_outage_in_a_batch_loses_and_duplicates_nothing(cluster: Cluster) -> None:
    node = sorted(cluster.nodes)[0]
    agent = cluster.agents[node]
    agent_pid = agent.pid()
    slices_before = _slice_specs(cluster)
    specs_before = journey.cdi_specs(cluster, node)
    names = [f"outage-{i}" for i in range(4)]
    for name in names:
        objects.create(cluster.control, _claim(name))
        objects.create(cluster.control, _pod(name, claim=name, node=node))
    try:
        objects.wait(
            "the batch scheduled",
            lambda: all(
                (objects.get(cluster.control, "Pod", n, "default") or {})
                .get("spec", {}).get("nodeName")
                for n in names
            ),
            timeout_s=120,
        )  # fmt: skip
        cluster.control.stop_apiserver_and_etcd()
        stopped = time.monotonic()
        while time.monotonic() - stopped < OUTAGE_S:
            assert agent.alive(), f"the agent exited during the outage:\n{agent.log.read_text()}"
            time.sleep(1)
        cluster.control.start_apiserver_and_etcd()
        for name in names:
            journey.wait_running(cluster, "default", name, timeout_s=180)
        # the same agent process all along: no crash, no restart
        assert agent.alive() and agent.pid() == agent_pid
        devices = [d for n in names for d in journey.allocation(cluster, "default", n).devices]
        assert len(set(devices)) == len(names), devices
        new_specs = set(journey.cdi_specs(cluster, node)) - set(specs_before)
        assert len(new_specs) == len(names), sorted(new_specs)  # one per claim, none twice
        assert objects.wait(
            "the slices as before", lambda: _slice_specs(cluster) == slices_before, timeout_s=60
        )
    finally:
        _cleanup(cluster, names, names)
    objects.wait(
        f"{node}'s CDI specs back to before the batch",
        lambda: journey.cdi_specs(cluster, node) == specs_before,
        timeout_s=60,
    )
