"""A rolling update from the release before gpu-dra-checkpoint.* (prepare/switchover.py): the
old agent, which keeps its checkpoint at ``checkpoint.json`` (+ ``.journal``, ``.lock``), runs
beside the new one. Both prepare through their real sockets; the new agent shares the old names
while the old agent has them open, and moves them to its own once it is gone, with one
consistent state and nothing lost."""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dra_driver.kube import KubeClient
from dra_driver.kube.events import node_event_reporter
from dra_driver.node.nodeplugin import NodePlugin
from dra_driver.node.wiring import kubelet_plugin
from dra_driver.prepare.state.checkpoint import (
    PREPARE_COMPLETED,
    Checkpoint,
    ClaimRecord,
    read_state,
)
from dra_driver.prepare.state.switchover import sole_user
from dra_driver.sim.localapi import FakeKubeApi
from tests.claimdata import allocated_claim, new_uid
from tests.test_plugin_server import inventory, make_config, prepare, start_plugin
from tests.test_switchover import unprepare


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="dra-roll-", dir="/tmp") as d:
        yield Path(d)


@pytest.fixture
def kube(kubeapi: FakeKubeApi) -> Any:
    kubeapi.add_node("node1")
    client = KubeClient.from_config(kubeconfig=kubeapi.kubeconfig_path)
    yield client
    client.close()


def old_release_agent(tmp: Path, kube: KubeClient) -> NodePlugin:
    """The previous release's agent: the same plugin with its checkpoint at checkpoint.json
    (a checkpoint there is its own, so it neither moves nor adopts anything)."""
    plugin = kubelet_plugin(
        config=make_config(tmp, pod_uid=new_uid()),
        inventory=inventory(),
        claims=kube,
        report_event=node_event_reporter(kube, node_name="node1"),
        proc_root=tmp / "proc",
        boot_id_path=tmp / "boot_id",
    )
    legacy = plugin.settings.plugin_data_dir / "checkpoint.json"
    plugin.state.settings = dataclasses.replace(plugin.settings, checkpoint_path=legacy)
    plugin.state.checkpoint = Checkpoint(legacy, boot_id_path=tmp / "boot_id")
    plugin.start()
    return plugin


def uids(*claims: dict[str, Any]) -> set[str]:
    return {c["metadata"]["uid"] for c in claims}


def test_old_and_new_agents_share_the_old_names_then_the_new_one_moves_them(
    short_tmp: Path, kube: KubeClient, kubeapi: FakeKubeApi
) -> None:
    plugin_dir = short_tmp / "plugins/gpu.nvidia.com"
    ours = plugin_dir / "gpu-dra-checkpoint.json"
    legacy = plugin_dir / "checkpoint.json"
    c1, c2, c3, rival0, rival1 = (
        kubeapi.add_claim(allocated_claim(name=n, devices=[d]))
        for n, d in (("c1", "gpu-0"), ("c2", "gpu-1"), ("c3", "gpu-2"),
                     ("rival0", "gpu-0"), ("rival1", "gpu-1"))
    )  # fmt: skip
    old = old_release_agent(short_tmp, kube)
    new = None
    try:
        assert prepare(old, c1).error == ""
        new = start_plugin(short_tmp, kube, pod_uid=new_uid())
        assert new.checkpoint.path == legacy and not ours.exists()  # shared, not moved
        assert prepare(new, c2).error == ""
        assert "gpu-0" in prepare(new, rival0).error  # the new agent sees the old one's claim
        assert "gpu-1" in prepare(old, rival1).error  # and the old one sees the new one's
        new.state._reconcile_pass()  # the old agent still runs: nothing moves
        assert new.checkpoint.path == legacy and not ours.exists()
        unprepare(new, c1)  # prepared by the old agent, unprepared by the new one
        assert set(read_state(legacy)[1]) == uids(c2)
    finally:
        old.stop()  # the rolling update removes the old pod
    try:
        assert set(read_state(legacy)[1]) == uids(c2)  # its clean stop kept the new one's claim
        new.state._reconcile_pass()
        assert new.checkpoint.path == ours
        assert not legacy.exists() and not (plugin_dir / "checkpoint.journal").exists()
        assert not (plugin_dir / "checkpoint.lock").exists()
        assert prepare(new, c3).error == ""
        assert "gpu-1" in prepare(new, rival1).error
        assert set(read_state(ours)[1]) == uids(c2, c3)
    finally:
        new.stop()
    assert set(read_state(ours)[1]) == uids(c2, c3)
    assert not legacy.exists()  # NVIDIA's plugin would start clean


def test_an_old_agent_killed_beside_the_new_one_is_noticed_and_its_claims_kept(
    short_tmp: Path, kube: KubeClient, kubeapi: FakeKubeApi
) -> None:
    plugin_dir = short_tmp / "plugins/gpu.nvidia.com"
    c1, c2 = (
        kubeapi.add_claim(allocated_claim(name=n, devices=[d]))
        for n, d in (("c1", "gpu-0"), ("c2", "gpu-1"))
    )
    old = old_release_agent(short_tmp, kube)
    assert prepare(old, c1).error == ""
    new = start_plugin(short_tmp, kube, pod_uid=new_uid())
    try:
        assert new.checkpoint.path == plugin_dir / "checkpoint.json"
        assert prepare(new, c2).error == ""
        old.kubelet._dra_server.stop(0).wait()  # type: ignore[union-attr]
        os.close(old.checkpoint._files._journal_fd)  # kill -9: its files close, nothing is folded
        os.close(old.checkpoint._files._lock_fd)
    finally:
        new.stop()  # no pass ran since: the stop moves the files
        old.checkpoint._files._journal_fd = old.checkpoint._files._lock_fd = -1
        old.stop()
    assert not (plugin_dir / "checkpoint.json").exists()
    assert set(read_state(plugin_dir / "gpu-dra-checkpoint.json")[1]) == uids(c1, c2)
    new = start_plugin(short_tmp, kube, pod_uid=new_uid())
    try:
        assert "gpu-0" in prepare(new, kubeapi.add_claim(allocated_claim(name="r"))).error
    finally:
        new.stop()


def test_a_file_open_elsewhere_has_another_user_and_the_lease_waits_for_nobody(
    tmp_path: Path,
) -> None:
    path = tmp_path / "journal"
    with sole_user(path) as alone:
        assert alone  # missing
    path.write_bytes(b"")
    with sole_user(path) as alone:
        assert alone
    fd = os.open(path, os.O_RDWR)
    try:
        with sole_user(path) as alone:
            assert not alone
    finally:
        os.close(fd)


def state_with(path: Path, boot_id_path: Path, name: str, *, mtime: float) -> str:
    checkpoint = Checkpoint(path, boot_id_path=boot_id_path)
    checkpoint.open()
    uid = new_uid()
    record = ClaimRecord(uid=uid, namespace="", name=name, phase=PREPARE_COMPLETED, devices=())
    checkpoint.transact(lambda claims: claims.__setitem__(uid, record))
    checkpoint.close()
    for p in (path, path.with_name(path.stem + ".journal")):
        os.utime(p, (mtime, mtime))
    return uid


@pytest.mark.parametrize("newer", ["checkpoint.json", "gpu-dra-checkpoint.json"])
def test_our_checkpoint_under_both_names_keeps_the_one_written_last_and_sets_the_other_aside(
    newer: str, tmp_path: Path, kube: KubeClient
) -> None:
    """A downgrade to the earlier release (which wrote checkpoint.json) and back, or the
    reverse; never a deletion."""
    make_config(tmp_path)
    plugin_dir = tmp_path / "plugins/gpu.nvidia.com"
    boot = tmp_path / "boot_id"
    uid = {
        name: state_with(plugin_dir / name, boot, name, mtime=2e9 if name == newer else 1e9)
        for name in ("checkpoint.json", "gpu-dra-checkpoint.json")
    }
    older = next(n for n in uid if n != newer)
    plugin = start_plugin(tmp_path, kube)
    plugin.stop()
    assert set(read_state(plugin_dir / "gpu-dra-checkpoint.json")[1]) == {uid[newer]}
    assert not (plugin_dir / "checkpoint.json").exists()
    (aside,) = plugin_dir.glob(f"{older}.superseded-*")
    assert set(read_state(aside)[1]) == {uid[older]}
    suffix = aside.name[len(older) :]
    assert (plugin_dir / (older.removesuffix(".json") + ".journal" + suffix)).exists()
