"""``moebench.results.stats``: ratios of throughput with hierarchical bootstrap intervals and verdicts.

Statistical properties (false verdicts, power) are in test_report_stats_simulation.py.
"""

from __future__ import annotations

import random

import pytest
from report_helpers import fixture_store, repeated_store

from moebench.report.gate.check import MetricRule, compare_metric
from moebench.results.stats import (
    PRACTICAL_CHANGE,
    block_length,
    cv,
    median_ci,
    metric_ratio,
    rate_ratio,
    t_multiplier,
)
from moebench.results.table import by_point, load_tables


def _steps(median: float, noise: float, seed: int, n: int = 20) -> list[float]:
    rng = random.Random(seed)
    return [median * (1 + rng.gauss(0, noise)) for _ in range(n)]


def _runs(median: float, noise: float, seed: int, runs: int = 3, n: int = 20) -> list[list[float]]:
    return [_steps(median, noise, 100 * seed + i, n) for i in range(runs)]


def test_a_clear_speedup_has_an_interval_that_excludes_one():
    r = rate_ratio(_runs(0.68, 0.01, 1), _runs(1.0, 0.01, 2))
    assert r.value == pytest.approx(1.47, abs=0.02)
    assert 1.0 < r.low < r.value < r.high < 1.6
    assert r.verdict == "faster" and not r.inconclusive
    assert r.text().startswith(f"{r.value:.2f}x [{r.low:.2f}, {r.high:.2f}] faster")
    assert r.runs == (3, 3) and 0 < r.detectable < 0.05


def test_one_run_a_side_gives_the_ratio_but_no_verdict():
    r = rate_ratio(_steps(0.68, 0.01, 1), _steps(1.0, 0.01, 2))
    assert r.value == pytest.approx(1.47, abs=0.02) and not r.has_ci and r.single_run
    assert r.verdict == "no verdict" and r.inconclusive
    assert r.text() == f"{r.value:.2f}x, 1 run each: no between-run variance, no verdict"
    mixed = rate_ratio(_runs(0.68, 0.01, 1), _steps(1.0, 0.01, 2))
    assert mixed.runs == (3, 1) and mixed.verdict == "no verdict" and "3 vs 1 runs" in mixed.text()


def test_the_run_level_spread_is_in_the_interval():
    """Runs whose medians differ widen the interval, even when each run's steps are quiet."""
    quiet = rate_ratio(_runs(1.0, 0.005, 3), _runs(1.0, 0.005, 4))
    offsets = [0.94, 1.0, 1.06]
    spread = rate_ratio([[x * o for x in run] for run, o in zip(_runs(1.0, 0.005, 3), offsets, strict=True)],
                        _runs(1.0, 0.005, 4))
    assert spread.high / spread.low > 3 * (quiet.high / quiet.low - 1) + 1
    assert spread.low < 1.0 < spread.high and spread.verdict == "within noise"


def test_block_length_and_the_small_sample_t_multiplier():
    assert [block_length(n) for n in (1, 4, 12, 20, 50)] == [1, 2, 3, 4, 7]
    # three runs a side: sqrt(3/2) * t(4) = 1.22 * 2.78 bootstrap standard errors
    assert t_multiplier((3, 3), 0.95) == pytest.approx(3.4004, abs=1e-3)
    assert t_multiplier((2, 2), 0.95) > t_multiplier((3, 3), 0.95) > t_multiplier((10, 10), 0.95) > 1.96


def test_a_change_inside_the_noise_has_an_interval_that_includes_one():
    r = rate_ratio(_runs(0.95, 0.15, 3), _runs(1.0, 0.15, 4))
    assert r.low < 1.0 < r.high
    assert r.verdict == "within noise"
    assert r.inconclusive == (abs(r.value - 1) >= PRACTICAL_CHANGE)


def test_a_tiny_change_is_within_noise_even_when_the_interval_is_tight():
    same = _runs(1.0, 0.001, 5)
    r = rate_ratio([[s / 1.005 for s in run] for run in same], same)
    assert r.excludes(1.0) and r.verdict == "within noise"


def test_slower_and_the_inverse():
    r = rate_ratio(_runs(1.3, 0.01, 6), _runs(1.0, 0.01, 7))
    assert r.verdict == "slower"
    inv = r.inverse()
    assert inv.value == pytest.approx(1 / r.value) and inv.low == pytest.approx(1 / r.high)
    assert inv.verdict == "faster"


def test_work_per_step_scales_the_ratio():
    steps = _runs(1.0, 0.01, 8)
    assert rate_ratio(steps, steps, num_work=2.0).value == pytest.approx(2.0)


def test_the_interval_is_reproducible_and_needs_enough_samples():
    a, b = _runs(0.9, 0.05, 9), _runs(1.0, 0.05, 10)
    assert rate_ratio(a, b) == rate_ratio(a, b)
    few = rate_ratio([run[:3] for run in a], [run[:3] for run in b])
    assert not few.has_ci and few.verdict == "no verdict" and "under 5 timed steps" in few.text()
    assert rate_ratio([], b) is None and rate_ratio([float("nan")] * 5, b) is None


def test_median_ci_and_cv():
    steps = _steps(2.0, 0.05, 11, n=40)
    lo, hi = median_ci(steps)
    assert lo < 2.0 < hi and hi - lo < 0.1
    assert median_ci(steps[:3]) is None
    assert cv(steps) == pytest.approx(0.05, abs=0.015)
    assert cv([1.0]) != cv([1.0])  # NaN


def test_metric_ratio_uses_tokens_per_step_and_world_size():
    steps = _runs(1.0, 0.01, 12)
    num = {"tokens_per_step": 4096, "world_size": 2, "step_runs": steps}
    den = {"tokens_per_step": 4096, "world_size": 4, "step_runs": steps}
    assert metric_ratio(num, den).value == pytest.approx(2.0) and metric_ratio(num, den).runs == (3, 3)
    one = {"tokens_per_step": 4096, "world_size": 4, "step_times_s": steps[0]}
    assert metric_ratio(num, one).runs == (3, 1)
    assert metric_ratio(num, den, "tokens_per_s").value == pytest.approx(1.0)
    assert metric_ratio(num, den, "peak_mem_bytes") is None


def test_the_gate_and_the_report_compute_the_same_interval(tmp_path):
    smoke = fixture_store("smoke")
    base = by_point(load_tables([repeated_store(smoke, tmp_path / "b", noise=0.02, seed=1)])[0])
    cur = by_point(load_tables([repeated_store(smoke, tmp_path / "c", factor=0.9, noise=0.02, seed=2)])[0])
    b, c = base.iloc[0], cur.iloc[0]
    assert b["runs"] == c["runs"] == 3 and len(c["step_runs"]) == 3
    gate = compare_metric(MetricRule("tokens_per_s_per_device", 0.05, True), b, c, alpha=0.05, min_samples=5)
    shown = metric_ratio(c, b)
    assert (gate.ci_low, gate.ci_high) == (shown.low, shown.high)
    assert gate.verdict == "regressed" and shown.verdict == "slower"
