"""The CDI hook: its installer, and the binary run as a runtime runs it (OCI state on stdin).

The binary tests need root (the hook chroots into the container root) and the built hook
(``make hook``); they skip otherwise, saying which.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from dra_driver.cdi import hook
from dra_driver.errors import CdiError

HOOK = hook.PACKAGED_BINARY


def test_install_names_the_copy_by_its_content_and_keeps_an_identical_one(tmp_path: Path) -> None:
    binary = tmp_path / "hook-v1"
    binary.write_bytes(b"\x7fELF version one")
    first = hook.install(tmp_path / "bin", binary=binary)
    assert first.name.startswith("gpu-dra-cdi-hook-") and len(first.name) == 17 + 16
    assert first.read_bytes() == binary.read_bytes()
    assert stat.S_IMODE(first.stat().st_mode) == 0o755
    inode = first.stat().st_ino
    assert hook.install(tmp_path / "bin", binary=binary) == first
    assert first.stat().st_ino == inode  # not rewritten: a starting container may run it
    binary.write_bytes(b"\x7fELF version two")
    second = hook.install(tmp_path / "bin", binary=binary)
    assert second != first and first.exists()  # a new version never replaces the old file
    assert not [p for p in (tmp_path / "bin").iterdir() if p.name.startswith(".")]


def test_install_without_the_binary_says_how_to_build_it(tmp_path: Path) -> None:
    with pytest.raises(CdiError, match=r"make hook.*--cdi-hook=none"):
        hook.install(tmp_path / "bin", binary=tmp_path / "missing")


needs_hook = pytest.mark.skipif(
    os.geteuid() != 0 or not HOOK.is_file(),
    reason="needs root (the hook chroots) and the built hook (make hook)",
)


def bundle(tmp_path: Path, *, relative_root: bool = True) -> tuple[Path, Path]:
    """An OCI bundle whose config names ``rootfs`` (relative, as runc's bundles do, or not)."""
    root = tmp_path / "bundle" / "rootfs"
    root.mkdir(parents=True)
    config = {"ociVersion": "1.0.2", "process": {"env": ['X="root":{"path":"/etc"}']},
              "root": {"path": "rootfs" if relative_root else str(root), "readonly": False},
              "annotations": {"root": "not this one"}}  # fmt: skip
    (tmp_path / "bundle/config.json").write_text(json.dumps(config))
    return tmp_path / "bundle", root


def run_hook(bundle_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    state = {"ociVersion": "1.0.2", "id": "c1", "status": "creating", "pid": 1,
             "bundle": str(bundle_dir)}  # fmt: skip
    return subprocess.run(
        [str(HOOK), *args], input=json.dumps(state), capture_output=True, text=True,
        timeout=30, check=False,
    )  # fmt: skip


@needs_hook
def test_links_are_made_inside_the_container_even_through_an_absolute_symlink(
    tmp_path: Path,
) -> None:
    bundle_dir, root = bundle(tmp_path)
    outside = tmp_path / "host-side"
    outside.mkdir()
    (root / "usr").symlink_to(str(outside))  # an image's absolute link must not lead to the host
    (root / str(outside).lstrip("/")).mkdir(parents=True)  # where it leads inside the image
    link_a, link_dev = "libcuda.so.1.2::/usr/local/lib/a.so.1", "a.so.1::/usr/local/lib/a.so"
    run = run_hook(bundle_dir, "create-symlinks", "--link", link_a, f"--link={link_dev}")
    assert run.returncode == 0, run.stderr
    assert list(outside.iterdir()) == []  # nothing written on the host side
    inside = root / str(outside).lstrip("/") / "local/lib"
    assert os.readlink(inside / "a.so.1") == "libcuda.so.1.2"
    assert os.readlink(inside / "a.so") == "a.so.1"
    # idempotent, a wrong link is replaced, a real file is left alone
    (inside / "a.so").unlink()
    (inside / "a.so").symlink_to("elsewhere")
    (inside / "real.so").write_text("image's own")
    again = run_hook(bundle_dir, "create-symlinks", "--link", link_a, "--link", link_dev,
                     "--link", "x::/usr/local/lib/real.so")  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert os.readlink(inside / "a.so") == "a.so.1"
    assert (inside / "real.so").read_text() == "image's own"


@needs_hook
def test_the_loader_cache_lists_the_folder_in_an_image_without_loader_configuration(
    tmp_path: Path,
) -> None:
    bundle_dir, root = bundle(tmp_path, relative_root=False)
    (root / "opt/nv").mkdir(parents=True)
    run = run_hook(bundle_dir, "update-ldcache", "--folder", "/opt/nv")
    assert run.returncode == 0, run.stderr
    assert (root / "etc/ld.so.conf").read_text() == "include /etc/ld.so.conf.d/*.conf\n"
    conf = (root / "etc/ld.so.conf.d/00-gpu-dra.conf").read_text().splitlines()
    assert conf[-1] == "/opt/nv"
    assert (root / "etc/ld.so.cache").is_file()  # written by the host's ldconfig, in the root
    assert not Path("/opt/nv").exists()


@needs_hook
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("remove-everything",), "unknown command remove-everything"),
        (("create-symlinks", "--link", "no-separator"), "want TARGET::/ABSOLUTE/LINK"),
        (("create-symlinks", "--link", "a::relative"), "want TARGET::/ABSOLUTE/LINK"),
        (("update-ldcache", "--folder", "relative/dir"), "is not an absolute path"),
        (("update-ldcache", "--bogus"), "unexpected argument --bogus"),
    ],
)
def test_bad_arguments_fail_with_a_message_naming_them(
    tmp_path: Path, args: tuple[str, ...], message: str
) -> None:
    bundle_dir, _ = bundle(tmp_path)
    run = run_hook(bundle_dir, *args)
    assert run.returncode == 1
    assert message in run.stderr and run.stderr.startswith("gpu-dra-cdi-hook: ")


@needs_hook
def test_a_state_without_a_bundle_is_refused(tmp_path: Path) -> None:
    run = subprocess.run([str(HOOK), "update-ldcache", "--folder", "/x"], input="{}",
                         capture_output=True, text=True, timeout=30, check=False)  # fmt: skip
    assert run.returncode == 1
    assert "names no absolute bundle path" in run.stderr
