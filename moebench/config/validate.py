"""A config's checks: each problem one line naming its field, in a fixed order;
:meth:`Config.validate <moebench.config.run_config.Config.validate>` raises them in one ConfigError."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moebench.config.run_config import Config

# Capacity of the row-wise dispatcher in multiples of a balanced share. At ep ranks a factor of
# ep already keeps every route; beyond 64 the buffers only grow (1e308 overflows to inf bytes).
MAX_CAPACITY_FACTOR = 64.0


def size_problems(cfg: Config) -> list[str]:
    """The counts every other check and cost divides by: each must be >= 1."""
    m, e, t, p = cfg.model, cfg.moe, cfg.train, cfg.parallel
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
    return problems


def config_problems(cfg: Config) -> list[str]:
    """Every other problem of the shapes and settings that do not depend on the launch, once
    :func:`size_problems` found none."""
    return [*_shape_problems(cfg), *_schedule_problems(cfg), *_range_problems(cfg), *_routing_problems(cfg),
            *_window_and_loss_problems(cfg), *_group_problems(cfg), *_ffn_problems(cfg), *_parallel_problems(cfg)]


def _shape_problems(cfg: Config) -> list[str]:
    """The attention heads, the layer counts and top_k against the experts."""
    m, e = cfg.model, cfg.moe
    problems = []
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
    return problems


def _schedule_problems(cfg: Config) -> list[str]:
    """The steps of a run: warm-up, compile, profiled and traced steps."""
    t = cfg.train
    problems = []
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
    if t.instructions and t.device != "cpu":
        problems.append(f"train.instructions=true counts a CPU process's instructions: train.device={t.device} "
                        "must be cpu")
    if t.instructions and t.cpu_threads != 1:
        problems.append(f"train.instructions=true needs train.cpu_threads=1 (got {t.cpu_threads}): more threads' "
                        "waits count instructions that vary from run to run")
    if t.cpu_threads < 0:
        problems.append(f"train.cpu_threads={t.cpu_threads} must be >= 0 (0: OMP_NUM_THREADS or the launcher's share)")
    if t.profile_steps < 0:
        problems.append(f"train.profile_steps={t.profile_steps} must be >= 0")
    if t.trace and t.profile_steps < 1:
        problems.append(f"train.trace=true traces the profiled steps: train.profile_steps={t.profile_steps} "
                        "must be >= 1")
    return problems


def _range_problems(cfg: Config) -> list[str]:
    """Numbers that must lie in a range: the capacity factor, the optimizer's, the norms', the losses'."""
    m, e, t = cfg.model, cfg.moe, cfg.train
    problems = []
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
    return problems


def _routing_problems(cfg: Config) -> list[str]:
    """The skewed-routing fields: in range, and set only with ``moe.routing=skewed``."""
    e, t, p = cfg.moe, cfg.train, cfg.parallel
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


def _window_and_loss_problems(cfg: Config) -> list[str]:
    """The sliding window and the chunked loss."""
    m, p = cfg.model, cfg.parallel
    problems = []
    if m.sliding_window is not None and m.sliding_window < 1:
        problems.append(f"model.sliding_window={m.sliding_window} must be >= 1 (or none: no window)")
    if m.loss_chunk_tokens is not None and m.loss_chunk_tokens < 1:
        problems.append(f"model.loss_chunk_tokens={m.loss_chunk_tokens} must be >= 1 (or none: the full logits)")
    if m.loss_chunk_tokens is not None and p.pp > 1:
        problems.append(f"model.loss_chunk_tokens={m.loss_chunk_tokens} needs parallel.pp=1 (pp={p.pp}): the "
                        "pipeline's loss runs on the last stage's logits")
    if m.sliding_window_pattern < 1:
        problems.append(f"model.sliding_window_pattern={m.sliding_window_pattern} must be >= 1")
    return problems


def _group_problems(cfg: Config) -> list[str]:
    """Group-limited routing: groups divide the experts and hold top_k between the chosen ones."""
    e = cfg.moe
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


def _ffn_problems(cfg: Config) -> list[str]:
    """The routed experts' output scale and SwiGLU clamp, and the dense layers' FFN."""
    m, e = cfg.model, cfg.moe
    problems = []
    if not e.routed_scaling > 0:
        problems.append(f"moe.routed_scaling={e.routed_scaling} must be > 0")
    if e.swiglu_limit is not None and not e.swiglu_limit > 0:
        problems.append(f"moe.swiglu_limit={e.swiglu_limit} must be > 0 (or none: no clamp)")
    if m.n_dense_layers > 0 and m.dense_hidden < 1:
        problems.append(f"model.dense_hidden={m.dense_hidden} must be >= 1 with model.n_dense_layers > 0")
    return problems


def _parallel_problems(cfg: Config) -> list[str]:
    """What the parallel section must agree with: the bf16-parameter policy, the batch split."""
    t, p, prec = cfg.train, cfg.parallel, cfg.precision
    problems = []
    if prec.param_dtype == "bf16" and (prec.mode == "fp32" or p.strategy != "ddp"):
        problems.append(f"precision.param_dtype=bf16 needs a bf16 compute mode and parallel.strategy=ddp "
                        f"(precision.mode={prec.mode}, parallel.strategy={p.strategy})")
    per_step = t.micro_batch_size * p.dp
    if t.global_batch_size % per_step:
        problems.append(
            f"train.global_batch_size={t.global_batch_size} is not a multiple of "
            f"train.micro_batch_size x parallel.dp = {per_step}"
        )
    return problems
