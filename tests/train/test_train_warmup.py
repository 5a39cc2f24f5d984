"""The adaptive warm-up (train.max_warmup_steps): the steady rule on scripted step times, its
decision shared by every rank, the timed window's drift, the reference GEMM around the window,
and the fields of a real run."""

from types import SimpleNamespace

import pytest
import torch

from moebench.errors import ConfigError
from moebench.metrics.steady import WINDOW, still_warming, window_drift
from moebench.metrics.timer import StepTimer
from moebench.presets import load_config
from moebench.record import WINDOW_DRIFT_LIMIT, window_drifting
from moebench.testing import run_distributed
from moebench.train.run import run_training
from moebench.train.trainer import Trainer


def warmup_used(times: list[float], min_steps: int, max_steps: int) -> int:
    """How many of the scripted step times the rule spends warming up."""
    n = 0
    while n < len(times) and still_warming(times[:n], min_steps, max_steps):
        n += 1
    return n


def test_fixed_warmup_when_no_cap():
    falling = [10.0 / (i + 1) for i in range(20)]
    assert warmup_used(falling, 2, 0) == 2
    assert warmup_used(falling, 3, 3) == 3  # a cap equal to the minimum is the fixed warm-up
    assert warmup_used(falling, 0, 0) == 0


def test_flat_times_stop_once_two_windows_exist():
    assert warmup_used([1.0] * 20, 2, 10) == 2 * WINDOW
    assert warmup_used([1.0] * 20, 8, 10) == 8  # the minimum is always spent


def test_still_falling_times_warm_up_to_the_cap():
    falling = [2.0 * 0.9**i for i in range(20)]  # -10% a step: each median of 3 is 27% below the last
    assert warmup_used(falling, 2, 12) == 12


def test_a_trend_that_settles_ends_the_warmup():
    # falling for 6 steps, then flat: after 11 steps the last two medians of 3 are both 1.0 (after
    # 10 the older one still holds the 1.1 step: 1.0 is 9% below it)
    times = [3.0, 2.5, 2.0, 1.6, 1.3, 1.1] + [1.0] * 14
    assert warmup_used(times, 2, 16) == 11


def test_one_outlier_neither_ends_nor_extends_it():
    flat_with_spike = [1.0, 1.0, 1.0, 1.0, 5.0, 1.0] + [1.0] * 10
    assert warmup_used(flat_with_spike, 2, 12) == 2 * WINDOW  # median of 3 ignores the spike
    falling = [2.0 * 0.9**i for i in range(20)]
    falling[5] = 0.01  # one fast step amid a falling series
    assert warmup_used(falling, 2, 12) == 12


def test_noise_below_the_tolerance_does_not_extend_it():
    gen = torch.Generator().manual_seed(0)
    noisy = (1.0 + 0.01 * torch.randn(30, generator=gen)).tolist()  # 1% step noise, no trend
    assert warmup_used(noisy, 2, 20) <= 2 * WINDOW + 2


def test_window_drift_and_its_flag():
    assert window_drift([1.0]) is None
    assert window_drift([1.0, 1.0, 1.0, 1.0]) == pytest.approx(1.0)
    assert window_drift([2.0, 2.0, 9.0, 1.0, 1.0]) == pytest.approx(0.5)  # the middle step in neither half
    assert window_drifting(None) is None
    assert window_drifting(1.0 + WINDOW_DRIFT_LIMIT / 2) is False
    assert window_drifting(1.0 - 2 * WINDOW_DRIFT_LIMIT) is True


def test_step_timer_times_after_end_warmup():
    timer = StepTimer(torch.device("cpu"), warming=True)
    for _ in range(2):
        timer.start()
        timer.stop()
    timer.end_warmup()
    timer.start()
    timer.stop()
    assert (len(timer.warmup_samples), len(timer.samples)) == (2, 1)


def test_max_warmup_steps_is_validated():
    with pytest.raises(ConfigError, match="max_warmup_steps"):
        load_config("tiny", ["train.warmup_steps=3", "train.max_warmup_steps=2"])
    with pytest.raises(ConfigError, match="max_warmup_steps"):
        load_config("tiny", ["train.max_warmup_steps=-1"])
    assert load_config("tiny", ["train.max_warmup_steps=0"]).train.max_warmup_steps == 0


def _settle_scripted(times_by_rank: list[list[float]]) -> int:
    """On each rank: feed this rank's scripted step times through the trainer's settle step, as
    the trainer does after each warm-up step; return how many warm-up steps it took."""
    import os

    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    try:
        cfg = load_config("tiny", ["train.steps=30", "train.warmup_steps=2", "train.max_warmup_steps=12"])
        trainer = SimpleNamespace(cfg=cfg, device=torch.device("cpu"), warmup_times=[],
                                  timer=StepTimer(torch.device("cpu"), warming=True))
        for t in times_by_rank[rank]:
            if not trainer.timer.warming:
                break
            Trainer._settle(trainer, t)
        return len(trainer.warmup_times)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_every_rank_warms_up_alike():
    # rank 0 alone would stop after 6 flat steps; rank 1 is still speeding up to the cap: the rule
    # reads the slowest rank's times, so both take the cap (a mismatch would deadlock collectives)
    flat, falling = [0.1] * 20, [2.0 * 0.9**i for i in range(20)]
    assert warmup_used(flat, 2, 12) == 6
    assert run_distributed(_settle_scripted, 2, [flat, falling], timeout=120) == [12, 12]


def test_a_real_run_records_its_warmup_and_drift():
    record = run_training(load_config("tiny", ["train.steps=5", "train.warmup_steps=1",
                                               "train.max_warmup_steps=4", "train.profile_steps=0"]))
    used = record["warmup_steps_used"]
    assert 1 <= used <= 4
    assert (record["warmup_steps"], record["max_warmup_steps"], record["timed_steps"]) == (1, 4, 4)
    assert len(record["warmup_step_times_s"]) == used
    assert len(record["losses"]) == used + 4  # the timed window keeps its length
    assert record["window_drift"] > 0
    assert isinstance(record["window_drifting"], bool)
    # the machine's speed around the timed window, and throughput per unit of it
    assert record["reference_flops_before"] > 0 and record["reference_flops_after"] > 0
    ratio = record["reference_flops_after"] / record["reference_flops_before"]
    assert record["reference_drift"] == pytest.approx(ratio)
    mean_gflops = (record["reference_flops_before"] + record["reference_flops_after"]) / 2e9
    assert record["tokens_per_reference_gflop"] == pytest.approx(record["tokens_per_s"] / mean_gflops)

    fixed = run_training(load_config("tiny", ["train.steps=4", "train.warmup_steps=1", "train.profile_steps=0"]))
    assert (fixed["warmup_steps_used"], fixed["timed_steps"], len(fixed["losses"])) == (1, 3, 4)
