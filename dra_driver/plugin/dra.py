"""The DRA node services v1 and v1beta1 (spec B): gRPC messages <-> a prepare.ClaimPreparer.

Both versions have the same semantics; v1beta1 has no ``share_id``. Every claim of a request gets
an entry in the answer (the kubelet treats a missing entry as an error), per-claim failures go in
that entry's ``error``; an RPC never fails as a whole because of one claim.

With metrics on, each call is counted once (``nvidia_dra_requests_total``), timed around the
whole handler and counted in flight meanwhile; each failed claim counts one error of its type.
An empty request (the agent's own readiness probe; the kubelet never sends one) is not counted,
so probes do not show up as kubelet traffic.

Each claim prepared or unprepared is told, through ``Told``, to a ``ClaimObserver`` (the
KubeletPlugin's: ``ClaimLog``, which logs it, then claimstatus/'s reporter when node/ gives one)
after the kubelet's answer is sent: gRPC runs an RPC's callbacks in its server thread once the
RPC's last message is out (``ServicerContext.add_callback``). The log line and the status wish
(about 40 us of the interpreter per claim on this project's VM) are then off the kubelet's wait:
in sequence, two agents side by side, prepare p50 over its floor 0.013-0.036 ms lower and
unprepare's 0.017-0.030 ms, in each of four runs of both slot orders (docs/benchmarks.md,
"Sixth pass"). The claims are told in the order their answers were built, so a claim's
unprepare is never told before its prepare.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from dra_driver._proto.dra_v1 import api_pb2 as v1_pb2
from dra_driver._proto.dra_v1 import api_pb2_grpc as v1_grpc
from dra_driver._proto.dra_v1beta1 import api_pb2 as v1beta1_pb2
from dra_driver._proto.dra_v1beta1 import api_pb2_grpc as v1beta1_grpc
from dra_driver.prepare import ClaimPreparer, ClaimRef, PreparedDevice

if TYPE_CHECKING:
    from dra_driver.metrics import DriverMetrics, RequestMetrics

log = logging.getLogger(__name__)

_Claim = v1_pb2.Claim | v1beta1_pb2.Claim


def _refs(claims: Iterable[_Claim]) -> list[ClaimRef]:
    return [ClaimRef(namespace=c.namespace, name=c.name, uid=c.uid) for c in claims]


class ClaimObserver(Protocol):
    """Told of each claim prepared or unprepared, once the answer is sent (``Told``); never
    blocks."""

    def prepared(
        self,
        *,
        namespace: str,
        name: str,
        uid: str,
        devices: Sequence[tuple[str, str, str | None]],
    ) -> None:
        """``devices``: (pool, device, share ID) of each device the claim was prepared with."""

    def unprepared(
        self,
        *,
        namespace: str,
        name: str,
        uid: str,
        devices: Sequence[tuple[str, str, str | None]] = (),
    ) -> None:
        """``devices``: those the claim held here (none: it was not prepared here)."""


class ClaimLog:
    """A ClaimObserver that logs each claim prepared (``prepared claim``, with its devices) or
    unprepared (``unprepared claim``; a claim that held nothing here is not logged: the
    kubelet's retries of a done unprepare), then tells ``then`` (if any)."""

    def __init__(self, then: ClaimObserver | None = None) -> None:
        self._then = then

    def prepared(
        self,
        *,
        namespace: str,
        name: str,
        uid: str,
        devices: Sequence[tuple[str, str, str | None]],
    ) -> None:
        _log_claim("prepared claim", namespace=namespace, name=name, uid=uid, devices=devices)
        if self._then is not None:
            self._then.prepared(namespace=namespace, name=name, uid=uid, devices=devices)

    def unprepared(
        self,
        *,
        namespace: str,
        name: str,
        uid: str,
        devices: Sequence[tuple[str, str, str | None]] = (),
    ) -> None:
        if devices:
            _log_claim("unprepared claim", namespace=namespace, name=name, uid=uid, devices=devices)
        if self._then is not None:
            self._then.unprepared(namespace=namespace, name=name, uid=uid, devices=devices)


def _log_claim(
    msg: str,
    *,
    namespace: str,
    name: str,
    uid: str,
    devices: Sequence[tuple[str, str, str | None]],
) -> None:
    extra = {
        "claim_uid": uid,
        "claim": f"{namespace}/{name}",
        "devices": [d for _, d, _ in devices],
    }
    log.info(msg, extra=extra)


def _held(devices: Iterable[PreparedDevice]) -> list[tuple[str, str, str | None]]:
    return [(d.pool, d.device, d.share_id) for d in devices]


class Told:
    """Tells ``observer`` of each claim the servicers answered for, in the order the answers
    were built, once they are sent. A servicer queues its claims (``prepared``,
    ``unprepared``) while it builds the answer, then calls ``after_answer`` with the RPC's
    context: the queue is told from gRPC's callback after the RPC is done, or at once without
    a live RPC (a servicer called directly; an RPC cancelled meanwhile). ``flush`` tells what is
    left (the plugin's stop, after its server's). An observer's error is logged, never raised
    into gRPC."""

    def __init__(self, observer: ClaimObserver) -> None:
        self._observer = observer
        self._queue: queue.SimpleQueue[tuple[bool, ClaimRef, tuple[PreparedDevice, ...]]] = (
            queue.SimpleQueue()
        )
        # held while telling: two threads flushing at once keep the queue's order
        self._telling = threading.Lock()

    def prepared(self, ref: ClaimRef, devices: tuple[PreparedDevice, ...]) -> None:
        self._queue.put((True, ref, devices))

    def unprepared(self, ref: ClaimRef, devices: tuple[PreparedDevice, ...]) -> None:
        self._queue.put((False, ref, devices))

    def after_answer(self, context: object) -> None:
        """Tell what is queued once the RPC of ``context`` is done (at once without one)."""
        add_callback = getattr(context, "add_callback", None)
        if add_callback is None or not add_callback(self.flush):
            self.flush()

    def flush(self) -> None:
        observer = self._observer
        with self._telling:
            while True:
                try:
                    prepared, ref, devices = self._queue.get_nowait()
                except queue.Empty:
                    return
                tell = observer.prepared if prepared else observer.unprepared
                try:
                    tell(
                        namespace=ref.namespace, name=ref.name, uid=ref.uid, devices=_held(devices)
                    )
                except Exception:  # an observer must not fail the server
                    log.exception("a claim observer failed", extra={"claim_uid": ref.uid})


class _Servicer:
    """Both versions in one body; a subclass names its message module and whether it has
    ``share_id`` (v1 only, spec B.3)."""

    _pb2: Any
    _share_ids: bool

    def __init__(
        self,
        preparer: ClaimPreparer,
        metrics: DriverMetrics | None = None,
        told: Told | None = None,
    ) -> None:
        self._preparer = preparer
        self._told = told
        self._prepare_metrics = metrics.prepare if metrics else None
        self._unprepare_metrics = metrics.unprepare if metrics else None

    def NodePrepareResources(self, request: Any, context: object) -> Any:  # noqa: N802
        try:
            return _measured(self._prepare, request, self._prepare_metrics)
        finally:
            if self._told is not None:
                self._told.after_answer(context)

    def NodeUnprepareResources(self, request: Any, context: object) -> Any:  # noqa: N802
        try:
            return _measured(self._unprepare, request, self._unprepare_metrics)
        finally:
            if self._told is not None:
                self._told.after_answer(context)

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
            if self._told is not None:
                self._told.prepared(by_uid[uid], outcome.devices)
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
            if not outcome.error and self._told is not None:
                self._told.unprepared(by_uid[uid], outcome.devices)
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
