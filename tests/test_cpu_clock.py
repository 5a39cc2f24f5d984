"""The step's CPU clock: process CPU time beside the wall time of every timed step, which waiting for
a core (or sleeping) does not lengthen and computing does."""

import time

import pytest
import torch

from moebench.metrics.timer import StepTimer
from moebench.presets import load_config
from moebench.testing import run_distributed
from moebench.train.run import run_training


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
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
    # computing for 0.2 s of wall time costs CPU time; a co-tenant may take some of it, never half of
    # a 2-core machine's share unless the load passes 4 (and then it costs more wall time, not less CPU)
    assert worked > 0.05


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
