"""The examples that need another mode of the chart, after a ``helm upgrade`` as an operator would
make it: consumable shares (the real scheduler hands out shares of one GPU, each claim prepared
with its MPS limits) and dynamic MIG (the real scheduler picks a MIG placement from the counters,
the agent creates the MIG device at prepare and removes it at unprepare). Back to the chart's
defaults at the end, for the tests that follow."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cluster import Cluster
from tests.cluster.conftest import GPUS, SIMULATE
from tests.cluster.journey import run_example
from tests.cluster.test_cluster_examples import EXAMPLES
from tests.test_examples_explain import expectation

DYNAMIC_SIMULATE, DYNAMIC_GPUS = "h100:2:mig,a100-80gb:1", 3
SHARE_EXAMPLES = sorted(
    p for p in EXAMPLES.glob("*.yaml") if "consumable-shares" in expectation(p)[1]
)
DYNAMIC_EXAMPLES = sorted((EXAMPLES / "dynamic-mig").glob("*.yaml"))


@pytest.fixture(scope="module")
def modes(cluster: Cluster, cluster_builds: Any) -> Iterator[Cluster]:
    try:
        yield cluster
    finally:  # the chart's defaults again
        cluster.upgrade(
            "--set", "consumableShares=disabled", "--set", "mig.mode=static",
            builds=cluster_builds, simulate=SIMULATE, gpus=GPUS,
        )  # fmt: skip


@pytest.mark.parametrize("path", SHARE_EXAMPLES, ids=[p.name for p in SHARE_EXAMPLES])
def test_share_example_runs_after_helm_upgrade(
    modes: Cluster, cluster_builds: Any, path: Path
) -> None:
    shares = expectation(path)[1]["consumable-shares"]
    agent = next(iter(modes.agents.values()))
    if agent.pod_env("CONSUMABLE_SHARES") != shares or agent.pod_env("MIG_MODE") != "static":
        modes.upgrade(
            "--set-string", f"consumableShares={shares}", "--set", "mig.mode=static",
            builds=cluster_builds, simulate=SIMULATE, gpus=GPUS,
        )  # fmt: skip
    run_example(modes, path)


@pytest.mark.parametrize("path", DYNAMIC_EXAMPLES, ids=[p.name for p in DYNAMIC_EXAMPLES])
def test_dynamic_mig_example_runs_after_helm_upgrade(
    modes: Cluster, cluster_builds: Any, path: Path
) -> None:
    agent = next(iter(modes.agents.values()))
    if agent.pod_env("MIG_MODE") != "dynamic":
        modes.upgrade(
            "--set", "consumableShares=disabled", "--set", "mig.mode=dynamic",
            builds=cluster_builds, simulate=DYNAMIC_SIMULATE, gpus=DYNAMIC_GPUS,
        )  # fmt: skip
    run_example(modes, path)
