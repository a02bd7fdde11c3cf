"""A DRA plugin that does only part of a prepare, for bench_grpc_floor: what the chosen libraries
cost before the rest of the agent's work.

``python -m bench.floorserver LEVEL SOCKET STATE_DIR [KUBECONFIG]`` serves the DRA v1 service on
the Unix socket SOCKET with the agent's own gRPC server settings and servicer
(dra_driver/plugin/dra.py), behind which a prepare does, cumulatively by LEVEL:

- ``grpc``: nothing; the answer names a fixed device (gRPC's Python server and our servicer).
- ``get``: the claim GET, through the agent's KubeClient (kubeconfig KUBECONFIG: TLS, bearer
  token, the keep-alive path), answered with the device the claim is allocated.
- ``record``: then the claim's record, committed durably through the agent's Checkpoint (group
  commit, fdatasync) under STATE_DIR, opened as the agent opens it (the only instance on its
  state: prepare/state/instances.py); an unprepare appends its removal without a sync, as the
  agent's does.

No CDI spec, no checks, no log line, no metrics: every level is a lower bound of the agent's
cost. Prints ``ready`` once it serves; stops when its standard input closes.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc

from dra_driver._proto.dra_v1 import api_pb2_grpc as v1_grpc
from dra_driver.kube import KubeClient
from dra_driver.plugin.dra import V1Servicer
from dra_driver.plugin.services import _GRPC_WORKERS, _serve
from dra_driver.prepare import ClaimRef, Outcome
from dra_driver.prepare.state.checkpoint import (
    PREPARE_COMPLETED,
    Checkpoint,
    ClaimRecord,
    PreparedDevice,
)
from dra_driver.prepare.state.instances import Instances

LEVELS = ("grpc", "get", "record")


class FloorPreparer:
    """A prepare.ClaimPreparer, as the servicer is given one, doing only what LEVEL names."""

    def __init__(
        self, level: str, *, claims: KubeClient | None, checkpoint: Checkpoint | None
    ) -> None:
        self._level = level
        self._claims = claims
        self._checkpoint = checkpoint

    def prepare_batch(self, refs: Sequence[ClaimRef]) -> dict[str, Outcome]:
        return {r.uid: Outcome(devices=self._prepare(r)) for r in refs}

    def unprepare_batch(self, refs: Sequence[ClaimRef]) -> dict[str, Outcome]:
        if self._checkpoint is not None:
            gone = {r.uid for r in refs}
            self._checkpoint.transact(
                lambda claims: [claims.discard(uid) for uid in gone], durable=False
            )
        return {r.uid: Outcome() for r in refs}

    def _prepare(self, ref: ClaimRef) -> tuple[PreparedDevice, ...]:
        request, pool, device = "gpus", "floor", "gpu-0"
        if self._claims is not None:
            claim = self._claims.get_resource_claim(namespace=ref.namespace, name=ref.name)
            if claim is None:
                raise LookupError(f"ResourceClaim {ref.namespace}/{ref.name} does not exist")
            result = claim["status"]["allocation"]["devices"]["results"][0]
            request, pool, device = result["request"], result["pool"], result["device"]
        devices = (
            PreparedDevice(
                request_names=(request,),
                pool=pool,
                device=device,
                cdi_device_ids=(f"k8s.gpu.nvidia.com/claim={ref.uid}-{device}",),
            ),
        )
        if self._checkpoint is not None:
            record = ClaimRecord(
                uid=ref.uid,
                namespace=ref.namespace,
                name=ref.name,
                phase=PREPARE_COMPLETED,
                devices=devices,
            )

            def put(claims: Any) -> None:
                claims[ref.uid] = record

            self._checkpoint.transact(put)
        return devices


def main(argv: list[str]) -> int:
    level, socket, state_dir = argv[0], Path(argv[1]), Path(argv[2])
    if level not in LEVELS:
        sys.exit(f"level {level!r}: one of {', '.join(LEVELS)}")
    claims = None
    if level != "grpc":
        claims = KubeClient.from_config(kubeconfig=Path(argv[3]))
    checkpoint = None
    instances = Instances(state_dir / "instances.lock")
    if level == "record":
        # as the agent opens its checkpoint: alone on its state, so solo (instances.py)
        instances.open()
        checkpoint = Checkpoint(state_dir / "checkpoint.json", instances=instances)
        checkpoint.open()
        instances.allow_solo()
    preparer = FloorPreparer(level, claims=claims, checkpoint=checkpoint)
    # the agent's server (plugin/services.py serve_dra) and servicer
    server = grpc.server(
        ThreadPoolExecutor(max_workers=_GRPC_WORKERS, thread_name_prefix="dra-grpc")
    )
    v1_grpc.add_DRAPluginServicer_to_server(V1Servicer(preparer), server)
    _serve(server, socket)
    print("ready", flush=True)
    sys.stdin.read()
    server.stop(grace=1).wait()
    if checkpoint is not None:
        checkpoint.close()
    instances.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
