"""Memory peaks: torch allocator on GPU, resident set size of the process everywhere."""

from __future__ import annotations

import resource
import sys

import torch


def peak_rss_bytes() -> int:
    """Peak resident set size of this process.

    Linux: ``VmHWM`` of ``/proc/self/status``, the high-water mark of this process's own
    address space. (``ru_maxrss`` is not used there: after fork + exec it also carries the
    RSS the *parent* had at fork time, so a run started from a large process would report
    the parent's size.) Elsewhere ``ru_maxrss`` (bytes on macOS).
    """
    hwm = _proc_bytes("/proc/self/status", "VmHWM:")
    if hwm is not None:
        return hwm
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


# torch's CPU allocator reports a failed malloc as a plain RuntimeError with this text (the CUDA
# allocator raises torch.OutOfMemoryError)
_CPU_ALLOC_FAILED = "DefaultCPUAllocator: can't allocate memory"


def allocation_failure(exc: BaseException) -> str | None:
    """One line saying why, when ``exc`` is a failed allocation (CUDA or CPU allocator, or Python's
    MemoryError); None for any other error."""
    text = str(exc)
    if isinstance(exc, RuntimeError) and _CPU_ALLOC_FAILED in text:
        return text[text.index(_CPU_ALLOC_FAILED):].splitlines()[0]
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return (text.splitlines() or [""])[0] or f"{type(exc).__name__}: out of memory"
    return None


def available_host_bytes() -> int | None:
    """Memory the kernel could give this process now (``MemAvailable``, Linux); None elsewhere."""
    return _proc_bytes("/proc/meminfo", "MemAvailable:")


def _proc_bytes(path: str, key: str) -> int | None:
    """The ``key: N kB`` line of a /proc file in bytes; None where the file or the line is missing."""
    try:
        with open(path) as fh:
            for line in fh:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
