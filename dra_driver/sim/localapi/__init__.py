"""A small Kubernetes API server on 127.0.0.1 for `make demo` and tests, used by the real client.

It implements just what the driver uses, with the semantics the driver relies on:

* discovery: ``/api``, ``/apis``, ``/apis/resource.k8s.io``, ``/apis/resource.k8s.io/<v>``; the
  served resource.k8s.io versions are configurable (``versions=("v1beta1",)`` mimics 1.32);
* ResourceSlices (cluster-scoped; v1, v1beta2 and v1beta1, whose devices are wrapped in ``basic``),
  ResourceClaims (namespaced; v1beta1 requests flat instead of under ``exactly``), DeviceClasses,
  Nodes, Events, Pods (as given; ``gpu-dra status`` lists the agent's), apps/v1 Deployments
  (stored as given; localkubelet.py runs the pods of those pinned to a node); DeviceTaintRules
  only in the versions given as ``device_taint_rule_versions``
  (none by default, as on a cluster whose DRADeviceTaintRules gate is off; ``("v1alpha3",)``
  mimics 1.33-1.35 with the gate on);
* list with ``fieldSelector`` (``spec.driver``, ``spec.nodeName``, ``spec.pool.name``,
  ``metadata.name``) and ``labelSelector`` (``k=v``, ``k!=v``, ``k``); watch as a chunked JSON event
  stream from a resourceVersion (ADDED/MODIFIED/DELETED, BOOKMARK when asked, an ERROR event with
  410 when the version is older than the compacted history, see :meth:`FakeKubeApi.compact`);
* create with ``generateName`` (random suffix, truncated like the real name generator), update
  with resourceVersion conflicts (409), delete with uid/resourceVersion preconditions;
* a ResourceSlice validation subset (limits of spec D.1), answered with 422 like the real server;
  taints get ``timeAdded`` on write, as the real server does;
* fault injection per (verb, resource): :meth:`FakeKubeApi.fail` and :meth:`FakeKubeApi.forbid`;
  :meth:`FakeKubeApi.drop_fields` simulates a feature gate being off (fields silently not stored);
* a request log of (verb, resource, namespace, name) in :attr:`FakeKubeApi.requests`, and a count
  of the connections clients opened in :attr:`FakeKubeApi.connections_accepted`.

Objects are stored in v1 shape and converted per request. This package does not import the
driver: conversions and checks here are written independently, so tests compare two readings of
the API rather than one with itself.

Modules, in the order a request meets them: ``server`` (``FakeKubeApi``: lifecycle, test
controls, storage) -> ``handler`` (the HTTP handler: dispatch, the verbs, watch) -> ``routing``
(discovery documents, path -> resource, method -> verb) -> ``resources`` (the resources served:
kind, group, scope; errors as Status) -> ``selectors`` (field and label selectors) ->
``conversion`` (v1 storage <-> the request's version) -> ``slices`` (ResourceSlice admission:
validation, immutable fields, taint times); ``store`` holds the state (objects, history, faults,
the request log) and ``clientconfig`` how clients reach the server (TLS certificate, kubeconfig,
the in-cluster environment of a Pod).
"""

from __future__ import annotations

from dra_driver.sim.localapi.clientconfig import AGENT_INTERPRETER_ENV
from dra_driver.sim.localapi.handler import Handler as _Handler
from dra_driver.sim.localapi.resources import ALL_VERSIONS, GROUP, ApiError, JsonDict, group_of
from dra_driver.sim.localapi.server import FakeKubeApi, free_port
from dra_driver.sim.localapi.slices import validate_slice
from dra_driver.sim.localapi.store import Request

__all__ = [
    "AGENT_INTERPRETER_ENV",
    "ALL_VERSIONS",
    "GROUP",
    "ApiError",
    "FakeKubeApi",
    "JsonDict",
    "Request",
    "_Handler",  # the handler class, by its old name (a test patches its _serve)
    "free_port",
    "group_of",
    "validate_slice",
]
