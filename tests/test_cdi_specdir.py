"""cdi/specdir.py: atomic spec writes, temp files, spares, in-memory spec directories."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from dra_driver.cdi.specdir import CdiSpecDir
from dra_driver.errors import CdiError
from dra_driver.fsutil import OS_CALLS, held_calls, in_memory_fs
from tests.claimdata import new_uid
from tests.spares import held, spares_in

UID = "6c0e1d2f-0000-4000-8000-00000000abcd"
VENDOR = "k8s.gpu.nvidia.com"


def test_spec_dir_writes_atomically_and_touches_only_its_own_files(tmp_path: Path) -> None:
    specs = CdiSpecDir(tmp_path, vendor=VENDOR)
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
    specs = CdiSpecDir(tmp_path, vendor=VENDOR)
    old = specs.write(UID, b'{"old":1}\n')
    pending = specs.begin(UID, b'{"new":1}\n')
    assert [uid for uid, _ in specs.temp_files()] == [UID]
    assert old.read_bytes() == b'{"old":1}\n'  # readers still see the old spec
    pending.sync()
    pending.commit()
    assert pending.final == old
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
    specs = CdiSpecDir(tmp_path, vendor=VENDOR)
    with pytest.raises(CdiError, match="not a lowercase UUID"):
        specs.write(uid, b"{}")
    assert list(tmp_path.iterdir()) == []


# --- spares: removed specs kept for the next write --------------------------------------------


def test_a_removed_spec_becomes_a_locked_spare_whose_file_the_next_write_reuses(
    tmp_path: Path,
) -> None:
    specs = CdiSpecDir(tmp_path, vendor=VENDOR)
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
    specs = CdiSpecDir(tmp_path, vendor=VENDOR)
    specs.write(UID, b"{}\n")
    specs.remove(UID)
    pending = specs.begin(new_uid(), b'{"never":1}\n')
    pending.abort()
    assert list(tmp_path.iterdir()) == [] and specs.spare_count == 0


def test_spares_are_capped_and_deleted_at_close(tmp_path: Path) -> None:
    specs = CdiSpecDir(tmp_path, vendor=VENDOR, max_spares=3)
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
    first = CdiSpecDir(tmp_path, vendor=VENDOR, max_spares=4)
    uids = [new_uid() for _ in range(4)]
    for uid in uids:
        first.write(uid, b"{}\n")
    for uid in uids:
        first.remove(uid)
    second = CdiSpecDir(tmp_path, vendor=VENDOR, max_spares=2)  # a rolling update
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
    specs = CdiSpecDir(tmp_path, vendor=VENDOR)
    target = tmp_path / "elsewhere.txt"
    target.write_text("not ours to reuse")
    (tmp_path / f"{VENDOR}-claim_{UID}.json").symlink_to(target)
    assert specs.remove(UID)
    assert specs.claim_uids() == set() and specs.spare_count == 0
    assert target.read_text() == "not ours to reuse"


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
    specs = CdiSpecDir(tmp_path / "cdi", vendor="k8s.gpu.nvidia.com")
    specs.ensure()
    assert specs.in_memory is (_fstype(tmp_path) in ("tmpfs", "ramfs"))
    # a write's and a removal's calls keep the interpreter lock only where none waits for a disk
    assert specs._calls is (held_calls() if specs.in_memory else OS_CALLS)
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
        earlier = CdiSpecDir(root, vendor=VENDOR)  # ensure() not called: keeps spares
        earlier.write(UID, b"{}\n")
        earlier.remove(UID)
        (left,) = spares_in(root)
        for spare in earlier._spares:  # the earlier instance is gone: its locks with it
            os.close(spare.fd)
        specs = CdiSpecDir(root, vendor=VENDOR)
        specs.ensure()
        assert specs.in_memory and specs._calls is held_calls()
        assert specs.collect_spares() == (0, 1) and not left.exists()
        uids = [new_uid() for _ in range(3)]
        for uid in uids:
            specs.write(uid, b"{}\n")
        assert all(specs.remove(uid) for uid in uids)
        assert list(root.iterdir()) == [] and specs.spare_count == 0


def test_a_spec_is_fsynced_on_a_disk_and_not_on_a_tmpfs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tmpfs has no disk to sync to (its fsync returns at once): the call is skipped there,
    and kept everywhere else, where it makes the spec survive a power loss."""
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    on_disk = CdiSpecDir(tmp_path, vendor=VENDOR)
    on_disk.write(UID, b"{}\n")
    assert len(synced) == 1
    in_memory = CdiSpecDir(tmp_path / "mem", vendor=VENDOR)
    in_memory.ensure()
    in_memory.in_memory = True  # as ensure() finds a tmpfs
    in_memory.write(UID, b"{}\n")
    assert len(synced) == 1
    assert in_memory.read(UID) == b"{}\n"


def test_temp_names_are_numbered_not_drawn_per_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write's temp file name costs no random draw (a getrandom call per prepare); names
    stay distinct within an instance and between instances."""
    first = CdiSpecDir(tmp_path, vendor=VENDOR, max_spares=0)
    second = CdiSpecDir(tmp_path, vendor=VENDOR, max_spares=0)
    monkeypatch.setattr(
        "dra_driver.cdi.specdir.secrets.token_hex", lambda n: pytest.fail("a random draw")
    )
    pending = [specs.begin(new_uid(), b"{}\n") for specs in (first, first, second, second)]
    temps = {str(p._temp) for p in pending}
    assert len(temps) == 4
    for p in pending:
        p.abort()
    assert list(tmp_path.iterdir()) == []


def test_removing_our_spec_leaves_the_yaml_path_alone_and_an_adopted_one_goes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claim has our ``.json`` spec or, adopted from NVIDIA's driver, its ``.yaml``: removing
    ours is one unlink; an adopted claim's ``.yaml`` is removed when there is no ``.json``."""
    specs = CdiSpecDir(tmp_path, vendor=VENDOR, max_spares=0)
    specs.write(UID, b"{}\n")
    unlinked: list[str] = []
    real_unlink = os.unlink
    monkeypatch.setattr(os, "unlink", lambda p: (unlinked.append(str(p)), real_unlink(p))[1])
    assert specs.remove(UID)
    assert [Path(p).suffix for p in unlinked] == [".json"]
    adopted = new_uid()
    specs.foreign_path(adopted).write_text("cdiVersion: 0.5.0\n")
    assert specs.remove(adopted)
    assert not specs.foreign_path(adopted).exists()
    assert not specs.remove(adopted)  # nothing left: not an error
    assert list(tmp_path.iterdir()) == []


def test_on_a_tmpfs_a_failed_write_is_a_cdi_error_and_leaves_nothing() -> None:
    """The calls that keep the interpreter lock fail as the os module's do: a write into a
    directory that went away names the spec; a removal of a spec that is not there is no
    error."""
    if _fstype(Path("/dev/shm")) != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm on this machine")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        root = Path(d) / "cdi"
        specs = CdiSpecDir(root, vendor=VENDOR)
        specs.ensure()
        root.rmdir()
        with pytest.raises(
            CdiError, match=rf"cannot write CDI spec {root}/.*{UID}\.json: .*No such file"
        ):
            specs.begin(UID, b"{}\n")
        assert specs.remove(UID) is False
        root.mkdir()
        pending = specs.begin(UID, b"{}\n")
        root.joinpath(next(p.name for p in root.iterdir())).unlink()  # the temp file, gone
        with pytest.raises(CdiError, match="cannot write CDI spec"):
            pending.commit()
        pending.abort()
        assert list(root.iterdir()) == []
