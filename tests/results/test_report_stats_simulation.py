"""The statistics, tested statistically: false verdicts and power of :func:`moebench.results.stats.rate_ratio`.

Two identical configurations are simulated the way processes on a shared machine behave:
each run's step times follow an AR(1) series (lag-1 correlation 0.7, 5% marginal noise)
around a run-level offset (log-normal, 3%: allocator state, co-tenants, clocks). A verdict
(``faster`` / ``slower``) between identical configurations is a false one; at 95% confidence
the rate must stay at or below ~7% (5% plus the simulation's own sampling error: the
standard error of a rate near 5% over 300 trials is 1.3 points).

The bootstrap draws 1000 resamples instead of the production 4000: that moves the 2.5% and
97.5% percentiles by about their Monte Carlo error (~0.5% of the interval's width), far below
what the rates tested here resolve, and keeps the file well under a minute.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from report_helpers import fixture_store
from scipy.signal import lfilter

from moebench.results.stats import rate_ratio

TRIALS = 300
N_BOOT = 1000
PHI, STEP_NOISE, RUN_OFFSET = 0.7, 0.05, 0.03


def simulate(rng: np.random.Generator, trials: int, runs: int, steps: int, phi: float = PHI,
             run_offset: float = RUN_OFFSET, factor: float = 1.0) -> np.ndarray:
    """Step times, shape (trials, runs, steps), median about ``0.1 * factor`` s."""
    innovations = rng.normal(0, STEP_NOISE * np.sqrt(1 - phi ** 2), size=(trials, runs, steps + 50))
    series = lfilter([1.0], [1.0, -phi], innovations, axis=-1)[..., 50:]  # 50 steps of burn-in: stationary
    offsets = np.exp(rng.normal(0, run_offset, size=(trials, runs, 1)))
    return 0.1 * factor * offsets * (1 + series)


def verdict_rate(num: np.ndarray, den: np.ndarray, verdicts: tuple[str, ...]) -> float:
    found = [rate_ratio([list(r) for r in a], [list(r) for r in b], n_boot=N_BOOT, seed=i).verdict in verdicts
             for i, (a, b) in enumerate(zip(num, den, strict=True))]
    return float(np.mean(found))


def step_level_verdict(num: np.ndarray, den: np.ndarray, rng: np.random.Generator) -> str:
    """The old interval: one run a side, its steps resampled one by one as if independent."""
    boot = lambda a: np.median(a[rng.integers(0, len(a), size=(N_BOOT, len(a)))], axis=1)  # noqa: E731
    value = np.median(den) / np.median(num)
    low, high = np.percentile(boot(den) / boot(num), [2.5, 97.5])
    if abs(value - 1) < 0.02 or low <= 1.0 <= high:
        return "within noise"
    return "faster" if value > 1 else "slower"


@pytest.mark.parametrize(("runs", "steps"), [(3, 20), (3, 50), (5, 20)])
def test_identical_configurations_rarely_get_a_verdict(runs, steps):
    rng = np.random.default_rng(steps + runs - 3)
    a, b = simulate(rng, TRIALS, runs, steps), simulate(rng, TRIALS, runs, steps)
    rate = verdict_rate(a, b, ("faster", "slower"))
    assert rate <= 0.07, f"{100 * rate:.1f}% false verdicts between identical configs ({runs} runs, {steps} steps)"


def test_a_real_thirty_percent_slowdown_is_found():
    rng = np.random.default_rng(30)
    slow, fast = simulate(rng, TRIALS, 3, 20, factor=1.3), simulate(rng, TRIALS, 3, 20)
    rate = verdict_rate(slow, fast, ("slower",))
    assert rate >= 0.90, f"a 30% slowdown found in only {100 * rate:.1f}% of trials"


def test_real_step_series_of_a_fixture_store_rarely_get_a_verdict():
    """Each run replays a fixture point's measured steps (their own autocorrelation and tail) from a random
    start, wrapping around, with a 3% run-level offset."""
    rate = replayed_fixture_rate()
    assert rate <= 0.07, f"{100 * rate:.1f}% false verdicts on replayed fixture steps"


def replayed_fixture_rate() -> float:
    records = [json.loads(line) for line in (fixture_store("smoke") / "records.jsonl").read_text().splitlines()]
    steps = np.asarray(next(r for r in records if r["point_id"] == "fsdp")["step_times_s"])
    rng = np.random.default_rng(3)
    starts = rng.integers(0, len(steps), size=(2, TRIALS, 3))
    idx = (starts[..., None] + np.arange(len(steps))) % len(steps)
    runs = steps[idx] * np.exp(rng.normal(0, RUN_OFFSET, size=(2, TRIALS, 3, 1)))
    return verdict_rate(runs[0], runs[1], ("faster", "slower"))


def test_one_run_a_side_gets_no_verdict():
    rng = np.random.default_rng(1)
    a, b = simulate(rng, 20, 1, 20, factor=1.3), simulate(rng, 20, 1, 20)
    assert verdict_rate(a, b, ("no verdict",)) == 1.0


def test_negative_control_the_step_level_bootstrap_fails_this_test():
    """Resampling steps as if independent, ignoring the runs, finds differences between identical configurations."""
    rng = np.random.default_rng(7)
    a, b = simulate(rng, TRIALS, 1, 20), simulate(rng, TRIALS, 1, 20)
    rate = np.mean([step_level_verdict(x[0], y[0], rng) != "within noise" for x, y in zip(a, b, strict=True)])
    assert rate > 0.25, f"the step-level bootstrap gave only {100 * rate:.1f}% false verdicts"
    # independent steps, no run offset: the same bootstrap is right, so the failure above is the model's
    a, b = simulate(rng, TRIALS, 1, 20, phi=0.0, run_offset=0.0), simulate(rng, TRIALS, 1, 20, phi=0.0, run_offset=0.0)
    rate = np.mean([step_level_verdict(x[0], y[0], rng) != "within noise" for x, y in zip(a, b, strict=True)])
    assert rate <= 0.07


def rates() -> list[tuple[str, float]]:
    """The rates docs/report.md quotes, with the seeds of the tests above
    (``python tests/results/test_report_stats_simulation.py`` prints them)."""
    out = []
    for runs, steps in [(3, 20), (3, 50), (5, 20)]:
        rng = np.random.default_rng(steps + runs - 3)
        a, b = simulate(rng, TRIALS, runs, steps), simulate(rng, TRIALS, runs, steps)
        rate = verdict_rate(a, b, ("faster", "slower"))
        out.append((f"identical, {runs} runs x {steps} steps: false verdicts", rate))
    for runs, factor, seed in [(3, 1.3, 30), (3, 1.1, 10), (2, 1.3, 32)]:
        rng = np.random.default_rng(seed)
        slow, fast = simulate(rng, TRIALS, runs, 20, factor=factor), simulate(rng, TRIALS, runs, 20)
        out.append((f"{round(100 * (factor - 1))}% slowdown, {runs} runs x 20 steps: found",
                    verdict_rate(slow, fast, ("slower",))))
    out.append(("the smoke fixture's fsdp steps replayed, 3 runs: false verdicts", replayed_fixture_rate()))
    rng = np.random.default_rng(7)
    a, b = simulate(rng, TRIALS, 1, 20), simulate(rng, TRIALS, 1, 20)
    old = [step_level_verdict(x[0], y[0], rng) != "within noise" for x, y in zip(a, b, strict=True)]
    out.append(("old step-level bootstrap, identical, 1 run x 20 steps: false verdicts", float(np.mean(old))))
    return out


if __name__ == "__main__":
    for what, rate in rates():
        print(f"{100 * rate:5.1f}%  {what}")
