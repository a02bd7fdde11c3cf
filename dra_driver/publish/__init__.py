"""ResourceSlices: the pure slice bodies built from the node's devices (``slices``) and the
publisher that keeps the API server equal to them (``publisher``)."""
