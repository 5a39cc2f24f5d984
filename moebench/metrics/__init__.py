"""Measurement: step timers, FLOPs -> TFLOP/s and MFU, memory peaks, NVML sampling."""

# Where a sweep run keeps its one CPU peak calibration (set by the sweep runner for its points; read by
# moebench.metrics.flops.device_peak). Here, not in flops.py, so the runner needs no torch import.
CPU_PEAK_FILE_ENV = "MOEBENCH_CPU_PEAK_FILE"
