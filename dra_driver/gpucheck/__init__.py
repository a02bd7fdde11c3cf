"""``gpu-dra gpu-check``: one read-only run that checks a machine's real GPUs and driver the way
the agent would use them, ready for the first lent GPU (docs/gpu-check.md).

A tool beside the flow, like scheduling/: it runs the agent's own parts (discovery, the devices
it would publish, the driver-file scan and CDI spec, the telemetry reader) on this machine and
reports what they found. In order:

    nvmlquery.py  the read-only NVML questions (MIG tables, events, ECC, pages, rows), timed,
                  with each return code; refuses any setter
    compare.py    one GPU's answers against its simulated twin's, field by field (pure)
    driverroot.py the driver roots, the agent's scan of each, the spec for one GPU per
                  capability set, and whether every host path it names exists
    runtime.py    a minimal container runtime: the spec applied to a root without driver files
                  in a private mount namespace, a probe that loads CUDA and NVML, nvidia-smi -L
    mpscheck.py   with --mps: an MPS daemon of the check's own given a share's limits, the
                  probe as its client (memory steps, a PTX kernel), the daemon always quit
    check.py      runs every part and builds the report
    report.py     the report's JSON and summary files
    command.py    the command line; the CLI passes in the simulated GPUs (sim/checkmachine.py)
"""
