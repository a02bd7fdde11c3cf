"""ResourceSlices: the pure slice bodies built from the node's devices (``slices``), the pure plan
that makes the API server's slices equal them (``syncplan``), and the publisher that carries the
plan out through kube/ (``publisher``: the syncer and the public face; ``watcher``: the watch that
wakes it on foreign changes; ``sliceapi``: the calls both make and their backoff)."""
