"""Run configuration: nested dataclasses, ``--set`` overrides and the analytic cost model.

A :class:`Config` has five sections (``model``, ``moe``, ``train``, ``precision``,
``parallel``). Presets live in :mod:`moebench.presets`; any field can be overridden with
``section.field=value``. Derived quantities (parameter counts, FLOPs per token) are
methods here, computed from the shapes and tested against the numel of a built model.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import types
import typing
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, Literal

from moebench.errors import ConfigError

ADDED = "added"  # field metadata: see added_field


def added_field(default: Any) -> Any:
    """A config field added after configs were first hashed: at ``default`` it leaves
    :meth:`Config.hash` unchanged (only a scalar default: the hash compares the value to it)."""
    return field(default=default, metadata={ADDED: True})

# Capacity of the row-wise dispatcher in multiples of a balanced share. At ep ranks a factor of
# ep already keeps every route; beyond 64 the buffers only grow (1e308 overflows to inf bytes).
MAX_CAPACITY_FACTOR = 64.0


@dataclass
class ModelConfig:
    vocab_size: int = 512
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int | None = None  # None: d_model // n_heads
    qk_norm: bool = False
    # per_head: one RMSNorm over each head's head_dim (Qwen3, the reference benchmark); full: one
    # over the whole projected q (n_heads x head_dim) and one over k (n_kv_heads x head_dim) (OLMoE)
    qk_norm_scope: Literal["per_head", "full"] = "per_head"
    rope_theta: float = 10000.0
    seq_len: int = 64
    n_dense_layers: int = 0  # leading layers with a dense SwiGLU FFN instead of MoE
    dense_hidden: int = 256
    norm_eps: float = 1e-5
    attention_bias: bool = added_field(False)  # biases on the q, k, v and output projections (gpt-oss)
    # Sliding-window attention: a token sees itself and the sliding_window - 1 tokens before it (None:
    # every layer attends causally over the whole sequence). With sliding_window_pattern = P, every
    # P-th layer (layers P-1, 2P-1, ...) attends over the whole sequence and the others use the
    # window; P = 1: every layer uses the window (gpt-oss: window 128, P = 2, layer 0 sliding).
    sliding_window: int | None = added_field(None)
    sliding_window_pattern: int = added_field(1)
    # one learned logit per query head that joins every softmax denominator and attends to nothing
    # (gpt-oss), so a head can put weight on no token
    attention_sinks: bool = added_field(False)
    # The LM head and the loss (moebench.model.loss): None, the head's full [T, V] logits and the
    # reference cross-entropy on them; an integer, the head fused with the loss over chunks of this
    # many tokens, which keeps no [T, V] tensor for backward (single pipeline stage only)
    loss_chunk_tokens: int | None = added_field(None)
    # RMSNorm (block, QK and final norms; moebench.model.norm): "torch", torch's nn.RMSNorm, which
    # keeps fp32 normalised rows (and the q/k norms an fp32 upcast) for backward; "recompute", one
    # that keeps its input as it came and an fp32 rstd a row, and recomputes the rest in backward
    norm_impl: Literal["torch", "recompute"] = added_field("torch")

    @property
    def hd(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    def layer_window(self, layer_id: int) -> int | None:
        """The attention window of layer ``layer_id`` (None: the whole causal sequence)."""
        period = self.sliding_window_pattern
        if self.sliding_window is None or (period > 1 and (layer_id + 1) % period == 0):
            return None
        return self.sliding_window


@dataclass
class MoEConfig:
    num_experts: int = 8
    top_k: int = 2
    expert_hidden: int = 64
    shared_expert_hidden: int = 0  # 0: no shared expert
    gating: Literal["softmax", "sigmoid"] = "softmax"
    norm_topk_prob: bool = False  # renormalise the top-k weights to sum to one
    lb_loss_weight: float = 0.01
    z_loss_weight: float = 0.001
    bias_gamma: float = 0.0  # aux-loss-free balancing step; 0 disables the bias
    router_bias: bool = added_field(False)  # a learned bias on the router logits (gpt-oss)
    # Group-limited routing (DeepSeek-V3): the experts form expert_groups equal groups, a group
    # scores the sum of its two best selection scores, and a token picks its top_k experts from its
    # expert_groups_per_token best groups only (1 group: no limit). Learned routing only.
    expert_groups: int = added_field(1)
    expert_groups_per_token: int = added_field(1)
    # the routed experts' combined output is multiplied by this (DeepSeek-V3's routed_scaling_factor)
    routed_scaling: float = added_field(1.0)
    # gpt-oss's clamped SwiGLU in the routed experts (None: plain silu(gate) * up); see
    # moebench.kernels.swiglu.swiglu_clamped for the formula
    swiglu_limit: float | None = added_field(None)
    capacity_factor: float = 1.25  # row-wise dispatcher capacity, in multiples of a balanced share
    # "factor": the row-wise capacity is capacity_factor (routes over it are dropped); "lossless":
    # the worst case, no route can drop (capacity_factor is then ignored; see
    # Config.effective_capacity_factor)
    capacity: Literal["factor", "lossless"] = added_field("factor")
    # learned: the router's top-k; random: fresh noise each call; uniform: token t of a call takes
    # experts t*K.. (mod E); skewed: a seeded draw keyed by the token's place in the global batch,
    # the same under every layout (moebench.model.route_keys), skewed by the two fields below
    routing: Literal["learned", "random", "uniform", "skewed"] = "learned"
    # skewed routing: expert r of a token's preference order is drawn with weight (r + 1) ** -skew
    # (0: uniform); the step's tokens form routing_sources equal shares in global-batch order (a
    # data-parallel rank's share when it equals parallel.dp), share j preferring the experts rotated
    # by j * num_experts // routing_sources (1: every token prefers the same experts)
    routing_skew: float = added_field(0.0)
    routing_sources: int = added_field(1)
    # auto: the fastest tested path for the device (resolved_backend); the record's moe_backend says which ran
    backend: Literal["auto", "grouped_mm", "loop", "triton", "cpu_fused"] = "auto"

    def features(self) -> frozenset[str]:
        """The model features (:data:`MOE_FEATURES`) this config turns on."""
        on = {"moe.swiglu_limit": self.swiglu_limit is not None, "moe.router_bias": self.router_bias,
              "moe.expert_groups": self.expert_groups > 1, "moe.routed_scaling": self.routed_scaling != 1.0,
              "moe.shared_expert_hidden": self.shared_expert_hidden > 0}
        return frozenset(name for name, used in on.items() if used)

    def resolved_backend(self, device_type: str) -> str:
        """The backend a run on ``device_type`` uses (see :func:`resolve_backend`)."""
        return resolve_backend(self.backend, device_type, self.features())


# The model features an expert backend may or may not compute, by the config field that turns each
# on (quantized experts: precision.mode fp8 or mxfp8). Router bias, group-limited routing, routed
# scaling and the shared expert run in the router and the MoE block, outside every backend today;
# they are listed so that a backend that fuses them in has to say whether it computes them.
MOE_FEATURES: dict[str, str] = {
    "moe.swiglu_limit": "clamped SwiGLU",
    "moe.router_bias": "router bias",
    "moe.expert_groups": "group-limited routing",
    "moe.routed_scaling": "routed scaling",
    "moe.shared_expert_hidden": "shared expert",
    "precision.mode": "quantized experts (fp8, mxfp8)",
}

# What each expert backend computes, on every device (moebench.kernels.expert_backends has the
# backends). cpu_fused's CPU kernels write plain SwiGLU out by hand.
BACKEND_FEATURES: dict[str, frozenset[str]] = {
    "loop": frozenset(MOE_FEATURES),
    "grouped_mm": frozenset(MOE_FEATURES),
    "triton": frozenset(MOE_FEATURES),
    "cpu_fused": frozenset(MOE_FEATURES) - {"moe.swiglu_limit"},
}


def check_backend_features(backend: str, features: Collection[str]) -> None:
    """ConfigError, naming what would work, when expert backend ``backend`` (a ``moe.backend``)
    does not compute every one of ``features`` (names of :data:`MOE_FEATURES`); ``auto`` always can."""
    if backend == "auto" or backend not in BACKEND_FEATURES:  # an unknown name is the backend lookup's error
        return
    missing = sorted(set(features) - BACKEND_FEATURES[backend])
    if missing:
        able = ["auto", *(name for name, has in BACKEND_FEATURES.items() if set(features) <= has)]
        what = ", ".join(f"{MOE_FEATURES[f]} ({f})" for f in missing)
        raise ConfigError(f"moe.backend={backend} does not compute {what}: use moe.backend={' or '.join(able)}")


def resolve_backend(backend: str, device_type: str, features: Collection[str] = ()) -> str:
    """``auto`` is ``cpu_fused`` on CPU (at the layer benchmark shape 0.96-1.02 of the dense fp32
    matmul rate, against 0.73-0.83 for ``grouped_mm``) and ``grouped_mm`` on a GPU (device
    offsets, no host sync); on CPU it is ``grouped_mm`` too when the model uses a feature
    ``cpu_fused`` does not compute (:data:`BACKEND_FEATURES`); any other name as set."""
    if backend != "auto":
        return backend
    fused = device_type == "cpu" and set(features) <= BACKEND_FEATURES["cpu_fused"]
    return "cpu_fused" if fused else "grouped_mm"


@dataclass
class TrainConfig:
    global_batch_size: int = 8  # sequences per optimizer step, over all data-parallel ranks
    micro_batch_size: int = 4  # sequences per rank per forward/backward
    steps: int = 30
    warmup_steps: int = 2  # excluded from timing
    # Adaptive warm-up (moebench.metrics.steady): after warmup_steps, keep warming up while the step
    # time is still falling, up to this many warm-up steps in all; 0: the fixed warmup_steps. The
    # timed window keeps its length (steps - warmup_steps), so a longer warm-up adds steps to the run.
    max_warmup_steps: int = 0
    # extra steps after the timed ones that train.trace traces (untraced runs skip them); 0: none
    profile_steps: int = 2
    # Where the time goes, taken inside every timed step (moebench.model.phases: a host timestamp or
    # an unsynchronised CUDA event at each phase boundary): time_breakdown_s, comm_s. false: none
    # (docs/report.md has what the boundaries cost).
    phase_clock: bool = added_field(True)
    lr: float = 3e-3
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    clip_grad_norm: float = 1.0
    seed: int = 0
    data: Literal["random", "markov"] = "random"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # Regional torch.compile of each transformer block (moebench.model.compile); it compiles in the
    # warm-up steps, outside the timed window, and the record's compile_s says how long that took.
    compile: bool = False
    # A torch.profiler Chrome trace per rank of the profiled steps (moebench.metrics.trace), beside the
    # point's logs; the timed steps are never traced. It changes no result, yet is in the hash (when
    # true) as profile_steps is: a traced store holds other files than an untraced one.
    trace: bool = added_field(False)

    @property
    def timed_steps(self) -> int:
        """Steps in the timed window, whatever the warm-up took."""
        return self.steps - self.warmup_steps


# the GEMM kinds each precision.scope quantizes: "grouped" the expert GEMMs, "linear" the plain ones
# (the trainer's probe and the planner ask about each kind of the scope)
SCOPE_KINDS: dict[str, tuple[str, ...]] = {"experts": ("grouped",), "linear": ("grouped", "linear")}


@dataclass
class PrecisionConfig:
    # auto: bf16 on GPU, fp32 on CPU. bf16 keeps fp32 master weights (autocast compute).
    # fp8 / mxfp8: bf16 compute with quantized expert GEMMs (fp8: E4M3 + one scale per row;
    # mxfp8: E4M3 + one E8M0 scale per 32 elements); native or emulated per device, see
    # docs/precision.md and the run record's precision_impl.
    mode: Literal["auto", "fp32", "bf16", "fp8", "mxfp8"] = "auto"
    # MXFP8 block-scale rounding: "up" = ceil(log2(amax/448)) (no saturation), "floor" = OCP
    # reference floor(log2(amax)) - 8 (saturates the top of the binade).
    mxfp8_rounding: Literal["up", "floor"] = "up"
    # which GEMMs fp8 / mxfp8 quantize: "experts" the routed experts only; "linear" also the
    # attention projections, the dense FFNs and the shared expert (never the router, the
    # embedding or the LM head)
    scope: Literal["experts", "linear"] = "experts"
    # what the quantized GEMMs save for backward: "quantized" the E4M3 operands (+ scales) their
    # backward reads, "compute" the compute-dtype inputs (more memory; MXFP8's weight gradient
    # then reads the unquantized activation)
    saved_activations: Literal["quantized", "compute"] = "quantized"
    # true: a quantized mode that would run emulated on this device fails the run with the probe's
    # reason instead (the record's precision_probe_error), e.g. to catch a torch build without the kernels
    require_native: bool = added_field(False)
    # the parameters' dtype. "fp32": fp32 parameters are the master weights and matmuls run under
    # autocast (what the trainer runs). "bf16": OLMo-core's DDP policy, planned only (moebench plan;
    # the trainer refuses it): bf16 compute weights, each bf16 gradient added into a flat fp32 bucket,
    # fp32 main weights and AdamW moments in the optimizer (sharded with parallel.dist_opt)
    param_dtype: Literal["fp32", "bf16"] = added_field("fp32")

    def resolved_mode(self, on_gpu: bool) -> str:
        """The mode a run uses: ``auto`` is bf16 on a GPU and fp32 on CPU; others as set."""
        if self.mode == "auto":
            return "bf16" if on_gpu else "fp32"
        return self.mode


@dataclass
class ParallelConfig:
    strategy: Literal["fsdp", "ddp"] = "ddp"
    dp: int = 1
    ep: int = 1
    pp: int = 1
    dispatcher: Literal["sync", "rowwise"] = "sync"
    # row-wise capacity rule (moebench.parallel.capacity): "destination" one receive capacity per
    # EP rank shared by all sources, drops only on experts over their fair share; "pair" one
    # capacity per (source, destination), the original rule
    rowwise_capacity: Literal["destination", "pair"] = added_field("destination")
    dist_opt: bool = False
    pp_microbatches: int = 2
    pp_schedule: Literal["1f1b", "interleaved-1f1b", "gpipe"] = "1f1b"
    activation_checkpointing: Literal["none", "per-layer"] = "none"

    @property
    def world_size(self) -> int:
        return self.dp * self.pp


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "moe": MoEConfig,
    "train": TrainConfig,
    "precision": PrecisionConfig,
    "parallel": ParallelConfig,
}


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    preset: str = "custom"

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Config:
        cfg = cls(preset=str(data.get("preset", "custom")))
        for name, values in data.items():
            if name == "preset":
                continue
            if name not in SECTIONS:
                raise ConfigError(f"unknown config section {name!r}; allowed: {', '.join(SECTIONS)}")
            for key, value in dict(values).items():
                cfg.set(f"{name}.{key}", value)
        cfg.validate()
        return cfg

    def hash(self) -> str:
        """Stable short hash of the resolved config (keys sorted).

        A field declared with :func:`added_field` is left out while it holds its default, so that
        adding a field does not change the hash of every config written before it: stores,
        fixtures and ``check --against`` an older commit still match point by point.
        """
        data = self.to_dict()
        for name in SECTIONS:
            values = getattr(self, name)
            for f in dataclasses.fields(values):
                if f.metadata.get(ADDED) and getattr(values, f.name) == f.default:
                    del data[name][f.name]
        blob = json.dumps(data, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    # ------------------------------------------------------------------ overrides
    def set(self, key: str, value: Any) -> None:
        """Set ``section.field`` from a Python value or a command-line string."""
        value = parse_field(key, value)
        section_name, _, field_name = key.partition(".")
        setattr(getattr(self, section_name), field_name, value)

    def apply_overrides(self, overrides: list[str] | dict[str, Any]) -> Config:
        items = overrides.items() if isinstance(overrides, dict) else map(_split_override, overrides)
        for key, value in items:
            self.set(key, value)
        return self

    # ------------------------------------------------------------------ validation
    def validate_sizes(self) -> Config:
        """Check the counts every other check and cost divides by (all >= 1); raise ConfigError.

        The planner runs this alone before it scales the batch to a GPU count, which the full
        :meth:`validate` (batch divisibility) can only check afterwards.
        """
        m, e, t, p = self.model, self.moe, self.train, self.parallel
        problems: list[str] = []
        for key, value in [
            ("model.vocab_size", m.vocab_size), ("model.d_model", m.d_model),
            ("model.n_layers", m.n_layers), ("model.n_heads", m.n_heads),
            ("model.n_kv_heads", m.n_kv_heads), ("model.seq_len", m.seq_len),
            ("moe.num_experts", e.num_experts), ("moe.top_k", e.top_k),
            ("moe.expert_hidden", e.expert_hidden), ("train.micro_batch_size", t.micro_batch_size),
            ("train.global_batch_size", t.global_batch_size), ("train.steps", t.steps),
            ("parallel.dp", p.dp), ("parallel.ep", p.ep), ("parallel.pp", p.pp),
            ("parallel.pp_microbatches", p.pp_microbatches),
        ]:
            if value < 1:
                problems.append(f"{key}={value} must be >= 1")
        if problems:
            raise ConfigError("; ".join(problems))
        return self

    def validate(self) -> Config:
        """Check shapes and settings that do not depend on the launch; raise ConfigError."""
        self.validate_sizes()
        m, e, t, p = self.model, self.moe, self.train, self.parallel
        problems: list[str] = []
        if e.top_k > e.num_experts:
            problems.append(f"moe.top_k={e.top_k} exceeds moe.num_experts={e.num_experts}")
        if m.head_dim is not None and m.head_dim < 1:
            problems.append(f"model.head_dim={m.head_dim} must be >= 1 (or none: d_model // n_heads)")
        if m.head_dim is None and m.d_model % m.n_heads:
            problems.append(
                f"model.n_heads={m.n_heads} does not divide model.d_model={m.d_model} "
                "(set model.head_dim to decouple them)"
            )
        if m.n_heads % m.n_kv_heads:
            problems.append(f"model.n_kv_heads={m.n_kv_heads} does not divide model.n_heads={m.n_heads}")
        if m.hd % 2:
            problems.append(f"head_dim={m.hd} must be even for RoPE")
        if not 0 <= m.n_dense_layers <= m.n_layers:
            problems.append(f"model.n_dense_layers={m.n_dense_layers} must be in [0, {m.n_layers}]")
        if t.warmup_steps < 0 or t.warmup_steps >= t.steps:
            problems.append(f"train.warmup_steps={t.warmup_steps} must be in [0, train.steps={t.steps})")
        if t.compile and t.warmup_steps < 2:
            # the first step compiles every block, the second the variant with a graph break at each
            # phase mark that the profiled steps run (moebench.model.compile)
            problems.append(f"train.warmup_steps={t.warmup_steps} must be >= 2 with train.compile=true "
                            "(the blocks compile in the warm-up steps)")
        if t.max_warmup_steps and not t.warmup_steps <= t.max_warmup_steps:
            problems.append(f"train.max_warmup_steps={t.max_warmup_steps} must be 0 (the fixed warm-up) or at "
                            f"least train.warmup_steps={t.warmup_steps}")
        if t.profile_steps < 0:
            problems.append(f"train.profile_steps={t.profile_steps} must be >= 0")
        if t.trace and t.profile_steps < 1:
            problems.append(f"train.trace=true traces the profiled steps: train.profile_steps={t.profile_steps} "
                            "must be >= 1")
        if not 0 < e.capacity_factor <= MAX_CAPACITY_FACTOR:  # NaN fails too
            problems.append(f"moe.capacity_factor={e.capacity_factor} must be in (0, {MAX_CAPACITY_FACTOR:g}]")
        # torch accepts some of these and trains on garbage (a negative clip norm flips every
        # gradient, a negative weight decay in a param group is not checked), so refuse them here
        for key, value, ok, rule in [
            ("train.lr", t.lr, t.lr >= 0, ">= 0"),
            ("train.weight_decay", t.weight_decay, t.weight_decay >= 0, ">= 0"),
            ("train.beta1", t.beta1, 0 <= t.beta1 < 1, "in [0, 1)"),
            ("train.beta2", t.beta2, 0 <= t.beta2 < 1, "in [0, 1)"),
            ("train.clip_grad_norm", t.clip_grad_norm, t.clip_grad_norm > 0, "> 0"),
            ("model.norm_eps", m.norm_eps, m.norm_eps > 0, "> 0"),
            ("model.rope_theta", m.rope_theta, m.rope_theta > 0, "> 0"),
            ("moe.shared_expert_hidden", e.shared_expert_hidden, e.shared_expert_hidden >= 0, ">= 0 (0: none)"),
            ("moe.lb_loss_weight", e.lb_loss_weight, e.lb_loss_weight >= 0, ">= 0"),
            ("moe.z_loss_weight", e.z_loss_weight, e.z_loss_weight >= 0, ">= 0"),
            ("moe.bias_gamma", e.bias_gamma, e.bias_gamma >= 0, ">= 0 (0: no bias)"),
        ]:
            if not ok:
                problems.append(f"{key}={value} must be {rule}")
        problems += self._routing_problems()
        if m.sliding_window is not None and m.sliding_window < 1:
            problems.append(f"model.sliding_window={m.sliding_window} must be >= 1 (or none: no window)")
        if m.loss_chunk_tokens is not None and m.loss_chunk_tokens < 1:
            problems.append(f"model.loss_chunk_tokens={m.loss_chunk_tokens} must be >= 1 (or none: the full logits)")
        if m.loss_chunk_tokens is not None and p.pp > 1:
            problems.append(f"model.loss_chunk_tokens={m.loss_chunk_tokens} needs parallel.pp=1 (pp={p.pp}): the "
                            "pipeline's loss runs on the last stage's logits")
        if m.sliding_window_pattern < 1:
            problems.append(f"model.sliding_window_pattern={m.sliding_window_pattern} must be >= 1")
        problems += self._group_problems()
        if not e.routed_scaling > 0:
            problems.append(f"moe.routed_scaling={e.routed_scaling} must be > 0")
        if e.swiglu_limit is not None and not e.swiglu_limit > 0:
            problems.append(f"moe.swiglu_limit={e.swiglu_limit} must be > 0 (or none: no clamp)")
        if m.n_dense_layers > 0 and m.dense_hidden < 1:
            problems.append(f"model.dense_hidden={m.dense_hidden} must be >= 1 with model.n_dense_layers > 0")
        if self.precision.param_dtype == "bf16" and (self.precision.mode == "fp32" or p.strategy != "ddp"):
            problems.append(f"precision.param_dtype=bf16 needs a bf16 compute mode and parallel.strategy=ddp "
                            f"(precision.mode={self.precision.mode}, parallel.strategy={p.strategy})")
        per_step = t.micro_batch_size * p.dp
        if t.global_batch_size % per_step:
            problems.append(
                f"train.global_batch_size={t.global_batch_size} is not a multiple of "
                f"train.micro_batch_size x parallel.dp = {per_step}"
            )
        if problems:
            raise ConfigError("; ".join(problems))
        return self

    def _group_problems(self) -> list[str]:
        """Group-limited routing: groups divide the experts and hold top_k between the chosen ones."""
        e = self.moe
        groups, chosen = e.expert_groups, e.expert_groups_per_token
        if groups < 1 or e.num_experts % groups:
            return [f"moe.expert_groups={groups} must be >= 1 and divide moe.num_experts={e.num_experts}"]
        if groups == 1:
            return [] if chosen == 1 else [f"moe.expert_groups_per_token={chosen} needs moe.expert_groups > 1"]
        problems = []
        if not 1 <= chosen <= groups:
            problems.append(f"moe.expert_groups_per_token={chosen} must be in [1, moe.expert_groups={groups}]")
        elif e.top_k > chosen * (e.num_experts // groups):
            problems.append(f"moe.top_k={e.top_k} exceeds the {chosen * (e.num_experts // groups)} experts of "
                            f"moe.expert_groups_per_token={chosen} groups")
        if e.routing != "learned":
            problems.append(f"moe.expert_groups={groups} applies only to moe.routing=learned (moe.routing={e.routing})")
        return problems

    def _routing_problems(self) -> list[str]:
        """The skewed-routing fields: in range, and set only with ``moe.routing=skewed``."""
        e, t, p = self.moe, self.train, self.parallel
        problems = []
        if not 0 <= e.routing_skew < math.inf:  # NaN fails too
            problems.append(f"moe.routing_skew={e.routing_skew} must be a finite number >= 0 (0: uniform)")
        if e.routing_sources < 1:
            problems.append(f"moe.routing_sources={e.routing_sources} must be >= 1")
        elif t.global_batch_size % e.routing_sources:
            problems.append(f"moe.routing_sources={e.routing_sources} does not divide "
                            f"train.global_batch_size={t.global_batch_size} (a source is a share of whole sequences)")
        if e.routing != "skewed":
            for key, value, default in [("moe.routing_skew", e.routing_skew, 0.0),
                                        ("moe.routing_sources", e.routing_sources, 1)]:
                if value != default:
                    problems.append(f"{key}={value} applies only to moe.routing=skewed (moe.routing={e.routing})")
        if e.routing == "skewed" and p.pp > 1:
            # a stage's schedule interleaves micro-batches, so a call's place in the batch is not its order
            problems.append(f"moe.routing=skewed needs parallel.pp=1 (parallel.pp={p.pp})")
        return problems

    def effective_capacity_factor(self) -> float:
        """Capacity factor the row-wise dispatcher runs at (the one home of this rule).

        ``moe.capacity=factor``: ``moe.capacity_factor``. ``moe.capacity=lossless``: ``parallel.ep``,
        whatever ``moe.capacity_factor`` says (it is ignored, so a suite may set both). At ep it
        holds the worst case under either ``parallel.rowwise_capacity`` rule
        (:mod:`moebench.parallel.capacity`, R = ep ranks, N routes per source): ``pair`` gives every
        (source, destination) ``ceil(ep * N / R) = N`` rows, all a source has, and ``destination``
        gives every destination ``R * N`` rows, all that every source has; so every route of every
        source may go to one destination and none is dropped.
        """
        if self.moe.capacity == "lossless":
            return float(self.parallel.ep)
        return self.moe.capacity_factor

    @property
    def grad_accum_steps(self) -> int:
        return self.train.global_batch_size // (self.train.micro_batch_size * self.parallel.dp)

    @property
    def tokens_per_step(self) -> int:
        return self.train.global_batch_size * self.model.seq_len

    # ------------------------------------------------------------------ cost model
    def _attention_matmul_params(self) -> int:
        """QKV and output projections of one attention layer (weights only)."""
        m = self.model
        return m.d_model * (m.n_heads + 2 * m.n_kv_heads) * m.hd + m.n_heads * m.hd * m.d_model

    def attention_bias_params(self) -> int:
        """Projection biases (``model.attention_bias``) and sinks (``model.attention_sinks``) of one layer."""
        m = self.model
        bias = (m.n_heads + 2 * m.n_kv_heads) * m.hd + m.d_model if m.attention_bias else 0
        return bias + (m.n_heads if m.attention_sinks else 0)

    def qk_norm_params(self) -> int:
        """Weights of the q and k norms: one head_dim each per head, or the full q and k widths."""
        m = self.model
        if not m.qk_norm:
            return 0
        return 2 * m.hd if m.qk_norm_scope == "per_head" else (m.n_heads + m.n_kv_heads) * m.hd

    def attention_params(self) -> int:
        return self._attention_matmul_params() + self.attention_bias_params() + self.qk_norm_params()

    def router_params(self) -> int:
        """One layer's router: the gate weight and, with ``moe.router_bias``, its bias."""
        e = self.moe
        return (self.model.d_model + (1 if e.router_bias else 0)) * e.num_experts

    def expert_params(self) -> int:
        """One routed SwiGLU expert (gate, up, down)."""
        return 3 * self.model.d_model * self.moe.expert_hidden

    def _layer_params(self, experts_counted: int) -> tuple[int, int]:
        """(dense layer params, MoE layer params) with ``experts_counted`` routed experts."""
        m, e = self.model, self.moe
        norms = 2 * m.d_model
        dense = self.attention_params() + norms + 3 * m.d_model * m.dense_hidden
        shared = 3 * m.d_model * e.shared_expert_hidden
        moe = self.attention_params() + norms + self.router_params() + shared + experts_counted * self.expert_params()
        return dense, moe

    def _params(self, experts_counted: int) -> int:
        m = self.model
        dense, moe = self._layer_params(experts_counted)
        embed_and_head = 2 * m.vocab_size * m.d_model + m.d_model  # + final norm
        n_moe = m.n_layers - m.n_dense_layers
        return embed_and_head + m.n_dense_layers * dense + n_moe * moe

    def total_params(self) -> int:
        """Every parameter of the model (untied embedding and LM head)."""
        return self._params(self.moe.num_experts)

    def active_params(self) -> int:
        """Parameters one token touches: top_k routed experts, embeddings and head included."""
        return self._params(self.moe.top_k)

    def _matmul_params_by_phase(self, n_dense: int, n_moe: int, head: bool) -> dict[str, int]:
        """Active matmul parameters of ``n_dense`` dense and ``n_moe`` MoE layers (and the LM head)
        by step phase (the keys of :data:`moebench.record.PHASES` that do matmuls)."""
        m, e = self.model, self.moe
        return {
            "attention": (n_dense + n_moe) * self._attention_matmul_params(),
            "router": n_moe * m.d_model * e.num_experts,  # a router bias adds no matmul
            "experts": n_moe * e.top_k * self.expert_params(),
            "dense": 3 * m.d_model * (n_dense * m.dense_hidden + n_moe * e.shared_expert_hidden),
            "head_loss": m.vocab_size * m.d_model if head else 0,
        }

    def matmul_params_per_token(self) -> int:
        """Active parameters that take part in a matmul: everything but embeddings and norms."""
        m = self.model
        return sum(self._matmul_params_by_phase(m.n_dense_layers, m.n_layers - m.n_dense_layers, True).values())

    def flops_by_phase(self, n_dense: int | None = None, n_moe: int | None = None, head: bool = True) -> dict[str, int]:
        """Model FLOPs per trained token by step phase, for ``n_dense`` dense and ``n_moe`` MoE layers
        (default: the whole model) and the LM head; they add up to :meth:`flops_per_token`.

        ``6 * matmul params`` of each phase, plus the attention score/value term
        ``12 * heads * head_dim * context`` per layer, ``context`` from :meth:`attention_context`.
        """
        m = self.model
        n_dense = m.n_dense_layers if n_dense is None else n_dense
        n_moe = m.n_layers - m.n_dense_layers if n_moe is None else n_moe
        out = {p: 6 * v for p, v in self._matmul_params_by_phase(n_dense, n_moe, head).items()}
        out["attention"] += round(12 * (n_dense + n_moe) * m.n_heads * m.hd * self.attention_context())
        return out

    def attention_context(self) -> float:
        """Keys a query attends to, on average over the tokens and the layers (exact causal counting).

        Whole-sequence causal: ``seq_len / 2`` (``seq_len // 2``). A window ``w < seq_len``:
        ``min(i, w)`` keys for query ``i``, on average ``w - w^2 / (2 seq_len)``. With a window
        pattern of period P > 1 the mean over one period (P - 1 windowed layers, one whole-sequence
        one): exact for a model whose layer count is a multiple of P (every preset), and the same
        for every layer, so a pipeline stage's share is its layer count's.
        """
        m = self.model
        full = m.seq_len // 2
        if m.sliding_window is None or m.sliding_window >= m.seq_len:
            return full
        w = m.sliding_window
        windowed = w - w * w / (2 * m.seq_len)
        period = m.sliding_window_pattern
        return windowed if period == 1 else ((period - 1) * windowed + full) / period

    def flops_per_token(self) -> int:
        """Model FLOPs per trained token (forward + backward, no recompute): see :meth:`flops_by_phase`."""
        return sum(self.flops_by_phase().values())

    def cost_summary(self) -> dict[str, int]:
        return {
            "total_params": self.total_params(),
            "active_params": self.active_params(),
            "flops_per_token": self.flops_per_token(),
        }


# ---------------------------------------------------------------------- helpers
# Keys people give to --set that are command-line options (or their shorthands), not config fields.
OPTION_KEYS = {
    "preset": "--preset {value}",
    "nproc": "--nproc {value} (train) or --gpus {value} (plan)",
    "steps": "--set train.steps={value} (train: --steps {value})",
}


def field_named(name: str) -> str | None:
    """The ``section.field`` key of a bare field name (``num_experts`` -> ``moe.num_experts``),
    when exactly one section has a field of that name."""
    keys = [f"{s}.{f.name}" for s, c in SECTIONS.items() for f in dataclasses.fields(c) if f.name == name]
    return keys[0] if len(keys) == 1 else None


def parse_field(key: str, value: Any) -> Any:
    """``value`` (a Python value or command-line text) converted to the type of config field
    ``key`` (``section.field``); a ConfigError names the key and what is allowed.

    Suites call it on every axis value before expanding points, so a wrong type is an error
    in the suite file rather than one invalid point per combination.
    """
    section_name, _, field_name = key.partition(".")
    if key in OPTION_KEYS:
        raise ConfigError(f"unknown key {key!r}: {key} is not a config field; "
                          f"use {OPTION_KEYS[key].format(value=value)}")
    if section_name not in SECTIONS or not field_name:
        meant = field_named(key)
        raise ConfigError(
            f"unknown key {key!r}: " + (f"did you mean {meant}?" if meant else
                                        f"expected section.field with section one of {', '.join(SECTIONS)}")
        )
    section = SECTIONS[section_name]
    fields = [f.name for f in dataclasses.fields(section)]
    if field_name not in fields:
        raise ConfigError(
            f"unknown key {key!r}; {section_name} fields are: {', '.join(fields)}"
        )
    return _coerce(key, value, typing.get_type_hints(section)[field_name])


def _split_override(item: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {item!r} must look like section.field=value")
    return key.strip(), value.strip()


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


# Integers above 2^53 do not survive a float (JSON readers, pandas columns, the cost model's ratios)
# and no field needs one: a count that large is a typo.
MAX_EXACT_INT = 2**53
# Plain ASCII decimal text. float() and int() also take surrounding whitespace ("0.01\n"),
# underscores, non-ASCII digits ("\uff11") and inf/nan; none of them is a number a suite means,
# and a newline would end a line of a generated sbatch script.
_INT_TEXT = re.compile(r"[+-]?[0-9]+", re.ASCII)
_NUMBER_TEXT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?", re.ASCII)


def _integer(key: str, value: Any) -> int:
    """An int field's value: an int, an integral float, or ASCII decimal text; at most 2^53 in size."""
    bad = ConfigError(f"bad value {value!r} for {key}; expected an integer")
    if isinstance(value, bool):
        raise bad
    if isinstance(value, str):
        if _INT_TEXT.fullmatch(value):
            value = int(value)
        elif _NUMBER_TEXT.fullmatch(value):  # 1e3, 4.0
            value = float(value)
        else:
            raise bad
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            raise bad
        if abs(value) > MAX_EXACT_INT:  # this float already lost the digits the user typed
            raise ConfigError(f"bad value {value!r} for {key}; integers must be at most 2^53 = {MAX_EXACT_INT}")
        value = int(value)
    if not isinstance(value, int):
        raise bad
    if abs(value) > MAX_EXACT_INT:
        raise ConfigError(f"bad value {value!r} for {key}; integers must be at most 2^53 = {MAX_EXACT_INT}")
    return value


def _number(key: str, value: Any) -> float:
    """A float field's value: a finite int or float, or ASCII decimal text; exactly representable."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)) or (
            isinstance(value, str) and not _NUMBER_TEXT.fullmatch(value)):
        raise ConfigError(f"bad value {value!r} for {key}; expected a finite number in plain ASCII digits "
                          "without spaces, e.g. 0.01 or 1e-3")
    try:
        number = float(value)
    except OverflowError:  # an int beyond the float range
        number = math.inf
    if not math.isfinite(number):
        raise ConfigError(f"bad value {value!r} for {key}; expected a finite number")
    if isinstance(value, int) and int(number) != value:
        raise ConfigError(f"bad value {value!r} for {key}; {value} has no exact float (at most 2^53 = "
                          f"{MAX_EXACT_INT} for integers)")
    return number


def _coerce(key: str, value: Any, hint: Any) -> Any:
    """Convert ``value`` to the field type ``hint`` or raise a ConfigError naming ``key``."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        non_none = [a for a in args if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in {"none", "null"}):
            return None
        return _coerce(key, value, non_none[0])
    if origin is Literal:
        text = str(value)
        if text not in args:
            raise ConfigError(f"bad value {value!r} for {key}; allowed: {', '.join(map(str, args))}")
        return text
    if hint is bool:
        if isinstance(value, bool):
            return value
        text = str(value).lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        raise ConfigError(f"bad value {value!r} for {key}; expected a boolean (true/false)")
    if hint is int:
        return _integer(key, value)
    if hint is float:
        return _number(key, value)
    if hint is str:
        return str(value)
    raise AssertionError(f"unsupported field type {hint!r} for {key}")
