"""Peak FLOP/s of the device (for MFU) and the derived throughput metrics.

MFU is always reported against the *dense bf16* peak of a GPU (also for fp8/mxfp8 runs),
taken from the device table (:mod:`moebench.devices`). A CPU has no such table: its peak is measured
by a calibration matmul, and the record says so. Inside a sweep (``MOEBENCH_CPU_PEAK_FILE`` set by the
runner) the first run to calibrate on a thread count stores its figure and every later point of the
sweep reads it, so MFU is comparable across the points of one run (a fresh calibration per point
varied 3.5x under load).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

import torch

from moebench.devices import DEVICES, device_key
from moebench.metrics import CPU_PEAK_FILE_ENV
from moebench.metrics.timer import time_calls


def gpu_peak_flops(device_name: str) -> float | None:
    """Dense bf16 peak of a GPU as torch names it, from :data:`moebench.devices.DEVICES`; None if unknown."""
    key = device_key(device_name)
    return DEVICES[key].bf16_flops if key else None


def calibrate_cpu_peak(size: int = 1024, repeats: int = 5) -> float:
    """Best achieved fp32 FLOP/s of a square matmul on the current threads."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b  # warm-up: thread pool and caches
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def reference_flops(device: torch.device) -> float:
    """FLOP/s of a short reference GEMM on ``device``, best of 3 after one warm-up call: fp32 at 512 on
    a CPU (a smaller calibration matmul), bf16 at 4096 on a GPU. A few milliseconds; timed just
    before and after a run's timed window, it says how fast the machine itself was meanwhile."""
    n, dtype = (4096, torch.bfloat16) if device.type == "cuda" else (512, torch.float32)
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / min(time_calls(lambda: a @ b, device, warmup=1, repeats=3))


def shared_cpu_peak(prefix: Path, threads: int) -> float:
    """The calibration stored at ``<prefix>_t<threads>.json``, measured and stored first if there is
    none; the first writer wins (a hard link is atomic), so concurrent ranks agree on one figure."""
    path = prefix.with_name(f"{prefix.name}_t{threads}.json")
    if not path.exists():
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps({"peak_flops": calibrate_cpu_peak(), "threads": threads}))
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)
        tmp.unlink()
    return float(json.loads(path.read_text())["peak_flops"])


def device_peak(device: torch.device) -> tuple[float | None, str]:
    """(peak FLOP/s, where it came from)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak_flops(name)
        return peak, f"datasheet dense bf16 ({name})" if peak else f"unknown GPU {name!r}: no MFU"
    threads = torch.get_num_threads()
    shared = os.environ.get(CPU_PEAK_FILE_ENV)
    if shared:
        return (shared_cpu_peak(Path(shared), threads),
                f"calibration fp32 matmul on {threads} CPU threads, one per sweep run ({Path(shared).parent.name})")
    return calibrate_cpu_peak(), f"calibration fp32 matmul on {threads} CPU threads"


def throughput(tokens_per_step: int, step_time_s: float, world_size: int, flops_per_token: int,
               peak_flops: float | None) -> dict[str, float | None]:
    tokens_per_s = tokens_per_step / step_time_s
    per_device = tokens_per_s / world_size
    flops_per_device = flops_per_token * per_device
    return {
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_device": per_device,
        "tflops_per_device": flops_per_device / 1e12,
        "mfu": flops_per_device / peak_flops if peak_flops else None,
    }
