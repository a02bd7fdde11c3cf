"""The Pods a prepared claim is reserved for: one GET each, for telemetry.

Place in the flow: telemetry/holders.py's ``PodMapper`` reads each pod of a claim's
``status.reservedFor`` once (at the next sampling pass after the prepare, or after a reconcile
finds another pod) to label the DCGM-compatible series with the containers that use the claim;
the chart's ClusterRole grants ``get pods`` for it (permissions.py ``API_PERMISSIONS``).
"""

from __future__ import annotations

from dra_driver.errors import KubeNotFound
from dra_driver.kube.connection import ApiConnection
from dra_driver.resourceapi import JsonDict


class PodCalls(ApiConnection):
    """The core/v1 Pod call of :class:`~dra_driver.kube.client.KubeClient`."""

    def get_pod(self, namespace: str, name: str) -> JsonDict | None:
        """The Pod, or None when it does not exist; KubeError when it cannot be read. Over the
        keep-alive connections of the claim GET where the configuration allows (its bounded
        timeout: the sampling pass that asks waits for it)."""
        try:
            pod: JsonDict = self._get(
                f"/api/v1/namespaces/{namespace}/pods/{name}",
                resource="pods",
                namespace=namespace,
                name=name,
            )
        except KubeNotFound:
            return None
        return pod
