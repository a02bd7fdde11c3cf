"""ResourceSlice calls: list, watch, create, update and delete this node's slices.

Place in the flow: publish/publisher.py keeps the API server's slices equal to the ones
publish/slices.py builds, through these calls. Bodies go out and come back in v1 shape,
converted to and from the served version (conversion.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dra_driver.errors import KubeNotFound
from dra_driver.kube.connection import ApiConnection
from dra_driver.kube.conversion import convert_slice, slice_to_v1
from dra_driver.kube.watch import WatchStream
from dra_driver.resourceapi import GROUP, JsonDict

_WATCH_READ_MARGIN_S = 15.0


@dataclass(frozen=True)
class SliceList:
    """Our ResourceSlices (v1 shape) and the list's resourceVersion to start a watch from."""

    items: tuple[JsonDict, ...]
    resource_version: str


def v1_slices(listing: Mapping[str, Any], *, api_version: str) -> list[JsonDict]:
    """The items of a ResourceSlice list read in ``api_version``, in v1 shape, sorted by name."""
    return sorted(
        (slice_to_v1(item, api_version=api_version) for item in listing.get("items") or ()),
        key=lambda s: str(s.get("metadata", {}).get("name", "")),
    )


class ResourceSliceCalls(ApiConnection):
    """The ResourceSlice calls of :class:`~dra_driver.kube.client.KubeClient`."""

    def _slices_path(self, name: str = "") -> str:
        base = f"/apis/{GROUP}/{self.resource_api_version}/resourceslices"
        return f"{base}/{name}" if name else base

    @staticmethod
    def _slice_selector(driver_name: str, node_name: str) -> str:
        return f"spec.driver={driver_name},spec.nodeName={node_name}"

    def list_slices(self, *, driver_name: str, node_name: str) -> SliceList:
        """Our driver's slices on our node (field selector), v1 shape, sorted by name."""
        data = self._request(
            "GET",
            self._slices_path(),
            query={"fieldSelector": self._slice_selector(driver_name, node_name)},
            verb="list",
            resource="resourceslices",
        )
        return SliceList(
            items=tuple(v1_slices(data, api_version=self.resource_api_version)),
            resource_version=str(data.get("metadata", {}).get("resourceVersion", "")),
        )

    def watch_slices(
        self, *, driver_name: str, node_name: str, resource_version: str, timeout_s: int = 300
    ) -> WatchStream:
        """Open a watch of our slices from ``resource_version``; the server ends it after
        ``timeout_s``. Raises KubeGone at once when the version is already too old."""
        response = self._request(
            "GET",
            self._slices_path(),
            query={
                "fieldSelector": self._slice_selector(driver_name, node_name),
                "watch": "true",
                "resourceVersion": resource_version,
                "allowWatchBookmarks": "true",
                "timeoutSeconds": str(timeout_s),
            },
            verb="watch",
            resource="resourceslices",
            stream=True,
            timeout=(self._connect_timeout_s, timeout_s + _WATCH_READ_MARGIN_S),
        )
        return WatchStream(response, resource="resourceslices", convert=slice_to_v1)

    def create_slice(self, body: Mapping[str, Any]) -> JsonDict:
        """Create a slice (``metadata.generateName`` set); returns what the server stored."""
        stored = self._request(
            "POST",
            self._slices_path(),
            body=convert_slice(body, api_version=self.resource_api_version),
            verb="create",
            resource="resourceslices",
        )
        return slice_to_v1(stored)

    def update_slice(self, body: Mapping[str, Any]) -> JsonDict:
        """Replace a slice; ``metadata.resourceVersion`` must be current (else KubeConflict)."""
        name = str(body["metadata"]["name"])
        stored = self._request(
            "PUT",
            self._slices_path(name),
            body=convert_slice(body, api_version=self.resource_api_version),
            verb="update",
            resource="resourceslices",
            name=name,
        )
        return slice_to_v1(stored)

    def delete_slice(self, *, name: str, uid: str, resource_version: str) -> bool:
        """Delete a slice if it is still the object we saw (uid + resourceVersion preconditions).

        Returns False if it was already gone; a changed object raises KubeConflict.
        """
        preconditions = {
            k: v for k, v in (("uid", uid), ("resourceVersion", resource_version)) if v
        }
        try:
            self._request(
                "DELETE",
                self._slices_path(name),
                body={"kind": "DeleteOptions", "apiVersion": "v1", "preconditions": preconditions},
                verb="delete",
                resource="resourceslices",
                name=name,
            )
        except KubeNotFound:
            return False
        return True
