"""The Node the agent runs on, and Events about it.

Place in the flow: the agent reads its Node at start (its UID owns our ResourceSlices), and the
health monitor and the plugin record Events on it (shown by ``kubectl describe node``).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Literal

from dra_driver.kube.connection import ApiConnection
from dra_driver.resourceapi import JsonDict

EventType = Literal["Normal", "Warning"]


class NodeCalls(ApiConnection):
    """The Node and Event calls of :class:`~dra_driver.kube.client.KubeClient`."""

    def get_node(self, name: str) -> JsonDict:
        """The Node object; KubeNotFound if it does not exist."""
        node: JsonDict = self._request(
            "GET", f"/api/v1/nodes/{name}", verb="get", resource="nodes", name=name
        )
        return node

    def create_event(
        self,
        *,
        node_name: str,
        node_uid: str,
        reason: str,
        message: str,
        event_type: EventType = "Warning",
        component: str = "gpu-dra-kubelet-plugin",
        namespace: str = "default",
    ) -> JsonDict:
        """Record a core/v1 Event about the Node (shown by ``kubectl describe node``)."""
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{node_name}.", "namespace": namespace},
            "involvedObject": {
                "apiVersion": "v1",
                "kind": "Node",
                "name": node_name,
                "uid": node_uid,
            },
            "reason": reason,
            "message": message,
            "type": event_type,
            "source": {"component": component, "host": node_name},
            "reportingComponent": component,
            "reportingInstance": node_name,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        event: JsonDict = self._request(
            "POST",
            f"/api/v1/namespaces/{namespace}/events",
            body=body,
            verb="create",
            resource="events",
            namespace=namespace,
        )
        return event
