"""``make image``'s script (hack/build-image.sh, hack/build-local-base.sh) with a stand-in
container engine on PATH that records every call: the decisions the script makes without a real
build (which tests/test_deployed_image.py does, where podman is installed). The local Debian base
is rebuilt when it is a week old or when asked, the build stage is tagged so that its cache stays,
and the untagged images of earlier builds, and only ours, are removed afterwards."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VERSION = next(
    line.split('"')[1]
    for line in (REPO / "pyproject.toml").read_text().splitlines()
    if line.startswith("version")
)
LOCAL_BASE = "localhost/gpu-dra-base:bookworm"

# The engine: `image inspect` knows the local base only; `pull` fails (no registry); `images`
# lists the dangling images of $STATE/dangling-<label> once; `rmi` forgets one.
ENGINE = r"""#!/usr/bin/env bash
echo "$*" >> "$STATE/calls"
case "$1" in
  image)
    [ "$2" = inspect ] || exit 1
    for a in "$@"; do last="$a"; done
    [ "$last" = "localhost/gpu-dra-base:bookworm" ] || exit 1
    case "$*" in
      *Created.Unix*) echo "$CREATED" ;;
    esac
    exit 0 ;;
  pull) exit 1 ;;
  import) cat > /dev/null; exit 0 ;;
  build) exit 0 ;;
  images)
    for a in "$@"; do case "$a" in label=*) label="${a#label=}" ;; esac; done
    f="$STATE/dangling-${label%%=*}"
    [ -f "$f" ] && cat "$f" && rm -f "$f"
    exit 0 ;;
  rmi) echo "$2" >> "$STATE/removed"; exit 0 ;;
esac
exit 0
"""


def run(tmp_path: Path, *, age_days: float, **env: str) -> list[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "podman").write_text(ENGINE)
    (bin_dir / "mmdebstrap").write_text("#!/bin/sh\nexit 0\n")
    for tool in ("podman", "mmdebstrap"):
        (bin_dir / tool).chmod(0o755)
    (tmp_path / "dangling-org.opencontainers.image.title").write_text("aaa111\nbbb222\n")
    (tmp_path / "dangling-gpu-dra.stage").write_text("ccc333\n")
    created = str(int(time.time() - age_days * 86400))
    result = subprocess.run(
        ["bash", "hack/build-image.sh"],
        cwd=REPO, capture_output=True, text=True, timeout=60, check=False,
        env={"PATH": f"{bin_dir}:/usr/bin:/bin", "STATE": str(tmp_path), "CREATED": created,
             "ENGINE": "podman", "IMAGE": "localhost/gpu-dra:test", "CA_BUNDLE": "/nonexistent",
             "HOME": str(tmp_path), **env},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return (tmp_path / "calls").read_text().splitlines()


def builds(calls: list[str]) -> list[str]:
    return [c for c in calls if c.startswith("build ")]


def test_a_week_old_local_base_is_rebuilt_before_the_build(tmp_path: Path) -> None:
    calls = run(tmp_path, age_days=8)
    imported = [c for c in calls if c.startswith("import ")]
    assert len(imported) == 1 and imported[0].endswith(LOCAL_BASE)
    assert calls.index(imported[0]) < calls.index(builds(calls)[0])


def test_a_fresh_local_base_is_kept_unless_a_refresh_is_asked(tmp_path: Path) -> None:
    assert not [c for c in run(tmp_path, age_days=1) if c.startswith("import ")]
    (tmp_path / "calls").unlink()
    assert [c for c in run(tmp_path, age_days=1, REFRESH_BASE="1") if c.startswith("import ")]


def test_the_build_stage_is_tagged_and_only_our_untagged_images_are_removed(
    tmp_path: Path,
) -> None:
    calls = run(tmp_path, age_days=1)
    stage, final = builds(calls)
    assert f"--target build -t localhost/gpu-dra-build:{VERSION}" in stage
    assert final.endswith("-t localhost/gpu-dra:test .")
    for build in (stage, final):
        assert f"--build-arg BASE_IMAGE={LOCAL_BASE}" in build
        assert f"--build-arg VERSION={VERSION}" in build
    queries = [c for c in calls if c.startswith("images ")]
    assert queries and all("--filter dangling=true" in q for q in queries)
    assert {q.split("label=")[1] for q in queries} == {
        "org.opencontainers.image.title=gpu-dra",
        "gpu-dra.stage=build",
    }
    assert sorted((tmp_path / "removed").read_text().split()) == ["aaa111", "bbb222", "ccc333"]
    # after the builds: nothing removed that a build could still need
    assert calls.index(final) < min(i for i, c in enumerate(calls) if c.startswith("rmi "))
