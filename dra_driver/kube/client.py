"""KubeClient: every API call the driver makes, on one connection.

Place in the flow: built once by the node agent (and by ``gpu-dra explain``/``status``) and
handed to the publisher, the preparer, the health monitor and the MPS daemons. Each group of
calls lives in its own module; this class only puts them together on the shared
:class:`~dra_driver.kube.connection.ApiConnection`.
"""

from __future__ import annotations

from dra_driver.kube.clusterreads import ClusterReads
from dra_driver.kube.deployments import DeploymentCalls
from dra_driver.kube.nodes import NodeCalls
from dra_driver.kube.resourceclaims import ResourceClaimCalls
from dra_driver.kube.resourceslices import ResourceSliceCalls


class KubeClient(ResourceSliceCalls, ResourceClaimCalls, NodeCalls, DeploymentCalls, ClusterReads):
    """Typed access to the few API calls the driver makes. Thread-safe.

    Connect with :meth:`from_config`; every call raises a KubeError subclass on failure (see
    :class:`~dra_driver.kube.connection.ApiConnection`). Everything crosses as plain JSON dicts
    in resource.k8s.io/v1 shape, whichever version the server serves.
    """
