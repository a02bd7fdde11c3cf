"""cdi/devnodes.py: the device nodes a claim's spec names, made where missing as nvidia-modprobe
makes them. The rules alone (the text of /proc files in, what to make out), then prepare on a
fake driver tree (simulated GPUs, real files, real mknod as root) with nodes taken away.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from dra_driver import cdi
from dra_driver.cdi import devnodes
from dra_driver.cdi.devnodes import NodeFacts, ProcFacts, node_facts
from dra_driver.errors import CdiError
from dra_driver.prepare.repair import Repair
from dra_driver.sim.fakedriver import (
    CAPS_MAJOR,
    NVIDIA_PARAMS,
    PROC_DEVICES,
    UVM_MAJOR,
    make_fake_driver,
    mig_capability_table,
    write_capability,
)
from tests.claimdata import allocated_claim, opaque
from tests.test_prepare import MIG_3G, Env, build_env

TABLE = "".join(f"{name} {minor}\n" for name, minor in mig_capability_table(2).items())
PROC = ProcFacts(devices=PROC_DEVICES, nvidia_params=NVIDIA_PARAMS, mig_minors=TABLE)

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs root")


# -- the rules ------------------------------------------------------------------------------


def test_the_uvm_nodes_take_the_major_nvidia_uvm_has_in_proc_devices() -> None:
    assert node_facts("/dev/nvidia-uvm", PROC) == NodeFacts("/dev/nvidia-uvm", UVM_MAJOR, 0, 0o666)
    assert node_facts("/dev/nvidia-uvm-tools", PROC) == NodeFacts(
        "/dev/nvidia-uvm-tools", UVM_MAJOR, 1, 0o666
    )


def test_only_the_character_devices_section_of_proc_devices_counts() -> None:
    devices = "Character devices:\n195 nvidia\n\nBlock devices:\n237 nvidia-uvm\n"
    assert devnodes.char_majors(devices) == {"nvidia": 195}
    with pytest.raises(CdiError, match="nvidia-uvm module is not loaded"):
        node_facts("/dev/nvidia-uvm", ProcFacts(devices=devices))


def test_the_nvidia_nodes_are_major_195_with_the_modules_device_file_parameters() -> None:
    params = "ModifyDeviceFiles: 1\nDeviceFileUID: 7\nDeviceFileGID: 44\nDeviceFileMode: 432\n"
    proc = ProcFacts(devices="Character devices:\n195 nvidia\n", nvidia_params=params)
    assert node_facts("/dev/nvidiactl", proc) == NodeFacts("/dev/nvidiactl", 195, 255, 0o660, 7, 44)
    assert node_facts("/dev/nvidia-modeset", proc).minor == 254
    assert node_facts("/dev/nvidia3", proc).minor == 3
    # no params file: nvidia-modprobe's defaults
    assert node_facts("/dev/nvidia0", ProcFacts(devices=PROC_DEVICES)) == NodeFacts(
        "/dev/nvidia0", 195, 0, 0o666
    )


@pytest.mark.parametrize(
    ("path", "proc", "message"),
    [
        ("/dev/nvidia-uvm", ProcFacts(devices="Character devices:\n195 nvidia\n"),
         "cannot create device node /dev/nvidia-uvm: no 'nvidia-uvm' in /proc/devices"),
        ("/dev/nvidia0", ProcFacts(devices="Character devices:\n237 nvidia-uvm\n"),
         "cannot create device node /dev/nvidia0: no major 195 .* nvidia module is not loaded"),
        ("/dev/nvidiactl", ProcFacts(devices=PROC_DEVICES, nvidia_params="ModifyDeviceFiles: 0\n"),
         r"/dev/nvidiactl: the driver does not allow it .*params: modify 0"),
        ("/dev/nvidia-caps/nvidia-cap12", ProcFacts(devices=PROC_DEVICES, mig_minors=TABLE),
         "nvidia-cap12: /proc/driver/nvidia/capabilities/gpu0/mig/gi1/access does not exist"),
        ("/dev/nvidia-caps/nvidia-cap9999", PROC, "minor 9999 is not in the driver's capability"),
        ("/dev/nvidia-caps/nvidia-cap12", ProcFacts(devices="Character devices:\n195 nvidia\n"),
         "nvidia-cap12: no 'nvidia-caps' in /proc/devices"),
        ("/dev/nvidia-nvswitchctl", PROC, "not an NVIDIA device node the agent knows"),
    ],
)  # fmt: skip
def test_a_node_that_cannot_be_made_is_an_error_naming_it_and_why(
    path: str, proc: ProcFacts, message: str
) -> None:
    with pytest.raises(CdiError, match=message):
        node_facts(path, proc)


def test_a_capability_node_takes_its_minor_from_the_table_and_its_mode_from_its_file() -> None:
    minor = mig_capability_table()["gpu0/gi1/ci0/access"]
    assert devnodes.capability_file(minor, TABLE) == "gpu0/mig/gi1/ci0/access"
    assert devnodes.capability_file(1, TABLE) == "mig/config"
    assert devnodes.capability_file(minor, "") is None
    text = f"DeviceFileMinor: {minor}\nDeviceFileMode: 292\nDeviceFileModify: 1\n"
    proc = ProcFacts(
        devices=PROC_DEVICES, mig_minors=TABLE, capabilities={"gpu0/mig/gi1/ci0/access": text}
    )
    assert node_facts(f"/dev/nvidia-caps/nvidia-cap{minor}", proc) == NodeFacts(
        f"/dev/nvidia-caps/nvidia-cap{minor}", CAPS_MAJOR, minor, 0o444
    )
    wrong = ProcFacts(
        devices=PROC_DEVICES, mig_minors=TABLE, capabilities={"gpu0/mig/gi1/ci0/access": "x: 1"}
    )
    with pytest.raises(CdiError, match="says DeviceFileMinor None"):
        node_facts(f"/dev/nvidia-caps/nvidia-cap{minor}", wrong)
    forbidden = ProcFacts(
        devices=PROC_DEVICES,
        mig_minors=TABLE,
        capabilities={"gpu0/mig/gi1/ci0/access": text.replace("Modify: 1", "Modify: 0")},
    )
    with pytest.raises(CdiError, match="does not allow it"):
        node_facts(f"/dev/nvidia-caps/nvidia-cap{minor}", forbidden)


def test_modules_are_matched_with_dashes_and_underscores_alike() -> None:
    modules = "nvidia_uvm 1904640 0 - Live 0x0\nnvidia_modeset 1531904 1 nvidia_drm, Live 0x0\n"
    assert devnodes.module_loaded(modules, "nvidia-modeset")
    assert not devnodes.module_loaded(modules, "nvidia")


# -- making them ----------------------------------------------------------------------------


def _rdev(path: Path) -> tuple[int, int, int]:
    st = os.stat(path)
    assert stat.S_ISCHR(st.st_mode), path
    return os.major(st.st_rdev), os.minor(st.st_rdev), stat.S_IMODE(st.st_mode)


@root_only
def test_ensure_makes_what_is_missing_once_and_leaves_what_exists(tmp_path: Path) -> None:
    fake = make_fake_driver(tmp_path, gpu_minors=range(2))
    dev = fake.root / "dev"
    (dev / "nvidia-uvm").unlink()
    before = os.stat(dev / "nvidia-uvm-tools")
    paths = ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia1"]
    made = cdi.ensure_device_nodes(paths, dev_root=fake.root, proc_root=fake.proc_root)
    assert made == (NodeFacts("/dev/nvidia-uvm", UVM_MAJOR, 0, 0o666),)
    assert _rdev(dev / "nvidia-uvm") == (UVM_MAJOR, 0, 0o666)
    assert os.stat(dev / "nvidia-uvm-tools").st_ino == before.st_ino  # the fake's 1:3, kept
    assert cdi.ensure_device_nodes(paths, dev_root=fake.root, proc_root=fake.proc_root) == ()


@root_only
def test_nothing_is_made_outside_the_dev_root(tmp_path: Path) -> None:
    fake = make_fake_driver(tmp_path, gpu_minors=range(1))
    dev = fake.root / "dev"
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    for node in (dev / "nvidia-caps").iterdir():
        node.unlink()
    (dev / "nvidia-caps").rmdir()
    (dev / "nvidia-caps").symlink_to(outside)
    name = "gpu0/gi1/access"
    write_capability(fake.proc_root, name)
    path = f"/dev/nvidia-caps/nvidia-cap{mig_capability_table()[name]}"
    with pytest.raises(CdiError, match=f"{path} .*is outside"):
        cdi.ensure_device_nodes([path], dev_root=fake.root, proc_root=fake.proc_root)
    assert list(outside.iterdir()) == []


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    e = build_env(tmp_path)
    yield e
    e.preparer.close()


def _spec_nodes(env: Env, uid: str) -> list[dict[str, str]]:
    spec = json.loads(env.specs.path_for(uid).read_bytes())
    nodes = list(spec["containerEdits"]["deviceNodes"])
    for device in spec["devices"]:
        nodes += device["containerEdits"]["deviceNodes"]
    return nodes


@root_only
def test_prepare_makes_a_missing_nvidia_uvm_and_the_spec_names_it(env: Env) -> None:
    dev = env.tmp / "driver-root/dev"
    (dev / "nvidia-uvm").unlink()
    (dev / "nvidia-uvm-tools").unlink()
    claim = env.store.add(allocated_claim(name="c1", devices=["gpu-0"]))
    env.preparer.prepare(env.ref(claim))
    assert _rdev(dev / "nvidia-uvm") == (UVM_MAJOR, 0, 0o666)
    assert _rdev(dev / "nvidia-uvm-tools") == (UVM_MAJOR, 1, 0o666)
    paths = {n["path"]: n.get("hostPath") for n in _spec_nodes(env, claim["metadata"]["uid"])}
    assert paths["/dev/nvidia-uvm"] == str(dev / "nvidia-uvm")
    assert paths["/dev/nvidia-uvm-tools"] == str(dev / "nvidia-uvm-tools")


@root_only
def test_a_node_the_kernel_gives_no_major_fails_the_claim_naming_it_and_writes_no_spec(
    env: Env,
) -> None:
    (env.tmp / "driver-root/dev/nvidia-uvm").unlink()
    devices = env.tmp / "proc/devices"
    devices.write_text(devices.read_text().replace(f"{UVM_MAJOR} nvidia-uvm\n", ""))
    claim = env.store.add(allocated_claim(name="c1", devices=["gpu-0"]))
    (outcome,) = env.preparer.prepare_batch([env.ref(claim)]).values()
    assert outcome.error_type == "cdi"
    assert "cannot create device node /dev/nvidia-uvm (at " in outcome.error
    assert "the nvidia-uvm module is not loaded" in outcome.error
    assert list((env.tmp / "cdi").iterdir()) == []
    assert env.checkpoint.get(claim["metadata"]["uid"]) is None
    assert not (env.tmp / "driver-root/dev/nvidia-uvm").exists()


@root_only
def test_a_mig_claim_whose_capability_node_cannot_be_made_fails_alone_in_its_batch(
    env: Env,
) -> None:
    # the MIG device's capability nodes, as its spec names them
    mig = env.store.add(allocated_claim(name="mig", devices=[MIG_3G]))
    env.preparer.prepare(env.ref(mig))
    caps = [n for n in _spec_nodes(env, mig["metadata"]["uid"]) if "nvidia-caps" in n["path"]]
    assert len(caps) == 2
    env.preparer.unprepare(env.ref(mig))
    for node in caps:
        Path(node["hostPath"]).unlink()
    Repair(env.preparer).reconcile()  # the nodes a prepare found are not looked at till then
    # the driver's capability files are there, but no nvidia-caps major
    for name, minor in mig_capability_table().items():
        if any(n["path"].endswith(f"nvidia-cap{minor}") for n in caps):
            write_capability(env.tmp / "proc", name)
    devices = env.tmp / "proc/devices"
    devices.write_text(devices.read_text().replace(f"{CAPS_MAJOR} nvidia-caps\n", ""))
    whole = env.store.add(allocated_claim(name="whole", devices=["gpu-0"]))
    outcomes = env.preparer.prepare_batch([env.ref(mig), env.ref(whole)])
    failed = outcomes[mig["metadata"]["uid"]]
    assert failed.error.startswith(f"cannot create device node {caps[0]['path']} (at ")
    assert "no 'nvidia-caps' in /proc/devices" in failed.error
    assert outcomes[whole["metadata"]["uid"]].error == ""
    assert env.specs.path_for(whole["metadata"]["uid"]).exists()
    assert not env.specs.path_for(mig["metadata"]["uid"]).exists()


@root_only
def test_a_mig_claims_capability_nodes_are_made_from_the_drivers_capability_files(
    env: Env,
) -> None:
    mig = env.store.add(allocated_claim(name="mig", devices=[MIG_3G]))
    env.preparer.prepare(env.ref(mig))
    uid = mig["metadata"]["uid"]
    caps = [n for n in _spec_nodes(env, uid) if "nvidia-caps" in n["path"]]
    env.preparer.unprepare(env.ref(mig))
    table = mig_capability_table()
    written = []
    for node in caps:
        Path(node["hostPath"]).unlink()
        minor = int(node["path"].rsplit("nvidia-cap", 1)[1])
        (name,) = [n for n, m in table.items() if m == minor]
        written.append(write_capability(env.tmp / "proc", name, mode=0o440))
    assert [p.name for p in written] == ["access", "access"]  # the GI's, then its CI's
    Repair(env.preparer).reconcile()  # the nodes a prepare found are not looked at till then
    env.preparer.prepare(env.ref(mig))
    for node in caps:
        minor = int(node["path"].rsplit("nvidia-cap", 1)[1])
        assert _rdev(Path(node["hostPath"])) == (CAPS_MAJOR, minor, 0o440)
    assert caps == [n for n in _spec_nodes(env, uid) if "nvidia-caps" in n["path"]]
    # prepared again (idempotent): nothing made a second time
    inodes = [os.stat(n["hostPath"]).st_ino for n in caps]
    env.preparer.unprepare(env.ref(mig))
    env.preparer.prepare(env.ref(mig))
    assert [os.stat(n["hostPath"]).st_ino for n in caps] == inodes


@root_only
def test_a_graphics_claim_gets_nvidia_modeset_made_when_its_module_is_loaded(
    tmp_path: Path,
) -> None:
    make_fake_driver(tmp_path)  # build_env keeps a driver root it finds
    (tmp_path / "boot_id").write_text("boot-1\n")
    (tmp_path / "proc/modules").write_text("nvidia_modeset 1531904 1 nvidia_drm, Live 0x0\n")
    env = build_env(tmp_path)
    try:
        dev = tmp_path / "driver-root/dev"
        assert not (dev / "nvidia-modeset").exists()
        config = opaque({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
                         "driverCapabilities": ["graphics"]})  # fmt: skip
        claim = env.store.add(allocated_claim(name="g", devices=["gpu-0"], configs=[config]))
        env.preparer.prepare(env.ref(claim))
        assert _rdev(dev / "nvidia-modeset") == (195, 254, 0o666)  # params: DeviceFileMode 438
        paths = [n["path"] for n in _spec_nodes(env, claim["metadata"]["uid"])]
        assert "/dev/nvidia-modeset" in paths
    finally:
        env.preparer.close()


@root_only
def test_files_not_scanned_from_a_driver_root_never_make_nodes(tmp_path: Path) -> None:
    fake = make_fake_driver(tmp_path, device_nodes=False)
    files = cdi.DriverFiles(dev_root=tmp_path, proc_root=fake.proc_root)  # no dev_root_here
    files.ensure_claim_nodes(["/dev/nvidia0"], frozenset({"compute"}))
    assert not (tmp_path / "dev").exists()
    scanned = cdi.find_driver_files(
        driver_root=fake.root, driver_version=None, proc_root=fake.proc_root
    )
    assert scanned.dev_root_here == Path("/")  # no dev/ under the root: the host's /dev


@root_only
def test_the_nodes_every_claim_gets_are_checked_once_per_reconcile_pass_not_per_prepare(
    env: Env,
) -> None:
    """nvidiactl and the uvm nodes do not depend on the claim: the first prepare makes them,
    the next prepares check only their own devices' nodes, and after a reconcile pass (or a
    re-discovery) the next prepare checks them again."""
    dev = env.tmp / "driver-root/dev"
    (dev / "nvidia1").unlink()
    Repair(env.preparer).reconcile()  # a pass: gpu-1's node is missing now
    first = env.store.add(allocated_claim(name="c1", devices=["gpu-0"]))
    env.preparer.prepare(env.ref(first))
    (dev / "nvidia-uvm").unlink()
    second = env.store.add(allocated_claim(name="c2", devices=["gpu-1"]))
    env.preparer.prepare(env.ref(second))
    assert _rdev(dev / "nvidia1")[:2] == (195, 1)  # the claim's own node, missing at the pass
    assert not (dev / "nvidia-uvm").exists()  # a shared one: not on this prepare
    Repair(env.preparer).reconcile()
    third = env.store.add(allocated_claim(name="c3", devices=["gpu-2"]))
    env.preparer.prepare(env.ref(third))
    assert _rdev(dev / "nvidia-uvm") == (UVM_MAJOR, 0, 0o666)


@root_only
def test_a_devices_own_node_is_checked_once_per_reconcile_pass_and_device_version(
    env: Env,
) -> None:
    """A device's own node does not depend on the claim either: which nodes exist is looked
    up off the prepare path (at the Preparer's start, a re-discovery, each reconcile pass); a
    node there then is not looked at by a prepare, one missing then is made by the first
    prepare that names it, and the next prepares of the device do not look again; after a
    reconcile pass, or a re-discovery (set_targets), the next prepare makes a node removed
    since."""
    dev = env.tmp / "driver-root/dev"
    n = iter(range(100))

    def prepare_gpu_1() -> None:
        claim = env.store.add(allocated_claim(name=f"c{next(n)}", devices=["gpu-1"]))
        env.preparer.prepare(env.ref(claim))
        env.preparer.unprepare(env.ref(claim))

    (dev / "nvidia1").unlink()  # after the start's look: not looked at again till a pass
    prepare_gpu_1()
    assert not (dev / "nvidia1").exists()
    Repair(env.preparer).reconcile()  # the pass finds it missing
    prepare_gpu_1()
    assert _rdev(dev / "nvidia1")[:2] == (195, 1)  # made by the first prepare after it
    (dev / "nvidia1").unlink()
    prepare_gpu_1()
    assert not (dev / "nvidia1").exists()  # checked once: not on this prepare
    Repair(env.preparer).reconcile()
    prepare_gpu_1()
    assert _rdev(dev / "nvidia1")[:2] == (195, 1)  # the pass: checked again
    (dev / "nvidia1").unlink()
    env.preparer.set_targets(env.preparer.targets, env.preparer.files)  # a re-discovery
    prepare_gpu_1()
    assert _rdev(dev / "nvidia1")[:2] == (195, 1)  # a new version of the devices: again


@root_only
def test_a_prepare_does_not_look_for_the_nodes_found_before_it(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Which devices' nodes exist was looked up when the Preparer took its devices: the first
    prepare of a device whose node was there then costs no stat on the prepare path."""
    first = env.store.add(allocated_claim(name="c1", devices=["gpu-0"]))
    env.preparer.prepare(env.ref(first))  # the nodes every claim gets: once, here
    looked: list[str] = []
    real = devnodes._exists
    monkeypatch.setattr(devnodes, "_exists", lambda p: (looked.append(p), real(p))[1])
    second = env.store.add(allocated_claim(name="c2", devices=["gpu-1"]))
    env.preparer.prepare(env.ref(second))
    assert looked == []
