"""Layouts are checked before any process starts; a crashed rank never hangs the others."""

import os
import subprocess
import sys
import time

import pytest

from moebench.errors import ConfigError
from moebench.layout import pipeline_layer_ranges, rank_stage_ids, validate_layout
from moebench.presets import load_config


@pytest.mark.parametrize(
    "overrides,world,messages",
    [
        (["parallel.dp=3", "train.global_batch_size=12", "train.micro_batch_size=2"], 4,
         ["parallel.dp=3 x parallel.pp=1 = 3 ranks but the world size is 4", "would fit: dp=4 pp=1, dp=2 pp=2"]),
        (["parallel.dp=4", "parallel.ep=3", "train.micro_batch_size=2"], 4,
         ["parallel.ep=3 does not divide parallel.dp=4", "moe.num_experts=8 is not divisible by parallel.ep=3"]),
        (["parallel.dp=1", "parallel.pp=4", "model.n_layers=2"], 4,
         ["model.n_layers=2 cannot be split over parallel.pp=4 stages: every stage needs a layer"]),
        (["parallel.dp=2", "parallel.strategy=fsdp", "parallel.dist_opt=true"], 2, ["fsdp already shards"]),
        (["parallel.pp=2", "parallel.pp_schedule=interleaved-1f1b", "parallel.pp_virtual_stages=4",
          "model.n_layers=6"], 2,
         ["model.n_layers=6 cannot be split over 8 pipeline stages (parallel.pp=2 x parallel.pp_virtual_stages=4",
          "pp_virtual_stages could be at most 3"]),
        (["parallel.pp=2", "parallel.pp_virtual_stages=4", "model.n_layers=8"], 2,
         ["parallel.pp_virtual_stages=4 needs parallel.pp_schedule=interleaved-1f1b (1f1b runs one stage a rank)"]),
        (["parallel.pp=2", "parallel.pp_schedule=interleaved-1f1b", "parallel.pp_virtual_stages=1"], 2,
         ["parallel.pp_virtual_stages=1 with parallel.pp_schedule=interleaved-1f1b"]),
        (["parallel.pp=2", "parallel.pp_virtual_stages=0"], 2, ["parallel.pp_virtual_stages=0 must be >= 1"]),
        (["parallel.pp=2", "parallel.pp_schedule=interleaved-1f1b", "model.n_layers=4", "parallel.pp_microbatches=5",
          "train.micro_batch_size=5", "train.global_batch_size=10"], 2,
         ["parallel.pp_microbatches=5 under interleaved-1f1b must be a multiple of its 2 rounds"]),
        (["parallel.pp=2", "model.n_layers=3", "parallel.pp_layers=2,2"], 2,
         ["parallel.pp_layers=2,2 must give each of the 2 pipeline stages (pp=2 x 1 virtual) at least one layer, "
          "summing to model.n_layers=3"]),
        (["parallel.pp=2", "model.n_layers=3", "parallel.pp_layers=3"], 2, ["parallel.pp_layers=3 must give"]),
        (["parallel.pp=2", "model.n_layers=3", "parallel.pp_layers=3,0"], 2, ["at least one layer"]),
        (["parallel.dp=2", "parallel.pp=2", "train.micro_batch_size=3", "train.global_batch_size=6"], 4,
         ["not divisible by parallel.pp_microbatches=2"]),
        (["parallel.dp=2", "parallel.ep=2", "parallel.pp=2", "parallel.strategy=fsdp"], 4,
         ["parallel.strategy=fsdp with pp > 1 runs with ep=1 only"]),
    ],
)
def test_impossible_layouts_list_every_problem(overrides, world, messages):
    cfg = load_config("tiny", overrides)
    with pytest.raises(ConfigError) as err:
        validate_layout(cfg, world)
    for message in messages:
        assert message in str(err.value)


def test_valid_layouts_pass():
    validate_layout(load_config("tiny", ["parallel.dp=4", "parallel.ep=4", "train.micro_batch_size=2"]), 4)
    validate_layout(load_config("tiny", ["parallel.dp=2", "parallel.ep=2", "parallel.pp=2"]), 4)
    validate_layout(load_config("tiny", ["parallel.dp=2", "parallel.pp=2", "parallel.strategy=fsdp"]), 4)
    validate_layout(load_config("tiny", ["parallel.pp=2", "parallel.pp_schedule=interleaved-1f1b",
                                         "parallel.pp_virtual_stages=3", "model.n_layers=7"]), 2)
    validate_layout(load_config("tiny", ["parallel.pp=2", "model.n_layers=3", "parallel.pp_layers=1,2"]), 2)


def test_pipeline_layer_ranges_follow_pp_layers_and_loop_over_ranks():
    cfg = load_config("tiny", ["parallel.pp=2", "parallel.pp_schedule=interleaved-1f1b", "parallel.pp_virtual_stages=3",
                               "model.n_layers=7"])
    assert [len(r) for r in pipeline_layer_ranges(cfg)] == [2, 1, 1, 1, 1, 1]  # the first n_layers % 6 one more
    assert rank_stage_ids(cfg, 0) == [0, 2, 4] and rank_stage_ids(cfg, 1) == [1, 3, 5]
    cfg.parallel.pp_layers = (1, 1, 1, 1, 2, 1)
    assert pipeline_layer_ranges(cfg) == [range(0, 1), range(1, 2), range(2, 3), range(3, 4), range(4, 6),
                                          range(6, 7)]


def _moebench(*args, env=None, timeout=240):
    return subprocess.run([sys.executable, "-m", "moebench.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


@pytest.mark.slow
def test_cli_rejects_layout_before_launch():
    start = time.monotonic()
    result = _moebench("train", "--nproc", "2", "--set", "parallel.dp=2", "--set", "parallel.ep=3",
                       "--set", "train.micro_batch_size=2")
    assert result.returncode == 2
    assert "parallel.ep=3 does not divide parallel.dp=2" in result.stderr
    assert "Traceback" not in result.stderr
    assert time.monotonic() - start < 60  # rejected up front, no ranks were started


@pytest.mark.slow
def test_layout_needing_ranks_without_nproc():
    result = _moebench("train", "--set", "parallel.dp=2", "--steps", "4")
    assert result.returncode == 2
    assert "launch with --nproc 2" in result.stderr


@pytest.mark.slow
def test_crashed_rank_ends_the_run():
    """Rank 1 dies at step 1 while rank 0 waits in a collective: the launch ends, non-zero."""
    result = _moebench("train", "--nproc", "2", "--set", "parallel.dp=2", "--steps", "4", "--json",
                       env={"MOEBENCH_INJECT_FAILURE": "1:1", "MOEBENCH_DIST_TIMEOUT_S": "60"}, timeout=200)
    assert result.returncode != 0
    # the failing rank's own error, not torchrun's ChildFailedError nor rank 0's closed connection
    assert result.stderr.splitlines()[-1] == (
        "error: rank 1: RuntimeError: injected failure on rank 1 at step 1 (MOEBENCH_INJECT_FAILURE)")
