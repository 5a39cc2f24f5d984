"""Named model presets (shapes from published model cards and papers).

docs/presets.md lists each preset's source and what moebench does differently. Only shapes
(and the settings that change the math, such as norm eps and QK-norm scope) are typed in here.
Parameter counts are computed by the cost model in :mod:`moebench.config`, and tests check them
against the published totals.
"""

from __future__ import annotations

from collections.abc import Callable

from moebench.config import Config, ModelConfig, MoEConfig, TrainConfig
from moebench.errors import ConfigError

# Vocabulary of the reference benchmark and the "ultra" configs: the dolma2 tokenizer's, padded to a
# multiple of 128 (OLMo-core's src/test/examples/olmo_ddp_tech_report_test.py). With the dense-layer
# FFN hidden of top_k x expert hidden + shared hidden (5 x d_model for the reference family) they land
# every preset of the family on its published pins (24.31B total / 3.17B active at 64 experts).
_REF_VOCAB = 100_352


def _tiny() -> Config:
    return Config(
        model=ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                          seq_len=64, n_dense_layers=0, dense_hidden=128),
        moe=MoEConfig(num_experts=8, top_k=2, expert_hidden=64, shared_expert_hidden=0),
        train=TrainConfig(global_batch_size=16, micro_batch_size=8, steps=60, warmup_steps=2,
                          lr=1e-2, data="markov"),
    )


def _small() -> Config:
    return Config(
        model=ModelConfig(vocab_size=4096, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4,
                          seq_len=256, n_dense_layers=1, dense_hidden=1024),
        moe=MoEConfig(num_experts=16, top_k=2, expert_hidden=256, shared_expert_hidden=256),
        train=TrainConfig(global_batch_size=8, micro_batch_size=4, steps=20, lr=3e-3),
    )


def _olmoe() -> Config:
    return Config(
        model=ModelConfig(vocab_size=50_304, d_model=2048, n_layers=16, n_heads=16, n_kv_heads=16,
                          qk_norm=True, qk_norm_scope="full", seq_len=4096),
        moe=MoEConfig(num_experts=64, top_k=8, expert_hidden=1024),
    )


def _mixtral() -> Config:
    return Config(
        model=ModelConfig(vocab_size=32_000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                          rope_theta=1e6, seq_len=4096),
        moe=MoEConfig(num_experts=8, top_k=2, expert_hidden=14_336, norm_topk_prob=True),
    )


def _qwen3() -> Config:
    return Config(
        model=ModelConfig(vocab_size=151_936, d_model=2048, n_layers=48, n_heads=32, n_kv_heads=4,
                          head_dim=128, qk_norm=True, rope_theta=1e6, seq_len=4096, norm_eps=1e-6),
        moe=MoEConfig(num_experts=128, top_k=8, expert_hidden=768, norm_topk_prob=True),
    )


def _qwen3_235b() -> Config:
    """Qwen3-235B-A22B: Qwen3-30B-A3B's block at d_model 4096, 94 layers, 64/4 heads, expert hidden 1536."""
    cfg = _qwen3()
    cfg.model.n_layers, cfg.model.d_model, cfg.model.n_heads = 94, 4096, 64
    cfg.moe.expert_hidden = 1536
    return cfg


def _gpt_oss_120b() -> Config:
    """gpt-oss-120b: gpt-oss-20b's block with 36 layers and 128 experts."""
    cfg = _gpt_oss()
    cfg.model.n_layers, cfg.moe.num_experts = 36, 128
    return cfg


def _gpt_oss() -> Config:
    """gpt-oss-20b: windowed layers alternate with whole-sequence ones (layer 0 windowed)."""
    return Config(
        model=ModelConfig(vocab_size=201_088, d_model=2880, n_layers=24, n_heads=64, n_kv_heads=8,
                          head_dim=64, attention_bias=True, sliding_window=128, sliding_window_pattern=2,
                          attention_sinks=True, rope_theta=150_000, seq_len=4096),
        # softmax over the top-k logits: the top-k softmax probabilities renormalised
        moe=MoEConfig(num_experts=32, top_k=4, expert_hidden=2880, norm_topk_prob=True, router_bias=True,
                      swiglu_limit=7.0),
    )


def _deepseek_v3() -> Config:
    """DeepSeek-V3's MoE shape with GQA in place of MLA (head_dim 96 with 8 kv heads: 187.2M
    attention weights a layer, against MLA's 187.1M)."""
    return Config(
        model=ModelConfig(vocab_size=129_280, d_model=7168, n_layers=61, n_heads=128, n_kv_heads=8,
                          head_dim=96, seq_len=4096, n_dense_layers=3, dense_hidden=18_432, norm_eps=1e-6),
        moe=MoEConfig(num_experts=256, top_k=8, expert_hidden=2048, shared_expert_hidden=2048,
                      gating="sigmoid", bias_gamma=0.001, routed_scaling=2.5, lb_loss_weight=1e-4,
                      expert_groups=8, expert_groups_per_token=4),
    )


def _reference(num_experts: int) -> Callable[[], Config]:
    """The expert-scaling benchmark: 8 layers (first dense), top-4, random routing."""

    def build() -> Config:
        return Config(
            model=ModelConfig(vocab_size=_REF_VOCAB, d_model=4096, n_layers=8, n_heads=32,
                              n_kv_heads=8, head_dim=128, qk_norm=True, rope_theta=5e5,
                              seq_len=8192, n_dense_layers=1, dense_hidden=5 * 4096),
            moe=MoEConfig(num_experts=num_experts, top_k=4, expert_hidden=4096,
                          shared_expert_hidden=4096, routing="random", capacity_factor=1.25),
            train=TrainConfig(global_batch_size=8, micro_batch_size=1, steps=20, warmup_steps=5),
        )

    return build


def _ultra(num_experts: int) -> Callable[[], Config]:
    """The scale runs (OLMoE3-dev-u001.py / u002.py): 63 layers, the first two dense with an FFN of
    top_k x expert hidden + shared hidden (4 x 8192 + 8192 = 40,960), random routing, capacity 1.1875."""

    def build() -> Config:
        return Config(
            model=ModelConfig(vocab_size=_REF_VOCAB, d_model=6144, n_layers=63, n_heads=64,
                              n_kv_heads=32, head_dim=128, qk_norm=True, rope_theta=5e5,
                              seq_len=8192, n_dense_layers=2, dense_hidden=4 * 8192 + 8192),
            moe=MoEConfig(num_experts=num_experts, top_k=4, expert_hidden=8192,
                          shared_expert_hidden=8192, routing="random", capacity_factor=1.1875),
        )

    return build


def _olmoe3_scale(d_model: int, n_heads: int, n_layers: int, n_dense: int, num_experts: int) -> Callable[[], Config]:
    """The scale table's Tiny..Large runs (OLMoE3-dev-t001/s001/m001/m002/l001.py and the copies that
    only change routing or batch): heads of 128 with a quarter as many kv heads (the attention width,
    n_heads x 128, is d_model from Tiny and 1,024 wider above), one shared and 4 routed experts of
    hidden d_model, the leading dense blocks' FFN top_k x expert hidden + shared hidden = 5 x d_model,
    random routing, capacity factor 1.1875. The pipelined runs drop one layer of the last stage and
    have two dense blocks; Tiny and Small one."""

    def build() -> Config:
        return Config(
            model=ModelConfig(vocab_size=_REF_VOCAB, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
                              n_kv_heads=n_heads // 4, head_dim=128, qk_norm=True, rope_theta=5e5,
                              seq_len=8192, n_dense_layers=n_dense, dense_hidden=5 * d_model),
            moe=MoEConfig(num_experts=num_experts, top_k=4, expert_hidden=d_model, shared_expert_hidden=d_model,
                          routing="random", capacity_factor=1.1875),
        )

    return build


PRESETS: dict[str, Callable[[], Config]] = {
    "tiny": _tiny,
    "small": _small,
    "olmoe-1b-7b": _olmoe,
    "mixtral-8x7b": _mixtral,
    "qwen3-30b-a3b": _qwen3,
    "qwen3-235b-a22b": _qwen3_235b,
    "gpt-oss-20b": _gpt_oss,
    "gpt-oss-120b": _gpt_oss_120b,
    "deepseek-v3-671b-gqa": _deepseek_v3,
    **{f"moe-8l-e{n}": _reference(n) for n in (8, 32, 48, 64, 128)},
    "olmoe3-tiny-64e": _olmoe3_scale(2048, 16, 16, 1, 64),
    "olmoe3-small-64e": _olmoe3_scale(2560, 24, 32, 1, 64),
    "olmoe3-medium-64e": _olmoe3_scale(3072, 32, 39, 2, 64),
    "olmoe3-medium-96e": _olmoe3_scale(3072, 32, 39, 2, 96),
    "olmoe3-medium-128e": _olmoe3_scale(3072, 32, 39, 2, 128),
    "olmoe3-large-128e": _olmoe3_scale(4096, 40, 47, 2, 128),
    "ultra-1.2t": _ultra(128),
    "ultra-2.38t": _ultra(256),
}


def load_config(preset: str = "tiny", overrides: list[str] | dict | None = None, validate: bool = True) -> Config:
    """Build the named preset, apply ``section.field=value`` overrides and validate (unless not ``validate``)."""
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; known presets: {', '.join(PRESETS)}")
    cfg = PRESETS[preset]()
    cfg.preset = preset
    cfg.apply_overrides(overrides or [])
    return cfg.validate() if validate else cfg
