"""The step's CPU clock: process CPU time beside the wall time of every timed step, which waiting for
a core (or sleeping) does not lengthen and computing does."""

import time

import pytest
import torch
from report_helpers import edited_store, fixture_store, repeated_store

from moebench.metrics.timer import StepTimer
from moebench.presets import load_config
from moebench.report.build import load_tables
from moebench.results.stats import NO_VERDICT, metric_ratio
from moebench.results.table import by_point
from moebench.testing import run_distributed
from moebench.train.run import run_training

SMOKE = fixture_store("smoke")


def _busy(cpu_seconds: float) -> None:
    """Compute until the process has used ``cpu_seconds`` of CPU time, however long a loaded machine
    makes that take on the wall."""
    end = time.process_time() + cpu_seconds
    while time.process_time() < end:
        pass


def test_cpu_samples_count_work_not_waiting():
    timer = StepTimer(torch.device("cpu"), warming=True)
    timer.start()
    _busy(0.05)
    timer.stop()  # a warm-up step: neither clock keeps it
    timer.end_warmup()
    timer.start()
    time.sleep(0.2)
    timer.stop()
    timer.start()
    _busy(0.2)
    timer.stop()
    assert len(timer.samples) == len(timer.cpu_samples) == 2
    slept, worked = timer.cpu_samples
    assert timer.samples[0] >= 0.2 and slept < 0.05  # 0.2 s on the wall, next to no CPU time
    # 0.2 s of computing is 0.2 s of CPU time at any load (the wall time it takes grows with the load);
    # the margin is the start and stop around the loop
    assert 0.2 <= worked < 0.25


def test_a_real_run_records_its_cpu_time():
    record = run_training(load_config("tiny", ["train.steps=4", "train.warmup_steps=1", "train.profile_steps=0"]))
    cpu = record["step_cpu_times_s"]
    assert len(cpu) == record["timed_steps"] == 3
    assert all(c > 0 for c in cpu)
    assert record["step_cpu_median_s"] == pytest.approx(sorted(cpu)[1])


def _cpu_times(overrides):
    record = run_training(load_config("tiny", ["train.steps=3", "train.warmup_steps=1", "train.profile_steps=0",
                                               *overrides]))
    return record["step_cpu_times_s"]


@pytest.mark.slow
def test_every_rank_records_the_steps_cpu_time_over_all_ranks():
    a, b = run_distributed(_cpu_times, 2, ["parallel.dp=2"])
    assert a == b and len(a) == 2 and all(c > 0 for c in a)  # reduced: one figure per step for the run


def _cpu_row(cpu_runs, wall_runs=None, unsteady=None):
    """A folded point: its runs' wall and CPU step times, 1,000 tokens a step."""
    wall_runs = wall_runs or [[0.1] * 8 for _ in cpu_runs]
    return {"tokens_per_step": 1000, "world_size": 2, "step_runs": wall_runs, "cpu_step_runs": cpu_runs,
            "unsteady": unsteady}


def test_tokens_per_cpu_s_is_judged_on_the_cpu_times():
    """Equal wall times, 20% more CPU time a step: the CPU clock says 1/1.2, the wall clock unchanged."""
    base = _cpu_row([[0.20, 0.21, 0.19, 0.20, 0.20, 0.20], [0.20, 0.20, 0.21, 0.19, 0.20, 0.20]])
    more = _cpu_row([[0.24, 0.25, 0.23, 0.24, 0.24, 0.24], [0.24, 0.24, 0.25, 0.23, 0.24, 0.24]])
    cpu = metric_ratio(more, base, "tokens_per_cpu_s")
    assert cpu.value == pytest.approx(1 / 1.2) and cpu.verdict == "slower"
    assert metric_ratio(more, base, "tokens_per_s").value == pytest.approx(1.0)
    # a wall-clock window that moved with the load leaves the CPU clock's verdict standing
    unsteady = {**more, "unsteady": "unsteady timed window in 2 of 2 runs (window drift 1.30)"}
    assert metric_ratio(unsteady, base, "tokens_per_cpu_s").verdict == "slower"
    assert metric_ratio(unsteady, base, "tokens_per_s").verdict == NO_VERDICT


def test_a_point_folds_its_runs_cpu_times(tmp_path):
    cpu = {0: [0.30] * 10, 1: [0.34] * 10, 2: [0.32] * 10}
    store = edited_store(repeated_store(SMOKE, tmp_path / "three", 3), tmp_path / "s",
                         lambda r: {**r, "step_cpu_times_s": cpu[r["repeat"]]})
    points = by_point(load_tables([store])[0])
    row = points.iloc[0]
    assert row["cpu_step_runs"] == [cpu[0], cpu[1], cpu[2]]
    assert row["tokens_per_cpu_s"] == pytest.approx(row["tokens_per_step"] / 0.32)
    # records from before the CPU clock: no CPU rate, no CPU ratio, the wall clock as before
    old = by_point(load_tables([repeated_store(SMOKE, tmp_path / "old", 3)])[0])
    assert old["tokens_per_cpu_s"].isna().all()
    assert metric_ratio(old.iloc[0], old.iloc[1], "tokens_per_cpu_s") is None
