"""The ResourceClaim GET of every prepare.

Place in the flow: the plugin's NodePrepareResources (prepare/__init__.py) reads each claim here
to learn its allocation. The only call on the prepare path, so it goes over the keep-alive
connections (connection.py ``_get``); the claim comes back in v1 shape (conversion.py).
"""

from __future__ import annotations

from dra_driver.errors import KubeNotFound
from dra_driver.kube.connection import ApiConnection
from dra_driver.kube.conversion import claim_to_v1
from dra_driver.resourceapi import GROUP, JsonDict


class ResourceClaimCalls(ApiConnection):
    """The ResourceClaim call of :class:`~dra_driver.kube.client.KubeClient`."""

    def get_resource_claim(self, *, namespace: str, name: str) -> JsonDict | None:
        """The ResourceClaim in v1 shape, or None if it does not exist."""
        version = self.resource_api_version
        try:
            claim = self._get(
                f"/apis/{GROUP}/{version}/namespaces/{namespace}/resourceclaims/{name}",
                resource="resourceclaims",
                namespace=namespace,
                name=name,
            )
        except KubeNotFound:
            return None
        return claim_to_v1(claim, api_version=version)
