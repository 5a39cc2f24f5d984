"""The planner against the dry run of the real trainer (fake tensors, fake process group) at every shipped
layout family on the small preset: memory per rank (model state by part, and the peak) and bytes per mesh
axis within 5% (docs/plan.md, "Dry run of the real trainer"). tests/plan/test_plan_verify.py looks closer at one
layout (EP, PP and the distributed optimizer together)."""

from __future__ import annotations

import pytest

from moebench.devices import get_device
from moebench.plan import memory
from moebench.plan.precision import plan_precision
from moebench.plan.stages import stages
from moebench.plan.verify import verify
from moebench.presets import load_config
from moebench.train import dry_run
from moebench.train.dry_run import dry_config, run_ranks

TOLERANCE = 0.05  # the bar for memory per rank and bytes per axis
FAMILIES = {  # the ddp families: every quantity below within 5%
    "ddp": ["parallel.dp=2"],
    "ddp+ep rowwise": ["parallel.dp=2", "parallel.ep=2", "parallel.dispatcher=rowwise"],
    "ddp+ep+pp": ["parallel.dp=2", "parallel.ep=2", "parallel.pp=2", "parallel.dispatcher=rowwise",
                  "train.micro_batch_size=2"],
    "dist_opt": ["parallel.dp=2", "parallel.dist_opt=true"],
    # small activations: the optimizer step's phase would set the peak if it had temporaries; torch's fused
    # AdamW has none (planned with foreach's list-wide sqrt(exp_avg_sq), 0.938 of the dry run)
    "ddp backward-bound": ["parallel.dp=2", "train.global_batch_size=2", "train.micro_batch_size=1",
                           "model.seq_len=32"],
    # the distributed optimizer's step makes its AdamW denominator one flat buffer's shard at a time: bf16 peaks
    # in the backward (the weight copies), fp32 (no copies) in the step, on the experts' 18 MiB shard
    "dist_opt backward-bound": ["parallel.dp=2", "parallel.dist_opt=true", "train.global_batch_size=2",
                                "train.micro_batch_size=1", "model.seq_len=32"],
    "dist_opt step-bound": ["parallel.dp=2", "parallel.dist_opt=true", "train.global_batch_size=2",
                            "train.micro_batch_size=1", "model.seq_len=32", "precision.mode=fp32"],
}
# what a rank holds, by part, and its peak; saved activations and transient split the rest of the peak
# by when it falls in the step (test_plan_verify.py: test_activation_split_at_the_first_stage)
MEMORY = ("memory parameters", "memory gradients", "memory optimizer_state", "memory comm_buffers", "memory peak")


def _misses(result) -> list[str]:
    out = []
    for row in result["rows"]:
        if row["quantity"] in MEMORY or row["quantity"].endswith("bytes per step"):
            if row["planned"] == row["dry_run"] == 0:
                continue
            if row["ratio"] is None or abs(row["ratio"] - 1) > TOLERANCE:
                out.append(f"rank {row['rank']} {row['quantity']}: plan {row['planned']:,.0f}, "
                           f"dry run {row['dry_run']:,.0f}")
    return out


# two rank positions (first and last stage), so about twice the others' time
@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.slow) if "pp" in f else f
                                    for f in sorted(FAMILIES)])
def test_plan_equals_the_dry_run(family):
    result = verify(load_config("small", FAMILIES[family]))
    quantities = {row["quantity"] for row in result["rows"]}
    assert {"memory peak", "memory parameters"} <= quantities and any(q.endswith("bytes per step") for q in quantities)
    assert _misses(result) == [], family


def test_ddp_gradient_clip_copies_no_gradient_buffer():
    """The gradient norm of the clip is a norm reduction over each flat buffer: its square() made an fp32
    copy of the dense buffer (36 MiB here), on which the dry run of the backward-bound ddp family peaked,
    1.035x the plan; without it 1.011x (the backward's own peak)."""
    result = verify(load_config("small", FAMILIES["ddp backward-bound"]))
    peak = next(row for row in result["rows"] if row["quantity"] == "memory peak")
    assert abs(peak["ratio"] - 1) <= 0.015, peak


def test_dist_opt_step_holds_one_shards_denominator():
    """Where the step sets the peak, the plan is the dry run's to 0.1%: the model state and sqrt(v) over the
    largest shard (18 MiB here). Counting both shards' (26.15 MiB) would plan 3.6% above; sqrt(v) and its scaled
    copy over both (52.31 MiB, the earlier plan), 15% above."""
    cfg = load_config("small", FAMILIES["dist_opt step-bound"])
    result = verify(cfg)
    peak = next(row for row in result["rows"] if row["quantity"] == "memory peak")
    assert abs(peak["ratio"] - 1) <= 0.001, peak
    mem = memory.stage_memory(cfg, plan_precision(cfg, get_device("h200")), stages(cfg)[0])
    assert mem.total == mem.state + mem.optimizer_step_temp > mem.state + mem.forward_backward


FSDP = ["parallel.dp=2", "parallel.strategy=fsdp"]
# where fsdp's step peaks (docs/plan.md, "Dry run of the real trainer", gives the figures): at the end of its one
# forward (no gradient yet, the root gathered, the logits alive); in a layer's backward, the gradients of the
# layers above made (backward-bound: small activations); in the backward of a second micro-batch, every
# gradient there from the first; under per-layer recompute, inside the first layer's backward, its forward
# recomputed and the second layer's reduce-scatter input still held
FSDP_PEAKS = {
    "one micro-batch": [],
    "backward-bound": ["train.global_batch_size=2", "train.micro_batch_size=1", "model.seq_len=32"],
    "two micro-batches": ["train.global_batch_size=4", "train.micro_batch_size=1", "model.seq_len=64"],
    "per-layer recompute": ["parallel.activation_checkpointing=per-layer"],
}
# the other families' peaks: within 1.5% (docs/plan.md's table); per-layer recompute's is 0.5% below the dry run
# (1.1% under fp32), the activation gradients of a layer's backward other than its FFN's not planned
PEAK_TOLERANCE = 0.015


@pytest.mark.parametrize("case", list(FSDP_PEAKS))
def test_fsdp_peak_is_the_dry_runs_wherever_it_falls(case):
    """fsdp's planned peak, the larger of the end of the last forward and a layer's backward, within 1.5% of
    the dry run's, and its gradients there those the dry run holds; parameters, optimizer state and bytes per
    axis within 5% as for every family."""
    result = verify(load_config("small", [*FSDP, *FSDP_PEAKS[case]]))
    assert result["layout"]["strategy"] == "fsdp"
    rows = {row["quantity"]: row for row in result["rows"]}
    assert abs(rows["memory peak"]["ratio"] - 1) <= PEAK_TOLERANCE, rows["memory peak"]
    # two micro-batches peak in a layer's backward before its post-backward, when torch's tracker still names the
    # layer's gradients temporaries: the dry run's transient, the plan's comm_buffers
    misses = [m for m in _misses(result) if not (case == "two micro-batches" and "comm_buffers" in m)]
    assert misses == [], misses
    grads, full = rows["memory gradients"], rows["memory parameters"]["planned"]  # fp32 shards, as the parameters
    if case == "one micro-batch":
        assert grads["planned"] == grads["dry_run"] == 0
    elif case == "two micro-batches":
        assert grads["planned"] == full == pytest.approx(grads["dry_run"])
    else:
        assert 0 < grads["planned"] < full and grads["planned"] == pytest.approx(grads["dry_run"], rel=TOLERANCE)


@pytest.mark.parametrize(("sets", "says"), [
    (["parallel.dp=2", "parallel.ep=2", "parallel.strategy=fsdp"], "fsdp with ep > 1: not dry-run"),
    (["parallel.pp=2", "parallel.strategy=fsdp", "train.micro_batch_size=2"], "fsdp with pp > 1: not dry-run"),
])
def test_what_the_dry_run_cannot_run_is_refused_with_the_reason(sets, says):
    with pytest.raises(ValueError, match=says):
        dry_config(load_config("small", sets))


def test_planned_only_parameter_dtype_is_run_and_planned_as_the_trainer_runs_it():
    """precision.param_dtype=bf16 is planned only (the trainer keeps fp32 parameters): the dry run and
    its plan both take fp32 and say so, where the plan alone would be 2x the dry run's parameters."""
    cfg, notes = dry_config(load_config("small", ["precision.param_dtype=bf16"]))
    assert cfg.precision.param_dtype == "fp32"
    assert any(note.startswith("precision.param_dtype bf16 -> fp32") for note in notes)



@pytest.mark.slow
def test_ranks_run_in_processes_of_their_own_as_they_run_here(monkeypatch):
    """The last stage's rank run in a spawned process (2 cores) gives what it gives run here after the first
    (1 core), in rank order; only the wall time differs, and the first rank's memory by a few bytes."""
    cfg, _ = dry_config(load_config("small", FAMILIES["ddp+ep+pp"]))
    monkeypatch.setattr(dry_run, "_cores", lambda: 2)
    parallel = run_ranks(cfg)
    monkeypatch.setattr(dry_run, "_cores", lambda: 1)
    serial = run_ranks(cfg)
    assert [r.rank for r in parallel] == [r.rank for r in serial] == [0, 2]
    for p, s in zip(parallel, serial, strict=True):
        # a process's first dry run saves 8 bytes more than a later one (not identified): rank 0 here
        assert p.peak_bytes == pytest.approx(s.peak_bytes, abs=64)
        assert p.memory_parts == pytest.approx(s.memory_parts, abs=64)
        same = {"seconds": 0, "peak_bytes": 0, "memory_parts": {}}
        assert {**vars(p), **same} == {**vars(s), **same}

@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b"])
def test_a_pipeline_rank_runs_the_chunks_to_its_peak_and_scales_the_rest(schedule):
    """8 chunks a step: each rank runs its warm-up and one round of the steady state, not all 8 (what makes
    ultra-1.2t's 128 chunks affordable), and gets the full step's FLOPs and bytes after scaling. Its peak is
    the full step's but for saved tensors that outlive a chunk's backward and so grow with the chunks run
    (not yet identified; docs/plan.md gives the figures): within 3% here, never above."""
    cfg, _ = dry_config(load_config("small", ["parallel.pp=2", "train.global_batch_size=8", "train.micro_batch_size=8",
                                              "parallel.pp_microbatches=8", f"parallel.pp_schedule={schedule}"]))
    sampled, full = run_ranks(cfg), run_ranks(cfg, sample_chunks=False)
    for s, f in zip(sampled, full, strict=True):
        assert s.chunks_run < f.chunks_run == 8
        assert f.peak_bytes * 0.97 <= s.peak_bytes <= f.peak_bytes
        assert all(s.memory_parts[k] == f.memory_parts[k] for k in ("parameters", "gradients", "optimizer_state"))
        # the step's one pp all-reduce of the gradient norm (4 bytes) is scaled with the chunks' sends
        assert s.flops == pytest.approx(f.flops, rel=1e-6) and s.comm_bytes == pytest.approx(f.comm_bytes, rel=1e-4)


RECOMPUTE_PP = ["parallel.pp=4", "parallel.activation_checkpointing=per-layer", "parallel.pp_microbatches=8",
                "train.global_batch_size=8", "train.micro_batch_size=8", "model.seq_len=1024",
                "model.n_dense_layers=0"]


@pytest.mark.slow
def test_per_layer_recompute_holds_one_recomputed_layer_whatever_the_chunks_in_flight():
    """Under per-layer recompute each chunk in flight keeps its layers' inputs and, on a stage before the
    last, the stage's output (torch's PipelineStage keeps it for the chunk's backward), and backward
    recomputes one layer of one chunk at a time: rank 0 of 1F1B over 4 stages (4 chunks in flight) holds one
    layer's full activations, not four (docs/plan.md gives the figures: counting one per chunk planned 1.4x
    the dry run). Rank 0's peak within 3%; without the stage outputs (4 MiB of its 105) it was 6.8% below."""
    result = verify(load_config("small", RECOMPUTE_PP))
    peak = next(row for row in result["rows"] if row["rank"] == 0 and row["quantity"] == "memory peak")
    assert abs(peak["ratio"] - 1) <= 0.03, peak
