"""Every example in examples/resourceclaims/, applied to the real cluster as a user would.

For each: ``gpu-dra explain`` against the idle cluster predicts the allocation on each node; the
file is created; every pod reaches Running on a GPU node; the real scheduler's allocation equals
explain's prediction for the node it chose; the real kubelet passed the runtime CDI device IDs
that the node's CDI specs (written by the agent at prepare) declare; deleting the file's objects
unprepares: the pods and claims go and the node's CDI specs are back to what they were.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cluster import Cluster, journey
from tests.test_examples_explain import expectation

EXAMPLES = Path(__file__).resolve().parent.parent.parent / "examples" / "resourceclaims"
# On the chart's default values: static MIG, consumable shares off (the share and dynamic-MIG
# examples run after `helm upgrade` in test_cluster_modes.py).
DEFAULT_MODE = sorted(
    p for p in EXAMPLES.glob("*.yaml") if "consumable-shares" not in expectation(p)[1]
)


@pytest.mark.parametrize("path", DEFAULT_MODE, ids=[p.name for p in DEFAULT_MODE])
def test_example_runs_on_the_cluster_as_explain_predicts(cluster: Cluster, path: Path) -> None:
    journey.run_example(cluster, path)
