"""The two gRPC servers of the plugin: what each socket serves, and how it listens (spec A.3, B.2).

``dra.sock``: the DRA node service in v1 and v1beta1 (dra.py) and the health stream in v1 and
v1alpha1 (health_stream.py), all on one server as the reference helper does. The registration
socket: ``pluginregistration.Registration`` (registration.py), advertising every service above
in the order the kubelet expects. kubelet.KubeletPlugin starts dra.sock first, then registration.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from dra_driver._proto.dra_v1 import api_pb2_grpc as v1_grpc
from dra_driver._proto.dra_v1beta1 import api_pb2_grpc as v1beta1_grpc
from dra_driver._proto.health_v1 import api_pb2_grpc as health_v1_grpc
from dra_driver._proto.health_v1alpha1 import api_pb2_grpc as health_v1alpha1_grpc
from dra_driver._proto.pluginregistration_v1 import api_pb2_grpc as reg_grpc
from dra_driver.errors import DraError
from dra_driver.plugin import sockets
from dra_driver.plugin.dra import Told, V1beta1Servicer, V1Servicer
from dra_driver.plugin.health_stream import HealthFeed, V1alpha1HealthServicer, V1HealthServicer
from dra_driver.plugin.registration import DRA_SERVICES, HEALTH_SERVICES, RegistrationServicer
from dra_driver.prepare import ClaimPreparer

if TYPE_CHECKING:
    from dra_driver.metrics import DriverMetrics

# Threads serving dra.sock: the kubelet's calls, 8 at a time, plus the health streams it holds
# (one; two for a moment across a kubelet restart: a closed stream lets its thread go at its next
# report), each for its lifetime. Calls beyond wait in gRPC's queue, never fail, and lose nothing
# by it: the calls share one interpreter lock, so more threads add no throughput (prepares/s at
# concurrency 16 against 20 threads, two agents taking turns in one run: 0.993-1.007), only memory
# (each thread's stack and state: 20 threads held 0.4 MiB more after bursts of 16 calls;
# docs/benchmarks.md, "Ninth pass").
_GRPC_WORKERS = 10

ADVERTISED_VERSIONS = (*DRA_SERVICES, *HEALTH_SERVICES)
"""GetInfo's ``supported_versions``: the DRA services first (the kubelet takes the first it
knows), then the health services (chosen apart)."""


def serve_dra(
    *,
    preparer: ClaimPreparer,
    metrics: DriverMetrics | None,
    health: HealthFeed,
    path: Path,
    told: Told | None = None,
) -> grpc.Server:
    """Serve DRA v1 + v1beta1 and health v1 + v1alpha1 on ``path`` (a stale socket there is
    replaced), telling ``told`` of the claims answered for. Raises DraError when it cannot
    listen."""
    server = grpc.server(
        ThreadPoolExecutor(max_workers=_GRPC_WORKERS, thread_name_prefix="dra-grpc")
    )
    v1_grpc.add_DRAPluginServicer_to_server(V1Servicer(preparer, metrics, told), server)
    v1beta1_grpc.add_DRAPluginServicer_to_server(V1beta1Servicer(preparer, metrics, told), server)
    health_v1_grpc.add_DRAResourceHealthServicer_to_server(V1HealthServicer(health), server)
    health_v1alpha1_grpc.add_DRAResourceHealthServicer_to_server(
        V1alpha1HealthServicer(health), server
    )
    return _serve(server, path)


def serve_registration(registration: RegistrationServicer, path: Path) -> grpc.Server:
    """Serve ``registration`` on ``path`` (a stale socket there is replaced)."""
    server = grpc.server(ThreadPoolExecutor(max_workers=4, thread_name_prefix="reg-grpc"))
    reg_grpc.add_RegistrationServicer_to_server(registration, server)
    return _serve(server, path)


def _serve(server: grpc.Server, path: Path) -> grpc.Server:
    sockets.remove_stale(path)
    try:
        bound = server.add_insecure_port(f"unix://{path}")
    except RuntimeError as exc:
        raise DraError(f"cannot listen on {path}: {exc}") from exc
    if bound == 0:
        raise DraError(f"cannot listen on {path}")
    server.start()
    return server
