"""moebench's RMSNorm kernel (``model.norm_impl=recompute``) against torch's ``nn.RMSNorm``, its slow twin.

Forward and backward of each on the same rows, interleaved call by call in one process (so the
host's drift hits both alike), for fp32 rows and for bf16 rows (as the q/k norms see them under
autocast, through :func:`moebench.model.transformer.fp32_norm`). Prints each one's median and the
median of the paired ratios, torch / recompute.

    python scripts/rmsnorm_speed.py --rows 1024 --width 512
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch import nn

from moebench.metrics.timer import time_call
from moebench.model.norm import RecomputeRMSNorm
from moebench.model.transformer import fp32_norm


def paired_times(rows: int, width: int, dtype: torch.dtype, calls: int, warmup: int) -> dict[str, list[float]]:
    torch.manual_seed(0)
    x = torch.randn(rows, width).to(dtype).requires_grad_()
    grad = torch.randn(rows, width).to(dtype)
    norms = {"torch": nn.RMSNorm(width, eps=1e-5), "recompute": RecomputeRMSNorm(width, eps=1e-5)}
    times: dict[str, list[float]] = {name: [] for name in norms}
    for i in range(warmup + calls):
        for name, norm in norms.items():
            elapsed = time_call(lambda norm=norm: fp32_norm(norm, x).backward(grad), x.device)
            x.grad = norm.weight.grad = None
            if i >= warmup:
                times[name].append(elapsed)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--calls", type=int, default=280)
    parser.add_argument("--warmup", type=int, default=20)
    args = parser.parse_args()
    for dtype in (torch.float32, torch.bfloat16):
        times = paired_times(args.rows, args.width, dtype, args.calls, args.warmup)
        ratio = statistics.median(a / b for a, b in zip(times["torch"], times["recompute"], strict=True))
        medians = ", ".join(f"{name} {statistics.median(t) * 1e6:.0f} us" for name, t in times.items())
        print(f"{str(dtype).removeprefix('torch.')} [{args.rows}, {args.width}] forward+backward: {medians}; "
              f"torch / recompute {ratio:.2f}x (median of {args.calls} paired calls)")


if __name__ == "__main__":
    main()
