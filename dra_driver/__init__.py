"""gpu-dra: a Kubernetes DRA driver for NVIDIA GPUs (drop-in for gpu.nvidia.com).

The node agent is one flow, and the modules read in that order:

    gpus/ (NVML or simulated GPUs) -> devices -> slices -> publisher/kube
        -> plugin/ (kubelet sockets) -> prepare -> cdi + checkpoint

scheduling/ holds what the kube-scheduler would do, offline: its CEL environment (cel/, one module
per part), the environment per Kubernetes version, and the allocator (``gpu-dra explain``).
"""

__version__ = "0.1.0"
