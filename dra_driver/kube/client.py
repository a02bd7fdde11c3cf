"""KubeClient: every API call the node agent makes, on one connection.

Place in the flow: built once by the node agent and handed to the publisher, the preparer, the
health monitor and the MPS daemons. Each group of calls lives in its own module; this class only
puts them together on the shared :class:`~dra_driver.kube.connection.ApiConnection`. The offline
tools (``gpu-dra explain``/``status``) use clusterreads.py's ``ClusterClient``, this client plus
the cluster-wide reads the agent never makes (and whose module it does not load).
"""

from __future__ import annotations

from dra_driver.kube.deployments import DeploymentCalls
from dra_driver.kube.nodes import NodeCalls
from dra_driver.kube.pods import PodCalls
from dra_driver.kube.resourceclaims import ResourceClaimCalls
from dra_driver.kube.resourceslices import ResourceSliceCalls


class KubeClient(ResourceSliceCalls, ResourceClaimCalls, NodeCalls, PodCalls, DeploymentCalls):
    """Typed access to the few API calls the node agent makes. Thread-safe.

    Connect with :meth:`from_config`; every call raises a KubeError subclass on failure (see
    :class:`~dra_driver.kube.connection.ApiConnection`). Everything crosses as plain JSON dicts
    in resource.k8s.io/v1 shape, whichever version the server serves.
    """
