"""``make demo``: the whole node flow on simulated GPUs, no GPU and no cluster needed.

1. Starts a local API server (the one the tests use) unless ``KUBECONFIG`` names a cluster.
2. Runs the real node agent process on a simulated node (``DEMO_SIMULATE``) and shows, as a
   table, the ResourceSlices the API server stored.
3. Acts as the kubelet: registers over the registration socket (GetInfo).
4. GPU health: makes simulated GPU 0 fall off the bus (``gpu-dra simulate-event --lost``, XID
   79), shows its taints in the stored slice and the Node Events, then resets it and shows them
   gone.
5. Allocates a claim with the ``gpu-dra explain`` allocator against the stored slices, calls
   NodePrepareResources over dra.sock and shows the answer, the CDI spec and the agent's log.
6. Ends with ``gpu-dra status`` of the node, read from the agent's ``/metrics``: every GPU and MIG
   device with the claim and pod holding it and its simulated readings; then unprepares the
   claim, stops the agent with SIGTERM and says that both sockets are gone.
7. MIG on demand (local API server only): starts the agent again with ``--mig-mode dynamic`` on
   ``MIG_ON_DEMAND_SIMULATE``, an H100 that is not in MIG mode. It is published partitionable
   (its counter set, the whole GPU and every placement); a 3g.40gb claim allocated by the
   explain allocator is prepared (MIG mode turned on, the MIG device created) and unprepared
   (the MIG device destroyed, MIG mode off again), the MIG mode shown at each point.
8. Sharing and dynamic MIG (local API server only, and root only: each MPS daemon gets a tmpfs):
   starts the agent again on ``SHARING_SIMULATE`` with ``--consumable-shares compute``, MPS on
   (``--mps-image``; the stand-in kubelet of localkubelet.py runs its daemon Deployments as
   processes) and ``--mig-mode dynamic``. Two claims of 20Gi with 30% and 50% of the compute are
   allocated shares of gpu-0 by the explain allocator (shareIDs and consumedCapacity are the
   scheduler's) and a third the 3g.40gb placement of the GPU in MIG mode; one
   NodePrepareResources over dra.sock prepares all three. It shows gpu-0's one MPS daemon
   (Deployment and process), each share's CDI device and MPS limits, and the MIG instance
   prepare created; then unprepares them and shows the daemon and the instance gone. Last, a
   claim of the whole gpu-1 (in MIG mode): prepare takes it out of MIG mode, unprepare puts it
   back.

Against a real cluster (``KUBECONFIG`` set) steps 1-4 publish to that cluster and step 5 only
explains the allocation: writing a claim's allocation is the scheduler's job there. Steps 7
and 8 are skipped there: they would create claims (and Deployments) in that cluster.

Modules: ``nodeflow`` (``main``, steps 1-6), ``migondemand`` (step 7), ``sharing`` (step 8),
``cluster`` (what the demo
plays itself: the agent's command line, a user's claims, the scheduler's write, the kubelet's
registration) and ``console`` (headings, waits, readable JSON). This package's ``__init__`` holds
only the demo nodes' names and GPUs, which tests read without starting anything.
"""

from __future__ import annotations

DEMO_NODE = "demo-node"
# The demo node: four H100 (two per PCIe root), an A100 80GB in MIG mode with pre-created
# instances, and an L4. Every example in examples/resourceclaims/ must be satisfiable on it.
DEMO_SIMULATE = "h100:4,a100-80gb:1:mig=3g.40gb+2g.20gb+1g.10gb+1g.10gb,l4:1"
# Step 7's node: an H100 not in MIG mode (dynamic MIG turns MIG mode on for a placement).
MIG_ON_DEMAND_SIMULATE = "h100:1"
# Step 8's node: an A100 not in MIG mode to share (an Ampere GPU's MIG mode is never toggled, so
# it stays a plain GPU under --mig-mode dynamic; an H100 would be partitionable and not shared),
# and an H100 in MIG mode without MIG devices (dynamic MIG).
SHARING_SIMULATE = "a100-80gb:1,h100:1:mig"
DRIVER = "gpu.nvidia.com"
MPS_NAMESPACE = "gpu-dra"
