"""The commands of README.md and docs/install.md as an operator copies them (issue 37).

Every command in their ``bash`` blocks is either run here as far as it can be without a cluster
(``helm install``/``upgrade``: the same arguments through ``helm template``, which renders and
checks the values against the chart's schema; ``gpu-dra``: the command itself), or named below as
needing what a test machine lacks (a cluster, root and podman, the network); a new kind of
command fails the test until it is sorted. Every command is checked for shell words a shell
would expand (an unquoted ``[*]`` fails in zsh: "no matches found"). The ``--set`` settings
install.md quotes inline are rendered too, and the RBAC lists of install.md and
troubleshooting.md are compared with the ClusterRole the chart renders.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).parents[1]
DOCS = ("README.md", "docs/install.md")
HELM = shutil.which("helm")
needs_helm = pytest.mark.skipif(HELM is None, reason="needs the helm binary (make helm)")

# Commands not run here, by their first word(s), and why: what they need that a test machine
# lacks, or where else they run.
NEEDS = {
    "kubectl": "a cluster",
    "helm uninstall": "a cluster",
    "make image": "podman, buildah or docker and a registry",
    "podman": "podman and a registry",
    "apt-get": "root and a Debian mirror",
    "hack/build-local-base.sh": "root, mmdebstrap and a Debian mirror",
    "python3 -m venv": "nothing, but the pip install after it needs PyPI",
    "make demo": "nothing: tests/test_sim_demo.py runs the demo",
    "make test": "nothing: it is the test suite this test is part of",
    "~/.gpu-dra/bin/pip": "PyPI (setuptools to build the package)",
    "gpu-dra-webhook": "a webhook Service's TLS files: tests/test_webhook.py runs the command",
}


def bash_commands(path: str) -> list[str]:
    """The commands of the file's bash blocks, continuation lines joined, comments dropped."""
    text = (REPO / path).read_text()
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                out.append(line.split(" #", 1)[0].strip())
    return out


def kind_of(command: str) -> str:
    for prefix in (*NEEDS, "helm install", "helm upgrade", "~/.gpu-dra/bin/gpu-dra"):
        if command == prefix or command.startswith(prefix + " "):
            return prefix
    return ""


ALL = [(path, command) for path in DOCS for command in bash_commands(path)]


def test_the_docs_have_the_commands_this_test_knows() -> None:
    assert len(ALL) > 10
    unknown = [command for _, command in ALL if not kind_of(command)]
    assert unknown == [], "sort these commands into NEEDS or run them here"


def unquoted_globs(command: str) -> list[str]:
    """The characters a POSIX shell (or zsh) would take for a file pattern (``*``, ``?``,
    ``[``) outside quotes, each with what precedes it."""
    found = []
    quote = ""
    escaped = False
    for index, char in enumerate(command):
        if escaped:
            escaped = False
        elif char == "\\" and quote != "'":
            escaped = True
        elif quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "*?[":
            found.append(command[max(0, index - 20) : index + 1])
    return found


@pytest.mark.parametrize(("path", "command"), ALL, ids=[f"{p}:{c[:50]}" for p, c in ALL])
def test_no_command_has_a_word_the_shell_would_expand(path: str, command: str) -> None:
    assert unquoted_globs(command) == []


def test_the_glob_check_catches_the_unquoted_custom_columns_of_issue_37() -> None:
    bad = "kubectl get resourceslices -o custom-columns=NODE:.spec.nodeName,D:.spec.devices[*].name"
    assert unquoted_globs(bad) != []
    assert unquoted_globs(bad.replace("custom-columns=", "custom-columns='") + "'") == []


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    assert HELM is not None
    return subprocess.run(
        [HELM, *args], capture_output=True, text=True, timeout=120, check=False, cwd=REPO
    )


HELM_COMMANDS = [(p, c) for p, c in ALL if kind_of(c) in ("helm install", "helm upgrade")]


@needs_helm
@pytest.mark.parametrize(("path", "command"), HELM_COMMANDS, ids=[c for _, c in HELM_COMMANDS])
def test_each_helm_install_and_upgrade_renders_as_written(path: str, command: str) -> None:
    words = shlex.split(command)
    args = [w for w in words[2:] if w not in ("--create-namespace", "--reuse-values")]
    result = helm("template", *args)
    assert result.returncode == 0, result.stderr
    assert "kind: DaemonSet" in result.stdout


INLINE_SETS = sorted(set(re.findall(r"`(--set [^`]+)`", (REPO / "docs/install.md").read_text())))


@needs_helm
@pytest.mark.parametrize("settings", INLINE_SETS)
def test_each_setting_install_md_quotes_renders(settings: str) -> None:
    """install.md's settings as written; a ``...`` placeholder becomes a path, and the
    simulation row's privileged=false goes with its simulate (the schema ties them)."""
    words = shlex.split(settings.replace("=...", "=/example/path"))
    result = helm("template", "gpu-dra", "charts/gpu-dra", "-n", "gpu-dra", *words)
    assert result.returncode == 0, result.stderr


def test_the_rolling_update_setting_of_issue_37_is_two_sets() -> None:
    text = (REPO / "docs/install.md").read_text()
    assert "rollingUpdate={" not in text
    assert (
        "`--set kubeletPlugin.rollingUpdate.maxSurge=0 --set "
        "kubeletPlugin.rollingUpdate.maxUnavailable=1`" in " ".join(text.split())
    )


GPU_DRA = [(p, c) for p, c in ALL if kind_of(c) == "~/.gpu-dra/bin/gpu-dra"]


@pytest.mark.parametrize(("path", "command"), GPU_DRA, ids=[c for _, c in GPU_DRA])
def test_each_gpu_dra_command_runs(path: str, command: str) -> None:
    """As installed by the commands before it: this virtualenv's ``gpu-dra`` is the same
    package."""
    words = shlex.split(command)
    gpu_dra = Path(sys.executable).parent / "gpu-dra"
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
    result = subprocess.run(
        [str(gpu_dra), *words[1:]],
        capture_output=True, text=True, timeout=120, check=False, cwd=REPO, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "satisfiable" in result.stdout


def rbac_list(text: str, after: str) -> dict[str, set[str]]:
    """``{resource: verbs}`` of a docs sentence such as "`nodes` get, `pods` get" that follows
    ``after`` (up to the end of the sentence)."""
    flat = " ".join(text.split())
    sentence = flat[flat.index(after) + len(after) :].split(". ", 1)[0]
    pairs = re.findall(r"`([a-z]+(?:/[a-z]+)?)`\s+([a-z]+(?:/[a-z]+)*)", sentence)
    assert pairs, sentence
    return {resource: set(verbs.split("/")) for resource, verbs in pairs}


@needs_helm
def test_the_rbac_lists_of_the_docs_are_the_chart_cluster_role() -> None:
    result = helm("template", "gpu-dra", "charts/gpu-dra", "-n", "gpu-dra")
    assert result.returncode == 0, result.stderr
    objects: list[dict[str, Any]] = [d for d in yaml.safe_load_all(result.stdout) if d]
    (role,) = [o for o in objects if o["kind"] == "ClusterRole"]
    granted: dict[str, set[str]] = {}
    for rule in role["rules"]:
        for resource in rule["resources"]:
            granted.setdefault(resource, set()).update(rule["verbs"])
    install = (REPO / "docs/install.md").read_text()
    troubleshooting = (REPO / "docs/troubleshooting.md").read_text()
    assert rbac_list(install, "allows exactly the calls the agent makes:") == granted
    assert rbac_list(troubleshooting, "or grant exactly:") == granted


BIG = """
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: big, namespace: default}
spec:
  devices:
    requests:
    - name: gpu
      exactly:
        deviceClassName: gpu.nvidia.com
        selectors:
        - cel:
            expression: >-
              device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('40Gi')) >= 0
        - cel: {expression: "device.attributes['gpu.nvidia.com'].profile == '1g.10gb'"}
"""


def test_the_explain_sample_in_troubleshooting_is_what_explain_prints(tmp_path: Path) -> None:
    """troubleshooting.md's sample: its command run on the claim its text describes; every
    line it shows after ``...`` is a line of the real output."""
    text = (REPO / "docs/troubleshooting.md").read_text()
    block = text.split("$ gpu-dra explain big.yaml", 1)[1].split("```", 1)[0]
    args, _, shown = block.partition("\n")
    sample = [line for line in shown.splitlines() if line and line != "..."]
    (tmp_path / "big.yaml").write_text(BIG)
    gpu_dra = Path(sys.executable).parent / "gpu-dra"
    result = subprocess.run(
        [str(gpu_dra), "explain", "big.yaml", *shlex.split(args)],
        capture_output=True, text=True, timeout=120, check=False, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert len(sample) == 3
    assert [line for line in sample if line not in result.stdout.splitlines()] == []
