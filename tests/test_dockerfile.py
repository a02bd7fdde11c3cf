"""The node agent's Dockerfile, checked without building it (no container engine runs here).

Checks what decides whether the image is reproducible and safe: pinned base images, pinned
dependencies, no remote ADD or secrets, a non-root default user, an entry point that is a real
console script of the package, and a .dockerignore that keeps the build context small.
"""

from __future__ import annotations

import importlib
import re
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO / "Dockerfile"
SECRET_WORDS = ("PASSWORD", "TOKEN", "SECRET", "API_KEY", "PRIVATE_KEY", "CREDENTIAL")


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    joined: list[str] = []
    current = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        joined.append(current + line)
        current = ""
    assert not current, "the Dockerfile ends inside a continued line"
    result = []
    for line in joined:
        keyword, _, rest = line.partition(" ")
        result.append((keyword.upper(), rest.strip()))
    return result


def of(keyword: str) -> list[str]:
    return [args for kw, args in instructions() if kw == keyword]


def pyproject() -> dict[str, object]:
    with (REPO / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)


def bases() -> list[str]:
    """Each stage's base image, the build argument BASE_IMAGE replaced by its default."""
    (arg,) = [a for a in of("ARG") if a.startswith("BASE_IMAGE=")]
    default = arg.partition("=")[2]
    return [base.replace("${BASE_IMAGE}", default) for base in of("FROM")]


def test_build_is_multi_stage_on_pinned_slim_python_bases() -> None:
    assert len(bases()) >= 2
    assert {base.split()[0] for base in of("FROM")} == {"${BASE_IMAGE}"}  # one base, one argument
    for base in bases():
        image = base.split()[0]
        match = re.fullmatch(
            r"(docker\.io/library/)?python:(\d+)\.(\d+)\.(\d+)-slim(-[a-z]+)?@sha256:[0-9a-f]{64}",
            image,
        )
        assert match, f"base {image!r} must be pinned as python:X.Y.Z-slim...@sha256:<digest>"


def test_base_python_satisfies_requires_python() -> None:
    requires = str(pyproject()["project"]["requires-python"])  # type: ignore[index]
    minimum = tuple(int(p) for p in requires.removeprefix(">=").split("."))
    for base in bases():
        major, minor = re.findall(r"python:(\d+)\.(\d+)", base)[0]
        assert (int(major), int(minor)) >= minimum


def test_final_stage_installs_from_the_build_stage_only() -> None:
    first_stage = of("FROM")[0].split()
    assert first_stage[-2].upper() == "AS"
    stage = first_stage[-1]
    final_runs = " ".join(of("RUN")[1:])
    assert f"from={stage}" in final_runs
    assert "--no-index" in final_runs


def test_every_pip_call_uses_the_constraints_file() -> None:
    pip_calls = [run for run in of("RUN") if "pip " in run]
    assert pip_calls
    for run in pip_calls:
        assert re.search(r"-c \S*constraints\.txt", run), f"pip without constraints: {run}"
    copied = " ".join(of("COPY") + of("RUN"))
    assert "constraints.txt" in copied


def test_every_runtime_dependency_has_an_exact_pin_in_constraints() -> None:
    pinned = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            pinned[re.sub(r"[-_.]+", "-", name).lower()] = version
    for requirement in pyproject()["project"]["dependencies"]:  # type: ignore[index]
        name = re.split(r"[<>=!~\[ ;]", requirement, maxsplit=1)[0]
        assert pinned.get(re.sub(r"[-_.]+", "-", name).lower()), f"{name} is not pinned"


def test_no_remote_add_and_no_secrets() -> None:
    for args in of("ADD"):
        assert not re.search(r"(https?|git|ftp)://", args), f"ADD of a URL: {args}"
    for keyword in ("ENV", "ARG", "LABEL"):
        for args in of(keyword):
            assert not any(word in args.upper() for word in SECRET_WORDS), f"{keyword} {args}"
    for args in of("COPY"):
        for name in (".netrc", ".pypirc", "id_rsa", "kubeconfig", ".env", ".git"):
            assert name not in args.split(), f"COPY of {name}"


def test_default_user_is_not_root() -> None:
    users = of("USER")
    assert users, "no USER: the image would run as root"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0")


def test_entry_point_is_the_node_agent_console_script() -> None:
    (entrypoint,) = of("ENTRYPOINT")
    assert entrypoint == '["gpu-dra-kubelet-plugin"]'
    scripts = pyproject()["project"]["scripts"]  # type: ignore[index]
    target = scripts["gpu-dra-kubelet-plugin"]  # type: ignore[index]
    module, _, function = target.partition(":")
    assert callable(getattr(importlib.import_module(module), function))


def test_the_chart_runs_the_console_script_of_the_image_make_builds() -> None:
    chart = (REPO / "charts" / "gpu-dra" / "Chart.yaml").read_text()
    version = pyproject()["project"]["version"]  # type: ignore[index]
    assert f'appVersion: "{version}"' in chart
    makefile = (REPO / "Makefile").read_text()
    assert "bash hack/build-image.sh" in makefile
    assert 'image="${IMAGE:-gpu-dra:$version}"' in (REPO / "hack/build-image.sh").read_text()
    values = (REPO / "charts" / "gpu-dra" / "values.yaml").read_text()
    assert re.search(r"^  repository: gpu-dra$", values, re.MULTILINE)
    daemonset = (REPO / "charts" / "gpu-dra" / "templates" / "daemonset.yaml").read_text()
    assert 'command: ["gpu-dra-kubelet-plugin"]' in daemonset


def dockerignore() -> list[str]:
    path = REPO / ".dockerignore"
    assert path.is_file(), ".dockerignore is missing: the whole .venv would be sent to the daemon"
    return [
        line.strip()
        for line in path.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]


@pytest.mark.parametrize("heavy", [".git", ".venv", ".tools", "tests"])
def test_dockerignore_keeps_heavy_and_private_paths_out(heavy: str) -> None:
    assert heavy in dockerignore()


def test_dockerignore_keeps_what_the_dockerfile_copies() -> None:
    ignored = set(dockerignore())
    for args in of("COPY"):
        if "--from=" in args:
            continue
        *sources, _ = args.split()
        for source in sources:
            assert source.rstrip("/") not in ignored
            assert (REPO / source).exists(), f"COPY of a missing path: {source}"


def test_the_image_has_the_pyc_files_of_the_charts_pythonoptimize() -> None:
    """The chart runs the agent with PYTHONOPTIMIZE=2 (tests/test_chart.py): the final stage
    compiles those .pyc files after installing, since pip compiles only the plain ones and the
    image forbids writing them at run time (PYTHONDONTWRITEBYTECODE)."""
    final_runs = next(run for run in of("RUN") if " install --no-index" in run)
    install = final_runs.index(" install --no-index")
    assert final_runs.index("python3 -OO -m compileall", install) > install
    assert any("PYTHONDONTWRITEBYTECODE=1" in env for env in of("ENV"))
    daemonset = (REPO / "charts" / "gpu-dra" / "templates" / "daemonset.yaml").read_text()
    assert re.search(r'- name: PYTHONOPTIMIZE\n\s+value: "2"', daemonset)


def test_new_wheels_invalidate_the_cached_install() -> None:
    """podman/buildah key a cached RUN by its text, not by what it bind-mounts from another
    stage: the final stage copies the wheels' checksums from the build stage before the RUN
    that installs them, so that a new wheel of the package makes a new install layer."""
    steps = instructions()
    final = steps[[kw for kw, _ in steps].index("FROM", 1) :]
    copies = [i for i, (kw, args) in enumerate(final) if kw == "COPY" and "--from=build" in args]
    installs = [i for i, (kw, args) in enumerate(final) if kw == "RUN" and "from=build" in args]
    assert copies and installs and copies[0] < installs[0]
    assert "sha256sum" in " ".join(of("RUN")[:-1])  # the build stage writes them
