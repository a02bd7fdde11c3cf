"""What one claim may carry (prepare/limits.py): each limit refused with an error naming it,
the largest claim within every limit still prepared, and every check linear (issue 37)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dra_driver.errors import ClaimNotFound, LimitExceeded, PrepareError
from dra_driver.prepare import limits
from dra_driver.prepare.plan import ClaimRef, plan_claim
from dra_driver.prepare.targets import device_targets
from dra_driver.sim.fakedriver import simulated_inventory
from tests.claimdata import DRIVER, allocated_claim, opaque

TARGETS = device_targets(simulated_inventory("h100:8", node_name="node1"))
API = "resource.nvidia.com/v1beta1"


def plan(claim: dict[str, Any]) -> None:
    meta = claim["metadata"]
    plan_claim(
        ClaimRef(namespace=meta["namespace"], name=meta["name"], uid=meta["uid"]),
        claim,
        driver_name=DRIVER,
        node_name="node1",
        targets=TARGETS,
    )


def other_driver_results(n: int) -> list[dict[str, Any]]:
    return [
        {"request": "nic", "driver": "net.example.com", "pool": "node1", "device": f"eth{i}"}
        for i in range(n)
    ]


def nested(depth: int) -> Any:
    value: Any = "leaf"
    for _ in range(depth - 1):
        value = [value]
    return value


def gpu_config(**fields: Any) -> dict[str, Any]:
    return {"apiVersion": API, "kind": "GpuConfig", **fields}


def config_of_size(size: int) -> dict[str, Any]:
    """A valid GpuConfig of ours that is ``size`` bytes as compact JSON."""

    def of(key_length: int) -> dict[str, Any]:
        limit = {"x" * key_length: "1Gi"}
        mps = {"defaultPerDevicePinnedMemoryLimit": limit}
        return gpu_config(sharing={"strategy": "MPS", "mpsConfig": mps})

    config = of(size - len(json.dumps(of(0), separators=(",", ":"))))
    assert len(json.dumps(config, separators=(",", ":"))) == size
    return config


def at_the_limits() -> dict[str, Any]:
    """A claim at every limit at once: each list as long as allowed, one config of ours as
    large as allowed."""
    configs = [
        opaque(gpu_config(), requests=["gpus"] * limits.MAX_REQUESTS_PER_CONFIG)
        for _ in range(limits.MAX_CONFIGS_PER_CLAIM - 1)
    ]
    configs.append(opaque(config_of_size(limits.MAX_OPAQUE_CONFIG_BYTES)))
    return allocated_claim(
        name="big",
        devices=["gpu-0"],
        configs=configs,
        extra_results=other_driver_results(limits.MAX_RESULTS_PER_CLAIM - 1),
    )


def test_a_claim_at_every_limit_is_planned() -> None:
    plan(at_the_limits())


def test_one_byte_more_is_refused() -> None:
    claim = allocated_claim(
        name="c", configs=[opaque(config_of_size(limits.MAX_OPAQUE_CONFIG_BYTES + 1))]
    )
    with pytest.raises(LimitExceeded, match="are 65537 bytes, more than the 65536 allowed"):
        plan(claim)


Mutation = Callable[[dict[str, Any]], None]


def devices_of(claim: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = claim["status"]["allocation"]["devices"]
    return found


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda c: devices_of(c)["results"].extend(
                other_driver_results(limits.MAX_RESULTS_PER_CLAIM)
            ),
            f"has {limits.MAX_RESULTS_PER_CLAIM + 1} allocation results, more than the "
            f"{limits.MAX_RESULTS_PER_CLAIM} allowed (docs/plugin.md#limits)",
        ),
        (
            lambda c: devices_of(c).update(
                config=[opaque(gpu_config())] * (limits.MAX_CONFIGS_PER_CLAIM + 1)
            ),
            f"has {limits.MAX_CONFIGS_PER_CLAIM + 1} config entries, more than the "
            f"{limits.MAX_CONFIGS_PER_CLAIM} allowed",
        ),
        (
            lambda c: devices_of(c).update(config=[opaque(gpu_config(), requests=["g"] * 257)]),
            "config 0 names 257 requests, more than the 256 allowed",
        ),
        (
            lambda c: devices_of(c).update(
                config=[opaque(gpu_config(driverCapabilities=["compute"] * 9000))]
            ),
            "bytes, more than the 65536 allowed (docs/plugin.md#limits)",
        ),
        (
            lambda c: devices_of(c).update(config=[opaque(gpu_config(x=nested(33)))]),
            "config 0: its opaque parameters are nested more than 32 levels deep",
        ),
        (
            lambda c: devices_of(c).update(config=[opaque(gpu_config(x=nested(900)))]),
            "config 0: its opaque parameters are nested more than 32 levels deep",
        ),
    ],
    ids=["results", "configs", "requests", "bytes", "depth", "depth-900"],
)
def test_each_limit_is_refused_with_an_error_naming_it(mutate: Mutation, message: str) -> None:
    claim = allocated_claim(name="c", devices=["gpu-0"])
    mutate(claim)
    with pytest.raises(LimitExceeded) as info:
        plan(claim)
    assert message in str(info.value)


def test_a_deep_config_within_the_limit_reaches_the_decoder() -> None:
    claim = allocated_claim(name="c", configs=[opaque(gpu_config(x=nested(32)))])
    with pytest.raises(PrepareError, match="x: Extra inputs are not permitted"):
        plan(claim)


def test_another_drivers_big_config_is_not_ours_to_limit() -> None:
    huge = opaque({"blob": "x" * (2 * limits.MAX_OPAQUE_CONFIG_BYTES)}, driver="other.example")
    plan(allocated_claim(name="c", configs=[huge]))


@pytest.mark.parametrize(
    ("where", "value", "message"),
    [
        ("results", "gpu-0", "allocation results is not a list"),
        ("config", {"a": 1}, "configs is not a list"),
        ("requests", 5, "config 0: requests is not a list"),
        ("devices", [], "allocation devices is not an object"),
    ],
)
def test_lists_of_the_wrong_type_are_refused_not_crashed_on(
    where: str, value: object, message: str
) -> None:
    claim = allocated_claim(name="c", configs=[opaque(gpu_config())])
    allocation = claim["status"]["allocation"]
    if where == "devices":
        allocation["devices"] = value
    elif where == "requests":
        allocation["devices"]["config"][0]["requests"] = value
    else:
        allocation["devices"][where] = value
    with pytest.raises(PrepareError, match=message):
        plan(claim)


def test_a_node_selector_of_the_wrong_shape_is_read_without_crashing() -> None:
    claim = allocated_claim(name="c")
    claim["status"]["allocation"]["nodeSelector"] = {
        "nodeSelectorTerms": ["x", 5, {"matchFields": [7, {"key": "metadata.name",
                                                            "operator": "In", "values": 3}]}]
    }  # fmt: skip
    plan(claim)


def test_a_huge_foreign_uid_is_quoted_cut_short() -> None:
    claim = allocated_claim(name="c")
    uid = claim["metadata"]["uid"]
    claim["metadata"]["uid"] = "u" * 100_000
    with pytest.raises(ClaimNotFound) as info:
        plan_claim(
            ClaimRef(namespace="default", name="c", uid=uid),
            claim,
            driver_name=DRIVER,
            node_name="node1",
            targets=TARGETS,
        )
    assert len(str(info.value)) < 300
    assert "(100002 chars)" in str(info.value)


def test_a_config_far_over_the_size_limit_is_refused_before_its_items_are_read() -> None:
    """The quadratic check of issue 37 took 2 s at 16,000 names; 650,000 never finished."""
    claim = allocated_claim(
        name="c", configs=[opaque(gpu_config(driverCapabilities=["compute"] * 650_000))]
    )
    started = time.perf_counter()
    with pytest.raises(LimitExceeded):
        plan(claim)
    assert time.perf_counter() - started < 1.0


def test_the_example_in_the_docs_is_what_prepare_says() -> None:
    """docs/plugin.md "Limits" shows the error of a 5 MB config (524,288 names)."""
    claim = allocated_claim(
        name="c1", configs=[opaque(gpu_config(driverCapabilities=["compute"] * 524_288))]
    )
    with pytest.raises(LimitExceeded) as info:
        plan(claim)
    docs = (Path(__file__).parents[1] / "docs" / "plugin.md").read_text()
    section = docs[docs.index("### Limits") :]
    example = " ".join(
        line.strip() for line in section.split("For example:")[1].split("\n\n")[1].splitlines()
    )
    assert example == str(info.value)
