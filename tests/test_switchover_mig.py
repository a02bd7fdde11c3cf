"""A claim NVIDIA's driver prepared on a dynamic MIG device (``--mig-mode dynamic``), adopted
(prepare/switchover.py): the agent counts its MIG device as its own from its first discovery
pass (mig/dynamic.py reads NVIDIA's checkpoint), so the GPU stays partitionable, and the
adopted claim's unprepare destroys the instance NVIDIA's driver made."""

from __future__ import annotations

import json
from pathlib import Path

from dra_driver.mig.dynamic import ManagedMig
from dra_driver.mig.targets import dynamic_targets, is_placement
from dra_driver.prepare.repair import Repair
from dra_driver.prepare.state import switchover
from dra_driver.prepare.state.nodestate import recorded_device_names_on_disk
from tests.claimdata import allocated_claim
from tests.test_mig_instance_step import THREE_G_AT_4, open_env
from tests.test_switchover import nvidia_checkpoint, nvidia_spec, yaml_spec


def test_an_adopted_dynamic_mig_device_counts_as_ours_and_its_unprepare_destroys_it(
    tmp_path: Path,
) -> None:
    with open_env(tmp_path) as env:
        # NVIDIA's driver made the instance for the claim: here made by a prepare whose record
        # and spec are then dropped, leaving an instance no record of ours names
        claim = env.store.add(allocated_claim(name="nv", devices=[THREE_G_AT_4]))
        uid = claim["metadata"]["uid"]
        env.preparer.prepare(env.ref(claim))
        env.checkpoint.transact(lambda claims: claims.pop(uid))
        env.specs.path_for(uid).unlink()
        assert list(env.instances()) == [THREE_G_AT_4]
        legacy = tmp_path / "plugin" / "checkpoint.json"
        legacy.write_bytes(nvidia_checkpoint([claim]))
        (tmp_path / "cdi").mkdir(exist_ok=True)
        yaml_spec(tmp_path, uid).write_text(nvidia_spec(claim))
        boot = tmp_path / "boot_id"

        # the agent's first discovery pass, before the plugin opens: the instance is ours
        recorded = recorded_device_names_on_disk(env.checkpoint.path, boot_id_path=boot)
        assert THREE_G_AT_4 in recorded
        mig = ManagedMig(mig_mode="dynamic", driver_name="gpu.nvidia.com", warn=False)
        mig.node_devices(env.inventory(), recorded=recorded)
        assert mig.left_static() == {}  # partitionable, not left static for a foreign device
        without = ManagedMig(mig_mode="dynamic", driver_name="gpu.nvidia.com", warn=False)
        without.node_devices(env.inventory(), recorded=frozenset())
        assert "gpu-1" in without.left_static()  # what the agent did before

        env.rediscover()
        assert is_placement(dynamic_targets(env.inventory())[THREE_G_AT_4])
        adoption = switchover.adopt_nvidia_checkpoint(
            legacy,
            checkpoint=env.checkpoint,
            specs=env.specs,
            targets=env.preparer.targets,
            driver_name="gpu.nvidia.com",
            node_name="node1",
            cdi_vendor="k8s.gpu.nvidia.com",
        )
        assert adoption.adopted == [uid], adoption.message()
        Repair(env.preparer).reconcile()
        assert list(env.instances()) == [THREE_G_AT_4]  # in use by the running pod: kept
        env.preparer.unprepare(env.ref(claim))
        assert env.instances() == {}  # destroyed as our own
        assert not yaml_spec(tmp_path, uid).exists()
        assert env.checkpoint.get(uid) is None
    assert json.loads(next(legacy.parent.glob("checkpoint.json.nvidia-adopted-*")).read_bytes())
