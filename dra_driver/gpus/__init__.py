"""GPU discovery and the other NVML calls of the agent: NVML through pynvml (``nvml``), MIG
instance calls (``migmanager``), health events (``healthwatch``) and telemetry readings
(``readings``). The NVML boundary only: simulated GPUs (``dra_driver.sim.nvml``) stand in for the
NVML C library, so the same code runs with and without hardware."""
