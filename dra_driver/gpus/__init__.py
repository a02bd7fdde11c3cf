"""GPU discovery: NVML through pynvml (nvml.py), with simulated GPUs (simulated.py) standing in
for the NVML C library so the same discovery code runs with and without hardware."""
