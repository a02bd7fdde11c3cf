"""ResourceClaim JSON as the API server returns it (v1 shape), for prepare tests and benchmarks."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from dra_driver.prepare.state.checkpointlocks import ClaimLocks
from dra_driver.prepare.state.checkpointrecords import (
    PREPARE_STARTED,
    ClaimRecord,
    PreparedDevice,
)

DRIVER = "gpu.nvidia.com"


def new_uid() -> str:
    return str(uuid.uuid4())


def uid_sharing_the_lock_of(uid: str) -> str:
    """Another claim UID whose lock is ``uid``'s stripe (checkpointlocks.py: 4,096 stripes, so
    two claims share one now and then; found by trying, a few thousand UIDs)."""
    stripe = ClaimLocks._stripe(uid)
    while True:
        other = new_uid()
        if other != uid and ClaimLocks._stripe(other) == stripe:
            return other


def allocated_claim(
    *,
    name: str,
    namespace: str = "default",
    uid: str | None = None,
    node: str = "node1",
    devices: Sequence[str | tuple[str, str]] = ("gpu-0",),
    configs: Sequence[dict[str, Any]] = (),
    driver: str = DRIVER,
    extra_results: Sequence[dict[str, Any]] = (),
) -> dict[str, Any]:
    """A claim allocated on ``node``; each device is a name (request "gpus") or (request, name)."""
    results = []
    for d in devices:
        request, device = ("gpus", d) if isinstance(d, str) else d
        results.append({"request": request, "driver": driver, "pool": node, "device": device})
    results.extend(extra_results)
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace, "uid": uid or new_uid()},
        "spec": {"devices": {"requests": [{"name": "gpus"}]}},
        "status": {
            "allocation": {
                "nodeSelector": {
                    "nodeSelectorTerms": [
                        {
                            "matchFields": [
                                {"key": "metadata.name", "operator": "In", "values": [node]}
                            ]
                        }
                    ]
                },
                "devices": {"results": results, "config": list(configs)},
            },
            "reservedFor": [{"resource": "pods", "name": "pod-0", "uid": new_uid()}],
        },
    }


def opaque(
    parameters: dict[str, Any],
    *,
    source: str = "FromClaim",
    requests: Sequence[str] = (),
    driver: str = DRIVER,
) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "source": source,
        "opaque": {"driver": driver, "parameters": parameters},
    }
    if requests:
        entry["requests"] = list(requests)
    return entry


class ClaimStore:
    """An in-memory ClaimSource (prepare.ClaimSource) for tests of prepare/'s logic alone;
    the gRPC tests use the real KubeClient against dra_driver/sim/localapi/ instead."""

    def __init__(self) -> None:
        self.claims: dict[tuple[str, str], dict[str, Any]] = {}
        self.gets = 0

    def add(self, claim: dict[str, Any]) -> dict[str, Any]:
        meta = claim["metadata"]
        self.claims[(meta["namespace"], meta["name"])] = claim
        return claim

    def delete(self, claim: dict[str, Any]) -> None:
        meta = claim["metadata"]
        del self.claims[(meta["namespace"], meta["name"])]

    def get_resource_claim(self, *, namespace: str, name: str) -> dict[str, Any] | None:
        self.gets += 1
        return self.claims.get((namespace, name))


def checkpoint_record(uid: str, *devices: str) -> ClaimRecord:
    """A checkpoint record of claim ``uid`` holding ``devices`` whole."""
    return ClaimRecord(
        uid=uid,
        namespace="ns",
        name=f"claim-{uid}",
        phase=PREPARE_STARTED,
        devices=tuple(
            PreparedDevice(request_names=("r",), pool="node1", device=d, cdi_device_ids=())
            for d in devices
        ),
    )
