"""The node agent as a process: wires every part together and supervises its loops.

``agent`` starts discovery, publishing, the kubelet plugin, health and telemetry; ``wiring``
builds the kubelet plugin and the prepare steps the flags ask for; ``config`` is the
validated configuration from flags and environment; ``probes`` and ``http_server`` answer
``/healthz``, ``/readyz`` and ``/metrics``; ``log`` writes structured lines; ``cpuaffinity``
pins the agent to one CPU when asked. Only this package (and the CLI) decides which parts and
which prepare steps exist.
"""
