"""Every stand-in, for ``make demo``, tests and users without GPUs or a cluster: the simulated
NVML library (``nvml``, loaded by pynvml in place of the real one), the fake driver tree, the fault
injector, the local API server and kubelet, and the demo. Only ``node`` and the CLI import it."""
