"""Every example in examples/resourceclaims/ gets the outcome its ``# expect:`` line promises.

The line format is defined in docs/explain.md:

    # expect: satisfiable [devices=NAME,NAME...] [count=N] [requests=NAME,NAME...]
    #                     [consumable-shares=MODE]
    # expect: unsatisfiable

It is checked with ``gpu-dra explain`` against the demo node (``dra_driver.sim.demo``), built by the
real simulated-GPU pipeline; the examples in ``dynamic-mig/`` against two H100s in MIG mode
and an A100 not in MIG mode published with ``--mig-mode dynamic``.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from dra_driver.cli import explain_main as main
from dra_driver.sim.demo import DEMO_NODE, DEMO_SIMULATE
from tests.simulatedslices import simulated_slices

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "resourceclaims"
FILES = sorted(EXAMPLES.rglob("*.yaml"))
DYNAMIC_MIG = EXAMPLES / "dynamic-mig"
# Two H100s in MIG mode and an A100 that is not: an Ampere GPU is never toggled, so it stays a
# plain GPU in dynamic mode (an H100 not in MIG mode would be partitionable: MIG mode on demand).
DYNAMIC_MIG_NODE = [
    "--simulate", "h100:2:mig,a100-80gb:1", "--mig-mode", "dynamic", "--node", "node1",
]  # fmt: skip
KEYS = ("devices", "count", "requests", "consumable-shares")


def expectation(path: Path) -> tuple[bool, dict[str, str]]:
    lines = [line for line in path.read_text().splitlines() if line.startswith("# expect:")]
    assert len(lines) == 1, f"{path.name}: needs exactly one '# expect:' line, has {len(lines)}"
    words = lines[0].removeprefix("# expect:").split()
    assert words and words[0] in ("satisfiable", "unsatisfiable"), f"{path.name}: {lines[0]!r}"
    options = {}
    for word in words[1:]:
        key, sep, value = word.partition("=")
        assert sep and key in KEYS and value, f"{path.name}: bad expect option {word!r}"
        options[key] = value
    assert words[0] == "satisfiable" or not options, f"{path.name}: options need 'satisfiable'"
    return words[0] == "satisfiable", options


def test_there_are_examples() -> None:
    assert FILES, f"no examples in {EXAMPLES}"


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_example_gets_its_expected_outcome_on_the_demo_node(path: Path) -> None:
    satisfiable, options = expectation(path)
    out, err = io.StringIO(), io.StringIO()
    shares = (
        ["--consumable-shares", options["consumable-shares"]]
        if options.get("consumable-shares")
        else []
    )
    node = (
        DYNAMIC_MIG_NODE
        if path.parent == DYNAMIC_MIG
        else ["--simulate", DEMO_SIMULATE, "--node", DEMO_NODE]
    )
    rc = main([str(path), *node, "-o", "json", *shares], stdout=out, stderr=err)
    assert rc in (0, 1), err.getvalue()
    result = json.loads(out.getvalue())
    assert result["satisfiable"] is satisfiable, json.dumps(result["nodes"], indent=1)[:4000]
    if not satisfiable:
        assert rc == 1
        return
    assert rc == 0
    results = [
        r
        for claim in result["allocation"]["claims"]
        for r in claim["allocation"]["devices"]["results"]
    ]
    if "devices" in options:
        assert [r["device"] for r in results] == options["devices"].split(",")
    if "count" in options:
        assert len(results) == int(options["count"])
    if "requests" in options:
        seen = list(dict.fromkeys(r["request"] for r in results))
        assert seen == options["requests"].split(",")


# -- what each example's "What to expect" says beyond its `# expect:` line -----------------------


def explain(claim: Path, *extra: str) -> tuple[bool, dict[str, Any]]:
    out, err = io.StringIO(), io.StringIO()
    rc = main([str(claim), "--node", DEMO_NODE, "-o", "json", *extra], stdout=out, stderr=err)
    assert rc in (0, 1), err.getvalue()
    result = json.loads(out.getvalue())
    assert result["satisfiable"] is (rc == 0)
    return rc == 0, result


def on_demo_node(claim: Path, *extra: str) -> tuple[bool, dict[str, Any]]:
    return explain(claim, "--simulate", DEMO_SIMULATE, *extra)


def results(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        r
        for claim in result["allocation"]["claims"]
        for r in claim["allocation"]["devices"]["results"]
    ]


def allocated_file(tmp_path: Path, name: str, devices: list[str], *, admin: bool = False) -> Path:
    """A claim of another pod that already holds ``devices`` on the demo node (--allocated)."""
    result = [
        {"request": "gpus", "driver": "gpu.nvidia.com", "pool": DEMO_NODE, "device": d}
        | ({"adminAccess": True} if admin else {})
        for d in devices
    ]
    claim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"devices": {"requests": []}},
        "status": {"allocation": {"devices": {"results": result}}},
    }
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(claim))
    return path


def test_admin_access_results_are_marked_and_block_no_other_claim(tmp_path: Path) -> None:
    _, result = on_demo_node(EXAMPLES / "admin-access.yaml")
    assert [r.get("adminAccess") for r in results(result)] == [True] * 5
    admin = allocated_file(tmp_path, "admin", [r["device"] for r in results(result)], admin=True)
    ok, result = on_demo_node(EXAMPLES / "whole-gpu.yaml", "--allocated", str(admin))
    assert ok and [r["device"] for r in results(result)] == ["gpu-0"]
    # while a claim without admin access does block the device it holds
    held = allocated_file(tmp_path, "held", ["gpu-0"])
    ok, result = on_demo_node(EXAMPLES / "whole-gpu.yaml", "--allocated", str(held))
    assert ok and [r["device"] for r in results(result)] == ["gpu-1"]


def test_all_gpus_is_allocated_only_where_no_gpu_is_in_use(tmp_path: Path) -> None:
    held = allocated_file(tmp_path, "held", ["gpu-3"])
    ok, _ = on_demo_node(EXAMPLES / "all-gpus.yaml", "--allocated", str(held))
    assert not ok


def test_gpu_40gib_never_takes_the_l4_and_explain_names_the_selector(tmp_path: Path) -> None:
    held = allocated_file(tmp_path, "held", ["gpu-0", "gpu-1", "gpu-2", "gpu-3"])
    ok, result = on_demo_node(EXAMPLES / "gpu-40gib.yaml", "--allocated", str(held))
    assert not ok
    ((request,),) = [node["requests"] for node in result["nodes"]]
    why = {d["device"]: " ".join(d["reasons"]) for d in request["devices"]}
    assert "selector" in why["gpu-5"]
    assert "40Gi" in why["gpu-5"]


def test_same_pcie_root_gets_two_gpus_of_one_root_and_nothing_where_each_has_its_own(
    tmp_path: Path,
) -> None:
    slices = simulated_slices(DEMO_SIMULATE, node_name=DEMO_NODE)
    roots = {
        d["name"]: d["attributes"]["resource.kubernetes.io/pcieRoot"]["string"]
        for s in slices
        for d in s["spec"].get("devices", [])
    }
    _, result = on_demo_node(EXAMPLES / "same-pcie-root.yaml")
    first, second = (r["device"] for r in results(result))
    assert roots[first] == roots[second]
    # the same node with every device on a root of its own
    for s in slices:
        for i, d in enumerate(s["spec"].get("devices", [])):
            d["attributes"]["resource.kubernetes.io/pcieRoot"] = {"string": f"pci0000:{i:02x}"}
    own_roots = tmp_path / "slices.json"
    own_roots.write_text(json.dumps({"kind": "List", "items": slices}))
    ok, _ = explain(EXAMPLES / "same-pcie-root.yaml", "--slices", str(own_roots))
    assert not ok


def test_template_deployment_gives_each_replica_a_claim_with_a_gpu_of_its_own(
    tmp_path: Path,
) -> None:
    documents = list(yaml.safe_load_all((EXAMPLES / "template-deployment.yaml").read_text()))
    (template,) = [d for d in documents if d["kind"] == "ResourceClaimTemplate"]
    (deployment,) = [d for d in documents if d["kind"] == "Deployment"]
    pods = [
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"gpu-server-{i}"},
            "spec": deployment["spec"]["template"]["spec"],
        }
        for i in range(deployment["spec"]["replicas"])
    ]
    replicas = tmp_path / "replicas.yaml"
    replicas.write_text(yaml.safe_dump_all([template, *pods]))
    ok, result = on_demo_node(replicas)
    assert ok
    claims = result["allocation"]["claims"]
    assert [c["claim"] for c in claims] == [
        "gpu-server-0-gpu",
        "gpu-server-1-gpu",
        "gpu-server-2-gpu",
    ]
    devices = [r["device"] for r in results(result)]
    assert len(devices) == 3 == len(set(devices))


# -- dynamic-mig/ -------------------------------------------------------------------------------


def on_dynamic_mig_node(claim: Path, *extra: str) -> tuple[bool, dict[str, Any]]:
    return explain(claim, *DYNAMIC_MIG_NODE[:4], *extra)


def test_dynamic_3g40gb_takes_the_other_placement_and_names_who_holds_a_slice(
    tmp_path: Path,
) -> None:
    claim = DYNAMIC_MIG / "mig-3g40gb.yaml"
    first = allocated_file(tmp_path, "first", ["gpu-0-mig-3g40gb-9-0"])
    ok, result = on_dynamic_mig_node(claim, "--allocated", str(first))
    assert ok and [r["device"] for r in results(result)] == ["gpu-0-mig-3g40gb-9-4"]

    full = allocated_file(
        tmp_path, "full", ["gpu-0-mig-3g40gb-9-0", "gpu-0-mig-1g10gb-19-6", "gpu-1-mig-7g80gb-0-0"]
    )
    ok, result = on_dynamic_mig_node(claim, "--allocated", str(full))
    assert not ok
    (request,) = result["nodes"][0]["requests"]
    why = {d["device"]: d["reasons"] for d in request["devices"]}
    assert why["gpu-0-mig-3g40gb-9-4"][0] == (
        "3g.40gb at placement 4 needs memory-slice-4..7 of gpu-0-counter-set; "
        "memory-slice-6 is used by gpu-0-mig-1g10gb-19-6 of claim default/full"
    )
    assert why["gpu-1-mig-3g40gb-9-4"][0].startswith(
        "3g.40gb at placement 4 needs memory-slice-4..7 of gpu-1-counter-set; "
        "memory-slice-4..7 are used by gpu-1-mig-7g80gb-0-0 of claim default/full"
    )


def test_dynamic_any_20gib_gets_a_1g20gb_when_asked_for_19gib(tmp_path: Path) -> None:
    text = (DYNAMIC_MIG / "mig-any-20gib.yaml").read_text()
    assert "quantity('20Gi')" in text
    smaller = tmp_path / "mig-any-19gib.yaml"
    smaller.write_text(text.replace("quantity('20Gi')", "quantity('19Gi')"))
    ok, result = on_dynamic_mig_node(smaller)
    assert ok and [r["device"] for r in results(result)] == ["gpu-0-mig-1g20gb-15-0"]


def test_dynamic_whole_gpu_gets_the_gpu_not_in_mig_mode_before_a_partitionable_one(
    tmp_path: Path,
) -> None:
    docs = [
        d
        for d in yaml.safe_load_all((DYNAMIC_MIG / "whole-gpu-next-to-mig.yaml").read_text())
        if d["kind"] == "ResourceClaim" and d["metadata"]["name"] == "dynamic-mig-whole-gpu"
    ]
    alone = tmp_path / "whole.yaml"
    alone.write_text(yaml.safe_dump_all(docs))
    ok, result = on_dynamic_mig_node(alone)
    assert ok and [r["device"] for r in results(result)] == ["gpu-2"]
    # gpu-2 taken: the whole GPU of a GPU in MIG mode, the first one with nothing allocated
    taken = allocated_file(tmp_path, "taken", ["gpu-2", "gpu-0-mig-1g10gb-19-6"])
    ok, result = on_dynamic_mig_node(alone, "--allocated", str(taken))
    assert ok and [r["device"] for r in results(result)] == ["gpu-1"]
    # every GPU busy: refused, and the why names the MIG device that holds a counter of gpu-1
    busy = allocated_file(
        tmp_path, "busy", ["gpu-2", "gpu-0-mig-1g10gb-19-6", "gpu-1-mig-1g10gb-19-0"]
    )
    ok, result = on_dynamic_mig_node(alone, "--allocated", str(busy))
    assert not ok
    text = json.dumps(result)
    assert "memory-slice-0 is used by gpu-1-mig-1g10gb-19-0 of claim default/busy" in text
