"""The kubelet-facing side of the node agent: registration and DRA gRPC services on Unix sockets.

``kubelet.KubeletPlugin`` serves a ``prepare.ClaimPreparer`` it is given (node/ opens prepare's
state, prepare/state/, and hands it over) and the health it is fed: ``dra.sock`` (the DRA
services, ``dra``, and the health stream, ``health_stream``, on one server: ``services``), then
the registration socket the kubelet discovers (``registration``), named by ``sockets``. It knows
sockets, registration and gRPC; it builds nothing and imports no wing.
"""
