"""GPU telemetry: the sampler that reads every device's utilisation, memory, temperature and
power for ``/metrics`` (with the claim and pod holding it), and ``gpu-dra status``."""
