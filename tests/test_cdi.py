"""cdi.py: spec content, the lowest cdiVersion, driver-file discovery, atomic writes."""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest

from dra_driver import cdi
from dra_driver.errors import CdiError
from dra_driver.fsutil import in_memory_fs
from dra_driver.sim.fakedriver import LIB_DIR, OLD_VERSION, make_fake_driver
from dra_driver.sim.profiles import DRIVER_VERSION
from tests.claimdata import new_uid
from tests.spares import held, spares_in

UID = "6c0e1d2f-0000-4000-8000-00000000abcd"
VENDOR = "k8s.gpu.nvidia.com"


def files_for(tmp: Path) -> cdi.DriverFiles:
    fake = make_fake_driver(tmp)
    return cdi.find_driver_files(
        driver_root=fake.root, driver_version=DRIVER_VERSION, proc_root=fake.proc_root
    )


LIB = cdi.CONTAINER_LIB_DIR


def links_of(files: cdi.DriverFiles, capability: str) -> dict[str, str]:
    return {x.link: x.target for x in files.links_by_capability.get(capability, ())}


def test_libraries_are_mounted_into_one_directory_with_their_links(tmp_path: Path) -> None:
    files = files_for(tmp_path)
    mounts = {m.container_path: m.host_path for m in files.mounts}
    real_cuda = str(tmp_path / "driver-root" / LIB_DIR / f"libcuda.so.{DRIVER_VERSION}")
    assert mounts[f"{LIB}/libcuda.so.{DRIVER_VERSION}"] == real_cuda  # the real file
    assert f"{LIB}/libcuda.so.1" not in mounts  # a link the hook creates, not a second mount
    assert links_of(files, "compute")[f"{LIB}/libcuda.so.1"] == f"libcuda.so.{DRIVER_VERSION}"
    assert links_of(files, "compute")[f"{LIB}/libcuda.so"] == "libcuda.so.1"  # the whole chain
    assert links_of(files, "utility")[f"{LIB}/libnvidia-ml.so.1"] == (
        f"libnvidia-ml.so.{DRIVER_VERSION}"
    )
    assert f"{LIB}/libnvidia-gpucomp.so.{DRIVER_VERSION}" in mounts
    assert f"{LIB}/libcuda.so.{OLD_VERSION}" not in mounts  # another driver's leftovers
    assert f"{LIB}/libc.so.6" not in mounts
    assert not any(p.startswith(f"/{LIB_DIR}/") for p in mounts)  # no host layout in containers
    assert {
        "/usr/bin/nvidia-smi",
        "/usr/bin/nvidia-debugdump",
        "/usr/bin/nvidia-persistenced",
    } <= set(mounts)
    assert files.dev_root == tmp_path / "driver-root"


def test_libraries_are_grouped_by_driver_capability(tmp_path: Path) -> None:
    files = files_for(tmp_path)

    def names(capability: str) -> set[str]:
        return {
            m.container_path.rsplit("/", 1)[1].split(".so")[0]
            for m in files.mounts_by_capability.get(capability, ())
        }

    assert {"libcuda", "libnvidia-ptxjitcompiler", "libnvidia-nvvm"} <= names("compute")
    assert {"libnvidia-ml", "libnvidia-cfg", "nvidia-smi"} <= names("utility")
    assert names("video") == {"libnvcuvid", "libnvidia-encode", "libnvidia-opticalflow"}
    default = json.dumps(files.edits(cdi.DEFAULT_CAPABILITIES))
    assert "libnvcuvid" not in default and "libcuda" in default
    video = json.dumps(files.edits(cdi.DEFAULT_CAPABILITIES | {"video"}))
    assert "libnvcuvid" in video and "libnvidia-encode" in video and "libcuda" in video


def test_files_are_found_in_the_agents_view_and_named_as_the_host_sees_them(
    tmp_path: Path,
) -> None:
    # The chart mounts the host's driver root at /driver-root: scanning the host path from inside
    # the container would find nothing (or the image's own files).
    fake = make_fake_driver(tmp_path, lib_dir="usr/lib64")
    host_root = Path("/run/nvidia/driver")
    files = cdi.find_driver_files(
        driver_root=fake.root,
        host_driver_root=host_root,
        driver_version=DRIVER_VERSION,
        proc_root=fake.proc_root,
    )
    mounts = {m.container_path: m.host_path for m in files.mounts}
    assert mounts[f"{LIB}/libcuda.so.{DRIVER_VERSION}"] == (
        f"/run/nvidia/driver/usr/lib64/libcuda.so.{DRIVER_VERSION}"
    )
    assert mounts["/usr/bin/nvidia-smi"] == "/run/nvidia/driver/usr/bin/nvidia-smi"
    assert all(h.startswith("/run/nvidia/driver/") for h in mounts.values())
    assert files.dev_root == host_root  # the driver container's root holds dev/nvidiactl
    assert files.node("/dev/nvidia0").host_path == "/run/nvidia/driver/dev/nvidia0"


def test_device_nodes_are_on_the_host_unless_the_driver_root_holds_nvidiactl(
    tmp_path: Path,
) -> None:
    fake = make_fake_driver(tmp_path, device_nodes=False)
    (fake.root / "dev").mkdir()  # a dev/ without the driver's nodes (a plain install tree)
    (fake.root / "dev/null").write_text("")
    files = cdi.find_driver_files(
        driver_root=fake.root,
        host_driver_root=Path("/run/nvidia/driver"),
        driver_version=DRIVER_VERSION,
        proc_root=fake.proc_root,
    )
    assert files.dev_root == Path("/")
    assert files.node("/dev/nvidia0").host_path == "/dev/nvidia0"


def test_a_missing_soname_link_is_still_created(tmp_path: Path) -> None:
    fake = make_fake_driver(tmp_path)
    (fake.root / LIB_DIR / "libnvidia-ml.so.1").unlink()
    files = cdi.find_driver_files(
        driver_root=fake.root, driver_version=DRIVER_VERSION, proc_root=fake.proc_root
    )
    assert links_of(files, "utility")[f"{LIB}/libnvidia-ml.so.1"] == (
        f"libnvidia-ml.so.{DRIVER_VERSION}"
    )


def test_the_hook_creates_the_links_and_refreshes_the_loader_cache(tmp_path: Path) -> None:
    files = dataclasses.replace(files_for(tmp_path), hook_path="/var/lib/x/bin/gpu-dra-cdi-hook-1")
    hooks = files.edits(cdi.DEFAULT_CAPABILITIES)["hooks"]
    assert [h["hookName"] for h in hooks] == ["createContainer", "createContainer"]
    assert {h["path"] for h in hooks} == {"/var/lib/x/bin/gpu-dra-cdi-hook-1"}
    symlinks, ldcache = hooks[0]["args"], hooks[1]["args"]
    assert symlinks[:2] == ["gpu-dra-cdi-hook-1", "create-symlinks"]
    assert f"libcuda.so.{DRIVER_VERSION}::{LIB}/libcuda.so.1" in symlinks
    assert f"libcuda.so.1::{LIB}/libcuda.so" in symlinks
    assert all(a == "--link" for a in symlinks[2::2])
    assert ldcache == ["gpu-dra-cdi-hook-1", "update-ldcache", "--folder", LIB]


def test_without_a_hook_every_link_name_is_a_mount_of_its_file(tmp_path: Path) -> None:
    files = files_for(tmp_path)
    assert files.hook_path is None
    edits = files.edits(cdi.DEFAULT_CAPABILITIES)
    assert "hooks" not in edits
    mounts = {m["containerPath"]: m["hostPath"] for m in edits["mounts"]}
    real_cuda = str(files_for_root(tmp_path) / LIB_DIR / f"libcuda.so.{DRIVER_VERSION}")
    assert mounts[f"{LIB}/libcuda.so.1"] == real_cuda
    assert mounts[f"{LIB}/libcuda.so"] == real_cuda  # libcuda.so -> .so.1 -> the file


def files_for_root(tmp: Path) -> Path:
    return tmp / "driver-root"


def test_absolute_links_resolve_inside_the_driver_root(tmp_path: Path) -> None:
    fake = make_fake_driver(tmp_path)
    link = fake.root / LIB_DIR / "libcuda.so.1"
    link.unlink()
    link.symlink_to(f"/{LIB_DIR}/libcuda.so.{DRIVER_VERSION}")  # absolute, as driver containers do
    escape = fake.root / LIB_DIR / "libnvidia-cfg.so.1"
    escape.unlink()
    escape.symlink_to("../../../../../../etc/hostname")
    files = cdi.find_driver_files(
        driver_root=fake.root, driver_version=DRIVER_VERSION, proc_root=fake.proc_root
    )
    mounts = {m.container_path: m.host_path for m in files.mounts}
    assert mounts[f"{LIB}/libcuda.so.{DRIVER_VERSION}"] == str(fake.library("libcuda"))
    assert links_of(files, "compute")[f"{LIB}/libcuda.so.1"] == f"libcuda.so.{DRIVER_VERSION}"
    assert all(h.startswith(str(fake.root)) for h in mounts.values())


def test_mig_capability_minors_follow_the_kernel_table(tmp_path: Path) -> None:
    files = files_for(tmp_path)
    assert files.mig_cap_minor("gpu0/gi0/access") == 3
    assert files.mig_cap_minor("gpu3/gi3/ci3/access") == 439
    without_table = cdi.DriverFiles(dev_root=Path("/"))
    for name, minor in files.mig_cap_minors.items():  # the formula agrees with every table line
        assert without_table.mig_cap_minor(name) == minor


def claim_spec(
    *, vendor: str, claim_uid: str, devices: list[cdi.ClaimDevice], files: cdi.DriverFiles
) -> dict[str, Any]:
    return cdi.ClaimSpecEncoder(vendor=vendor, files=files).spec(claim_uid, devices)


def whole_json(spec: dict[str, Any]) -> bytes:
    """The reference encoding: the whole spec as compact JSON, nothing spliced."""
    return json.dumps(spec, separators=(",", ":")).encode() + b"\n"


def test_spec_uses_the_lowest_version_its_fields_need() -> None:
    files = cdi.DriverFiles(dev_root=Path("/"))
    node = (files.node("/dev/nvidia0"),)
    plain = claim_spec(vendor=VENDOR, claim_uid="abcdef00-0000-4000-8000-000000000000",
                           devices=[cdi.ClaimDevice("gpu-0", node)], files=files)  # fmt: skip
    assert plain["cdiVersion"] == "0.3.0"
    digit = claim_spec(
        vendor=VENDOR, claim_uid=UID, devices=[cdi.ClaimDevice("gpu-0", node)], files=files
    )
    assert digit["cdiVersion"] == "0.5.0"  # a device name starting with a digit needs 0.5.0
    host = cdi.DriverFiles(dev_root=Path("/run/nvidia/driver"))
    hosted_device = cdi.ClaimDevice("gpu-0", (host.node("/dev/nvidia0"),))
    hosted = claim_spec(
        vendor=VENDOR, claim_uid="abcdef00-0000-4000-8000-000000000000",
        devices=[hosted_device], files=host,
    )  # fmt: skip
    assert hosted["cdiVersion"] == "0.5.0"
    assert hosted["devices"][0]["containerEdits"]["deviceNodes"] == [
        {"path": "/dev/nvidia0", "hostPath": "/run/nvidia/driver/dev/nvidia0"}
    ]
    assert cdi.minimum_version({"annotations": {}, "devices": []}) == "0.6.0"


def test_spec_content_is_deterministic(tmp_path: Path) -> None:
    files = files_for(tmp_path)
    devices = [cdi.ClaimDevice("gpu-1", cdi.gpu_nodes(files, minor=1))]
    a = cdi.ClaimSpecEncoder(vendor=VENDOR, files=files).encode(UID, devices)
    b = cdi.ClaimSpecEncoder(vendor=VENDOR, files=files).encode(UID, devices)
    assert a == b
    spec = json.loads(a)
    assert spec["containerEdits"]["env"] == ["NVIDIA_VISIBLE_DEVICES=void"]
    assert [n["path"] for n in spec["containerEdits"]["deviceNodes"]] == [
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
        "/dev/nvidia-uvm-tools",
    ]
    assert all(
        m["options"] == ["ro", "nosuid", "nodev", "bind"] for m in spec["containerEdits"]["mounts"]
    )


@pytest.mark.parametrize("uid", [UID, "0bcdef00-0000-4000-8000-000000000000"])
def test_the_encoder_gives_the_same_bytes_as_encoding_the_spec(tmp_path: Path, uid: str) -> None:
    files = files_for(tmp_path)
    encoder = cdi.ClaimSpecEncoder(vendor=VENDOR, files=files)
    mig = cdi.mig_nodes(files, parent_minor=0, gpu_instance_id=1, compute_instance_id=0)
    for devices in (
        [cdi.ClaimDevice("gpu-1", cdi.gpu_nodes(files, minor=1))],
        [
            cdi.ClaimDevice("gpu-0-mig-1g10gb-1", mig),
            cdi.ClaimDevice("gpu-2", cdi.gpu_nodes(files, minor=2)),
        ],
    ):
        spec = claim_spec(vendor=VENDOR, claim_uid=uid, devices=devices, files=files)
        assert encoder.encode(uid, devices) == whole_json(spec)
        assert json.loads(encoder.encode(uid, devices)) == spec
    with pytest.raises(CdiError, match="needs at least one device"):
        encoder.encode(uid, [])


def test_specs_from_the_template_cache_are_the_specs_built_whole(tmp_path: Path) -> None:
    # device nodes at their own paths (no hostPath), so the UID alone decides the cdiVersion
    files = dataclasses.replace(files_for(tmp_path), dev_root=Path("/"))
    encoder = cdi.ClaimSpecEncoder(vendor=VENDOR, files=files)
    encoder.max_templates = 3
    mig = cdi.mig_nodes(files, parent_minor=0, gpu_instance_id=1, compute_instance_id=0)
    device_sets = [[cdi.ClaimDevice(f"gpu-{i}", cdi.gpu_nodes(files, minor=i))] for i in range(4)]
    device_sets.append([cdi.ClaimDevice("gpu-0-mig-1g10gb-1", mig), *device_sets[1]])
    # UIDs starting with a letter give cdiVersion 0.3.0, with a digit 0.5.0: both kinds, and
    # more device sets than templates kept, so templates are made, reused and dropped
    uids = ["abcdef00-0000-4000-8000-000000000000", UID] + [new_uid() for _ in range(6)]
    versions = set()
    for _ in range(2):
        for devices in device_sets:
            for uid in uids:
                spec = claim_spec(vendor=VENDOR, claim_uid=uid, devices=devices, files=files)
                assert encoder.encode(uid, devices) == whole_json(spec)
                versions.add(spec["cdiVersion"])
    assert versions == {"0.3.0", "0.5.0"}
    assert len(encoder._templates) == 3
    # a template holds its devices' bytes only: the shared edits are kept once, not per template
    shared = json.dumps(files.edits(cdi.DEFAULT_CAPABILITIES), separators=(",", ":")).encode()
    assert len(shared) > 500
    assert all(shared not in b"".join(parts) for parts in encoder._templates.values())
    assert all(sum(map(len, parts)) < len(shared) for parts in encoder._templates.values())


def test_spec_dir_writes_atomically_and_touches_only_its_own_files(tmp_path: Path) -> None:
    specs = cdi.CdiSpecDir(tmp_path, vendor=VENDOR)
    (tmp_path / "nvidia.yaml").write_text("someone else's")
    path = specs.write(UID, b'{"a":1}\n')
    assert path.name == f"{VENDOR}-claim_{UID}.json"
    specs.write(UID, b'{"a":2}\n')
    assert path.read_bytes() == b'{"a":2}\n'
    assert specs.claim_uids() == {UID}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([path.name, "nvidia.yaml"])
    stale = tmp_path / f".{path.name}.deadbeef.tmp"
    stale.write_text("half")
    (tmp_path / f".{path.name}.notatemp").write_text("not ours")
    assert specs.temp_files() == [(UID, stale)]
    assert specs.remove_temp_file(stale) and not specs.remove_temp_file(stale)
    with pytest.raises(CdiError, match="not a temp file of ours"):
        specs.remove_temp_file(tmp_path / "nvidia.yaml")
    assert specs.remove(UID) and not specs.remove(UID)
    assert (tmp_path / "nvidia.yaml").exists()


def test_a_spec_write_in_steps_shows_nothing_until_commit_and_abort_leaves_nothing(
    tmp_path: Path,
) -> None:
    specs = cdi.CdiSpecDir(tmp_path, vendor=VENDOR)
    old = specs.write(UID, b'{"old":1}\n')
    pending = specs.begin(UID, b'{"new":1}\n')
    assert [uid for uid, _ in specs.temp_files()] == [UID]
    assert old.read_bytes() == b'{"old":1}\n'  # readers still see the old spec
    pending.sync()
    assert pending.commit() == old
    assert old.read_bytes() == b'{"new":1}\n'
    pending.abort()  # after commit: nothing to undo
    assert old.exists() and specs.temp_files() == []

    dropped = specs.begin(UID, b'{"never":1}\n')
    dropped.abort()
    dropped.abort()
    assert specs.temp_files() == [] and old.read_bytes() == b'{"new":1}\n'


@pytest.mark.parametrize(
    "uid", ["../../etc/x", "6C0E1D2F-0000-4000-8000-00000000ABCD", "", "x" * 36]
)
def test_claim_uids_that_are_not_uuids_never_become_paths(tmp_path: Path, uid: str) -> None:
    specs = cdi.CdiSpecDir(tmp_path, vendor=VENDOR)
    with pytest.raises(CdiError, match="not a lowercase UUID"):
        specs.write(uid, b"{}")
    assert list(tmp_path.iterdir()) == []


# --- spares: removed specs kept for the next write --------------------------------------------


def test_a_removed_spec_becomes_a_locked_spare_whose_file_the_next_write_reuses(
    tmp_path: Path,
) -> None:
    specs = cdi.CdiSpecDir(tmp_path, vendor=VENDOR)
    first = specs.write(UID, b'{"long":"' + b"x" * 100 + b'"}\n')
    inode = first.stat().st_ino
    assert specs.remove(UID)
    assert not first.exists() and specs.claim_uids() == set() and specs.temp_files() == []
    (spare,) = spares_in(tmp_path)
    assert not spare.name.endswith((".json", ".yaml"))  # never read by a runtime
    assert held(spare) and specs.spare_count == 1
    other_uid = new_uid()
    other = specs.write(other_uid, b'{"short":1}\n')
    assert other.stat().st_ino == inode  # the same file: no inode allocated or freed
    assert other.read_bytes() == b'{"short":1}\n'  # overwritten and cut to the new length
    assert spares_in(tmp_path) == [] and specs.spare_count == 0
    assert not held(other)  # a spec is nobody's spare
    assert specs.claim_uids() == {other_uid}


def test_an_aborted_write_on_a_spare_leaves_nothing(tmp_path: Path) -> None:
    specs = cdi.CdiSpecDir(tmp_path, vendor=VENDOR)
    specs.write(UID, b"{}\n")
    specs.remove(UID)
    pending = specs.begin(new_uid(), b'{"never":1}\n')
    pending.abort()
    assert list(tmp_path.iterdir()) == [] and specs.spare_count == 0


def test_spares_are_capped_and_deleted_at_close(tmp_path: Path) -> None:
    specs = cdi.CdiSpecDir(tmp_path, vendor=VENDOR, max_spares=3)
    uids = [new_uid() for _ in range(5)]
    for uid in uids:
        specs.write(uid, b"{}\n")
    assert all(specs.remove(uid) for uid in uids)
    assert len(spares_in(tmp_path)) == 3 and specs.spare_count == 3
    assert specs.claim_uids() == set()
    specs.close()
    assert list(tmp_path.iterdir()) == []


def test_a_second_instance_leaves_live_spares_alone_and_adopts_those_of_a_dead_one(
    tmp_path: Path,
) -> None:
    first = cdi.CdiSpecDir(tmp_path, vendor=VENDOR, max_spares=4)
    uids = [new_uid() for _ in range(4)]
    for uid in uids:
        first.write(uid, b"{}\n")
    for uid in uids:
        first.remove(uid)
    second = cdi.CdiSpecDir(tmp_path, vendor=VENDOR, max_spares=2)  # a rolling update
    assert second.collect_spares() == (0, 0)  # all held by the live first instance
    assert len(spares_in(tmp_path)) == 4
    # the first instance is killed: its locks go with its file descriptors
    for spare in first._spares:
        os.close(spare.fd)
    first._spares = []
    assert not any(held(p) for p in spares_in(tmp_path))
    assert second.collect_spares() == (2, 2)
    assert len(spares_in(tmp_path)) == 2 and all(held(p) for p in spares_in(tmp_path))
    assert second.collect_spares() == (0, 0)  # its own spares are not collected twice
    path = second.write(UID, b'{"adopted":1}\n')
    assert path.read_bytes() == b'{"adopted":1}\n' and len(spares_in(tmp_path)) == 1
    second.close()
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_a_spec_that_cannot_become_a_spare_is_simply_deleted(tmp_path: Path) -> None:
    specs = cdi.CdiSpecDir(tmp_path, vendor=VENDOR)
    target = tmp_path / "elsewhere.txt"
    target.write_text("not ours to reuse")
    (tmp_path / f"{VENDOR}-claim_{UID}.json").symlink_to(target)
    assert specs.remove(UID)
    assert specs.claim_uids() == set() and specs.spare_count == 0
    assert target.read_text() == "not ours to reuse"


def test_every_claim_gets_the_daemon_sockets_and_the_running_drivers_firmware(
    tmp_path: Path,
) -> None:
    import socket  # noqa: PLC0415

    fake = make_fake_driver(tmp_path)
    sock_dir = fake.root / "run/nvidia-persistenced"
    sock_dir.mkdir(parents=True)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(sock_dir / "socket"))
    firmware = fake.root / "lib/firmware/nvidia" / DRIVER_VERSION
    firmware.mkdir(parents=True)
    (firmware / "gsp_ga10x.bin").write_bytes(b"fw")
    (firmware / "README").write_text("not firmware")
    old = fake.root / "lib/firmware/nvidia" / OLD_VERSION
    old.mkdir()
    (old / "gsp_ga10x.bin").write_bytes(b"old fw")
    try:
        files = cdi.find_driver_files(
            driver_root=fake.root,
            host_driver_root=Path("/run/nvidia/driver"),
            driver_version=DRIVER_VERSION,
            proc_root=fake.proc_root,
        )
    finally:
        listener.close()
    base = {m.container_path: m.host_path for m in files.mounts_by_capability[cdi.BASE]}
    assert base == {
        "/run/nvidia-persistenced/socket": "/run/nvidia/driver/run/nvidia-persistenced/socket",
        f"/lib/firmware/nvidia/{DRIVER_VERSION}/gsp_ga10x.bin": (
            f"/run/nvidia/driver/lib/firmware/nvidia/{DRIVER_VERSION}/gsp_ga10x.bin"
        ),
    }
    for capabilities in (cdi.DEFAULT_CAPABILITIES, frozenset({"video"})):
        paths = {m["containerPath"] for m in files.edits(capabilities)["mounts"]}
        assert set(base) <= paths


def test_graphics_brings_its_icd_files_and_the_modeset_node_only_when_asked(
    tmp_path: Path,
) -> None:
    fake = make_fake_driver(tmp_path)
    icd = fake.root / "usr/share/vulkan/icd.d/nvidia_icd.json"
    icd.parent.mkdir(parents=True)
    icd.write_text('{"ICD": {"library_path": "libGLX_nvidia.so.0"}}')
    (fake.root / LIB_DIR / f"libGLX_nvidia.so.{DRIVER_VERSION}").write_text("glx")
    (fake.root / "dev/nvidia-modeset").write_text("")
    files = cdi.find_driver_files(
        driver_root=fake.root, driver_version=DRIVER_VERSION, proc_root=fake.proc_root
    )
    plain = files.edits(cdi.DEFAULT_CAPABILITIES)
    graphics = files.edits(cdi.DEFAULT_CAPABILITIES | {"graphics"})

    def paths(edits: dict[str, Any]) -> set[str]:
        return {m["containerPath"] for m in edits["mounts"]}

    assert "/usr/share/vulkan/icd.d/nvidia_icd.json" in paths(graphics) - paths(plain)
    assert f"{LIB}/libGLX_nvidia.so.{DRIVER_VERSION}" in paths(graphics) - paths(plain)
    assert "/dev/nvidia-modeset" in [n["path"] for n in graphics["deviceNodes"]]
    assert "/dev/nvidia-modeset" not in [n["path"] for n in plain["deviceNodes"]]
    assert "hooks" not in graphics  # no hook configured here: the soname link is a mount
    assert f"{LIB}/libGLX_nvidia.so.0" in paths(graphics)


def _fstype(path: Path) -> str:
    """The file system type /proc/mounts gives for ``path`` (its longest mount point)."""
    best, fstype = "", ""
    for line in Path("/proc/mounts").read_text().splitlines():
        fields = line.split()
        point = fields[1].replace("\\040", " ")
        if (str(path) == point or str(path).startswith(point.rstrip("/") + "/")) and len(
            point
        ) >= len(best):
            best, fstype = point, fields[2]
    return fstype


def test_the_spec_directory_knows_whether_it_is_in_memory(tmp_path: Path) -> None:
    """statfs's answer agrees with /proc/mounts: a tmpfs (where a node's /run/cdi is) is in
    memory; a disk directory and /proc are not; a path that cannot be asked counts as a disk."""
    specs = cdi.CdiSpecDir(tmp_path / "cdi", vendor="k8s.gpu.nvidia.com")
    specs.ensure()
    assert specs.in_memory is (_fstype(tmp_path) in ("tmpfs", "ramfs"))
    for path in (Path("/proc"), Path("/dev/shm")):
        if path.is_dir():
            assert in_memory_fs(path) is (_fstype(path) in ("tmpfs", "ramfs")), path
    assert in_memory_fs(tmp_path / "does-not-exist") is False


def test_a_spec_directory_on_a_tmpfs_keeps_no_spares() -> None:
    """On a tmpfs (a node's /run/cdi) a removed spec is deleted, and spares an earlier instance
    left there are deleted, not adopted: creating a file there costs less than a spare does."""
    if _fstype(Path("/dev/shm")) != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm on this machine")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        root = Path(d)
        earlier = cdi.CdiSpecDir(root, vendor=VENDOR)  # ensure() not called: keeps spares
        earlier.write(UID, b"{}\n")
        earlier.remove(UID)
        (left,) = spares_in(root)
        for spare in earlier._spares:  # the earlier instance is gone: its locks with it
            os.close(spare.fd)
        specs = cdi.CdiSpecDir(root, vendor=VENDOR)
        specs.ensure()
        assert specs.in_memory
        assert specs.collect_spares() == (0, 1) and not left.exists()
        uids = [new_uid() for _ in range(3)]
        for uid in uids:
            specs.write(uid, b"{}\n")
        assert all(specs.remove(uid) for uid in uids)
        assert list(root.iterdir()) == [] and specs.spare_count == 0
