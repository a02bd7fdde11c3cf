"""What the kube-scheduler would do with our ResourceSlices, without a cluster.

``cel`` evaluates device selectors as the scheduler's CEL environment does, ``allocator`` runs the
structured-parameters allocation for one node, ``explain`` is the ``gpu-dra explain`` command.
"""
