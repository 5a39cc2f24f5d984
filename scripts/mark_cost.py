"""What one phase mark costs (``moebench.model.phases.mark`` under a step clock), forward and backward.

Times a chain of small ops with ``--marks`` marks in it, with a step clock active (each mark stamps
the host clock in forward and in backward) and without one (a mark is then the identity), the two
interleaved round by round; prints the per-mark difference of the median step times:

    python scripts/mark_cost.py --marks 16 --rounds 30

The tiny model marks 16 regions a step (two blocks' attention, router and experts regions and the
head, each forward and backward), so 16 x this figure is what its boundaries cost a step.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

import torch

from moebench.model.phases import PhaseClock, clock_active, mark


def step(marks: int, clock: PhaseClock | None) -> None:
    w = torch.ones(8, requires_grad=True)
    x = w * 1.0
    with clock_active(clock) if clock is not None else contextlib.nullcontext():
        for i in range(marks):
            x = mark(x, f"region{i % 4}") * 1.0
        x.sum().backward()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--marks", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--steps", type=int, default=50, help="steps per round and side")
    args = parser.parse_args()
    torch.set_num_threads(1)
    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(args.rounds):
        for clocked in ((True, False) if r % 2 == 0 else (False, True)):
            started = time.perf_counter()
            for _ in range(args.steps):
                step(args.marks, PhaseClock(torch.device("cpu")) if clocked else None)
            times[clocked].append((time.perf_counter() - started) / args.steps)
    on, off = statistics.median(times[True]), statistics.median(times[False])
    print(f"{(on - off) / args.marks * 1e6:.1f} us a mark (forward and backward): step of {args.marks} marks "
          f"{on * 1e6:.0f} us with a step clock, {off * 1e6:.0f} us without; medians of {args.rounds} rounds of "
          f"{args.steps} steps, interleaved; load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
