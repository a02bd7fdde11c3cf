"""GPU health: pure decisions (NVML observations -> conditions -> device taints) and the
monitor loop that applies them (taints on the slices, the kubelet's health stream, Node Events)."""
