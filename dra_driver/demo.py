"""``make demo``: the whole node flow on simulated GPUs, no cluster needed.

(Being written: publishes with the real agent process, allocates a claim with the explain
allocator, prepares and unprepares it through the real kubelet sockets.)
"""

from __future__ import annotations

DEMO_NODE = "demo-node"
# The demo node: four H100 (two per PCIe root), an A100 80GB in MIG mode with pre-created
# instances, and an L4. Every example in examples/resourceclaims/ must be satisfiable on it.
DEMO_SIMULATE = "h100:4,a100-80gb:1:mig=3g.40gb+2g.20gb+1g.10gb+1g.10gb,l4:1"
