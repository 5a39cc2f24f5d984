"""How much faster is one point than another, and is the difference real?

One module answers this for ``moebench report`` (headline, speedup column, run-vs-run
deltas) and ``moebench check`` (the regression gate and the ratio gate), so a report and a
gate never disagree about the same two points.

A throughput ratio is the ratio of rates ``work_a / median(steps_a)`` over
``work_b / median(steps_b)``, where ``work`` is what one step achieves of the metric (for
tokens/s per device: tokens per step over world size; two sides may differ in both).

The confidence interval is a seeded percentile bootstrap of that ratio of medians: each
side's raw ``step_times_s`` are resampled with replacement, independently (the two points
ran separately), the ratio is recomputed from the medians of each pair of resamples, and
the interval runs between the matching percentiles of :data:`N_BOOT` such ratios. A fixed
seed makes a report or a gate give the same answer every time it is run. The median is
used because step times have a long right tail (a collective that waits, a GC pause): one
slow step moves a mean, not a median.

Verdict: ``faster`` or ``slower`` when the interval excludes 1.0 *and* the change is at
least :data:`PRACTICAL_CHANGE`; otherwise ``within noise``. Without enough samples for an
interval the practical threshold alone decides.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from moebench.record import METRICS

CONFIDENCE = 0.95
# A change smaller than this is not worth a reader's attention, however tight its interval.
PRACTICAL_CHANGE = 0.02
MIN_SAMPLES = 5
N_BOOT = 4000
SEED = 20261128
VERDICTS = ("faster", "slower", "within noise")


@dataclass(frozen=True)
class Ratio:
    """A ratio of rates (above 1: the numerator is faster) with its confidence interval."""

    value: float
    low: float | None  # None: too few samples for an interval
    high: float | None
    confidence: float = CONFIDENCE
    threshold: float = PRACTICAL_CHANGE

    @property
    def has_ci(self) -> bool:
        return self.low is not None and self.high is not None

    def excludes(self, bound: float) -> bool:
        """The interval lies wholly on one side of ``bound`` (False without an interval)."""
        return self.has_ci and not (self.low <= bound <= self.high)

    @property
    def verdict(self) -> str:
        small = abs(self.value - 1.0) < self.threshold
        if small or (self.has_ci and not self.excludes(1.0)):
            return "within noise"
        return "faster" if self.value > 1.0 else "slower"

    @property
    def inconclusive(self) -> bool:
        """The change is big enough to matter, but the noise hides it: a reader should not trust either way."""
        return abs(self.value - 1.0) >= self.threshold and self.has_ci and not self.excludes(1.0)

    def inverse(self) -> Ratio:
        """The same comparison as a ratio of times (or with the sides swapped)."""
        low, high = (1.0 / self.high, 1.0 / self.low) if self.has_ci else (None, None)
        return Ratio(1.0 / self.value, low, high, self.confidence, self.threshold)

    def ci_text(self) -> str:
        return f"[{self.low:.2f}, {self.high:.2f}]" if self.has_ci else "[no CI: too few steps]"

    def text(self) -> str:
        """``1.47x [1.31, 1.62] faster``."""
        return f"{self.value:.2f}x {self.ci_text()} {self.verdict}"


def finite_samples(samples: Any) -> np.ndarray:
    if not isinstance(samples, (list, tuple, np.ndarray)):
        return np.empty(0)
    a = np.asarray(samples, dtype=float)
    return a[np.isfinite(a) & (a > 0)]


def _boot_medians(a: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    return np.median(a[rng.integers(0, len(a), size=(N_BOOT, len(a)))], axis=1)


def _bounds(values: np.ndarray, confidence: float) -> tuple[float, float]:
    tail = 100 * (1 - confidence) / 2
    lo, hi = np.percentile(values, [tail, 100 - tail])
    return float(lo), float(hi)


def rate_ratio(num_steps: Sequence[float], den_steps: Sequence[float], num_work: float = 1.0,
               den_work: float = 1.0, confidence: float = CONFIDENCE, min_samples: int = MIN_SAMPLES,
               threshold: float = PRACTICAL_CHANGE) -> Ratio | None:
    """``(num_work / median(num_steps)) / (den_work / median(den_steps))`` with its bootstrap interval.

    None when either side has no usable sample; no interval when either has fewer than
    ``min_samples``.
    """
    a, b = finite_samples(num_steps), finite_samples(den_steps)
    if not len(a) or not len(b) or not num_work or not den_work:
        return None
    scale = num_work / den_work
    value = scale * float(np.median(b) / np.median(a))
    if min(len(a), len(b)) < min_samples:
        return Ratio(value, None, None, confidence, threshold)
    rng = np.random.default_rng(SEED)
    low, high = _bounds(scale * _boot_medians(b, rng) / _boot_medians(a, rng), confidence)
    # A percentile interval of a median can sit just off the point estimate with few samples.
    return Ratio(value, min(low, value), max(high, value), confidence, threshold)


def median_ci(samples: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float] | None:
    """Bootstrap interval of the median of ``samples`` (None with fewer than :data:`MIN_SAMPLES`)."""
    a = finite_samples(samples)
    if len(a) < MIN_SAMPLES:
        return None
    return _bounds(_boot_medians(a, np.random.default_rng(SEED)), confidence)


def cv(samples: Sequence[float]) -> float:
    """Coefficient of variation (sample standard deviation over mean); NaN with under two samples."""
    a = finite_samples(samples)
    return float(np.std(a, ddof=1) / np.mean(a)) if len(a) > 1 else math.nan


def _num(row: Any, name: str) -> float | None:
    value = row.get(name)
    if value is None or isinstance(value, bool):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def work_per_step(row: Any, metric: str) -> float | None:
    """What one step achieves of a step-time-derived rate metric, so that metric = work / step time.

    Throughput comes from the tokens per step (over the world size per device); other rates
    (TFLOP/s, MFU) from the record's value times its median step time.
    """
    tokens, world = _num(row, "tokens_per_step"), _num(row, "world_size")
    if metric == "tokens_per_s" and tokens:
        return tokens
    if metric == "tokens_per_s_per_device" and tokens and world:
        return tokens / world
    value, median = _num(row, metric), _num(row, "step_time_median_s")
    return value * median if value is not None and median else None


def metric_ratio(num: Any, den: Any, metric: str = "tokens_per_s_per_device", confidence: float = CONFIDENCE,
                 min_samples: int = MIN_SAMPLES, threshold: float = PRACTICAL_CHANGE) -> Ratio | None:
    """Ratio of a step-time-derived metric between two points (rows or records), num over den.

    For a rate (throughput, TFLOP/s, MFU) above 1 means ``num`` is faster; for
    ``step_time_median_s`` it is the ratio of step times (above 1: slower). None when the
    metric is not derived from step time or a side lacks samples.
    """
    spec = METRICS.get(metric)
    if spec is None or not spec.from_step_time:
        return None
    rate = "step_time_median_s" if metric == "step_time_median_s" else metric
    nw, dw = (1.0, 1.0) if rate == "step_time_median_s" else (work_per_step(num, rate), work_per_step(den, rate))
    if nw is None or dw is None:
        return None
    r = rate_ratio(num.get("step_times_s"), den.get("step_times_s"), nw, dw, confidence, min_samples, threshold)
    return r.inverse() if r is not None and rate == "step_time_median_s" else r
