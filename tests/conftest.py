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
# processes do not run beside every other test. Their own order stays random.
_LAST = ("tests/cluster/", "tests/integration/", "tests/realnode/")


@pytest.hookimpl(trylast=True)  # after pytest-randomly's shuffle
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def last(item: pytest.Item) -> bool:
        return any(part in item.nodeid for part in _LAST)

    items[:] = [i for i in items if not last(i)] + [i for i in items if last(i)]


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
