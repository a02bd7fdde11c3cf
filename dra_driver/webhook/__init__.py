"""The validating admission webhook for this driver's opaque configs (``gpu-dra-webhook``).

Off by default, like NVIDIA's (chart value ``webhook.enabled``). The API server sends it each
ResourceClaim and ResourceClaimTemplate that is created or updated; every opaque config whose
``driver`` is this driver is decoded with the agent's own strict decoding
(prepare/deviceconfig.py), so a bad ``GpuConfig`` or ``MigDeviceConfig`` is refused when the claim
is written instead of at prepare time on the node. ``review`` is the pure part (AdmissionReview
in, AdmissionReview out); ``server`` the HTTPS endpoint and its command line. A wing of its own,
run as a separate Deployment: the node agent never loads it.
"""
