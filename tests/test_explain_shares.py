"""`gpu-dra explain` with consumable shares (KEP-5075): several claims on one device, as the
scheduler allocates them, and why a share does not fit.

The devices come from the real pipeline (simulated NVML -> devices -> shares -> slices) through
``--simulate ... --consumable-shares MODE``; the rules checked are KEP-5075's: the requestPolicy
default for a request that names no capacity, rounding up to the step, a request above the
maximum refused, capacity used up across claims already allocated (``--allocated``), and
``distinctAttribute``. The examples' own "What to expect" is checked at the end.
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

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "resourceclaims"
H100_MIB = 81559


def claim(
    name: str,
    *requests: dict[str, Any],
    constraints: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    spec: dict[str, Any] = {"devices": {"requests": list(requests)}}
    if constraints:
        spec["devices"]["constraints"] = constraints
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default"},
        "spec": spec,
    }


def request(name: str = "gpu", cls: str = "gpu.nvidia.com", **capacity: str) -> dict[str, Any]:
    exactly: dict[str, Any] = {"deviceClassName": cls}
    if capacity:
        exactly["capacity"] = {"requests": capacity}
    return {"name": name, "exactly": exactly}


def explain(
    tmp_path: Path, docs: list[dict[str, Any]], *args: str
) -> tuple[int, dict[str, Any], str]:
    path = tmp_path / f"claims-{len(list(tmp_path.iterdir()))}.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    out, err = io.StringIO(), io.StringIO()
    rc = main([str(path), "-o", "json", *args], stdout=out, stderr=err)
    if rc == 2:
        return rc, {}, err.getvalue()
    return rc, json.loads(out.getvalue()), err.getvalue()


def results(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        r for c in result["allocation"]["claims"] for r in c["allocation"]["devices"]["results"]
    ]


def reasons(result: dict[str, Any], device: str) -> list[str]:
    ((req, *_),) = [n["requests"] for n in result["nodes"]]
    return next(d["reasons"] for d in req["devices"] if d["device"] == device)


def allocated(tmp_path: Path, name: str, device: str, consumed: dict[str, str]) -> Path:
    """A claim already allocated a share of ``device`` (what --allocated reads)."""
    held = claim(name, request())
    held["status"] = {
        "allocation": {
            "devices": {
                "results": [
                    {
                        "request": "gpu",
                        "driver": "gpu.nvidia.com",
                        "pool": "node1",
                        "device": device,
                        "shareID": "0f8fad5b-d9cb-469f-a165-70867728950e",
                        "consumedCapacity": consumed,
                    }
                ]
            }
        }
    }
    path = tmp_path / f"{name}-allocated.yaml"
    path.write_text(yaml.safe_dump(held))
    return path


def on(spec: str, mode: str) -> tuple[str, ...]:
    return ("--simulate", spec, "--node", "node1", "--consumable-shares", mode)


def test_two_claims_of_20gi_share_one_gpu_each_with_a_share_id(tmp_path: Path) -> None:
    rc, result, _ = explain(
        tmp_path,
        [claim("a", request(memory="20Gi")), claim("b", request(memory="20Gi"))],
        *on("h100:2", "unlimited"),
    )
    assert rc == 0
    got = results(result)
    assert [r["device"] for r in got] == ["gpu-0", "gpu-0"]
    assert [r["consumedCapacity"] for r in got] == [{"memory": "20Gi"}] * 2
    assert got[0]["shareID"] != got[1]["shareID"]


def test_without_sharing_each_claim_takes_a_gpu_of_its_own(tmp_path: Path) -> None:
    rc, result, _ = explain(
        tmp_path,
        [claim("a", request(memory="20Gi")), claim("b", request(memory="20Gi"))],
        *on("h100:2", "disabled"),
    )
    assert rc == 0
    assert [r["device"] for r in results(result)] == ["gpu-0", "gpu-1"]
    assert all("shareID" not in r for r in results(result))


def test_a_share_that_does_not_fit_says_how_much_was_asked_and_is_left(tmp_path: Path) -> None:
    held = allocated(tmp_path, "held", "gpu-0", {"memory": "70Gi"})
    rc, result, _ = explain(
        tmp_path, [claim("a", request(memory="30Gi"))], *on("h100:1", "unlimited"), "--allocated",
        str(held),
    )  # fmt: skip
    assert rc == 1
    assert reasons(result, "gpu-0") == [
        f"memory: 30Gi requested, {H100_MIB - 70 * 1024}Mi left on gpu-0 (in use by default/held)"
    ]
    # the same claim fits next to a smaller one
    small = allocated(tmp_path, "small", "gpu-0", {"memory": "40Gi"})
    rc, result, _ = explain(
        tmp_path, [claim("a", request(memory="30Gi"))], *on("h100:1", "unlimited"), "--allocated",
        str(small),
    )  # fmt: skip
    assert rc == 0 and results(result)[0]["consumedCapacity"] == {"memory": "30Gi"}


def test_a_claim_naming_no_memory_consumes_the_policy_default(tmp_path: Path) -> None:
    # memory: the default is all of it, so the second claim needs the second GPU
    rc, result, _ = explain(
        tmp_path, [claim("a", request()), claim("b", request())], *on("h100:2", "memory")
    )
    assert rc == 0
    got = results(result)
    assert [(r["device"], r["consumedCapacity"]) for r in got] == [
        ("gpu-0", {"memory": f"{H100_MIB}Mi"}),
        ("gpu-1", {"memory": f"{H100_MIB}Mi"}),
    ]
    held = allocated(tmp_path, "held", "gpu-0", {"memory": f"{H100_MIB}Mi"})
    rc, result, _ = explain(
        tmp_path, [claim("a", request())], *on("h100:1", "memory"), "--allocated", str(held)
    )
    assert rc == 1
    assert reasons(result, "gpu-0") == [
        f"memory: {H100_MIB}Mi requested (the requestPolicy's default), 0 left on gpu-0 "
        "(in use by default/held)"
    ]
    # unlimited: the default is 0, so any number of such claims share the GPU
    rc, result, _ = explain(
        tmp_path, [claim(f"c{i}", request()) for i in range(5)], *on("h100:1", "unlimited")
    )
    assert rc == 0
    assert {r["consumedCapacity"]["memory"] for r in results(result)} == {"0"}


def test_a_request_is_rounded_up_to_the_1mi_step(tmp_path: Path) -> None:
    rc, result, _ = explain(
        tmp_path, [claim("a", request(memory="1G"))], *on("h100:1", "unlimited")
    )
    assert rc == 0
    # 10^9 bytes is 953.67Mi: the step makes it 954Mi
    assert results(result)[0]["consumedCapacity"] == {"memory": "954Mi"}


def test_a_request_above_the_policy_maximum_is_refused(tmp_path: Path) -> None:
    rc, result, _ = explain(
        tmp_path, [claim("a", request(compute="150"))], *on("h100:1", "compute")
    )
    assert rc == 1
    assert reasons(result, "gpu-0") == [
        "compute: 150 requested, more than the requestPolicy's maximum 100 on gpu-0"
    ]
    rc, result, _ = explain(
        tmp_path,
        [claim("a", request(compute="60")), claim("b", request(compute="40"))],
        *on("h100:1", "compute"),
    )
    assert rc == 0
    assert [r["consumedCapacity"]["compute"] for r in results(result)] == ["60", "40"]


def test_integer_shares_are_used_up_across_claims_already_allocated(tmp_path: Path) -> None:
    held = allocated(tmp_path, "held", "gpu-0", {"memory": "0", "shares": "3"})
    rc, result, _ = explain(
        tmp_path, [claim("a", request(shares="1")), claim("b", request(shares="1"))],
        *on("h100:2", "4"), "--allocated", str(held),
    )  # fmt: skip
    assert rc == 0
    assert [r["device"] for r in results(result)] == ["gpu-0", "gpu-1"]
    assert results(result)[0]["consumedCapacity"] == {"memory": "0", "shares": "1"}


def test_distinct_attribute_keeps_two_shares_of_a_claim_on_two_gpus(tmp_path: Path) -> None:
    two = [request("a", memory="10Gi"), request("b", memory="10Gi")]
    rc, result, _ = explain(tmp_path, [claim("c", *two)], *on("h100:2", "unlimited"))
    assert rc == 0
    assert [r["device"] for r in results(result)] == ["gpu-0", "gpu-0"]
    distinct = [{"requests": ["a", "b"], "distinctAttribute": "gpu.nvidia.com/uuid"}]
    rc, result, _ = explain(
        tmp_path, [claim("c", *two, constraints=distinct)], *on("h100:2", "unlimited")
    )
    assert rc == 0
    assert [r["device"] for r in results(result)] == ["gpu-0", "gpu-1"]
    rc, result, _ = explain(
        tmp_path, [claim("c", *two, constraints=distinct)], *on("h100:1", "unlimited")
    )
    assert rc == 1


def test_shares_of_a_mig_device_do_not_take_its_other_capacities(tmp_path: Path) -> None:
    rc, result, _ = explain(
        tmp_path,
        [claim(n, request(cls="mig.nvidia.com", memory="5Gi")) for n in ("a", "b", "c")],
        *on("a100-40gb:1:mig=3g.20gb", "unlimited"),
    )
    assert rc == 0
    got = results(result)
    assert len({r["device"] for r in got}) == 1 and "-mig-3g20gb-" in got[0]["device"]
    assert got[0]["consumedCapacity"]["multiprocessors"] == "0"


def test_consumable_shares_needs_simulate_and_a_valid_mode(tmp_path: Path) -> None:
    slices = tmp_path / "slices.yaml"
    slices.write_text("{}")
    rc, _, err = explain(
        tmp_path, [claim("a", request())], "--slices", str(slices), "--consumable-shares", "4"
    )
    assert rc == 2 and "--consumable-shares only applies to --simulate" in err
    rc, _, err = explain(tmp_path, [claim("a", request())], *on("h100:1", "1"))
    assert rc == 2 and "use at least 2 shares" in err


# -- the examples' "What to expect" ------------------------------------------------------------


def workload_pods(path: Path, *, replicas: int | None = None) -> list[dict[str, Any]]:
    """The example's template and the pods of its Pods or Deployment, one per replica."""
    docs = list(yaml.safe_load_all(path.read_text()))
    out = [d for d in docs if d["kind"] in ("ResourceClaimTemplate", "Pod")]
    for d in docs:
        if d["kind"] == "Deployment":
            for i in range(replicas or d["spec"]["replicas"]):
                out.append(
                    {
                        "apiVersion": "v1",
                        "kind": "Pod",
                        "metadata": {"name": f"{d['metadata']['name']}-{i}"},
                        "spec": d["spec"]["template"]["spec"],
                    }
                )
    return out


def demo(mode: str) -> tuple[str, ...]:
    return ("--simulate", DEMO_SIMULATE, "--node", DEMO_NODE, "--consumable-shares", mode)


def test_shares_memory_example_puts_both_pods_on_gpu_0_and_a_fourth_on_gpu_1(
    tmp_path: Path,
) -> None:
    docs = workload_pods(EXAMPLES / "shares-memory.yaml")
    rc, result, _ = explain(tmp_path, docs, *demo("unlimited"))
    assert rc == 0
    got = results(result)
    assert [r["device"] for r in got] == ["gpu-0", "gpu-0"]
    assert [r["consumedCapacity"] for r in got] == [{"memory": "20Gi"}] * 2
    assert len({r["shareID"] for r in got}) == 2
    template, pod, _ = docs
    more = [template] + [{**pod, "metadata": {"name": f"infer-{i}"}} for i in range(5)]
    rc, result, _ = explain(tmp_path, more, *demo("unlimited"))
    assert rc == 0
    # 81559Mi holds three 20Gi shares, not four
    assert [r["device"] for r in results(result)] == ["gpu-0"] * 3 + ["gpu-1"] * 2
    rc, result, _ = explain(tmp_path, docs, *demo("disabled"))
    assert rc == 0
    assert [r["device"] for r in results(result)] == ["gpu-0", "gpu-1"]


def test_shares_integer_example_packs_four_replicas_to_a_gpu(tmp_path: Path) -> None:
    rc, result, _ = explain(tmp_path, workload_pods(EXAMPLES / "shares-integer.yaml"), *demo("4"))
    assert rc == 0
    got = results(result)
    assert [r["device"] for r in got] == ["gpu-0"] * 4 + ["gpu-1"] * 2
    assert all(r["consumedCapacity"] == {"memory": "0", "shares": "1"} for r in got)


@pytest.mark.parametrize("name", ["shares-memory.yaml", "shares-integer.yaml"])
def test_the_share_examples_say_that_sharing_needs_mps_as_the_agent_does(name: str) -> None:
    """The agent refuses --consumable-shares without MPS (tests/test_chart.py), and each share
    is a client of its device's MPS daemon (tests/test_mps_shares.py): the headers say so."""
    text = (EXAMPLES / name).read_text()
    assert "with MPS on (chart value mps.enabled, the default)" in text
    assert "MPS daemon" in text and "refuses" not in text
