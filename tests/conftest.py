"""Shared pytest fixtures."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from dra_driver.sim.localapi import FakeKubeApi
from tests import leakcheck


@pytest.hookimpl(tryfirst=True)  # before anything reads the temporary directory
def pytest_configure(config: pytest.Config) -> None:
    """Fail the run if it leaves temporary files or processes behind (tests/leakcheck.py)."""
    leakcheck.install(config)


# The tiers that start Kubernetes itself hold a whole cluster (or an API server) for the
# session: they run last, after the rest in whatever order pytest-randomly drew, so that their
# processes do not run beside every other test. Their own order stays random, but for the test
# that stops the cluster tier's API server and etcd: it runs last of all, since for a minute
# after it the scheduler may still decide on what it cached before (a test that ran right after
# it had a claim allocated a device of slices that were already replaced).
_LAST = ("tests/cluster/", "tests/integration/", "tests/realnode/")
_LAST_OF_ALL = ("tests/cluster/test_cluster_outage.py",)


def run_order(nodeid: str) -> int:
    """0: the rest; 1: the tiers that start Kubernetes; 2: what restarts a control plane."""
    if any(part in nodeid for part in _LAST_OF_ALL):
        return 2
    return 1 if any(part in nodeid for part in _LAST) else 0


@pytest.hookimpl(trylast=True)  # after pytest-randomly's shuffle
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: run_order(item.nodeid))  # stable: the drawn order within each


@pytest.fixture
def kubeapi(tmp_path: Path) -> Iterator[FakeKubeApi]:
    """A started local API server (all resource.k8s.io versions) with a kubeconfig for it at
    ``kubeapi.kubeconfig_path``; stopped after the test."""
    api = FakeKubeApi().start()
    api.write_kubeconfig(tmp_path / "kubeconfig")
    try:
        yield api
    finally:
        api.stop()
