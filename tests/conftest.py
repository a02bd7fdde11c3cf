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
