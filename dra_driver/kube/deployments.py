"""The Deployments that run MPS control daemons, in the agent's own namespace.

Place in the flow: sharing/mpsdaemon.py starts one per GPU shared with MPS and deletes it when
the last claim goes; the chart's Role (permissions.py ``MPS_PERMISSIONS``) grants these calls.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dra_driver.errors import KubeNotFound
from dra_driver.kube.connection import ApiConnection
from dra_driver.resourceapi import JsonDict


class DeploymentCalls(ApiConnection):
    """The apps/v1 Deployment calls of :class:`~dra_driver.kube.client.KubeClient`."""

    def get_deployment(self, *, namespace: str, name: str) -> JsonDict | None:
        """The apps/v1 Deployment, or None when it does not exist."""
        try:
            found: JsonDict = self._request(
                "GET",
                f"/apis/apps/v1/namespaces/{namespace}/deployments/{name}",
                verb="get",
                resource="deployments",
                namespace=namespace,
                name=name,
            )
        except KubeNotFound:
            return None
        return found

    def list_deployments(self, *, namespace: str, label_selector: str) -> list[JsonDict]:
        data = self._request(
            "GET",
            f"/apis/apps/v1/namespaces/{namespace}/deployments",
            query={"labelSelector": label_selector},
            verb="list",
            resource="deployments",
            namespace=namespace,
        )
        return list(data.get("items") or ())

    def create_deployment(self, *, namespace: str, body: Mapping[str, Any]) -> JsonDict:
        created: JsonDict = self._request(
            "POST",
            f"/apis/apps/v1/namespaces/{namespace}/deployments",
            body=body,
            verb="create",
            resource="deployments",
            namespace=namespace,
            name=str(body.get("metadata", {}).get("name", "")),
        )
        return created

    def delete_deployment(self, *, namespace: str, name: str) -> bool:
        """Delete the Deployment and its pods (in the background); False when it was gone."""
        try:
            self._request(
                "DELETE",
                f"/apis/apps/v1/namespaces/{namespace}/deployments/{name}",
                body={"propagationPolicy": "Background"},
                verb="delete",
                resource="deployments",
                namespace=namespace,
                name=name,
            )
        except KubeNotFound:
            return False
        return True
