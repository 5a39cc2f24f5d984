"""The planner's memory model against the real model: parameter counts per pipeline stage
against a built model's numel, activation bytes against what autograd actually saves."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moebench.kernels.quantized import apply_expert_precision
from moebench.model.transformer import Transformer, build_model
from moebench.parallel.layout import stage_layer_ranges
from moebench.plan.memory import head_token_bytes, layer_token_bytes, stage_memory
from moebench.plan.precision import Precision, resolve_precision
from moebench.plan.stages import check_layout, stages
from moebench.presets import load_config

# small's features (dense first layer, shared expert) plus QK-norm, shrunk to build quickly
SMALL_QK = ["model.qk_norm=true", "model.seq_len=32", "model.vocab_size=512", "moe.num_experts=4",
            "moe.expert_hidden=128", "model.dense_hidden=256", "moe.shared_expert_hidden=64"]


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
def test_check_layout_rejects(overrides):
    cfg = load_config("small", [*overrides, "train.global_batch_size=12", "train.micro_batch_size=4"])
    with pytest.raises(ValueError):
        check_layout(cfg)


def _saved_bytes(cfg, batch: int, dtype: torch.dtype | None) -> int:
    """Bytes of distinct non-parameter storages autograd saves for one forward + loss."""
    torch.manual_seed(0)
    model = build_model(cfg)
    apply_expert_precision(model, cfg.precision.mode)
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
        logits = model(tokens)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())
    return sum(seen.values())


def _planned_per_token(cfg, prec: Precision) -> float:
    m = cfg.model
    dense, moe = layer_token_bytes(cfg, prec, False), layer_token_bytes(cfg, prec, True)
    n_moe = m.n_layers - m.n_dense_layers
    return m.n_dense_layers * dense.total + n_moe * moe.total + head_token_bytes(cfg, prec) + 8  # + token ids


@pytest.mark.parametrize("preset,overrides", [
    ("tiny", []),
    ("small", SMALL_QK),  # dense first layer, shared expert, QK-norm
])
@pytest.mark.parametrize("mode", ["fp32", "bf16", "mxfp8"])
def test_activation_bytes_match_saved_tensors(preset, overrides, mode):
    cfg = load_config(preset, [*overrides, f"precision.mode={mode}"])
    prec = resolve_precision(cfg, on_gpu=False)
    dtype = None if mode == "fp32" else torch.bfloat16
    # The difference of two batch sizes is the per-token part; weight casts and RoPE tables cancel.
    measured = (_saved_bytes(cfg, 4, dtype) - _saved_bytes(cfg, 2, dtype)) / (2 * cfg.model.seq_len)
    planned = _planned_per_token(cfg, prec)
    assert planned == pytest.approx(measured, rel=0.02)


def test_bf16_weight_copies_match_saved_casts():
    cfg = load_config("small", [*SMALL_QK, "precision.mode=bf16"])
    prec = resolve_precision(cfg, on_gpu=False)
    tokens = 2 * cfg.model.seq_len
    casts = _saved_bytes(cfg, 2, torch.bfloat16) - tokens * _planned_per_token(cfg, prec)
    (st,) = stages(cfg)
    planned = stage_memory(cfg, prec, st).compute_weight_copies
    # RoPE's cos/sin tables are saved too (per layer, fp32): a small, token-independent extra
    rope = 2 * 4 * cfg.model.seq_len * cfg.model.hd // 2 * cfg.model.n_layers
    assert planned == pytest.approx(casts - rope, rel=0.02)


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
