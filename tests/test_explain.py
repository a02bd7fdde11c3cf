"""``gpu-dra explain``: inputs, outputs, exit codes (docs/explain.md)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from dra_driver.cli import explain_main as main
from dra_driver.cli import gpu_dra_main
from dra_driver.devices.classes import class_expression, default_device_classes
from dra_driver.scheduling.explain import allocate
from dra_driver.scheduling.explain import main as explain_command
from tests.simulatedslices import simulated_slices

SIMULATE = "h100:2,l4:1"

CLAIM = """
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: two, namespace: default}
spec:
  devices:
    requests:
    - name: gpus
      exactly: {deviceClassName: gpu.nvidia.com, count: 2}
"""

BIG = """
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: big}
spec:
  devices:
    requests:
    - name: gpus
      exactly:
        deviceClassName: gpu.nvidia.com
        selectors:
        - cel: {expression: "device.capacity['gpu.nvidia.com'].memory
                 .compareTo(quantity('100Gi')) >= 0"}
"""


def explain(tmp_path: Path, text: str, *args: str) -> tuple[int, str, str]:
    path = tmp_path / "claim.yaml"
    path.write_text(text)
    out, err = io.StringIO(), io.StringIO()
    rc = main([str(path), *args], stdout=out, stderr=err)
    return rc, out.getvalue(), err.getvalue()


def test_satisfiable_claim_prints_the_allocation_and_exits_0(tmp_path: Path) -> None:
    rc, out, _ = explain(tmp_path, CLAIM, "--simulate", SIMULATE, "--node", "n1")
    assert rc == 0
    assert "satisfiable on node n1" in out
    assert "gpu-0" in out and "gpu-1" in out


def test_unsatisfiable_claim_says_why_and_exits_1(tmp_path: Path) -> None:
    rc, out, _ = explain(tmp_path, BIG, "--simulate", SIMULATE)
    assert rc == 1
    assert "NOT satisfiable" in out
    assert "memory 81559Mi is less than 100Gi" in out  # the simulated H100 has 81559Mi
    assert "memory 23034Mi is less than 100Gi" in out  # the L4


def test_json_and_yaml_outputs_carry_the_same_result(tmp_path: Path) -> None:
    rc, out, _ = explain(tmp_path, CLAIM, "--simulate", SIMULATE, "-o", "json")
    assert rc == 0
    data = json.loads(out)
    assert data["satisfiable"] is True
    results = data["allocation"]["claims"][0]["allocation"]["devices"]["results"]
    assert [r["device"] for r in results] == ["gpu-0", "gpu-1"]
    rc, out, _ = explain(tmp_path, BIG, "--simulate", SIMULATE, "-o", "yaml")
    assert rc == 1
    data = yaml.safe_load(out)
    devices = data["nodes"][0]["requests"][0]["devices"]
    assert all(not d["usable"] and d["reasons"] for d in devices)


def test_bad_yaml_is_an_input_error_with_file_and_position(tmp_path: Path) -> None:
    rc, _, err = explain(tmp_path, "spec: [\n", "--simulate", SIMULATE)
    assert rc == 2
    assert "claim.yaml:2:1: invalid YAML" in err


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            b"\x7fELF\x02\x01\x01\x00\xff\xfe",
            "not UTF-8 text (byte 0xff at offset 8); expected YAML or JSON",
        ),
        (b"a: " + b"[" * 5000 + b"]" * 5000, "YAML nested deeper than explain reads"),
    ],
)
def test_a_binary_or_absurdly_nested_file_is_an_input_error_not_a_traceback(
    tmp_path: Path, content: bytes, message: str
) -> None:
    """Issue 37: ``gpu-dra explain /bin/ls`` printed a UnicodeDecodeError traceback."""
    path = tmp_path / "claim.yaml"
    path.write_bytes(content)
    out, err = io.StringIO(), io.StringIO()
    assert main([str(path), "--simulate", SIMULATE], stdout=out, stderr=err) == 2
    assert err.getvalue() == f"gpu-dra explain: error: {path}: {message}\n"


def test_a_closed_pipe_ends_the_command_quietly(tmp_path: Path) -> None:
    """Issue 37: ``gpu-dra explain … | head`` printed a BrokenPipeError traceback. The reader is
    gone before the command writes: its first write fails."""
    path = tmp_path / "claim.yaml"
    path.write_text(CLAIM)
    code = "import sys; from dra_driver.cli import gpu_dra_main; sys.exit(gpu_dra_main())"
    command = [sys.executable, "-c", code, "explain", str(path), "--simulate", SIMULATE]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as process:
        assert process.stdout is not None and process.stderr is not None
        process.stdout.close()
        stderr = process.stderr.read().decode()
        assert process.wait(timeout=60) == 141, stderr
    assert stderr == ""


def test_unknown_class_is_an_input_error(tmp_path: Path) -> None:
    rc, _, err = explain(tmp_path, CLAIM.replace("gpu.nvidia.com", "nope"), "--simulate", SIMULATE)
    assert rc == 2
    assert "device class 'nope' not found" in err


def test_invalid_cel_is_an_input_error_with_position(tmp_path: Path) -> None:
    text = BIG.replace("compareTo(quantity('100Gi')) >= 0", "compareTo(quantity('100Gi')) >=")
    rc, _, err = explain(tmp_path, text, "--simulate", SIMULATE)
    assert rc == 2
    assert "claim.yaml: claim big: request gpus: selectors[0]: CEL compile error: line 1" in err
    assert "unexpected end of expression" in err


def test_pod_with_a_template_generates_its_claim(tmp_path: Path) -> None:
    text = """
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: one-gpu}
spec:
  spec:
    devices:
      requests: [{name: gpu, exactly: {deviceClassName: gpu.nvidia.com}}]
---
apiVersion: v1
kind: Pod
metadata: {name: trainer}
spec:
  resourceClaims: [{name: gpu, resourceClaimTemplateName: one-gpu}]
  containers: [{name: c, image: x}]
"""
    rc, out, _ = explain(tmp_path, text, "--simulate", SIMULATE)
    assert rc == 0
    assert "trainer-gpu" in out


def test_slices_file_and_allocated_claims(tmp_path: Path) -> None:
    slices = simulated_slices(SIMULATE, node_name="n1")
    (tmp_path / "slices.yaml").write_text(
        yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": slices})
    )
    allocated = {
        "metadata": {"name": "busy", "namespace": "default"},
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {"request": "r", "driver": "gpu.nvidia.com", "pool": "n1", "device": d}
                        for d in ("gpu-0", "gpu-1")
                    ]
                }
            }
        },
    }
    (tmp_path / "allocated.yaml").write_text(yaml.safe_dump(allocated))
    rc, out, _ = explain(
        tmp_path,
        CLAIM,
        "--slices",
        str(tmp_path / "slices.yaml"),
        "--allocated",
        str(tmp_path / "allocated.yaml"),
    )
    assert rc == 1
    assert "gpu-0   n1    in use by default/busy" in out
    assert (
        "needs 2, 1 of 3 devices usable: gpu-2; 2 matching devices are allocated: "
        "gpu-0 (default/busy), gpu-1 (default/busy)"
    ) in out


def test_library_allocate_reports_every_node(tmp_path: Path) -> None:
    slices = simulated_slices(SIMULATE, node_name="a") + simulated_slices("l4:1", node_name="b")
    result = allocate(yaml.safe_load(CLAIM), default_device_classes(), slices)
    assert result.satisfiable
    assert result.satisfiable_nodes == ("a",)
    assert result.chosen is not None and result.chosen.node == "a"


def test_default_classes_match_nvidia_selectors() -> None:
    exprs = {
        c["metadata"]["name"]: c["spec"]["selectors"][0]["cel"]["expression"]
        for c in default_device_classes()
    }
    nvidia = "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type =="
    assert exprs == {
        name: f"{nvidia} '{t}'"
        for name, t in (("gpu.nvidia.com", "gpu"), ("mig.nvidia.com", "mig"))
    }
    assert (
        class_expression("x.io", "gpu")
        == "device.driver == 'x.io' && device.attributes['x.io'].type == 'gpu'"
    )


def test_explain_reads_slices_and_classes_live_from_a_cluster(tmp_path: Path, kubeapi: Any) -> None:
    """--kubeconfig: every node's slices and the cluster's classes, through the real client."""
    for node, spec in (("small", "l4:1"), ("big", "h100:2")):
        for obj in simulated_slices(spec, node_name=node):
            kubeapi.put("resourceslices", obj)
    for cls in default_device_classes():
        kubeapi.put("deviceclasses", cls)
    claim = tmp_path / "claim.yaml"
    claim.write_text(CLAIM)  # two GPUs: only node "big" has them
    out = io.StringIO()
    code = main(
        [str(claim), "--kubeconfig", str(kubeapi.kubeconfig_path), "-o", "json"],
        stdout=out,
        stderr=io.StringIO(),
    )
    assert code == 0, out.getvalue()
    result = json.loads(out.getvalue())
    assert result["satisfiableNodes"] == ["big"]
    devices = [
        r["device"] for r in result["allocation"]["claims"][0]["allocation"]["devices"]["results"]
    ]
    assert devices == ["gpu-0", "gpu-1"]
    listed = {(r.verb, r.resource) for r in kubeapi.requests}
    assert {("list", "resourceslices"), ("list", "deviceclasses")} <= listed

    big = tmp_path / "big.yaml"
    big.write_text(BIG)  # >= 100Gi: no node has it
    code = main(
        [str(big), "--kubeconfig", str(kubeapi.kubeconfig_path)],
        stdout=io.StringIO(),
        stderr=io.StringIO(),
    )
    assert code == 1


def numa_mig_claim(count: int, slice_selector: str) -> str:
    return f"""
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {{name: near, namespace: default}}
spec:
  devices:
    requests:
    - name: migs
      exactly:
        deviceClassName: mig.nvidia.com
        count: {count}
        selectors:
        - cel: {{expression: "device.attributes['resource.kubernetes.io'].numaNode == 1"}}
        - cel: {{expression: "{slice_selector}"}}
"""


SLICE_0 = "device.capacity['gpu.nvidia.com'].memorySlice0.compareTo(quantity('1')) == 0"


def results_of(out: str) -> list[str]:
    data = json.loads(out)
    return [
        r["device"] for r in data["allocation"]["claims"][0]["allocation"]["devices"]["results"]
    ]


def test_selectors_on_numa_node_and_memory_slices_match_as_for_nvidias_driver(
    tmp_path: Path,
) -> None:
    # Four GPUs: 0-1 on NUMA node 0, 2-3 on node 1; a 7g device covers memory slices 0-7.
    rc, out, _ = explain(
        tmp_path,
        numa_mig_claim(2, SLICE_0),
        "--simulate",
        "h100:2:mig=7g.80gb,h100:2:mig=7g.80gb",
        "-o",
        "json",
    )

    assert rc == 0, out
    assert results_of(out) == ["gpu-2-mig-7g80gb-0-0", "gpu-3-mig-7g80gb-0-0"]


def test_a_memory_slice_selector_needs_a_guard_where_devices_lack_that_slice(
    tmp_path: Path,
) -> None:
    """As in the scheduler: a missing capacity is a CEL runtime error, not false."""
    simulate = "h100:2,h100:2:mig=1g.10gb*7"
    guarded = f"has(device.capacity['gpu.nvidia.com'].memorySlice0) && {SLICE_0}"

    rc, out, _ = explain(tmp_path, numa_mig_claim(2, guarded), "--simulate", simulate, "-o", "json")
    assert rc == 0, out
    assert results_of(out) == ["gpu-2-mig-1g10gb-19-0", "gpu-3-mig-1g10gb-19-0"]

    rc, out, _ = explain(tmp_path, numa_mig_claim(2, SLICE_0), "--simulate", simulate)
    assert rc == 1
    assert "gpu-2-mig-1g10gb-19-1: CEL runtime error: capacity gpu.nvidia.com/memorySlice0" in out


BIG_SELECTOR = (
    "device.capacity['gpu.nvidia.com'].memory\n                 .compareTo(quantity('100Gi')) >= 0"
)


def test_k8s_version_compiles_selectors_as_that_api_server_does(tmp_path: Path) -> None:
    text = BIG.replace(
        BIG_SELECTOR,
        "['a', 'b'].reverse()[0] == 'b'",
    )
    assert "reverse" in text
    rc, _, err = explain(tmp_path, text, "--simulate", SIMULATE, "--k8s-version", "1.34")
    assert rc == 2
    assert "claim big: request gpus: selectors[0]: CEL compile error: line 1, column 11:" in err
    assert "undeclared reference to 'reverse' (in container '')" in err
    for version in ("1.35", "1.37"):
        rc, out, err = explain(tmp_path, text, "--simulate", SIMULATE, "--k8s-version", version)
        assert rc == 0, err
        assert "satisfiable" in out
    rc, out, _ = explain(tmp_path, text, "--simulate", SIMULATE)  # default: the newest, 1.37
    assert rc == 0


def test_k8s_version_must_be_a_supported_minor(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, _, _ = explain(tmp_path, CLAIM, "--simulate", SIMULATE, "--k8s-version", "1.33")
    assert rc == 2
    assert "invalid choice: '1.33'" in capsys.readouterr().err  # argparse writes to sys.stderr


def test_a_selector_over_the_cost_limit_is_an_input_error(tmp_path: Path) -> None:
    nested = (
        "device.attributes.all(d, device.attributes[d].all(k, device.attributes.all(e, "
        "device.attributes[e].all(j, device.attributes[e][j] == device.attributes[d][k]))))"
    )
    text = BIG.replace(
        BIG_SELECTOR,
        nested,
    )
    assert nested in text
    rc, _, err = explain(tmp_path, text, "--simulate", SIMULATE)
    assert rc == 2
    assert "too complex, exceeds cost limit: estimated cost" in err


def test_gpu_dra_explain_simulates_gpus_through_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "claim.yaml"
    path.write_text(CLAIM)
    assert gpu_dra_main(["explain", str(path), "--simulate", SIMULATE, "--node", "n1"]) == 0
    assert "satisfiable on node n1" in capsys.readouterr().out


def test_simulate_without_a_simulated_discovery_is_an_input_error(tmp_path: Path) -> None:
    path = tmp_path / "claim.yaml"
    path.write_text(CLAIM)
    out, err = io.StringIO(), io.StringIO()
    assert explain_command([str(path), "--simulate", SIMULATE], stdout=out, stderr=err) == 2
    assert "--simulate needs simulated GPUs" in err.getvalue()
    assert out.getvalue() == ""


def test_the_scheduling_package_does_not_import_the_simulators() -> None:
    code = (
        "import sys\n"
        "import dra_driver.scheduling.explain\n"
        "print(sorted(m for m in sys.modules if m.startswith('dra_driver.sim')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.strip() == "[]"
