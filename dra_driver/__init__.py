"""gpu-dra: a Kubernetes DRA driver for NVIDIA GPUs (drop-in for gpu.nvidia.com).

The node agent is one flow, and the packages read in that order:

    gpus/ (NVML) -> devices/ -> publish/ (ResourceSlices, through kube/) -> plugin/ (kubelet
        sockets) -> prepare/ (steps: sharing/, mig/) -> cdi/ (CDI specs) + the checkpoint

node/ wires the flow into one process; health/ and telemetry/ watch the GPUs beside it;
scheduling/ is what the kube-scheduler would do, offline (``gpu-dra explain``); sim/ holds every
stand-in (simulated NVML, local API server and kubelet, the demo). docs/architecture.md has the
map and the rules between the packages.
"""

__version__ = "0.1.0"
