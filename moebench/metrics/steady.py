"""When a warm-up has settled, and how much a timed window still drifts.

The steady rule (``train.max_warmup_steps``, docs/sweep.md): after the fixed ``warmup_steps``,
keep warming up while the step time is still falling, i.e. while the median of the last
:data:`WINDOW` warm-up steps is more than :data:`TOLERANCE` below the median of the
:data:`WINDOW` before them, up to ``max_warmup_steps`` in all. Medians of three make one
outlier step (a page fault, a co-tenant's burst) unable to end or extend the warm-up alone; 5%
is above the step-to-step noise of a median of three on a shared CPU host and well below the
1.3-1.4x first-half/second-half trends the fixed 2-step warm-up left in the smoke points.

The decision takes the step times of every rank (their max: a step lasts as long as its slowest
rank), so every rank warms up the same number of steps and the collectives stay matched.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

WINDOW = 3  # steps per median
TOLERANCE = 0.05  # "still falling": the newer median more than this fraction below the older one


def still_warming(times: Sequence[float], min_steps: int, max_steps: int) -> bool:
    """Whether the run should take another warm-up step after the warm-up steps ``times``.

    ``min_steps`` steps always warm up (``train.warmup_steps``); ``max_steps`` caps the warm-up
    (``train.max_warmup_steps``; at or below ``min_steps``, e.g. 0: the fixed warm-up). Until two
    windows of steps exist there is no trend to read, so the warm-up goes on (within the cap).
    """
    n = len(times)
    if n < min_steps:
        return True
    if max_steps <= min_steps or n >= max_steps:
        return False
    if n < 2 * WINDOW:
        return True
    newer = statistics.median(times[-WINDOW:])
    older = statistics.median(times[-2 * WINDOW : -WINDOW])
    return newer < (1.0 - TOLERANCE) * older


def window_drift(samples: Sequence[float]) -> float | None:
    """Median step time of the second half of a timed window over that of its first half (the
    middle step of an odd window in neither): 1.0 is steady, above 1 slowing down, below 1 still
    speeding up. None with fewer than two steps."""
    half = len(samples) // 2
    if half == 0:
        return None
    first, second = samples[:half], samples[len(samples) - half :]
    return statistics.median(second) / statistics.median(first)
