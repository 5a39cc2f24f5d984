"""Measurement: step timers, FLOPs -> TFLOP/s and MFU, memory peaks, NVML sampling."""

# Where a sweep run keeps its one CPU peak calibration (set by the sweep runner for its points; read by
# moebench.metrics.flops.device_peak). Here, not in flops.py, so the runner needs no torch import.
CPU_PEAK_FILE_ENV = "MOEBENCH_CPU_PEAK_FILE"

# The folder each rank writes its Chrome trace of the profiled steps into (train.trace); the sweep sets
# it to the point's rank-log folder, logs/<point>.ranks/. Unset: ./traces.
TRACE_DIR_ENV = "MOEBENCH_TRACE_DIR"


def trace_name(rank: int) -> str:
    """A rank's trace file, beside its ``rank<N>.log``; gzip'd (torch writes ``.gz`` compressed)."""
    return f"rank{rank}.trace.json.gz"
