"""cdi/driverfiles.py: which driver files a container needs, found under the driver root."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from dra_driver.cdi.driverfiles import (
    BASE,
    CONTAINER_LIB_DIR,
    DEFAULT_CAPABILITIES,
    DriverFiles,
    find_driver_files,
)
from dra_driver.cdi.driverpaths import file_kind, find_driver_tool
from dra_driver.sim.fakedriver import LIB_DIR, OLD_VERSION, make_fake_driver
from dra_driver.sim.profiles import DRIVER_VERSION


def files_for(tmp: Path) -> DriverFiles:
    fake = make_fake_driver(tmp)
    return find_driver_files(
        driver_root=fake.root, driver_version=DRIVER_VERSION, proc_root=fake.proc_root
    )


LIB = CONTAINER_LIB_DIR


def links_of(files: DriverFiles, capability: str) -> dict[str, str]:
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
    default = json.dumps(files.edits(DEFAULT_CAPABILITIES))
    assert "libnvcuvid" not in default and "libcuda" in default
    video = json.dumps(files.edits(DEFAULT_CAPABILITIES | {"video"}))
    assert "libnvcuvid" in video and "libnvidia-encode" in video and "libcuda" in video


def test_files_are_found_in_the_agents_view_and_named_as_the_host_sees_them(
    tmp_path: Path,
) -> None:
    # The chart mounts the host's driver root at /driver-root: scanning the host path from inside
    # the container would find nothing (or the image's own files).
    fake = make_fake_driver(tmp_path, lib_dir="usr/lib64")
    host_root = Path("/run/nvidia/driver")
    files = find_driver_files(
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
    files = find_driver_files(
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
    files = find_driver_files(
        driver_root=fake.root, driver_version=DRIVER_VERSION, proc_root=fake.proc_root
    )
    assert links_of(files, "utility")[f"{LIB}/libnvidia-ml.so.1"] == (
        f"libnvidia-ml.so.{DRIVER_VERSION}"
    )


def test_the_hook_creates_the_links_and_refreshes_the_loader_cache(tmp_path: Path) -> None:
    files = dataclasses.replace(files_for(tmp_path), hook_path="/var/lib/x/bin/gpu-dra-cdi-hook-1")
    hooks = files.edits(DEFAULT_CAPABILITIES)["hooks"]
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
    edits = files.edits(DEFAULT_CAPABILITIES)
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
    files = find_driver_files(
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
    without_table = DriverFiles(dev_root=Path("/"))
    for name, minor in files.mig_cap_minors.items():  # the formula agrees with every table line
        assert without_table.mig_cap_minor(name) == minor


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
        files = find_driver_files(
            driver_root=fake.root,
            host_driver_root=Path("/run/nvidia/driver"),
            driver_version=DRIVER_VERSION,
            proc_root=fake.proc_root,
        )
    finally:
        listener.close()
    base = {m.container_path: m.host_path for m in files.mounts_by_capability[BASE]}
    assert base == {
        "/run/nvidia-persistenced/socket": "/run/nvidia/driver/run/nvidia-persistenced/socket",
        f"/lib/firmware/nvidia/{DRIVER_VERSION}/gsp_ga10x.bin": (
            f"/run/nvidia/driver/lib/firmware/nvidia/{DRIVER_VERSION}/gsp_ga10x.bin"
        ),
    }
    for capabilities in (DEFAULT_CAPABILITIES, frozenset({"video"})):
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
    files = find_driver_files(
        driver_root=fake.root, driver_version=DRIVER_VERSION, proc_root=fake.proc_root
    )
    plain = files.edits(DEFAULT_CAPABILITIES)
    graphics = files.edits(DEFAULT_CAPABILITIES | {"graphics"})

    def paths(edits: dict[str, Any]) -> set[str]:
        return {m["containerPath"] for m in edits["mounts"]}

    assert "/usr/share/vulkan/icd.d/nvidia_icd.json" in paths(graphics) - paths(plain)
    assert f"{LIB}/libGLX_nvidia.so.{DRIVER_VERSION}" in paths(graphics) - paths(plain)
    assert "/dev/nvidia-modeset" in [n["path"] for n in graphics["deviceNodes"]]
    assert "/dev/nvidia-modeset" not in [n["path"] for n in plain["deviceNodes"]]
    assert "hooks" not in graphics  # no hook configured here: the soname link is a mount
    assert f"{LIB}/libGLX_nvidia.so.0" in paths(graphics)


def wrapped_driver(tmp: Path, *, real_tool: bool = True) -> Path:
    """A root as on a node whose driver lives under /usr/local/nvidia (a real H200's): the
    libraries there, linked from the system's library directory, and /usr/bin/nvidia-smi a
    shell script wrapping the driver's own program beside them."""
    root = tmp / "root"
    home = root / "usr/local/nvidia"
    (home / "lib64").mkdir(parents=True)
    (root / "usr/lib/x86_64-linux-gnu").mkdir(parents=True)
    (root / "usr/bin").mkdir(parents=True)
    for lib in ("libnvidia-ml", "libcuda"):
        real = home / "lib64" / f"{lib}.so.{DRIVER_VERSION}"
        real.write_bytes(b"\x7fELF stand-in")
        (root / "usr/lib/x86_64-linux-gnu" / f"{lib}.so.1").symlink_to(
            f"/usr/local/nvidia/lib64/{real.name}"
        )
    wrapper = root / "usr/bin/nvidia-smi"
    wrapper.write_text('#!/bin/sh\nexec /usr/local/nvidia/bin/nvidia-smi "$@"\n')
    if real_tool:
        (home / "bin").mkdir()
        (home / "bin/nvidia-smi").write_bytes(b"\x7fELF stand-in")
    return root


def test_a_wrapper_script_on_the_path_gives_way_to_the_drivers_own_program(
    tmp_path: Path,
) -> None:
    root = wrapped_driver(tmp_path)
    files = find_driver_files(driver_root=root, driver_version=DRIVER_VERSION, proc_root=tmp_path)
    mounts = {m.container_path: m.host_path for m in files.mounts}
    assert mounts["/usr/bin/nvidia-smi"] == str(root / "usr/local/nvidia/bin/nvidia-smi")
    assert find_driver_tool(root, "nvidia-smi") == root / "usr/local/nvidia/bin/nvidia-smi"
    assert file_kind(root / "usr/bin/nvidia-smi") == "script"
    assert file_kind(Path(mounts["/usr/bin/nvidia-smi"])) == "ELF"
    assert file_kind(root / "nothing") == "missing"


def test_a_wrapper_script_is_kept_when_the_driver_has_no_program_beside_its_libraries(
    tmp_path: Path,
) -> None:
    root = wrapped_driver(tmp_path, real_tool=False)
    files = find_driver_files(driver_root=root, driver_version=DRIVER_VERSION, proc_root=tmp_path)
    mounts = {m.container_path: m.host_path for m in files.mounts}
    assert mounts["/usr/bin/nvidia-smi"] == str(root / "usr/bin/nvidia-smi")
    assert find_driver_tool(root, "nvidia-smi") == root / "usr/bin/nvidia-smi"


def test_a_program_on_the_path_that_is_no_script_is_used_as_it_is(tmp_path: Path) -> None:
    root = wrapped_driver(tmp_path)
    (root / "usr/bin/nvidia-smi").write_bytes(b"\x7fELF another build")
    assert find_driver_tool(root, "nvidia-smi") == root / "usr/bin/nvidia-smi"
