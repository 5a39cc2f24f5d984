"""How much faster is one point than another, and is the difference real?

One module answers this for ``moebench report`` (headline, speedup column, run-vs-run
deltas) and ``moebench check`` (the regression gate and the ratio gate), so a report and a
gate never disagree about the same two points.

A point is measured by one or more *runs* (repeats: each its own process), each with its raw
``step_times_s``. A side's statistic is the mean over its runs of each run's median step
time; a throughput ratio is ``work_a / stat_a`` over ``work_b / stat_b``, where ``work`` is
what one step achieves of the metric (for tokens/s per device: tokens per step over world
size; two sides may differ in both). The median is used within a run because step times
have a long right tail (a collective that waits, a GC pause): one slow step moves a mean,
not a median.

The confidence interval is a seeded hierarchical bootstrap, because the noise has two
levels that a reader of one process cannot both see:

- **between runs**: two processes of the same code differ by a run-level offset (allocator
  state, co-tenants, clocks). Each resample draws a side's runs with replacement, so the
  spread of the runs is in the interval.
- **within a run**: consecutive steps are autocorrelated (a lag-1 correlation of +0.5 is
  common), so steps are not resampled one by one but in moving blocks of
  :func:`block_length` consecutive steps, which keeps the correlation inside a block.

With only a handful of runs a percentile bootstrap is too narrow: resampling ``R`` runs
shrinks their variance by ``(R - 1) / R``, and the normal quantile stands in for a Student t
one (4.30 instead of 1.96 at two runs a side). So the interval is a t interval on the log
scale: the log ratio plus or minus ``sqrt(R / (R - 1)) t(df) se``, where ``se`` is the standard
deviation of the bootstrap's log ratios, ``R`` the smaller side's runs and ``df = R_a + R_b - 2``
(:func:`t_multiplier`). A side with a single run has no between-run variance at all: the
ratio is given, with no interval and no verdict. A fixed seed makes a report or a gate give
the same answer every time it is run.

Verdict: ``faster`` or ``slower`` when the interval excludes 1.0 *and* the change is at
least :data:`PRACTICAL_CHANGE`; otherwise ``within noise``. No interval, no verdict: with one
run on a side, under :data:`MIN_SAMPLES` timed steps in a run, or a side whose timed windows
were unsteady (:func:`moebench.record.unsteady`) the ratio is given with ``no verdict`` and
the reason (:attr:`Ratio.why`), never judged on its size alone.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from moebench.record import CLOCK_FIELDS, METRICS, Clock

CONFIDENCE = 0.95
# A change smaller than this is not worth a reader's attention, however tight its interval.
PRACTICAL_CHANGE = 0.02
MIN_SAMPLES = 5
N_BOOT = 4000
SEED = 20261128
NO_VERDICT = "no verdict"
VERDICTS = ("faster", "slower", "within noise", NO_VERDICT)


def runs_text(runs: tuple[int, int]) -> str:
    """``1 run each`` / ``3 vs 1 runs``: how many runs stand behind a comparison."""
    if runs[0] == runs[1]:
        return f"{runs[0]} run{'s' if runs[0] != 1 else ''} each"
    return f"{runs[0]} vs {runs[1]} runs"


@dataclass(frozen=True)
class Ratio:
    """A ratio of rates (above 1: the numerator is faster) with its confidence interval."""

    value: float
    low: float | None  # None: too few samples for an interval, or a side with one run
    high: float | None
    confidence: float = CONFIDENCE
    threshold: float = PRACTICAL_CHANGE
    runs: tuple[int, int] = (1, 1)  # runs (repeats) behind the numerator and the denominator
    unsteady: str | None = None  # why a side's timed windows cannot stand for its speed (no verdict)
    min_samples: int = MIN_SAMPLES  # timed steps a run needs for an interval

    @property
    def has_ci(self) -> bool:
        return self.low is not None and self.high is not None and self.unsteady is None

    @property
    def single_run(self) -> bool:
        """A side with one run: no between-run variance, so no verdict."""
        return min(self.runs) < 2

    @property
    def why(self) -> str | None:
        """Why there is no verdict (None: there is an interval to judge by)."""
        if self.single_run:
            return f"{runs_text(self.runs)}: no between-run variance"
        if self.unsteady is not None:
            return self.unsteady
        if not self.has_ci:
            return f"under {self.min_samples} timed steps in a run: no interval"
        return None

    def excludes(self, bound: float) -> bool:
        """The interval lies wholly on one side of ``bound`` (False without an interval)."""
        return self.has_ci and not (self.low <= bound <= self.high)

    @property
    def verdict(self) -> str:
        if self.why is not None:
            return NO_VERDICT
        if abs(self.value - 1.0) < self.threshold or not self.excludes(1.0):
            return "within noise"
        return "faster" if self.value > 1.0 else "slower"

    @property
    def inconclusive(self) -> bool:
        """The change is big enough to matter, but the noise (or missing evidence) hides it: trust neither way."""
        if abs(self.value - 1.0) < self.threshold:
            return False
        return self.why is not None or not self.excludes(1.0)

    @property
    def detectable(self) -> float | None:
        """The smallest relative change these data could have told from noise: the interval's half-width
        on the log scale, as a fraction (0.08: changes under about 8% are invisible here)."""
        if not self.has_ci or self.low <= 0:
            return None
        return math.sqrt(self.high / self.low) - 1.0

    def inverse(self) -> Ratio:
        """The same comparison as a ratio of times (or with the sides swapped)."""
        low, high = (1.0 / self.high, 1.0 / self.low) if self.low is not None and self.high is not None \
            else (None, None)
        return dataclasses.replace(self, value=1.0 / self.value, low=low, high=high)

    def ci_text(self) -> str:
        return f"[{self.low:.2f}, {self.high:.2f}]" if self.has_ci else f"[{self.why}]"

    def text(self) -> str:
        """``1.47x [1.31, 1.62] faster``, or ``1.47x, 1 run each: no between-run variance, no verdict``."""
        if self.why is not None:
            return f"{self.value:.2f}x, {self.why}, {NO_VERDICT}"
        return f"{self.value:.2f}x {self.ci_text()} {self.verdict}"


# Comparison operators of bounds (``>= 1.0``): a ratio gate's and a claim's.
OPS = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt}
HOLDS, FAILS, UNDECIDED = "holds", "does not hold", "inconclusive"


def bound_verdict(ratio: Ratio, op: str, bound: float) -> tuple[str, str]:
    """Whether ``ratio`` meets ``OP BOUND``, the one rule of ``check --ratio`` and ``moebench claim``: it holds
    only when its whole interval lies on the bound's holding side, does not hold only when the whole interval
    lies past it, and is inconclusive otherwise, or without an interval (:attr:`Ratio.why`). Returns
    (verdict, detail: the interval with its runs, or why there is none)."""
    if ratio.why is not None:
        return UNDECIDED, f"{ratio.why}, no verdict"
    test = OPS[op]
    low_ok, high_ok = test(ratio.low, bound), test(ratio.high, bound)
    shown = f"{100 * ratio.confidence:g}% CI {ratio.ci_text()}, {runs_text(ratio.runs)}"
    return (HOLDS if low_ok and high_ok else FAILS if not (low_ok or high_ok) else UNDECIDED), shown


def finite_samples(samples: Any) -> np.ndarray:
    if not isinstance(samples, (list, tuple, np.ndarray)):
        return np.empty(0)
    a = np.asarray(samples, dtype=float)
    return a[np.isfinite(a) & (a > 0)]


def as_runs(samples: Any) -> list[np.ndarray]:
    """One run's step times, or a list of runs' step times, as a list of non-empty arrays."""
    if isinstance(samples, (list, tuple)) and samples and all(isinstance(s, (list, tuple, np.ndarray))
                                                                 for s in samples):
        runs = [finite_samples(s) for s in samples]
    else:
        runs = [finite_samples(samples)]
    return [r for r in runs if len(r)]


def block_length(n: int) -> int:
    """Consecutive steps per bootstrap block: about ``sqrt(n)``.

    A block must be longer than the step correlation lasts (an AR(1) series with lag-1
    correlation 0.7 forgets within about 5 steps: 0.7**5 = 0.17) and short enough that a
    run holds several of them to reshuffle; ``sqrt(n)`` gives 4 to 5 steps at 20 steps and 7 at 50.
    """
    return max(1, min(n, round(math.sqrt(n))))


def _block_medians(steps: np.ndarray, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """``n_boot`` moving-block bootstrap medians of one run: blocks of consecutive steps drawn with replacement."""
    n = len(steps)
    size = block_length(n)
    blocks = -(-n // size)
    starts = rng.integers(0, n - size + 1, size=(n_boot, blocks))
    idx = (starts[:, :, None] + np.arange(size)).reshape(n_boot, blocks * size)[:, :n]
    return np.median(steps[idx], axis=1)


def _side_stats(runs: list[np.ndarray], n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """``n_boot`` resampled side statistics: draw the runs with replacement, each drawn run contributing an
    independent block-bootstrap median, and average them."""
    medians = np.stack([_block_medians(r, n_boot, rng) for r in runs])  # (R, n_boot)
    pick = rng.integers(0, len(runs), size=(n_boot, len(runs)))
    column = rng.integers(0, n_boot, size=(n_boot, len(runs)))  # a run drawn twice gets two resamples
    return medians[pick, column].mean(axis=1)


@functools.lru_cache(maxsize=64)
def _multiplier(few: int, df: int, confidence: float) -> float:
    from scipy.special import stdtrit  # the t quantile (scipy.stats takes seconds to import)

    return math.sqrt(few / (few - 1)) * float(stdtrit(df, 1 - (1 - confidence) / 2))


def t_multiplier(runs: tuple[int, int], confidence: float) -> float:
    """Half-width of a ratio's interval in bootstrap standard errors (log scale) with this few runs:
    ``sqrt(R / (R - 1)) t(R_a + R_b - 2)``, ``R`` the smaller side's runs (see the module)."""
    return _multiplier(min(runs), runs[0] + runs[1] - 2, confidence)


def side_stat(runs: list[np.ndarray]) -> float:
    """A side's step time: the mean over its runs of each run's median."""
    return float(np.mean([np.median(r) for r in runs]))


def rate_ratio(num_steps: Any, den_steps: Any, num_work: float = 1.0, den_work: float = 1.0,
               confidence: float = CONFIDENCE, min_samples: int = MIN_SAMPLES, threshold: float = PRACTICAL_CHANGE,
               n_boot: int = N_BOOT, seed: int = SEED) -> Ratio | None:
    """``(num_work / num_time) / (den_work / den_time)`` with its hierarchical bootstrap interval.

    Each side is one run's step times or a list of runs' step times. None when either side
    has no usable sample; no interval when a run has fewer than ``min_samples`` steps or a
    side has a single run.
    """
    a, b = as_runs(num_steps), as_runs(den_steps)
    if not a or not b or not num_work or not den_work:
        return None
    scale = num_work / den_work
    runs = (len(a), len(b))
    value = scale * side_stat(b) / side_stat(a)
    if min(runs) < 2 or min(len(r) for r in (*a, *b)) < min_samples:
        return Ratio(value, None, None, confidence, threshold, runs, min_samples=min_samples)
    rng = np.random.default_rng(seed)
    logs = np.log(scale * _side_stats(b, n_boot, rng) / _side_stats(a, n_boot, rng))
    half = t_multiplier(runs, confidence) * float(np.std(logs, ddof=1))
    return Ratio(value, value * math.exp(-half), value * math.exp(half), confidence, threshold, runs,
                 min_samples=min_samples)


def _bounds(values: np.ndarray, confidence: float) -> tuple[float, float]:
    tail = 100 * (1 - confidence) / 2
    lo, hi = np.percentile(values, [tail, 100 - tail])
    return float(lo), float(hi)


def median_ci(samples: Any, confidence: float = CONFIDENCE) -> tuple[float, float] | None:
    """Interval of a point's step time: the block-bootstrap percentile interval of one run's median, or over
    several runs (a list of runs' step times) the hierarchical t interval (``sqrt(R / (R - 1)) t(R - 1)``).

    None when a run has fewer than :data:`MIN_SAMPLES` steps.
    """
    runs = as_runs(samples)
    if not runs or min(len(r) for r in runs) < MIN_SAMPLES:
        return None
    rng = np.random.default_rng(SEED)
    if len(runs) == 1:
        return _bounds(_block_medians(runs[0], N_BOOT, rng), confidence)
    half = _multiplier(len(runs), len(runs) - 1, confidence) * float(np.std(np.log(_side_stats(runs, N_BOOT, rng)),
                                                                            ddof=1))
    centre = side_stat(runs)
    return centre * math.exp(-half), centre * math.exp(half)


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
    """What one step achieves of a step-time-derived rate metric, so that metric = work / step time
    (on the metric's clock: :data:`moebench.record.CLOCK_FIELDS`).

    Throughput comes from the tokens per step (over the world size per device); other rates
    (TFLOP/s, MFU) from the record's value times its median step time.
    """
    tokens, world = _num(row, "tokens_per_step"), _num(row, "world_size")
    if metric in ("tokens_per_s", "tokens_per_cpu_s", "tokens_per_ginstruction") and tokens:
        return tokens
    if metric == "tokens_per_s_per_device" and tokens and world:
        return tokens / world
    spec = METRICS.get(metric)
    value, median = _num(row, metric), _num(row, CLOCK_FIELDS[spec.clock if spec else "wall"][2])
    return value * median if value is not None and median else None


def step_runs(row: Any, clock: Clock = "wall") -> list[Any]:
    """The step times on ``clock`` of each run of a point: its ``step_runs`` / ``cpu_step_runs`` /
    ``instruction_step_runs`` (one list per repeat) or its one run's ``step_times_s`` / ``step_cpu_times_s`` /
    ``step_ginstructions``."""
    per_point, per_run, _ = CLOCK_FIELDS[clock]
    runs = row.get(per_point)
    if isinstance(runs, (list, tuple)) and runs:
        return list(runs)
    return [row.get(per_run)]


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
    r = rate_ratio(step_runs(num, spec.clock), step_runs(den, spec.clock), nw, dw, confidence, min_samples,
                   threshold)
    # an unsteady window is a wall-clock finding (a run slowed or sped up as the load moved): the CPU
    # clock counts the work done, which the load does not change
    # the side's name only where it is the baseline's: every point of a report shares one baseline, whose
    # unsteady windows would otherwise read as each point's own
    why = [f"{side}{w}" for side, w in (("", num.get("unsteady")), ("baseline: ", den.get("unsteady")))
           if isinstance(w, str) and w and spec.clock == "wall"]
    if r is not None and why:
        r = dataclasses.replace(r, unsteady="; ".join(why))
    return r.inverse() if r is not None and rate == "step_time_median_s" else r
