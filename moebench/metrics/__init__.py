"""Measurement: step timers, FLOPs -> TFLOP/s and MFU, memory peaks, NVML sampling."""
