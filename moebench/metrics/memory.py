"""Memory peaks: torch allocator on GPU, resident set size of the process everywhere."""

from __future__ import annotations

import resource
import sys

import torch


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def reset_peaks(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def memory_fields(device: torch.device) -> dict[str, int | None]:
    rss = peak_rss_bytes()
    if device.type == "cuda":
        return {
            "peak_mem_bytes": torch.cuda.max_memory_allocated(device),
            "peak_mem_reserved_bytes": torch.cuda.max_memory_reserved(device),
            "peak_rss_bytes": rss,
        }
    return {"peak_mem_bytes": rss, "peak_mem_reserved_bytes": None, "peak_rss_bytes": rss}
