"""The ResourceClaim GET of every prepare, and the driver's part of a claim's status.

Place in the flow: the plugin's NodePrepareResources (prepare/__init__.py) reads each claim here
to learn its allocation. The only call on the prepare path, so it goes over the keep-alive
connections (connection.py ``_get``); the claim comes back in v1 shape (conversion.py). After
the answer, claimstatus/ writes the prepared devices' ``status.devices`` entries here (KEP-4817)
with server-side apply, off the prepare path.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dra_driver.errors import KubeNotFound
from dra_driver.kube.connection import ApiConnection
from dra_driver.kube.conversion import claim_to_v1
from dra_driver.resourceapi import GROUP, JsonDict

APPLY_PATCH = "application/apply-patch+yaml"  # server-side apply (JSON is YAML)


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

    def apply_resource_claim_status(
        self,
        *,
        namespace: str,
        name: str,
        uid: str,
        devices: Sequence[Mapping[str, Any]],
        field_manager: str,
    ) -> bool:
        """Server-side apply of this driver's ``status.devices`` entries of the claim (KEP-4817):
        the entries ``field_manager`` applied before and does not send now are removed, other
        drivers' entries are kept; ``devices=()`` removes all of ours. ``uid`` guards against a
        claim re-created under the same name (409). Returns False when the claim is gone."""
        version = self.resource_api_version
        body = {
            "apiVersion": f"{GROUP}/{version}",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": namespace, "uid": uid},
            "status": {"devices": [dict(d) for d in devices]},
        }
        try:
            self._apply(
                f"/apis/{GROUP}/{version}/namespaces/{namespace}/resourceclaims/{name}/status",
                query={"fieldManager": field_manager, "force": "true"},
                body=body,
                content_type=APPLY_PATCH,
                resource="resourceclaims/status",
                namespace=namespace,
                name=name,
            )
        except KubeNotFound:
            return False
        return True
