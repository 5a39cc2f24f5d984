"""The planner's memory model against the real model: parameter counts per pipeline stage
against a built model's numel, activation bytes against what autograd actually saves."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from moebench.devices import DEVICES
from moebench.layout import check_physical_layout, stage_layer_ranges
from moebench.model.precision import apply_precision
from moebench.model.transformer import Transformer, build_model
from moebench.plan.memory import MemoryBreakdown, head_saved_bytes, head_token_bytes, layer_token_bytes, stage_memory
from moebench.plan.planner import PlanOptions, build_plan
from moebench.plan.precision import Precision, plan_precision
from moebench.plan.stages import capacity_factor, kept_route_share, stages
from moebench.presets import load_config

# small's features (dense first layer, shared expert) plus QK-norm, shrunk to build quickly
SMALL_QK = ["model.qk_norm=true", "model.seq_len=32", "model.vocab_size=512", "moe.num_experts=4",
            "moe.expert_hidden=128", "model.dense_hidden=256", "moe.shared_expert_hidden=64"]


# the recompute RMSNorm and the LM head fused with the loss over 16-token chunks
FUSED = ["model.norm_impl=recompute", "model.loss_chunk_tokens=16"]


def _numel(modules) -> int:
    return sum(p.numel() for m in modules if m is not None for p in m.parameters())


@pytest.mark.parametrize("preset,pp", [("small", 1), ("small", 3), ("tiny", 2), ("small", 4)])
def test_stage_params_match_built_model(preset, pp):
    cfg = load_config(preset, [f"parallel.pp={pp}"])
    with torch.device("meta"):
        model = Transformer(cfg)
    for stage, layers in zip(stages(cfg), stage_layer_ranges(cfg.model.n_layers, pp), strict=True):
        parts = [model.layers[str(i)] for i in layers]
        if stage.has_embed:
            parts.append(model.tok_emb)
        if stage.has_head:
            parts += [model.norm, model.lm_head]
        assert stage.params_local == _numel(parts)
        assert stage.n_layers == len(layers)
    assert sum(s.params_local for s in stages(cfg)) == cfg.total_params()
    assert sum(s.flops_per_token for s in stages(cfg)) == cfg.flops_per_token()


def test_expert_parallel_stage_holds_its_share_of_experts():
    cfg = load_config("small", ["parallel.dp=4", "parallel.ep=4", "train.global_batch_size=16"])
    full = load_config("small", [])
    (st,), (st_full,) = stages(cfg), stages(full)
    assert st.dense_params == st_full.dense_params
    assert st.expert_params_local * 4 == st_full.expert_params_local


def test_stage_split_gives_early_stages_the_extra_layers():
    assert [len(r) for r in stage_layer_ranges(63, 8)] == [8, 8, 8, 8, 8, 8, 8, 7]
    assert [r.start for r in stage_layer_ranges(10, 4)] == [0, 3, 6, 8]


@pytest.mark.parametrize("overrides", [
    ["parallel.ep=3", "parallel.dp=3"],  # 16 experts do not split over 3
    ["parallel.ep=2", "parallel.dp=3"],  # ep must divide dp
    ["parallel.pp=5"],  # more stages than layers
])
def test_physical_layout_rules_reject(overrides):
    cfg = load_config("small", [*overrides, "train.global_batch_size=12", "train.micro_batch_size=4"])
    with pytest.raises(ValueError):
        check_physical_layout(cfg)


def _saved_bytes(cfg, batch: int, dtype: torch.dtype | None) -> int:
    """Bytes of distinct non-parameter storages autograd saves for one forward + loss. With
    ``precision.param_dtype=bf16`` the parameters are cast to bf16 and autocast stays off, as
    bf16 compute weights run."""
    torch.manual_seed(0)
    model = build_model(cfg)
    pc = cfg.precision
    apply_precision(model, pc.mode, pc.mxfp8_rounding, pc.scope, pc.saved_activations)
    if pc.param_dtype == "bf16":
        model.to(torch.bfloat16)
        dtype = None
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    tokens = torch.randint(0, cfg.model.vocab_size, (batch, cfg.model.seq_len))
    autocast = torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        model(tokens, tokens)  # the forward and the loss, as the trainer runs them
    return sum(seen.values())


def _planned_per_token(cfg, prec: Precision) -> float:
    m = cfg.model
    dense, moe = layer_token_bytes(cfg, prec, False), layer_token_bytes(cfg, prec, True)
    n_moe = m.n_layers - m.n_dense_layers
    return m.n_dense_layers * dense.total + n_moe * moe.total + head_token_bytes(cfg, prec) + 8  # + token ids


@pytest.mark.parametrize("preset,overrides", [
    ("tiny", []),
    ("small", SMALL_QK),  # dense first layer, shared expert, QK-norm
    ("small", [*SMALL_QK, "model.qk_norm_scope=full"]),  # one norm over all of q and of k
])
@pytest.mark.parametrize("mode", ["fp32", "bf16", "bf16 params", "mxfp8", "fp8", "mxfp8 linear", "mxfp8 compute"])
@pytest.mark.parametrize("impl", [[], FUSED], ids=["torch", "fused"])
def test_activation_bytes_match_saved_tensors(preset, overrides, mode, impl):
    """Quantized modes save E4M3 forms (experts; with scope=linear every dense linear too) unless
    saved_activations=compute. bf16 parameters (param_dtype=bf16) save what autocast saves per token:
    torch's norms and QK-norms, the router and the reference loss upcast to fp32 either way. ``fused``:
    the recompute norms and the head fused with the loss (the settings of the published 4-B300 plan)."""
    mode, *how = mode.split()
    extra = {"linear": "precision.scope=linear", "compute": "precision.saved_activations=compute",
             "params": "precision.param_dtype=bf16"}
    # grouped_mm: the planner models the GPU path (`auto` there); CPU's fused kernel saves less
    cfg = load_config(preset, [*overrides, *impl, "moe.backend=grouped_mm", f"precision.mode={mode}",
                               *(extra[h] for h in how)])
    prec = plan_precision(cfg, None)
    dtype = None if mode == "fp32" else torch.bfloat16
    # The difference of two batch sizes is the per-token part; weight casts and RoPE tables cancel.
    measured = (_saved_bytes(cfg, 4, dtype) - _saved_bytes(cfg, 2, dtype)) / (2 * cfg.model.seq_len)
    planned = _planned_per_token(cfg, prec)
    assert planned == pytest.approx(measured, rel=0.02)


def test_bf16_weight_copies_match_saved_casts():
    cfg = load_config("small", [*SMALL_QK, "moe.backend=grouped_mm", "precision.mode=bf16"])
    prec = plan_precision(cfg, None)
    tokens = 2 * cfg.model.seq_len
    casts = _saved_bytes(cfg, 2, torch.bfloat16) - tokens * _planned_per_token(cfg, prec)
    (st,) = stages(cfg)
    planned = stage_memory(cfg, prec, st).compute_weight_copies
    # RoPE's cos/sin tables are saved too (per layer, fp32): a small, token-independent extra
    rope = 2 * 4 * cfg.model.seq_len * cfg.model.hd // 2 * cfg.model.n_layers
    assert planned == pytest.approx(casts - rope, rel=0.02)


@pytest.mark.parametrize("mode", ["fp32", "bf16"])
def test_fused_loss_keeps_the_head_weight_gradient(mode):
    """With the head fused with the loss, the token-independent saved bytes gain the head's weight
    gradient in the compute dtype and lose the head's saved weight cast (bf16; the plan's weight copies
    still count the cast: it is alive while the loss runs). The plan's loss term holds that gradient,
    with its fp32 accumulator and one token chunk's logits."""
    def fixed(cfg) -> float:  # saved bytes that do not scale with the tokens
        dtype = None if mode == "fp32" else torch.bfloat16
        return _saved_bytes(cfg, 2, dtype) - 2 * cfg.model.seq_len * _planned_per_token(cfg, plan_precision(cfg, None))

    base = [*SMALL_QK, "moe.backend=grouped_mm", f"precision.mode={mode}"]
    cfg, reference = load_config("small", [*base, *FUSED]), load_config("small", base)
    prec = plan_precision(cfg, None)
    m, (st,) = cfg.model, stages(cfg)
    gradient = prec.compute_bytes * m.vocab_size * m.d_model
    head_cast = prec.compute_bytes * st.head_matmul_params if prec.casts_weights else 0
    assert fixed(cfg) - fixed(reference) == pytest.approx(gradient - head_cast, abs=0.01 * gradient)
    mem, ref_mem = stage_memory(cfg, prec, st), stage_memory(reference, prec, st)
    assert mem.compute_weight_copies == ref_mem.compute_weight_copies
    chunk = min(m.loss_chunk_tokens, cfg.train.micro_batch_size * m.seq_len)
    accumulator, logits = 4 * m.vocab_size * m.d_model, chunk * (4 + prec.compute_bytes) * m.vocab_size
    assert mem.logits_transient - accumulator - logits == gradient


def test_memory_phases_and_sharding():
    base = ["train.global_batch_size=8", "train.micro_batch_size=2"]
    ddp = load_config("small", [*base, "parallel.dp=4", "parallel.ep=4"])
    opt = load_config("small", [*base, "parallel.dp=4", "parallel.ep=4", "parallel.dist_opt=true"])
    fsdp = load_config("small", [*base, "parallel.dp=4", "parallel.strategy=fsdp"])
    single = load_config("small", base)
    prec = Precision("fp32", 4)
    m_ddp, m_opt, m_fsdp, m_one = (stage_memory(c, prec, stages(c)[0]) for c in (ddp, opt, fsdp, single))
    st = stages(ddp)[0]
    held = st.params_local
    # ddp: flat fp32 parameter and gradient buffers, replicated moments
    assert m_ddp.params == m_ddp.grads == 4 * held
    assert m_ddp.optimizer_moments == 8 * held and m_ddp.master_weights == 0
    assert m_ddp.optimizer_state == 12 * held  # parameters (the master weights) + moments
    # dist_opt: master + moments of the shard (dense over dp=4, experts over dp/ep = 1)
    shard = st.dense_params / 4 + st.expert_params_local
    assert m_opt.master_weights == 4 * shard and m_opt.optimizer_moments == 8 * shard
    assert m_opt.optimizer_state == 12 * shard
    assert m_opt.params == m_ddp.params and m_opt.grads == 4 * held + 4 * shard
    # its step makes sqrt(v) over one flat buffer's shard at a time: the larger, not both
    assert m_opt.optimizer_step_temp == 4 * max(st.dense_params / 4, st.expert_params_local) < 4 * shard
    # fsdp shards everything over dp; no flat buffers
    assert m_fsdp.params == pytest.approx(stages(fsdp)[0].params_local)  # 4 bytes / 4 ranks
    assert m_fsdp.fsdp_unsharded > 0
    # one process: the plain trainer, fp32 parameters and gradients
    assert m_one.params == m_one.grads
    assert m_ddp.total == m_ddp.state + max(m_ddp.forward_backward, m_ddp.optimizer_step_temp)


def test_recompute_and_pipeline_activations():
    base = ["train.global_batch_size=8", "train.micro_batch_size=4", "parallel.pp=2", "parallel.pp_microbatches=4"]
    prec = Precision("bf16", 2)
    plain = load_config("small", base)
    recompute = load_config("small", [*base, "parallel.activation_checkpointing=per-layer"])
    gpipe = load_config("small", [*base, "parallel.pp_schedule=gpipe"])
    first, last = (stage_memory(plain, prec, s) for s in stages(plain))
    # 1F1B: stage 0 holds pp - 0 = 2 chunks, the last stage one
    assert first.activations > last.activations
    assert stage_memory(gpipe, prec, stages(gpipe)[0]).activations == pytest.approx(first.activations * 2)
    assert stage_memory(recompute, prec, stages(recompute)[0]).activations < first.activations / 1.5


@pytest.mark.parametrize("sets, outputs", [
    ([], (2, 0)),  # 1F1B: rank 0 holds pp - 0 = 2 chunks; the last stage keeps its loss
    (["parallel.activation_checkpointing=per-layer"], (2, 0)),  # the output is no layer's saved input
    (["parallel.pp_schedule=gpipe"], (4, 0)),
    # interleaved, 8 chunks (2 a round): rank 0 runs (2 - 1) x 2 + 2 + 1 = 5 forwards of stages 0 and 2 before
    # its first backward; rank 1 runs 2 of stage 1, then stage 3's (the last) first chunk and its backward
    (["parallel.pp_schedule=interleaved-1f1b", "parallel.pp_microbatches=8", "train.micro_batch_size=8",
      "train.global_batch_size=8"], (5, 2)),
])
def test_a_stage_before_the_last_keeps_its_output_per_chunk_in_flight(sets, outputs):
    """torch's PipelineStage keeps each chunk's stage output (the residual stream, fp32 parameters: fp32) until
    the chunk's backward; the dry run of the trainer finds them alive at rank 0's peak
    (tests/plan/test_plan_verify_families.py)."""
    cfg = load_config("small", ["train.global_batch_size=8", "train.micro_batch_size=4", "parallel.pp=2",
                                "parallel.pp_microbatches=4", *sets])
    tokens = cfg.train.micro_batch_size // cfg.parallel.pp_microbatches * cfg.model.seq_len
    prec = Precision("bf16", 2)
    held = tuple(stage_memory(cfg, prec, s).stage_outputs for s in stages(cfg))
    assert held == tuple(n * tokens * 4 * cfg.model.d_model for n in outputs)
    one = load_config("small", ["train.global_batch_size=8", "train.micro_batch_size=4"])
    assert stage_memory(one, prec, stages(one)[0]).stage_outputs == 0


def test_interleaved_activations_follow_torchs_warm_up():
    """Interleaved 1F1B holds (v - 1) x chunks-a-round + 2 (pp - 1 - r) + 1 virtual-stage chunks on rank r,
    each 1/v of the rank's layers: with 8 chunks on pp 2 (2 a round), v=2 holds 2.5 / 1.5 whole-rank
    chunks on ranks 0 / 1 and v=4 2.25 / 1.75 (rank 0: pp + (pp - 1) / v), but of the head stage's chunks
    one (the rank's warm-up forwards are its earlier stages'), so the loss's saved tensors once; the dry run
    of the trainer agrees (tests/plan/test_plan_verify.py)."""
    base = ["train.global_batch_size=8", "train.micro_batch_size=8", "parallel.pp=2", "parallel.pp_microbatches=8",
            "parallel.pp_schedule=interleaved-1f1b", "model.n_layers=8"]
    prec = Precision("bf16", 2)
    one = load_config("small", [*base[:-2], "model.n_layers=8"])  # 1F1B: 2 and 1 chunks
    v2 = load_config("small", base)
    v4 = load_config("small", [*base, "parallel.pp_virtual_stages=4"])
    head = head_saved_bytes(one, prec, stages(one)[1])
    assert head > 0 and head_saved_bytes(one, prec, stages(one)[0]) == 0
    per_chunk = [(stage_memory(one, prec, s).activations - h) / n
                 for s, n, h in zip(stages(one), (2, 1), (0, head), strict=True)]
    for cfg, held in ((v2, (2.5, 1.5)), (v4, (2.25, 1.75))):
        got = [stage_memory(cfg, prec, s).activations for s in stages(cfg)]
        assert got == pytest.approx([c * n + h for c, n, h in zip(per_chunk, held, (0, head), strict=True)])


# compute capability decides native vs emulated: fp8 from 9.0 (Hopper), mxfp8 from 10.0 (Blackwell)
IMPL_PER_GPU = {
    "h100": {"bf16": "native", "fp8": "native", "mxfp8": "emulated"},
    "h200": {"bf16": "native", "fp8": "native", "mxfp8": "emulated"},
    "b200": {"bf16": "native", "fp8": "native", "mxfp8": "native"},
    "b300": {"bf16": "native", "fp8": "native", "mxfp8": "native"},
}


@pytest.mark.parametrize("gpu", list(IMPL_PER_GPU))
@pytest.mark.parametrize("mode", ["bf16", "fp8", "mxfp8"])
def test_precision_impl_per_gpu(gpu, mode):
    cfg = load_config("moe-8l-e8", [f"precision.mode={mode}"])
    assert plan_precision(cfg, DEVICES[gpu]).impl == IMPL_PER_GPU[gpu][mode]
    plan = build_plan(cfg, gpu)
    assert plan["precision"] == mode and plan["precision_impl"] == IMPL_PER_GPU[gpu][mode]
    if mode != "bf16":
        assert any(f"precision_impl {IMPL_PER_GPU[gpu][mode]}" in a for a in plan["plan"]["assumptions"])


def test_precision_impl_off_hopper_and_on_cpu():
    ampere = dataclasses.replace(DEVICES["h100"], compute_capability=(8, 0))
    fp8 = load_config("moe-8l-e8", ["precision.mode=fp8"])
    assert plan_precision(fp8, ampere).impl == "emulated"
    assert plan_precision(fp8, None).impl == "emulated"  # CPU runs every quantized mode emulated
    assert plan_precision(load_config("moe-8l-e8"), None) == Precision("fp32", 4, "native")  # auto on CPU


def _operand_peak(impl: str, rows: int, d: int, h: int, experts: int, c: int = 2, q: float = 1 + 1 / 32,
                  weight_grads: bool = False, saved: bool = False) -> float:
    """Live operand buffers step by step through each quantized GEMM of a layer; the largest.
    ``saved``: the GEMMs save E4M3 forms, which then count as saved tensors, not here."""
    w13, w2 = experts * d * 2 * h, experts * h * d
    gemms = [(rows * d, w13, "fwd"), (rows * h, w2, "fwd"), (rows * 2 * h, w13, "dgrad"), (rows * d, w2, "dgrad")]
    if weight_grads:  # (saved input, output gradient) of each weight gradient
        gemms += [(rows * d, rows * 2 * h, "wgrad"), (rows * h, rows * d, "wgrad")]
    peaks = []
    for a, b, kind in gemms:
        copy = c * b if kind == "fwd" else 0  # the weight made K-major in bf16 before quantizing
        # saved E4M3 forms: mxfp8's forward input, the input gradient's weight, the weight gradient's input
        a_saved = saved and (kind == "wgrad" or (kind == "fwd" and not weight_grads))
        qa, qb = (0 if a_saved else q * a), (0 if saved and kind == "dgrad" else q * b)
        cast = c * b if saved and kind == "fwd" else 0  # the weight's bf16 cast, no longer saved, lives meanwhile
        if impl == "native" and kind == "wgrad":  # both -> E4M3, both copied token-major, the GEMM
            steps = [[qa], [qa, qb], [qa, qb, qa], [qa, qb, qa, qb]]
        elif impl == "native":  # a -> E4M3; b (its K-major copy in the forward) -> E4M3; the GEMM
            steps = [[qa], [qa, copy, qb], [qa, qb]]
        else:  # a -> E4M3 -> bf16 (E4M3 freed unless saved), then b the same way; the GEMM on the bf16 copies
            steps = [[qa], [qa, c * a], [c * a, copy, qb], [c * a, qb, c * b], [c * a, c * b]]
        peaks.append(max(sum(step) + cast for step in steps))
    return max(peaks)


def test_mxfp8_operand_buffers_emulated_on_h200_native_on_b200():
    cfg = load_config("moe-8l-e64", ["parallel.dp=8", "parallel.ep=8", "precision.mode=mxfp8",
                                     "train.global_batch_size=8", "precision.saved_activations=compute"])
    (st,) = stages(cfg)
    h200, b200 = plan_precision(cfg, DEVICES["h200"]), plan_precision(cfg, DEVICES["b200"])
    mem_h200, mem_b200 = stage_memory(cfg, h200, st), stage_memory(cfg, b200, st)
    rows = cfg.train.micro_batch_size * cfg.model.seq_len * cfg.moe.top_k  # sync dispatch: no capacity padding
    shape = dict(rows=rows, d=cfg.model.d_model, h=cfg.moe.expert_hidden, experts=64 // 8)
    assert mem_h200.quantized_gemm_operands == pytest.approx(_operand_peak("emulated", **shape))
    assert mem_b200.quantized_gemm_operands == pytest.approx(_operand_peak("native", **shape))
    # D = H = 4096, N = 32768, E = 8: w13 and the [N, 2H] gradient both hold 2**28 elements, x [N, D]
    # half that. Emulated peaks in the backward GEMM on w13 (gradient's bf16 copy 2 + weight's E4M3
    # and bf16 copy 3.03125, per 2**28); native in the forward GEMM on w13 (x's E4M3 1.03125 / 2 +
    # the weight's K-major bf16 copy and E4M3 3.03125).
    assert mem_h200.quantized_gemm_operands - mem_b200.quantized_gemm_operands == (5.03125 - 3.546875) * 2**28
    # nothing else differs: saved tensors and weight copies are bf16's on both
    others = {k: v for k, v in mem_h200.as_dict().items() if k not in ("quantized_gemm_operands", "total")}
    assert others == {k: v for k, v in mem_b200.as_dict().items() if k in others}
    bf16 = stage_memory(cfg, Precision("bf16", 2), st)
    assert bf16.quantized_gemm_operands == 0 and bf16.activations == mem_h200.activations
    # the operands (1.4-1.8 GiB) live in a GEMM, the loss's logits (6.1 GiB) at another moment: the logits set
    # the peak of all three
    assert mem_b200.quantized_gemm_operands < mem_h200.quantized_gemm_operands < bf16.logits_transient
    assert mem_h200.total == mem_b200.total == bf16.total


@pytest.mark.parametrize("mode", ["fp8", "mxfp8"])
def test_saving_quantized_operands_shrinks_saved_tensors_below_bf16(mode):
    """precision.saved_activations=quantized: the expert rows the GEMMs read and the expert weight
    copies are q bytes per element instead of 2; the transient buffers lose the saved E4M3 forms and
    gain the weight's bf16 cast; the plan's total drops below bf16's."""
    overrides = ["parallel.dp=8", "parallel.ep=8", "train.global_batch_size=8", f"precision.mode={mode}"]
    cfg = load_config("moe-8l-e64", overrides)
    compute = load_config("moe-8l-e64", [*overrides, "precision.saved_activations=compute"])
    (st,) = stages(cfg)
    q = 1 + 1 / 32 if mode == "mxfp8" else 1.0
    d, h, k = cfg.model.d_model, cfg.moe.expert_hidden, cfg.moe.top_k
    tokens = cfg.train.micro_batch_size * cfg.model.seq_len
    shape = dict(rows=tokens * k, d=d, h=h, experts=64 // 8, q=q, weight_grads=mode == "fp8")
    bf16 = stage_memory(cfg, Precision("bf16", 2), st)
    for gpu in ("h200", "b200"):
        prec, prec_c = plan_precision(cfg, DEVICES[gpu]), plan_precision(compute, DEVICES[gpu])
        mem, mem_c = stage_memory(cfg, prec, st), stage_memory(compute, prec_c, st)
        assert mem.quantized_gemm_operands == pytest.approx(_operand_peak(prec.impl, **shape, saved=True))
        # the expert input x [N, D] and the w2 input [N, H] of every MoE layer, q instead of 2 bytes
        assert mem_c.activations - mem.activations == pytest.approx(st.n_moe * tokens * k * (d + h) * (2 - q))
        assert mem_c.compute_weight_copies - mem.compute_weight_copies == pytest.approx(
            st.expert_params_local * (2 - q))
        assert mem.total < bf16.total == mem_c.total  # the logits (6.1 GiB) outweigh either GEMM's operands


def test_fp8_operand_buffers_include_the_weight_gradients():
    # four sequences per chunk: the [N, 2H] gradient (2**30 elements) outgrows w13 (2**28)
    cfg = load_config("moe-8l-e8", ["precision.mode=fp8", "train.micro_batch_size=4", "train.global_batch_size=4",
                                    "precision.saved_activations=compute"])
    (st,) = stages(cfg)
    shape = dict(rows=4 * cfg.model.seq_len * cfg.moe.top_k, d=cfg.model.d_model, h=cfg.moe.expert_hidden,
                 experts=cfg.moe.num_experts, q=1.0, weight_grads=True)
    for gpu, impl in (("h200", "native"), ("b200", "native")):
        prec = plan_precision(cfg, DEVICES[gpu])
        assert prec.impl == impl
        got = stage_memory(cfg, prec, st).quantized_gemm_operands
        assert got == pytest.approx(_operand_peak(impl, **shape))
        # native: the weight gradient of w13 holds x and its gradient as E4M3, twice (token-major copies)
        assert got == 2 * (2**29 + 2**30)
    ampere = dataclasses.replace(DEVICES["h100"], compute_capability=(8, 0))
    emulated = stage_memory(cfg, plan_precision(cfg, ampere), st).quantized_gemm_operands
    assert emulated == pytest.approx(_operand_peak("emulated", **shape))


def test_capacity_below_one_holds_fewer_expert_rows_and_no_negative_padding():
    def memory(cf: float):
        cfg = load_config("moe-8l-e64", ["parallel.dp=8", "parallel.ep=8", "parallel.dispatcher=rowwise",
                                         f"moe.capacity_factor={cf}", "train.global_batch_size=8"])
        return stage_memory(cfg, plan_precision(cfg, DEVICES["h200"]), stages(cfg)[0])

    half, full, padded = memory(0.5), memory(1.0), memory(1.25)
    assert half.ep_capacity_buffers == 0 == full.ep_capacity_buffers < padded.ep_capacity_buffers
    cfg = load_config("moe-8l-e64")
    per_token = layer_token_bytes(cfg, plan_precision(cfg, DEVICES["h200"]), True).expert_rows
    rows_bytes = per_token * cfg.model.seq_len * stages(cfg)[0].n_moe
    # the buffers are capacity-sized: half the routed rows at 0.5, a quarter more at 1.25
    assert full.activations - half.activations == pytest.approx(0.5 * rows_bytes)
    assert padded.ep_capacity_buffers == pytest.approx(0.25 * rows_bytes)

    # lossless: capacity factor ep = 8 whatever capacity_factor says; nothing dropped, 7x padding
    lossless = load_config("moe-8l-e64", ["parallel.dp=8", "parallel.ep=8", "parallel.dispatcher=rowwise",
                                          "moe.capacity=lossless", "moe.capacity_factor=0.5",
                                          "train.global_batch_size=8"])
    assert capacity_factor(lossless) == lossless.effective_capacity_factor() == 8.0
    assert kept_route_share(lossless) == 1.0
    mem = stage_memory(lossless, plan_precision(lossless, DEVICES["h200"]), stages(lossless)[0])
    assert mem.ep_capacity_buffers == pytest.approx(7 * rows_bytes)
    assert mem.activations == pytest.approx(full.activations)


def test_the_plan_says_when_this_torch_would_run_its_native_plan_emulated():
    """The installed torch's gaps reach the plan as a fact passed in (plan imports no torch): a
    native plan names them; a plan made without asking, or planned emulated anyway, does not."""
    from moebench.plan.precision import installed_torch_gap

    fp8 = load_config("moe-8l-e8", ["precision.mode=fp8"])
    linear = load_config("moe-8l-e8", ["precision.mode=fp8", "precision.scope=linear"])
    asked: list[tuple[str, str]] = []

    def no_scaled_mm(fmt, kind):
        asked.append((fmt, kind))
        return "this torch has no torch._scaled_mm" if kind == "linear" else None

    assert installed_torch_gap(plan_precision(fp8, DEVICES["h200"]), None) is None  # not asked
    assert installed_torch_gap(plan_precision(fp8, DEVICES["h200"]), no_scaled_mm) is None  # experts: grouped only
    assert asked == [("fp8", "grouped")]
    gap = installed_torch_gap(plan_precision(linear, DEVICES["h200"]), no_scaled_mm)
    assert gap == "this torch has no torch._scaled_mm"
    assert not any("would run emulated" in a for a in build_plan(linear, "h200")["plan"]["assumptions"])
    told = build_plan(linear, "h200", PlanOptions(kernel_gap=no_scaled_mm))["plan"]["assumptions"]
    assert any(f"on this machine's torch it would run emulated ({gap})" in a for a in told)
    ampere = dataclasses.replace(DEVICES["h100"], compute_capability=(8, 0))
    assert installed_torch_gap(plan_precision(linear, ampere), no_scaled_mm) is None  # planned emulated anyway


@pytest.mark.parametrize(("gpu", "mode", "outside"), [("h200", "fp8", False), ("b200", "fp8", False),
                                                      ("b200", "mxfp8", False), ("b300", "fp8", True),
                                                      ("gb300", "mxfp8", True), ("h200", "mxfp8", False)])
def test_the_plan_names_the_pinned_torchs_allow_list(gpu, mode, outside):
    """The hardware decides the plan's precision_impl; where the pinned torch's grouped kernel does
    not serve the device (a set, not a minimum: 9.0 and 10.0; MXFP8 10.0), the plan says so."""
    cfg = load_config("moe-8l-e8", [f"precision.mode={mode}"])
    line = next(a for a in build_plan(cfg, gpu)["plan"]["assumptions"] if a.startswith(f"{mode}: "))
    assert ("torch 2.13 allows its native grouped" in line) == outside
    if outside:
        allowed = "9.0, 10.0" if mode == "fp8" else "10.0"
        assert f"only on {allowed}, so on that torch this layout would run emulated" in line


def test_plan_cli_asks_the_installed_torch():
    """moebench plan passes this machine's torch in: a CPU build runs no native kernel anywhere."""
    from click.testing import CliRunner

    import moebench.cli as cli

    result = CliRunner().invoke(cli.cli, ["plan", "--preset", "moe-8l-e8", "--gpu", "h200", "--set",
                                          "precision.mode=fp8", "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output.strip().splitlines()[-1])
    gap = "on this machine's torch it would run emulated"
    said = any(gap in a for a in plan["plan"]["assumptions"])
    assert said == (torch.version.cuda is None)


# The controlled 4-B300 benchmark of OLMo-core 3's tech report ("Supercharging Olmo-core for Efficient and
# Scalable MoE Training", Oct 2026): moe-8l-e32, EP4, DDP + row-wise + distributed optimizer, 2 x 8192-token
# micro-batches, 524,288 tokens a step, under its precision policy (param_dtype=bf16 here)
PUBLISHED_LAYOUT = ["parallel.dp=4", "parallel.ep=4", "parallel.dispatcher=rowwise", "parallel.dist_opt=true",
                    "train.micro_batch_size=2", "train.global_batch_size=64", "precision.mode=bf16",
                    "precision.param_dtype=bf16"]
PUBLISHED_PERSISTENT_GIB = 62.21


def test_bf16_parameters_count_olmo_core_bytes_per_parameter():
    """bf16 compute weights (2 bytes) + fp32 gradient buckets (4) held whole; fp32 main weights and
    moments (12) sharded by the distributed optimizer, dense over dp, experts over edp = dp / ep."""
    cfg = load_config("moe-8l-e32", PUBLISHED_LAYOUT)
    prec = plan_precision(cfg, DEVICES["b300"])
    (st,) = stages(cfg)
    m = stage_memory(cfg, prec, st)
    held, sharded = st.params_local, st.dense_params / 4 + st.expert_params_local / 1
    assert (m.params, m.grads, m.master_weights, m.optimizer_moments) == (2 * held, 4 * held, 4 * sharded,
                                                                          8 * sharded)
    assert m.compute_weight_copies == 0  # the weights are already bf16: nothing is cast and saved
    assert m.optimizer_state == 12 * sharded
    # without dist_opt the fp32 main copy and the moments are whole on every rank
    whole = load_config("moe-8l-e32", [*PUBLISHED_LAYOUT, "parallel.dist_opt=false"])
    w = stage_memory(whole, prec, stages(whole)[0])
    assert (w.params, w.master_weights, w.optimizer_moments) == (2 * held, 4 * held, 8 * held)
    # fp32 parameters (the trainer's): 4 + 4 bytes held, and the reduced gradient shard beside the buffer
    fp32 = load_config("moe-8l-e32", [*PUBLISHED_LAYOUT, "precision.param_dtype=fp32"])
    f = stage_memory(fp32, plan_precision(fp32, DEVICES["b300"]), st)
    assert (f.params, f.grads) == (4 * held, 4 * held + 4 * sharded) and f.compute_weight_copies > 0


def test_bf16_parameters_gather_in_bf16():
    """dist_opt's traffic under bf16 parameters: fp32 reduce-scatter + bf16 all-gather (4 + 2 bytes)."""
    plan = build_plan(load_config("moe-8l-e32", PUBLISHED_LAYOUT), "b300")
    terms = [t for t in plan["plan"]["stages"][0]["comm_terms"] if t["axis"] == "dp"]
    (scatter,), (gather,) = ([t["bytes"] for t in terms if op in t["what"]] for op in ("reduce-scatter", "all-gather"))
    assert gather == pytest.approx(scatter / 2)


def test_published_persistent_memory_is_the_counted_state():
    """Parameters, gradient buckets, main weights and moments of the published layout: within 1% of the
    published persistent memory (62.21 GiB; the rest of its 103.03 GiB peak is transient)."""
    cfg = load_config("moe-8l-e32", PUBLISHED_LAYOUT)
    m = stage_memory(cfg, plan_precision(cfg, DEVICES["b300"]), stages(cfg)[0])
    assert m.state / 2**30 == pytest.approx(PUBLISHED_PERSISTENT_GIB, rel=0.01)


def test_recompute_keeps_each_layer_input_in_the_parameters_dtype():
    base = ["train.global_batch_size=8", "train.micro_batch_size=2", "parallel.activation_checkpointing=per-layer",
            "precision.mode=bf16"]
    fp32, bf16 = (load_config("small", [*base, f"precision.param_dtype={d}"]) for d in ("fp32", "bf16"))
    a32, a16 = (stage_memory(c, plan_precision(c, None), stages(c)[0]).activations for c in (fp32, bf16))
    tokens = 2 * fp32.model.seq_len
    assert a32 - a16 == pytest.approx(tokens * 2 * fp32.model.d_model * fp32.model.n_layers)


@pytest.mark.parametrize("overrides", [["precision.mode=fp32"], ["parallel.strategy=fsdp", "precision.mode=bf16"]])
def test_bf16_parameters_need_bf16_compute_and_ddp(overrides):
    with pytest.raises(ValueError, match="param_dtype=bf16"):
        load_config("small", [*overrides, "precision.param_dtype=bf16"])


def test_trainer_refuses_bf16_parameters():
    """The policy is planned only: the trainer keeps fp32 parameters and says so rather than ignore it."""
    from moebench.train.run import check_device_support

    cfg = load_config("tiny", ["precision.mode=bf16", "precision.param_dtype=bf16"])
    with pytest.raises(ValueError, match="planned only"):
        check_device_support(cfg, torch.device("cpu"), "bf16")


def test_the_loss_and_a_layers_gemm_are_different_moments():
    """What the chunks hold is there at both; on top of it the loss's logits, or the largest GEMM's operands
    and the layer per-layer recompute rebuilt for its backward, whichever is larger, never both."""
    parts = dict.fromkeys((f.name for f in dataclasses.fields(MemoryBreakdown)), 0.0)
    parts |= {"activations": 10.0, "stage_outputs": 1.0, "compute_weight_copies": 2.0}
    loss = MemoryBreakdown(**parts | {"logits_transient": 6.0, "quantized_gemm_operands": 2.0, "recomputed_layer": 3.0})
    assert loss.forward_backward == 13.0 + 6.0
    gemm = dataclasses.replace(loss, recomputed_layer=5.0)
    assert gemm.forward_backward == 13.0 + 7.0
    # the recomputed layer is saved for backward: a part of the saved activations the run records
    assert gemm.parts()["saved_activations"] == 13.0 + 5.0 and gemm.parts()["transient"] == 2.0
