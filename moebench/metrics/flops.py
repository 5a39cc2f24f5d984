"""Peak FLOP/s of the device (for MFU) and the derived throughput metrics.

MFU is always reported against the *dense bf16* peak of a GPU (also for fp8/mxfp8 runs), taken
from the device table (:mod:`moebench.devices`). A CPU has no such table: its peak is measured by a
calibration matmul in the dtype that convention names, bf16, where the CPU has it (its bf16 matmul
outruns its fp32 one: AVX512-BF16 or AMX, where an fp32 calibration put bf16 runs above 100% MFU),
else fp32. The peak is the faster of the two, so no run beats it by more than calibration noise,
whatever its precision; the record names the dtype (``peak_flops_dtype``) and flags an MFU above 1
(``mfu_above_peak``) instead of clipping it. Inside a sweep (``MOEBENCH_CPU_PEAK_FILE`` set by the
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
from typing import NamedTuple

import torch

from moebench.devices import DEVICES, device_key
from moebench.metrics import CPU_PEAK_FILE_ENV
from moebench.metrics.timer import time_calls

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32"}


class Peak(NamedTuple):
    """A device's peak FLOP/s for MFU (None: unknown), the dtype it was measured or rated in, and
    where it came from."""

    flops: float | None
    dtype: str | None
    source: str


def gpu_peak_flops(device_name: str) -> float | None:
    """Dense bf16 peak of a GPU as torch names it, from :data:`moebench.devices.DEVICES`; None if unknown."""
    key = device_key(device_name)
    return DEVICES[key].bf16_flops if key else None


def matmul_flops(dtype: torch.dtype, size: int = 1024, repeats: int = 5) -> float:
    """Best achieved FLOP/s of a square ``dtype`` matmul on the current CPU threads."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    a @ b  # warm-up: thread pool and caches
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def calibrate_cpu_peak() -> tuple[float, str]:
    """(FLOP/s, dtype name) of the CPU's peak: the bf16 matmul rate where it beats the fp32 one
    (the CPU has bf16), else the fp32 rate."""
    rates = {_DTYPE_NAMES[dt]: matmul_flops(dt) for dt in (torch.bfloat16, torch.float32)}
    dtype = max(rates, key=rates.__getitem__)
    return rates[dtype], dtype


def reference_flops(device: torch.device) -> float:
    """FLOP/s of a short reference GEMM on ``device``, best of 3 after one warm-up call: fp32 at 512 on
    a CPU (a smaller calibration matmul), bf16 at 4096 on a GPU. A few milliseconds; timed just
    before and after a run's timed window, it says how fast the machine itself was meanwhile."""
    n, dtype = (4096, torch.bfloat16) if device.type == "cuda" else (512, torch.float32)
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / min(time_calls(lambda: a @ b, device, warmup=1, repeats=3))


def shared_cpu_peak(prefix: Path, threads: int) -> tuple[float, str]:
    """The calibration (FLOP/s, dtype) stored at ``<prefix>_t<threads>.json``, measured and stored first
    if there is none; the first writer wins (a hard link is atomic), so concurrent ranks agree on one
    figure. A file from before the dtype was stored held an fp32 calibration."""
    path = prefix.with_name(f"{prefix.name}_t{threads}.json")
    if not path.exists():
        flops, dtype = calibrate_cpu_peak()
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps({"peak_flops": flops, "dtype": dtype, "threads": threads}))
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)
        tmp.unlink()
    stored = json.loads(path.read_text())
    return float(stored["peak_flops"]), str(stored.get("dtype", "fp32"))


def device_peak(device: torch.device) -> Peak:
    """The peak MFU divides by: a GPU's datasheet dense bf16 peak, a CPU's calibration matmul."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak_flops(name)
        if peak is None:
            return Peak(None, None, f"unknown GPU {name!r}: no MFU")
        return Peak(peak, "bf16", f"datasheet dense bf16 ({name})")
    threads = torch.get_num_threads()
    shared = os.environ.get(CPU_PEAK_FILE_ENV)
    if shared:
        flops, dtype = shared_cpu_peak(Path(shared), threads)
        return Peak(flops, dtype, f"calibration {dtype} matmul on {threads} CPU threads, one per sweep run "
                                  f"({Path(shared).parent.name})")
    flops, dtype = calibrate_cpu_peak()
    return Peak(flops, dtype, f"calibration {dtype} matmul on {threads} CPU threads")
