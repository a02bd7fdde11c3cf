"""What the offline tools read of the whole cluster; the node agent never calls these, and
does not load this module (its client is client.py's ``KubeClient``).

Place in the flow: off it. ``gpu-dra explain --kubeconfig`` (scheduling/explain.py) reads every
node's ResourceSlices, the DeviceClasses, all ResourceClaims and the DeviceTaintRules where
served; ``gpu-dra status --kubeconfig`` (telemetry/status/cluster.py) also lists the agent's
pods. They run with the user's own credentials (permissions.py ``EXPLAIN_PERMISSIONS``,
``STATUS_PERMISSIONS``).
"""

from __future__ import annotations

from dra_driver.kube.client import KubeClient
from dra_driver.kube.connection import ApiConnection
from dra_driver.kube.conversion import claim_to_v1
from dra_driver.kube.resourceslices import v1_slices
from dra_driver.resourceapi import (
    DEVICE_CLASS,
    DEVICE_TAINT_RULE,
    DEVICE_TAINT_RULE_VERSIONS,
    GROUP,
    RESOURCE_CLAIM,
    JsonDict,
)


class ClusterReads(ApiConnection):
    """The cluster-wide reads of :class:`ClusterClient`."""

    def list_all_slices(self) -> list[JsonDict]:
        """Every ResourceSlice of the cluster (all nodes, all drivers), v1 shape, sorted by name:
        what the scheduler sees. For ``gpu-dra explain``; the agent never calls it."""
        version = self.resource_api_version
        path = f"/apis/{GROUP}/{version}/resourceslices"
        data = self._request("GET", path, verb="list", resource="resourceslices")
        return v1_slices(data, api_version=version)

    def list_device_classes(self) -> list[JsonDict]:
        """Every DeviceClass of the cluster as served (v1beta1 classes have the v1 shape)."""
        return self._list_typed(self.resource_api_version, "deviceclasses", DEVICE_CLASS)

    def _list_typed(self, version: str, resource: str, kind: str) -> list[JsonDict]:
        """Every ``resource`` of the cluster as ``version`` serves it, each with the
        ``apiVersion`` and ``kind`` a list's items leave out."""
        data = self._request(
            "GET", f"/apis/{GROUP}/{version}/{resource}", verb="list", resource=resource
        )
        items: list[JsonDict] = list(data.get("items") or ())
        for item in items:
            item.setdefault("apiVersion", f"{GROUP}/{version}")
            item.setdefault("kind", kind)
        return items

    def list_resource_claims(self) -> list[JsonDict]:
        """Every ResourceClaim of the cluster (all namespaces), v1 shape, sorted by (namespace,
        name), status included: what the scheduler counts as in use. For ``gpu-dra explain``;
        the agent never calls it."""
        version = self.resource_api_version
        data = self._request(
            "GET", f"/apis/{GROUP}/{version}/resourceclaims", verb="list", resource="resourceclaims"
        )
        claims = []
        for item in data.get("items") or ():
            claim = claim_to_v1(item, api_version=version)
            claim.setdefault("kind", RESOURCE_CLAIM)
            claims.append(claim)
        return sorted(
            claims,
            key=lambda c: (
                str(c.get("metadata", {}).get("namespace", "")),
                str(c.get("metadata", {}).get("name", "")),
            ),
        )

    def list_device_taint_rules(self) -> list[JsonDict] | None:
        """Every DeviceTaintRule of the cluster, sorted by name, or None when the cluster serves
        none (the DRADeviceTaintRules gate is off, or Kubernetes < 1.33). The served version is
        found by discovery (:data:`DEVICE_TAINT_RULE_VERSIONS`); the fields explain uses
        (``spec.deviceSelector``, ``spec.taint``) have the same shape in all of them. For
        ``gpu-dra explain``; the agent never calls it."""
        group = self._request("GET", f"/apis/{GROUP}", verb="get", resource=GROUP)
        served = {str(v.get("version")) for v in group.get("versions") or ()}
        for version in DEVICE_TAINT_RULE_VERSIONS:
            if version not in served:
                continue
            resources = self._request("GET", f"/apis/{GROUP}/{version}", verb="get", resource=GROUP)
            names = {str(r.get("name")) for r in resources.get("resources") or ()}
            if "devicetaintrules" not in names:
                continue
            items = self._list_typed(version, "devicetaintrules", DEVICE_TAINT_RULE)
            return sorted(items, key=lambda r: str(r.get("metadata", {}).get("name", "")))
        return None

    def list_pods(self, *, label_selector: str, namespace: str = "") -> list[JsonDict]:
        """The pods matching ``label_selector``, in ``namespace`` or (empty) all namespaces,
        sorted by (namespace, name). For ``gpu-dra status`` (the agent's pods, for their metrics
        endpoints); the agent never calls it."""
        path = f"/api/v1/namespaces/{namespace}/pods" if namespace else "/api/v1/pods"
        data = self._request(
            "GET",
            path,
            query={"labelSelector": label_selector},
            verb="list",
            resource="pods",
            namespace=namespace,
        )
        items: list[JsonDict] = list(data.get("items") or ())
        return sorted(
            items,
            key=lambda p: (
                str(p.get("metadata", {}).get("namespace", "")),
                str(p.get("metadata", {}).get("name", "")),
            ),
        )


class ClusterClient(KubeClient, ClusterReads):
    """:class:`~dra_driver.kube.client.KubeClient` with the cluster-wide reads, for ``gpu-dra
    explain`` and ``gpu-dra status``. Thread-safe; connect with :meth:`from_config`."""
