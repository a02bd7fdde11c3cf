"""The DRA node services v1 and v1beta1 (spec B): gRPC messages <-> prepare.py.

Both versions have the same semantics; v1beta1 has no ``share_id``. Every claim of a request gets
an entry in the answer (the kubelet treats a missing entry as an error), per-claim failures go in
that entry's ``error``; an RPC never fails as a whole because of one claim.
"""

from __future__ import annotations

from collections.abc import Iterable

from dra_driver._proto.dra_v1 import api_pb2 as v1_pb2
from dra_driver._proto.dra_v1 import api_pb2_grpc as v1_grpc
from dra_driver._proto.dra_v1beta1 import api_pb2 as v1beta1_pb2
from dra_driver._proto.dra_v1beta1 import api_pb2_grpc as v1beta1_grpc
from dra_driver.prepare import ClaimRef, Preparer

_Claim = v1_pb2.Claim | v1beta1_pb2.Claim


def _refs(claims: Iterable[_Claim]) -> list[ClaimRef]:
    return [ClaimRef(namespace=c.namespace, name=c.name, uid=c.uid) for c in claims]


class V1Servicer(v1_grpc.DRAPluginServicer):
    def __init__(self, preparer: Preparer) -> None:
        self._preparer = preparer

    def NodePrepareResources(  # noqa: N802
        self, request: v1_pb2.NodePrepareResourcesRequest, context: object
    ) -> v1_pb2.NodePrepareResourcesResponse:
        response = v1_pb2.NodePrepareResourcesResponse()
        for uid, outcome in self._preparer.prepare_batch(_refs(request.claims)).items():
            entry = response.claims[uid]
            if outcome.error:
                entry.error = outcome.error
                continue
            for d in outcome.devices:
                device = entry.devices.add(
                    request_names=list(d.request_names),
                    pool_name=d.pool,
                    device_name=d.device,
                    cdi_device_ids=list(d.cdi_device_ids),
                )
                if d.share_id is not None:
                    device.share_id = d.share_id
        return response

    def NodeUnprepareResources(  # noqa: N802
        self, request: v1_pb2.NodeUnprepareResourcesRequest, context: object
    ) -> v1_pb2.NodeUnprepareResourcesResponse:
        response = v1_pb2.NodeUnprepareResourcesResponse()
        for uid, outcome in self._preparer.unprepare_batch(_refs(request.claims)).items():
            response.claims[uid].error = outcome.error
        return response


class V1beta1Servicer(v1beta1_grpc.DRAPluginServicer):
    def __init__(self, preparer: Preparer) -> None:
        self._preparer = preparer

    def NodePrepareResources(  # noqa: N802
        self, request: v1beta1_pb2.NodePrepareResourcesRequest, context: object
    ) -> v1beta1_pb2.NodePrepareResourcesResponse:
        response = v1beta1_pb2.NodePrepareResourcesResponse()
        for uid, outcome in self._preparer.prepare_batch(_refs(request.claims)).items():
            entry = response.claims[uid]
            if outcome.error:
                entry.error = outcome.error
                continue
            for d in outcome.devices:
                entry.devices.add(
                    request_names=list(d.request_names),
                    pool_name=d.pool,
                    device_name=d.device,
                    cdi_device_ids=list(d.cdi_device_ids),
                )
        return response

    def NodeUnprepareResources(  # noqa: N802
        self, request: v1beta1_pb2.NodeUnprepareResourcesRequest, context: object
    ) -> v1beta1_pb2.NodeUnprepareResourcesResponse:
        response = v1beta1_pb2.NodeUnprepareResourcesResponse()
        for uid, outcome in self._preparer.unprepare_batch(_refs(request.claims)).items():
            response.claims[uid].error = outcome.error
        return response
