"""tests/conftest.py's run order: the Kubernetes tiers after the rest, the test that restarts the
cluster tier's control plane after everything, each group in the order pytest-randomly drew."""

from __future__ import annotations

import random
from dataclasses import dataclass

from tests.conftest import pytest_collection_modifyitems, run_order


@dataclass
class Item:
    nodeid: str


def test_the_control_plane_restart_runs_last_and_each_group_keeps_its_drawn_order() -> None:
    ids = [
        "tests/cluster/test_cluster_outage.py::test_an_api_server_outage",
        "tests/test_prepare.py::test_a",
        "tests/cluster/test_cluster_modes.py::test_dynamic[x]",
        "tests/realnode/test_realnode.py::test_b",
        "tests/test_agent.py::test_c",
        "tests/integration/test_kubelet.py::test_d",
        "tests/cluster/test_cluster_journey.py::test_e",
    ]
    for seed in range(20):  # whatever the shuffle drew
        drawn = [Item(i) for i in ids]
        random.Random(seed).shuffle(drawn)
        items = list(drawn)
        pytest_collection_modifyitems(items)  # type: ignore[arg-type]
        order = [run_order(i.nodeid) for i in items]
        assert order == sorted(order)
        assert items[-1].nodeid.startswith("tests/cluster/test_cluster_outage.py")
        for group in (0, 1):
            assert [i for i in items if run_order(i.nodeid) == group] == [
                i for i in drawn if run_order(i.nodeid) == group
            ]
    assert [run_order(i) for i in ids] == [2, 0, 1, 1, 0, 1, 1]
