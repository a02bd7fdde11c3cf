"""API objects -> the allocator's inputs (scheduling/allocator/parse.py): v1beta1 shapes, what
allocated claims hold."""

from __future__ import annotations

from typing import Any

from dra_driver.scheduling.allocator import (
    allocated_state,
)
from tests.allocatordata import (
    DRIVER,
    allocated_claim,
    devices_of,
    gpu,
    run,
    slice_,
)


def test_v1beta1_shapes_are_normalised() -> None:
    beta_claim = {
        "kind": "ResourceClaim",
        "metadata": {"name": "c"},
        "spec": {
            "devices": {
                "requests": [{"name": "gpu", "deviceClassName": "gpu.nvidia.com", "count": 1}]
            }
        },
    }
    beta_slice = slice_([])
    beta_slice["spec"]["devices"] = [
        {"name": "gpu-0", "basic": {k: v for k, v in gpu("gpu-0").items() if k != "name"}}
    ]
    assert devices_of(run([beta_claim], [beta_slice])) == ["gpu-0"]


def test_allocated_state_counts_each_kind_of_result_as_the_scheduler_does() -> None:
    def named(name: str, c: dict[str, Any]) -> dict[str, Any]:
        c["metadata"]["name"] = name
        return c

    admin = named("monitor", allocated_claim("gpu-0"))
    admin["status"]["allocation"]["devices"]["results"][0]["adminAccess"] = True
    state = allocated_state(
        [
            admin,
            named("share-a", allocated_claim("gpu-1", share=True)),
            named("share-b", allocated_claim("gpu-1", share=True)),
            named("whole", allocated_claim("gpu-2")),
            {"metadata": {"name": "pending", "namespace": "ns"}},
        ]
    )
    assert state.holders((DRIVER, "node1", "gpu-0")) == ()  # admin access holds nothing
    assert state.holders((DRIVER, "node1", "gpu-1")) == ("ns/share-a", "ns/share-b")
    assert state.holders((DRIVER, "node1", "gpu-2")) == ("ns/whole",)
    assert state.shared_capacity[(DRIVER, "node1", "gpu-1")] == {"memory": 60 * 2**30}
    assert sorted(state.claims) == ["ns/monitor", "ns/share-a", "ns/share-b", "ns/whole"]
    assert state.claims["ns/monitor"].results[0].admin_access
