"""What one small matmul costs under valgrind, with MKL's default GEMM path and with its reproducible one
(``MKL_CBWR=COMPATIBLE``, which the instruction clock sets: moebench/metrics/instructions.py).

    python scripts/valgrind_matmul_cost.py

Runs itself three times: natively, and under ``valgrind --tool=none`` with and without the setting; each
prints the milliseconds a 64 x 64 fp32 matmul takes on one thread (median of 50 after one warm-up call).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

CHILD = "MOEBENCH_VALGRIND_MATMUL_CHILD"


def child() -> None:
    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    torch.mm(a, b)
    samples = []
    for _ in range(50):
        started = time.perf_counter()
        torch.mm(a, b)
        samples.append(time.perf_counter() - started)
    print(f"{1e3 * statistics.median(samples):.3f}")


def main() -> None:
    runs = [("native", [], {}), ("valgrind, MKL default", ["valgrind", "--tool=none", "-q"], {}),
            ("valgrind, MKL_CBWR=COMPATIBLE", ["valgrind", "--tool=none", "-q"], {"MKL_CBWR": "COMPATIBLE"})]
    for name, prefix, env in runs:
        done = subprocess.run([*prefix, sys.executable, __file__], capture_output=True, text=True, check=True,
                              env={**os.environ, **env, CHILD: "1"})
        print(f"{name}: {done.stdout.strip().splitlines()[-1]} ms a 64 x 64 fp32 matmul")


if __name__ == "__main__":
    child() if os.environ.get(CHILD) else main()
