"""Every API call the driver's code can make, as (verb, API group, resource) tables.

The chart's RBAC is checked against these (tests/test_chart.py): the ClusterRole grants exactly
:data:`API_PERMISSIONS`, the namespaced Role exactly :data:`MPS_PERMISSIONS` (and the optional
one in NVIDIA's namespace :data:`NVIDIA_MPS_PERMISSIONS`); the offline tools
(``gpu-dra explain``/``status``) document what their users need. Change a table with the call
that needs it.
"""

from __future__ import annotations

from dra_driver.resourceapi import GROUP

API_PERMISSIONS: frozenset[tuple[str, str, str]] = frozenset(
    {
        ("get", "", "nodes"),
        ("create", "", "events"),
        ("get", "", "pods"),
        ("get", GROUP, "resourceclaims"),
        ("patch", GROUP, "resourceclaims/status"),
        ("list", GROUP, "resourceslices"),
        ("watch", GROUP, "resourceslices"),
        ("create", GROUP, "resourceslices"),
        ("update", GROUP, "resourceslices"),
        ("delete", GROUP, "resourceslices"),
    }
)
"""Every (verb, API group, resource) the node agent requests across the cluster; "" is the core
group. The chart's ClusterRole grants exactly these (``get pods``: the containers of a claim's
pods on the DCGM-compatible telemetry, kube/pods.py; ``patch resourceclaims/status``: the
prepared devices' ``status.devices`` entries, kube/resourceclaims.py). Discovery
(``GET /apis/resource.k8s.io``) is a non-resource URL every authenticated user may read."""

MPS_PERMISSIONS: frozenset[tuple[str, str, str]] = frozenset(
    {
        ("get", "apps", "deployments"),
        ("list", "apps", "deployments"),
        ("create", "apps", "deployments"),
        ("delete", "apps", "deployments"),
    }
)
"""What the node agent requests in its own namespace only: the Deployments that run MPS control
daemons (mpsdaemon.py). The chart's Role grants exactly these."""

NVIDIA_MPS_PERMISSIONS: frozenset[tuple[str, str, str]] = frozenset(
    {("delete", "apps", "deployments")}
)
"""What the node agent requests in NVIDIA's DRA driver's namespace (``--nvidia-namespace``)
only: deleting the MPS Deployment NVIDIA's driver started for a claim adopted from it, at the
claim's unprepare (sharing/mps_step.py). The chart's optional Role there grants exactly this."""

EXPLAIN_PERMISSIONS: frozenset[tuple[str, str, str]] = frozenset(
    {
        ("list", GROUP, "resourceslices"),
        ("list", GROUP, "deviceclasses"),
        ("list", GROUP, "resourceclaims"),
        ("list", GROUP, "devicetaintrules"),
    }
)
"""What ``gpu-dra explain --kubeconfig`` reads, with the user's own credentials (never the
agent's ServiceAccount): every node's slices, the cluster's DeviceClasses, the ResourceClaims of
all namespaces (the devices already in use) and the DeviceTaintRules where served."""

STATUS_PERMISSIONS: frozenset[tuple[str, str, str]] = frozenset(
    {
        ("list", GROUP, "resourceslices"),
        ("list", GROUP, "resourceclaims"),
        ("list", "", "pods"),
    }
)
"""What ``gpu-dra status --kubeconfig`` reads, with the user's own credentials: every node's
slices, the ResourceClaims of all namespaces (which claim holds which device), and the agent's pods
(where their metrics are served). Without the pods it still shows slices and claims."""
