"""The DRA node services v1 and v1beta1 (spec B): gRPC messages <-> a prepare.ClaimPreparer.

Both versions have the same semantics; v1beta1 has no ``share_id``. Every claim of a request gets
an entry in the answer (the kubelet treats a missing entry as an error), per-claim failures go in
that entry's ``error``; an RPC never fails as a whole because of one claim.

With metrics on, each call is counted once (``nvidia_dra_requests_total``), timed around the
whole handler and counted in flight meanwhile; each failed claim counts one error of its type.
An empty request (the agent's own readiness probe; the kubelet never sends one) is not counted,
so probes do not show up as kubelet traffic.

A ``ClaimObserver`` (node/ gives claimstatus/'s reporter) hears of each claim prepared (with its
devices) or unprepared once the answer is built: it must only take note and return at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from dra_driver._proto.dra_v1 import api_pb2 as v1_pb2
from dra_driver._proto.dra_v1 import api_pb2_grpc as v1_grpc
from dra_driver._proto.dra_v1beta1 import api_pb2 as v1beta1_pb2
from dra_driver._proto.dra_v1beta1 import api_pb2_grpc as v1beta1_grpc
from dra_driver.prepare import ClaimPreparer, ClaimRef

if TYPE_CHECKING:
    from dra_driver.metrics import DriverMetrics, RequestMetrics

_Claim = v1_pb2.Claim | v1beta1_pb2.Claim


def _refs(claims: Iterable[_Claim]) -> list[ClaimRef]:
    return [ClaimRef(namespace=c.namespace, name=c.name, uid=c.uid) for c in claims]


class ClaimObserver(Protocol):
    """Told of each claim prepared or unprepared, after the answer is built; never blocks."""

    def prepared(
        self,
        *,
        namespace: str,
        name: str,
        uid: str,
        devices: Sequence[tuple[str, str, str | None]],
    ) -> None:
        """``devices``: (pool, device, share ID) of each device the claim was prepared with."""

    def unprepared(self, *, namespace: str, name: str, uid: str) -> None: ...


class _Servicer:
    """Both versions in one body; a subclass names its message module and whether it has
    ``share_id`` (v1 only, spec B.3)."""

    _pb2: Any
    _share_ids: bool

    def __init__(
        self,
        preparer: ClaimPreparer,
        metrics: DriverMetrics | None = None,
        observer: ClaimObserver | None = None,
    ) -> None:
        self._preparer = preparer
        self._observer = observer
        self._prepare_metrics = metrics.prepare if metrics else None
        self._unprepare_metrics = metrics.unprepare if metrics else None

    def NodePrepareResources(self, request: Any, context: object) -> Any:  # noqa: N802
        return _measured(self._prepare, request, self._prepare_metrics)

    def NodeUnprepareResources(self, request: Any, context: object) -> Any:  # noqa: N802
        return _measured(self._unprepare, request, self._unprepare_metrics)

    def _prepare(self, request: Any, metrics: RequestMetrics | None) -> Any:
        response = self._pb2.NodePrepareResourcesResponse()
        refs = _refs(request.claims)
        by_uid = {r.uid: r for r in refs}
        for uid, outcome in self._preparer.prepare_batch(refs).items():
            entry = response.claims[uid]
            if outcome.error:
                entry.error = outcome.error
                if metrics is not None:
                    metrics.failed(outcome.error_type)
                continue
            if self._observer is not None:
                ref = by_uid[uid]
                self._observer.prepared(
                    namespace=ref.namespace,
                    name=ref.name,
                    uid=uid,
                    devices=[(d.pool, d.device, d.share_id) for d in outcome.devices],
                )
            for d in outcome.devices:
                device = entry.devices.add(
                    request_names=list(d.request_names),
                    pool_name=d.pool,
                    device_name=d.device,
                    cdi_device_ids=list(d.cdi_device_ids),
                )
                if self._share_ids and d.share_id is not None:
                    device.share_id = d.share_id
        return response

    def _unprepare(self, request: Any, metrics: RequestMetrics | None) -> Any:
        response = self._pb2.NodeUnprepareResourcesResponse()
        refs = _refs(request.claims)
        by_uid = {r.uid: r for r in refs}
        for uid, outcome in self._preparer.unprepare_batch(refs).items():
            response.claims[uid].error = outcome.error
            if outcome.error and metrics is not None:
                metrics.failed(outcome.error_type)
            if not outcome.error and self._observer is not None:
                ref = by_uid[uid]
                self._observer.unprepared(namespace=ref.namespace, name=ref.name, uid=uid)
        return response


def _measured(
    handler: Callable[[Any, RequestMetrics | None], Any],
    request: Any,
    metrics: RequestMetrics | None,
) -> Any:
    """``handler(request)``, counted, timed and counted in flight (empty requests are not)."""
    if metrics is None or not request.claims:
        return handler(request, None)
    metrics.started()
    started_s = time.perf_counter()
    try:
        return handler(request, metrics)
    finally:
        metrics.finished(time.perf_counter() - started_s)


class V1Servicer(_Servicer, v1_grpc.DRAPluginServicer):
    _pb2 = v1_pb2
    _share_ids = True


class V1beta1Servicer(_Servicer, v1beta1_grpc.DRAPluginServicer):
    _pb2 = v1beta1_pb2
    _share_ids = False
