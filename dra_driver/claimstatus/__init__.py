"""ResourceClaim device status (KEP-4817): which GPU a claim's pod got, in the claim itself.

A wing off the prepare flow: after the kubelet has its answer, the node agent writes one
``status.devices`` entry per prepared device of this driver (driver, pool, device, condition
``Ready``, and ``data`` with the GPU's or MIG device's UUID, index, product and MIG profile), and
removes them at unprepare. ``entries`` builds them from the node's GPUs (pure); ``reporter``
writes them in the background through kube/ (server-side apply), so a slow or failing API server
never delays or fails a prepare. docs/plugin.md "Claim status".
"""
