"""The kubelet-facing side of the node agent: registration and DRA gRPC services on Unix sockets.

``server.KubeletPlugin`` is the entry point: it opens the checkpoint, repairs leftover state,
starts the DRA service (v1, v1beta1, health stream) on ``dra.sock`` and then the registration
service the kubelet discovers. The work itself happens in ``dra_driver.prepare``. The plugin
builds nothing feature-specific: ``settings.PluginSettings`` and the preparer's steps come from
``node/wiring.py``.
"""
