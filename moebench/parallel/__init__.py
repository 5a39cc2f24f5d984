"""Parallelism applied from outside to a built single-device model (see :func:`parallelize`)."""
