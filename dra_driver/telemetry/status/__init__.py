"""``gpu-dra status``: every GPU and MIG device with its health, the claim and pod holding it, and
its latest readings, for one node or the whole cluster.

Node-local (the default) reads one agent's ``/metrics`` (``--metrics-url``, by default
``http://127.0.0.1:8080/metrics``, the chart's ``metricsPort`` seen from the node itself or through
``kubectl port-forward``) and shows what that agent reports: its devices (``gpu_dra_gpu_info``),
the claims and pods holding them (``gpu_dra_device_claim_info``, as of the agent's last telemetry
sample), the health state where the agent's health watcher reports one, and the readings.
Cluster-wide (``--kubeconfig``) reads the driver's ResourceSlices, the ResourceClaims and the
agents' pods with the caller's own credentials, and merges in the readings of each agent it can
reach. Output: ``-o table`` (default), ``json`` or ``yaml``; ``--watch N`` shows it again every N
seconds until Ctrl-C.

The flow, one module each:

- ``agent``: one agent's ``/metrics``, read and parsed into rows; the node-local source;
- ``cluster``: slices, claims and the agents' pods through kube/; the cluster-wide source;
- ``report``: the rows and the report both sources build, and its table, JSON and YAML (pure);
- ``command``: the flags, the source they choose, ``--watch``, the exit code (``cli.py`` runs
  its ``main``).
"""
