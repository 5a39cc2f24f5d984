"""Why cpu_fused buckets its bf16 GEMM row counts: bf16 matmuls at row counts never seen before vs bucketed ones.

    python scripts/bf16_row_counts.py [--rounds 4]

Each round times 200 ``[M, 512] x [512, 512]`` bf16 matmuls at exact row counts M, every one new
to the process (drawn without repeats from 64..1024), then the same M rounded up by
``moebench.kernels.cpu_experts._gemm_rows`` (48 buckets up to 4096, so all but the first round's
come from oneDNN's kernel cache). Routing gives experts new row counts every step, and over
6 GEMM shapes per expert they outnumber oneDNN's kernel cache (1024 kernels by default). Prints
GFLOP/s of each, medians over rounds (the padded rows' FLOPs count as work).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from moebench.kernels.cpu_experts import _gemm_rows


def _rate(rows: list[int], a: torch.Tensor, b: torch.Tensor) -> float:
    start = time.perf_counter()
    for m in rows:
        torch.mm(a[:m], b)
    return sum(2 * m * b.shape[0] * b.shape[1] for m in rows) / (time.perf_counter() - start) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    counts = random.Random(0).sample(range(64, 1025), 200 * args.rounds)
    a, b = torch.randn(1024, 512, dtype=torch.bfloat16), torch.randn(512, 512, dtype=torch.bfloat16)
    exact, bucketed = [], []
    for r in range(args.rounds):
        rows = counts[200 * r: 200 * (r + 1)]
        exact.append(_rate(rows, a, b))
        bucketed.append(_rate([_gemm_rows(m, torch.bfloat16) for m in rows], a, b))
    print(f"bf16 [M, 512] x [512, 512], {torch.get_num_threads()} threads, {args.rounds} rounds of 200 M")
    print(f"new row counts:      {statistics.median(exact):7.0f} GFLOP/s (median)")
    print(f"bucketed row counts: {statistics.median(bucketed):7.0f} GFLOP/s (median)")

if __name__ == "__main__":
    main()
