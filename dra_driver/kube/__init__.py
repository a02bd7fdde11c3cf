"""The one place that talks to the Kubernetes API, through the official ``kubernetes`` client.

Place in the flow: publish/ (publisher.py, its watcher.py) reads and writes ResourceSlices here;
the plugin reads ResourceClaims (NodePrepareResources), the Node, and records Events on the Node.
Everything crosses this boundary as plain JSON dicts in resource.k8s.io/v1 shape, whichever
version the server serves: discovery picks v1, else v1beta2, else v1beta1, and objects are
converted on the way in and out (spec D.0).

- ``connection``: the connection (official client's transport, keep-alive claim GET, discovery)
  and the conversion of every failure into a KubeError;
- ``resourceslices``, ``resourceclaims``, ``nodes``, ``deployments``: the agent's calls, per
  resource; ``client``: :class:`KubeClient`, all of them on one connection;
- ``clusterreads``: the cluster-wide reads of ``gpu-dra explain``/``status`` and their client,
  ``ClusterClient`` (not re-exported here: the agent does not load it);
- ``watch``: a watch stream; ``conversion``: objects between served versions and v1;
- ``permissions``: every (verb, group, resource) the code can use, which the chart's RBAC is
  checked against (by the tests; not re-exported); ``keepalive``: the plain keep-alive
  connections of the claim GET and status apply, with ``http1`` (a request's bytes, its
  response read) and ``tlssettings`` (the official client's TLS settings, their files watched).

This package re-exports the names the rest of the driver imports.
"""

from __future__ import annotations

from dra_driver.kube.client import KubeClient
from dra_driver.kube.connection import DEFAULT_CONNECT_TIMEOUT_S, DEFAULT_TIMEOUT_S, USER_AGENT
from dra_driver.kube.conversion import claim_to_v1
from dra_driver.kube.nodes import EventType
from dra_driver.kube.resourceslices import SliceList
from dra_driver.kube.watch import WatchEvent, WatchStream
from dra_driver.resourceapi import DEVICE_TAINT_RULE_VERSIONS

__all__ = [
    "DEFAULT_CONNECT_TIMEOUT_S",
    "DEFAULT_TIMEOUT_S",
    "DEVICE_TAINT_RULE_VERSIONS",
    "USER_AGENT",
    "EventType",
    "KubeClient",
    "SliceList",
    "WatchEvent",
    "WatchStream",
    "claim_to_v1",
]
