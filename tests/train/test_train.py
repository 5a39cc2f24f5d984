"""The single-process trainer: learning, determinism, the run record, accumulation."""

import json
import math
import time

import pytest
import torch

from moebench.errors import ConfigError
from moebench.presets import load_config
from moebench.record import REQUIRED_FIELDS, to_json_line
from moebench.run_record import useful_throughput
from moebench.train.data import TokenStream, micro_batches
from moebench.train.run import run_training, step_counter


def test_tiny_learns_the_markov_stream():
    cfg = load_config("tiny")
    start = time.perf_counter()
    record = run_training(cfg)
    elapsed = time.perf_counter() - start
    print(f"tiny: {cfg.train.steps} steps in {elapsed:.1f}s, loss {record['loss_first']:.3f}"
          f" -> {record['loss_last']:.3f}")
    assert record["status"] == "ok"
    assert record["loss_first"] == pytest.approx(math.log(cfg.model.vocab_size), abs=0.3)
    assert record["loss_first"] - record["loss_last"] >= 1.0


def test_same_seed_same_losses_and_record_fields():
    cfg = load_config("tiny", ["train.steps=4", "train.warmup_steps=1"])
    a, b = run_training(cfg), run_training(cfg)
    assert a["losses"] == b["losses"]
    other = run_training(load_config("tiny", ["train.steps=4", "train.warmup_steps=1", "train.seed=1"]))
    assert other["losses"] != a["losses"]
    for key in REQUIRED_FIELDS:
        assert key in a, key
    assert len(a["step_times_s"]) == a["timed_steps"] == 3
    assert a["step_time_median_s"] == sorted(a["step_times_s"])[1]
    assert a["tokens_per_s"] == pytest.approx(cfg.tokens_per_step / a["step_time_median_s"])
    assert a["tflops_per_device"] == pytest.approx(a["tokens_per_s"] * cfg.flops_per_token() / 1e12)
    assert 0 < a["mfu"] < 1 and "calibration" in a["peak_flops_source"]
    assert a["config"] == cfg.to_dict() and a["total_params"] == cfg.total_params()
    assert len(a["expert_load_max_over_mean"]) == 4 and all(v >= 1.0 for v in a["expert_load_max_over_mean"])
    assert json.loads(to_json_line(a))["config_hash"] == cfg.hash()
    # one process drops nothing: every model FLOP is useful
    assert a["useful_flops_per_step"] == cfg.flops_per_token() * cfg.tokens_per_step
    assert a["useful_mfu"] == pytest.approx(a["mfu"])
    assert a["padding_flops_per_step"] == 0.0  # only native fp8 computes padding rows (test_padding_flops.py)


def test_useful_flops_leave_out_dropped_routes():
    """A dropped route skips one expert's forward and backward: 6 x its parameters."""
    cfg = load_config("tiny")
    # 40 routes dropped over 2 timed steps, a 0.5 s median step on 2 ranks
    args = (cfg.flops_per_token(), cfg.expert_params(), cfg.tokens_per_step, 2, 40 / 2, 0.5)
    got = useful_throughput(*args, 1e12)
    useful = cfg.flops_per_token() * cfg.tokens_per_step - 20 * 6 * cfg.expert_params()
    assert got["useful_flops_per_step"] == useful
    assert got["useful_tflops_per_device"] == pytest.approx(useful / 0.5 / 2 / 1e12)
    assert got["useful_mfu"] == pytest.approx(useful / 0.5 / 2 / 1e12)
    assert useful_throughput(*args, None)["useful_mfu"] is None


def test_accumulation_matches_one_big_micro_batch():
    """Two micro-batches of 4 give the same update as one of 8 (fp32, reordered sums)."""
    common = ["train.steps=3", "train.warmup_steps=0", "train.global_batch_size=8", "moe.routing=uniform"]
    one = run_training(load_config("tiny", [*common, "train.micro_batch_size=8"]))
    two = run_training(load_config("tiny", [*common, "train.micro_batch_size=4"]))
    assert one["losses"] == pytest.approx(two["losses"], rel=1e-5)


def test_data_is_deterministic_and_split_by_rank():
    stream = TokenStream("markov", vocab_size=50, seq_len=16, seed=3)
    batch = stream.global_batch(step=5, num_seqs=8)
    assert torch.equal(batch, stream.global_batch(step=5, num_seqs=8))
    assert not torch.equal(batch, stream.global_batch(step=6, num_seqs=8))
    # every transition is one of the chain's successors
    prev, nxt = batch[:, :-1].reshape(-1), batch[:, 1:].reshape(-1)
    assert (stream.successors_VK[prev] == nxt[:, None]).any(dim=1).all()
    parts = [micro_batches(batch, r, 2, 2) for r in range(2)]
    rows = torch.cat([torch.cat([x for x, _ in p]) for p in parts])
    assert torch.equal(rows, batch[:, :-1])
    assert stream.entropy_rate() < math.log(50) / 2


@pytest.mark.slow
def test_peak_rss_is_this_process_not_its_parent():
    """A child started from a big parent reports its own peak, not the parent's size."""
    import subprocess
    import sys

    # 1 GiB held by this (parent) process: above what importing torch costs the child (a CUDA
    # build of torch alone maps ~500 MB)
    ballast = torch.ones(256 * 2**20)
    code = "from moebench.metrics.memory import peak_rss_bytes; print(peak_rss_bytes())"
    child = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    from moebench.metrics.memory import peak_rss_bytes

    assert peak_rss_bytes() > ballast.numel() * 4
    assert child < ballast.numel() * 4


def test_run_training_refuses_what_one_cpu_process_cannot_run(monkeypatch):
    """Called from Python too (not only through the CLI): an EP layout on one process would train
    unsharded under an EP label, and Triton kernels do not compile for the CPU."""
    with pytest.raises(ConfigError, match=r"parallel\.ep=2 does not divide parallel\.dp=1"):
        run_training(load_config("tiny", ["parallel.ep=2"]))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match=r"moe\.backend=triton"):
        run_training(load_config("tiny", ["moe.backend=triton", "train.device=cpu"]))


def test_a_model_too_big_for_this_machine_is_an_oom_record(monkeypatch):
    """qwen3-30b-a3b on a CPU host: its fp32 weights, gradients and AdamW moments alone (16 bytes a
    parameter) exceed the memory available, so nothing is allocated (allocating it gave a traceback
    or the kernel's OOM killer)."""
    import moebench.train.run as run

    monkeypatch.setattr(run, "available_host_bytes", lambda: 64 * 2**30)
    record = run_training(load_config("qwen3-30b-a3b", ["train.steps=3", "train.device=cpu"]))
    assert record["status"] == "oom"
    assert record["error"] == ("weights, gradients and AdamW moments of 30,532,122,624 parameters need at "
                               "least 455.0 GiB; this machine has 64.0 GiB available")


def test_an_allocation_the_cpu_allocator_refuses_is_an_oom_record(monkeypatch):
    """A real failed malloc (4 PiB, beyond any address space): torch raises a plain RuntimeError."""
    import moebench.train.run as run

    def huge(*args, **kwargs):
        torch.empty(2**50)

    monkeypatch.setattr(run, "build_model", huge)
    record = run_training(load_config("tiny", ["train.steps=3"]))
    assert record["status"] == "oom" and record["error"].startswith("DefaultCPUAllocator: can't allocate memory")

    def broken(*args, **kwargs):
        raise RuntimeError("not about memory")

    monkeypatch.setattr(run, "build_model", broken)
    with pytest.raises(RuntimeError, match="not about memory"):
        run_training(load_config("tiny", ["train.steps=3"]))


def test_a_loss_that_goes_nan_makes_the_run_diverged_not_ok():
    record = run_training(load_config("tiny", ["train.steps=4", "train.warmup_steps=1", "train.lr=1e30",
                                                "train.profile_steps=0"]))
    assert record["status"] == "diverged"
    assert record["error"] == "loss is nan at step 3 of 4 (the run diverged)"
    assert "NaN" not in to_json_line(record)  # the store line holds null where the loss was NaN


def test_step_lines_count_warmup_and_timed_steps_apart():
    """An adaptive warm-up of unknown length moves no denominator: warm-up steps count against the cap,
    timed steps against the timed window."""
    from moebench.config import TrainConfig

    adaptive = TrainConfig(steps=12, warmup_steps=2, max_warmup_steps=50)
    lines = [step_counter(step, min(step + 1, 7), adaptive) for step in range(7 + 10)]  # it settled after 7
    assert lines[:2] == ["warmup    1/≤50", "warmup    2/≤50"] and lines[6] == "warmup    7/≤50"
    assert lines[7] == "step    1/10" and lines[-1] == "step   10/10"
    assert {line.split("/")[1] for line in lines} == {"≤50", "10"}
    fixed = TrainConfig(steps=5, warmup_steps=2)
    assert [step_counter(step, min(step + 1, 2), fixed) for step in range(5)] == [
        "warmup    1/2", "warmup    2/2", "step    1/3", "step    2/3", "step    3/3"]


def test_the_step_lines_reach_stderr_with_their_counters(capsys):
    cfg = load_config("tiny")
    cfg.train.steps, cfg.train.warmup_steps = 3, 1
    run_training(cfg)
    lines = [line.split("  loss")[0] for line in capsys.readouterr().err.splitlines() if "  loss " in line]
    assert lines == ["warmup    1/1", "step    1/2", "step    2/2"]


def test_cpu_threads_sets_the_ranks_torch_threads_and_the_record_says_so():
    """train.cpu_threads=1 (the gate-cpu suite's steady CPU clock) computes on one thread whatever the
    process had; 0 keeps what it had."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        short = ["train.steps=3", "train.warmup_steps=1", "train.profile_steps=0", "train.device=cpu"]
        assert run_training(load_config("tiny", [*short, "train.cpu_threads=1"]))["cpu_threads"] == 1
        torch.set_num_threads(2)
        assert run_training(load_config("tiny", short))["cpu_threads"] == 2
    finally:
        torch.set_num_threads(before)
