"""Where the real Kubernetes programs are: the tests' one way to find them.

``make kube`` (hack/kube.sh) builds etcd, kube-apiserver, kube-controller-manager,
kube-scheduler, kubelet, kubemark and this project's Go test tooling (the hollow node with the
kubelet's real DRA manager, the allocator oracle) into
``${GPU_DRA_KUBE_CACHE:-~/.cache/gpu-dra/kube}/<version>/bin``, the version being the one
hack/kube/go.mod requires. ``KUBEBUILDER_ASSETS`` names any other folder and wins.

A test that needs a program it cannot find is skipped with a message naming ``make kube``; with
``CI=true`` (CI runs ``make kube`` first) it fails instead, so the real tiers can never be
skipped quietly in CI.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
GO_MOD = REPO / "hack" / "kube" / "go.mod"


def kube_version() -> str:
    """The Kubernetes release hack/kube builds (``v1.37.2``)."""
    match = re.search(r"^\s*k8s\.io/kubernetes\s+(v\S+)", GO_MOD.read_text(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"{GO_MOD} requires no k8s.io/kubernetes version")
    return match.group(1)


def bin_dir() -> Path:
    """The folder the programs are looked up in (it may not exist)."""
    assets = os.environ.get("KUBEBUILDER_ASSETS", "")
    if assets:
        return Path(assets)
    cache = os.environ.get("GPU_DRA_KUBE_CACHE", "") or str(Path.home() / ".cache/gpu-dra/kube")
    return Path(cache) / kube_version() / "bin"


def required_in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def kube_bin(*names: str) -> Path:
    """The folder holding every program in ``names``; skips the test (fails it in CI) when one
    is missing."""
    folder = bin_dir()
    missing = [n for n in names if not os.access(folder / n, os.X_OK)]
    if missing:
        message = (
            f"{', '.join(missing)} not found in {folder}: run `make kube` (or set "
            "KUBEBUILDER_ASSETS) for the real-cluster tier"
        )
        if required_in_ci():
            pytest.fail(f"CI=true and {message}")
        pytest.skip(message)
    return folder
