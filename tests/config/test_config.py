"""Config overrides, validation, presets and the analytic cost model."""

import json
import re

import pytest
import torch

from moebench.config import Config
from moebench.errors import ConfigError
from moebench.model.transformer import Transformer, build_model
from moebench.presets import PRESETS, load_config

# Published (total, active) parameter counts, BACKGROUND.md section 2.
PUBLISHED = {
    "olmoe-1b-7b": (6.9e9, 1.3e9),
    "mixtral-8x7b": (46.7e9, 12.9e9),
    "qwen3-30b-a3b": (30.5e9, 3.3e9),
    "moe-8l-e8": (4.6e9, 3.17e9),
    "moe-8l-e64": (24.31e9, 3.17e9),
    "moe-8l-e128": (47e9, 3.17e9),
    "ultra-1.2t": (1.2e12, 58.36e9),
    "ultra-2.38t": (2.38e12, 58.41e9),
    # OLMo-core 3's scale table, Tiny-64E .. Large-128E (BACKGROUND.md section 7)
    "olmoe3-tiny-64e": (12.91e9, 1.59e9),
    "olmoe3-small-64e": (40.86e9, 4.29e9),
    "olmoe3-medium-64e": (70.2e9, 7.4e9),
    "olmoe3-medium-96e": (103.8e9, 7.4e9),
    "olmoe3-medium-128e": (137.3e9, 7.4e9),
    "olmoe3-large-128e": (296.0e9, 15.14e9),
    # model card Qwen/Qwen3-235B-A22B: 235B total, 22B active
    "qwen3-235b-a22b": (235e9, 22e9),
    # model card openai/gpt-oss-20b: 20.91B total, 3.61B active
    "gpt-oss-20b": (20.91e9, 3.61e9),
    # model card openai/gpt-oss-120b: 117B total, 5.1B active
    "gpt-oss-120b": (117e9, 5.1e9),
    # DeepSeek-V3 technical report (arXiv:2412.19437): 671B total, 37B active; MLA attention is
    # replaced by GQA with as many weights a layer (docs/presets.md), so the totals stay within 3%
    "deepseek-v3-671b-gqa": (671e9, 37e9),
}
# Presets whose published active count leaves out the input embedding (a lookup, not a matmul)
ACTIVE_WITHOUT_EMBEDDING = {"gpt-oss-20b", "gpt-oss-120b"}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_presets_match_published_counts(preset):
    cfg = load_config(preset)
    total, active = PUBLISHED[preset]
    embed = cfg.model.vocab_size * cfg.model.d_model if preset in ACTIVE_WITHOUT_EMBEDDING else 0
    assert cfg.total_params() == pytest.approx(total, rel=0.03)
    assert cfg.active_params() - embed == pytest.approx(active, rel=0.03)


def test_deepseek_v3_proxy_has_the_published_moe_part():
    """The routed and shared experts of DeepSeek-V3's config (58 MoE layers of 256 routed + 1 shared
    SwiGLU experts, d_model 7168, hidden 2048) exactly: only the attention is a proxy."""
    cfg = load_config("deepseek-v3-671b-gqa")
    n_moe = cfg.model.n_layers - cfg.model.n_dense_layers
    shared = 3 * cfg.model.d_model * cfg.moe.shared_expert_hidden
    assert n_moe * (cfg.moe.num_experts * cfg.expert_params() + shared) == 58 * 257 * 3 * 7168 * 2048
    # MLA's weights a layer: q down/up (7168x1536, 1536x128x192), kv down/up (7168x576, 512x128x256),
    # output (128x128x7168); the proxy's GQA matches them within 0.1%
    mla = 7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256 + 128 * 128 * 7168
    assert cfg.attention_params() == pytest.approx(mla, rel=1e-3)


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_presets_built_on_meta_have_their_published_counts(preset):
    cfg = load_config(preset)
    with torch.device("meta"):
        model = Transformer(cfg)
    numel = sum(p.numel() for p in model.parameters())
    assert numel == cfg.total_params()
    assert numel == pytest.approx(PUBLISHED[preset][0], rel=0.03)


def test_presets_true_to_their_models():
    olmoe = load_config("olmoe-1b-7b")
    assert olmoe.model.qk_norm and olmoe.model.qk_norm_scope == "full"  # OLMoE normalises all of q and of k
    with torch.device("meta"):
        attn = Transformer(olmoe).layers["0"].attn
    assert attn.q_norm.weight.shape == (2048,) and attn.k_norm.weight.shape == (16 * 128,)
    qwen = load_config("qwen3-30b-a3b")
    assert qwen.model.norm_eps == 1e-6 and qwen.model.qk_norm_scope == "per_head"
    gpt_oss = load_config("gpt-oss-20b")
    with torch.device("meta"):
        layers = Transformer(gpt_oss).layers
    assert [layers[str(i)].attn.window for i in range(4)] == [128, None, 128, None]  # layer 0 windowed
    assert layers["0"].attn.sinks.shape == (64,) and layers["0"].attn.wqkv.bias is not None
    assert layers["0"].ffn.router.gate.bias.shape == (32,) and layers["0"].ffn.experts.swiglu_limit == 7.0


@pytest.mark.parametrize(
    "preset,overrides",
    [
        ("tiny", []),
        ("tiny", ["model.qk_norm=true", "model.qk_norm_scope=full", "model.n_kv_heads=1"]),
        ("small", []),  # dense first layer + shared expert
        ("tiny", ["model.qk_norm=true", "model.head_dim=8", "moe.shared_expert_hidden=32", "model.n_dense_layers=1"]),
        ("tiny", ["model.attention_bias=true", "model.attention_sinks=true", "moe.router_bias=true"]),
    ],
)
def test_cost_model_equals_numel(preset, overrides):
    cfg = load_config(preset, overrides)
    model = build_model(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.total_params()
    # active = total minus the (E - K) unused experts of every MoE layer
    n_moe = cfg.model.n_layers - cfg.model.n_dense_layers
    unused = n_moe * (cfg.moe.num_experts - cfg.moe.top_k) * cfg.expert_params()
    assert cfg.active_params() == cfg.total_params() - unused


def test_flops_per_token_formula():
    cfg = load_config("tiny")
    m = cfg.model
    matmul = cfg.active_params() - 2 * m.vocab_size * m.d_model - m.d_model  # no embeddings/final norm
    matmul -= m.n_layers * 2 * m.d_model  # no block norms
    matmul += m.vocab_size * m.d_model  # the LM head is a matmul
    attention = 12 * m.n_layers * m.n_heads * m.hd * (m.seq_len // 2)
    assert cfg.flops_per_token() == 6 * matmul + attention


def test_sliding_window_flops():
    base = load_config("tiny", ["model.seq_len=64"])
    m = base.model
    per_context = 12 * m.n_layers * m.n_heads * m.hd  # attention score/value FLOPs per key
    same = load_config("tiny", ["model.seq_len=64", "model.sliding_window=64"])
    assert same.flops_per_token() == base.flops_per_token()  # a window as long as the sequence
    # window 16 on every layer: min(i, 16) keys for query i, 16 - 16^2 / (2 * 64) = 14 on average
    every = load_config("tiny", ["model.seq_len=64", "model.sliding_window=16"])
    assert base.flops_per_token() - every.flops_per_token() == per_context * (32 - 14)
    # pattern 2: layer 0 windowed, layer 1 whole-sequence (the 2-layer tiny model: one of each)
    alternating = load_config("tiny", ["model.seq_len=64", "model.sliding_window=16",
                                       "model.sliding_window_pattern=2"])
    assert [alternating.model.layer_window(i) for i in range(4)] == [16, None, 16, None]
    assert base.flops_per_token() - alternating.flops_per_token() == per_context * (32 - 14) // 2
    # biases and sinks add parameters but no matmul FLOPs
    biased = load_config("tiny", ["model.attention_bias=true", "model.attention_sinks=true", "moe.router_bias=true"])
    assert biased.flops_per_token() == load_config("tiny").flops_per_token()
    assert biased.total_params() > load_config("tiny").total_params()


def test_big_presets_build_on_meta_only():
    with torch.device("meta"):
        model = Transformer(load_config("ultra-2.38t"))
    assert all(p.is_meta for p in model.parameters())


def test_overrides_are_typed():
    cfg = load_config("tiny", ["moe.num_experts=32", "moe.top_k=4", "train.lr=1e-3", "model.qk_norm=yes",
                               "moe.routing=random", "model.head_dim=none"])
    assert cfg.moe.num_experts == 32 and cfg.moe.top_k == 4
    assert cfg.train.lr == pytest.approx(1e-3) and cfg.model.qk_norm is True
    assert cfg.moe.routing == "random" and cfg.model.head_dim is None


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["moe.top_k=9"], "moe.top_k=9 exceeds moe.num_experts=8"),
        (["model.n_heads=3"], "does not divide model.d_model"),
        (["moe.nope=1"], "unknown key 'moe.nope'"),
        (["bogus.x=1"], "unknown key 'bogus.x'"),
        (["moe.top_k=two"], "bad value 'two' for moe.top_k; expected an integer"),
        (["moe.top_k=1.5"], "expected an integer"),
        (["moe.gating=relu"], "allowed: softmax, sigmoid"),
        (["train.lr=nan"], "finite"),
        (["moe.top_k"], "must look like section.field=value"),
        (["train.global_batch_size=6"], "not a multiple"),
        (["model.head_dim=0"], "model.head_dim=0 must be >= 1"),
        (["model.sliding_window=0"], "model.sliding_window=0 must be >= 1"),
        (["model.sliding_window_pattern=0"], "model.sliding_window_pattern=0 must be >= 1"),
        (["moe.routed_scaling=0"], "moe.routed_scaling=0.0 must be > 0"),
        (["moe.expert_groups=3"], "moe.expert_groups=3 must be >= 1 and divide moe.num_experts=8"),
        (["moe.expert_groups_per_token=2"], "moe.expert_groups_per_token=2 needs moe.expert_groups > 1"),
        (["moe.expert_groups=4", "moe.expert_groups_per_token=5"], "must be in [1, moe.expert_groups=4]"),
        (["moe.expert_groups=8", "moe.expert_groups_per_token=1"], "moe.top_k=2 exceeds the 1 experts"),
        (["moe.expert_groups=2", "moe.routing=random"], "applies only to moe.routing=learned"),
        (["moe.swiglu_limit=-1"], "moe.swiglu_limit=-1.0 must be > 0"),
        # values torch would reject with a traceback, or accept and train on garbage
        (["train.lr=-1"], "train.lr=-1.0 must be >= 0"),
        (["train.beta1=1"], "train.beta1=1.0 must be in [0, 1)"),
        (["train.beta2=-0.1"], "train.beta2=-0.1 must be in [0, 1)"),
        (["train.weight_decay=-0.1"], "train.weight_decay=-0.1 must be >= 0"),
        (["train.clip_grad_norm=0"], "train.clip_grad_norm=0.0 must be > 0"),
        (["train.cpu_threads=-1"], "train.cpu_threads=-1 must be >= 0"),
        (["model.norm_eps=0"], "model.norm_eps=0.0 must be > 0"),
        (["model.rope_theta=-1"], "model.rope_theta=-1.0 must be > 0"),
        (["moe.shared_expert_hidden=-4"], "moe.shared_expert_hidden=-4 must be >= 0"),
        (["moe.lb_loss_weight=-1"], "moe.lb_loss_weight=-1.0 must be >= 0"),
        (["moe.z_loss_weight=-1"], "moe.z_loss_weight=-1.0 must be >= 0"),
        (["moe.bias_gamma=-0.01"], "moe.bias_gamma=-0.01 must be >= 0"),
        (["model.n_dense_layers=1", "model.dense_hidden=0"], "model.dense_hidden=0 must be >= 1"),
        (["model.qk_norm_scope=heads"], "allowed: per_head, full"),
    ],
)
def test_bad_overrides_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config("tiny", overrides)


def test_pipeline_layout_fields():
    """parallel.pp_layers reads from comma-separated text or a list, survives a round trip (a list
    in JSON), and the virtual-stage degree defaults to the schedule's (2 interleaved, else 1)."""
    cfg = load_config("tiny", ["parallel.pp=2", "model.n_layers=7", "parallel.pp_layers=2,2,2,1",
                               "parallel.pp_schedule=interleaved-1f1b"])
    assert cfg.parallel.pp_layers == (2, 2, 2, 1) and cfg.parallel.num_stages == 4
    assert Config.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    four = load_config("tiny", ["parallel.pp=2", "parallel.pp_schedule=interleaved-1f1b",
                                "parallel.pp_virtual_stages=4", "model.n_layers=8"])
    assert four.parallel.virtual_stages == 4 and four.parallel.num_stages == 8
    assert load_config("tiny", ["parallel.pp=2"]).parallel.virtual_stages == 1
    for bad in ("2,x", "2, 2", "", "2;2"):
        with pytest.raises(ConfigError, match=re.escape("for parallel.pp_layers; expected an integer")):
            load_config("tiny", [f"parallel.pp_layers={bad}"])


def test_unknown_preset():
    with pytest.raises(ConfigError, match="unknown preset 'gpt5'"):
        load_config("gpt5")


def test_round_trip_and_hash():
    cfg = load_config("small", ["moe.top_k=4"])
    again = Config.from_dict(cfg.to_dict())
    assert again == cfg and again.hash() == cfg.hash()
    assert load_config("small").hash() != cfg.hash()


def test_every_preset_validates():
    for name in PRESETS:
        assert load_config(name).preset == name


@pytest.mark.parametrize("key,value,message", [
    # float() and int() take all of these; a suite or override never means them
    ("train.lr", "0.01\n", "expected a finite number"),  # a newline would end a line of the sbatch script
    ("train.lr", " 0.01", "expected a finite number"),
    ("train.lr", "1_0", "expected a finite number"),
    ("train.lr", "\uff10.\uff11", "expected a finite number"),  # fullwidth digits
    ("train.lr", "inf", "expected a finite number"),
    ("train.lr", "1e400", "finite"),
    ("train.lr", True, "expected a finite number"),
    ("train.lr", 2**53 + 1, "no exact float"),
    ("moe.top_k", "\uff12", "expected an integer"),
    ("moe.top_k", "2\n", "expected an integer"),
    ("moe.top_k", "٢", "expected an integer"),  # an Arabic-Indic two
    ("moe.top_k", 2**53 + 1, "at most 2^53"),
    ("moe.top_k", str(2**53 + 1), "at most 2^53"),
    ("moe.top_k", 1e300, "at most 2^53"),
    ("moe.top_k", [2], "expected an integer"),
    ("model.qk_norm", "true\n", "expected a boolean"),
    ("moe.gating", "softmax\n", "allowed: softmax, sigmoid"),
])
def test_numeric_text_is_plain_ascii_and_exact(key, value, message):
    from moebench.config import parse_field

    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_field(key, value)


@pytest.mark.parametrize("key,value,expected", [
    ("train.lr", "1e-3", 1e-3), ("train.lr", "-.5", -0.5), ("train.lr", 3, 3.0), ("train.lr", 2**53, 2.0**53),
    ("moe.top_k", "4", 4), ("moe.top_k", "+4", 4), ("moe.top_k", "4.0", 4), ("moe.top_k", "1e3", 1000),
    ("moe.top_k", 2**53, 2**53),
])
def test_numeric_text_that_is_accepted(key, value, expected):
    from moebench.config import parse_field

    got = parse_field(key, value)
    assert got == expected and type(got) is type(expected)


def test_a_field_added_at_its_default_leaves_the_hash_alone():
    """Fields declared with added_field() are left out of the hash while at their default, so a
    new field does not re-key every store, fixture and older commit's points; set, they count."""
    import dataclasses

    from moebench import config as config_module

    @dataclasses.dataclass
    class Extended(config_module.TrainConfig):
        new_knob: int = config_module.added_field(0)

    cfg = Config()
    extended = dataclasses.replace(cfg, train=Extended(**dataclasses.asdict(cfg.train)))
    assert extended.to_dict()["train"]["new_knob"] == 0
    assert extended.hash() == cfg.hash()
    extended.train.new_knob = 3
    assert extended.hash() != cfg.hash()


def test_lossless_capacity_is_ep_whatever_the_factor():
    cfg = Config()
    before = cfg.hash()
    assert cfg.moe.capacity == "factor" and cfg.effective_capacity_factor() == cfg.moe.capacity_factor
    cfg.apply_overrides(["parallel.ep=4", "moe.capacity=lossless", "moe.capacity_factor=0.5"]).validate()
    assert cfg.effective_capacity_factor() == 4.0
    cfg.set("parallel.ep", 1)
    assert cfg.hash() != before
    cfg.set("moe.capacity", "factor")
    cfg.set("moe.capacity_factor", 1.25)
    assert cfg.hash() == before  # added_field: at its default the hash is the one before the field
    with pytest.raises(ConfigError, match=r"moe\.capacity"):
        cfg.set("moe.capacity", "adaptive")
