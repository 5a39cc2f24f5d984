"""Per-GPU memory of a planned layout: model state, activations, buffers.

Bytes per rank of one pipeline stage (the plan reports every stage and the largest).
Model state, as moebench trains (see :mod:`moebench.plan.precision`):

- parameters: fp32; without the distributed optimizer they *are* the master weights.
  Under ``precision.param_dtype=bf16`` (OLMo-core's DDP policy, planned only) they are bf16
  compute weights, and an fp32 main copy lives in the optimizer (its shard with dist_opt).
- gradients: fp32, one per held parameter (bf16 parameters: the fp32 buckets their gradients
  are added into).
- AdamW moments: two fp32 tensors per parameter.
- ddp on more than one rank (``moebench.parallel.ddp``): parameters and gradients live in
  flat fp32 buffers (gradients always allocated; decayed matrices first, so weight decay
  needs no mask). The distributed optimizer (``moebench.parallel.optimizer.ShardedAdamW``)
  keeps an fp32 master copy and the moments of its shard only (dense over DP, experts over
  EDP = DP/EP) plus a reduced-gradient shard; parameters stay whole on every rank. With bf16
  parameters the reduce-scatter leaves the shard in place in the fp32 bucket (no second copy).
- fsdp shards parameters, gradients and moments over the same groups; its peak is the larger of
  the end of the last forward (the root gathered, no gradient before the step's first backward)
  and a layer's backward (gathered layers and a layer's unsharded gradients, the gradients of the
  layers above it made, the activations of those below it saved; under per-layer recompute its
  recomputed activations and activation gradients): :func:`_fsdp_memory`.
- compute-dtype weight copies: autocast's bf16 casts (explicit casts for the experts) are
  saved for backward, so one copy per chunk in flight; none with bf16 parameters.
- fp8 / mxfp8 (:mod:`moebench.plan.quantized`): with ``precision.saved_activations=quantized``
  each quantized GEMM saves its input and weight as E4M3 + scales (q bytes per element) where
  bf16 saves compute-dtype copies: the expert rows the expert GEMMs read, under
  ``precision.scope=linear`` also the inputs of the attention projections, dense FFNs and shared
  expert, and the weight copies of all of them (tests check the activations against the bytes a
  built model saves); with ``compute`` saved tensors are those of bf16. Each GEMM's transient
  quantized operands (native: E4M3 + scales; emulated: dequantized compute-dtype copies) exist
  only while it runs, so the largest GEMM's are counted.

Activations are the tensors autograd saves, counted term by term from the model code
(``moebench.model``) per token and layer, for either implementation of the norms
(``model.norm_impl``) and of the LM head and loss (``model.loss_chunk_tokens``); tests check the
formula against the bytes actually saved by a built model (``torch.autograd.graph.saved_tensors_hooks``).

Shapes in the legend: D model dim, Hq/Hkv query/kv heads, hd head dim, E experts,
K top-k, H expert hidden, Hs shared hidden, Hd dense hidden, V vocab.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from moebench.config import Config
from moebench.plan.precision import Precision
from moebench.plan.quantized import peak_operand_bytes, quantized_params_local, saved_bytes_factor
from moebench.plan.stages import (
    Stage,
    capacity_factor,
    chunks_in_flight,
    kept_route_share,
    layer_costs,
    micro_batching,
    stages,
)
from moebench.record import MEMORY_PARTS as PARTS

FP32 = 4
INDEX = 8  # int64 routing indices


@dataclass(frozen=True)
class TokenBytes:
    """Saved-activation bytes per token of one layer (or of the model ends)."""

    attention: float
    ffn: float  # dense FFN, or the MoE block without its expert rows
    expert_rows: float  # expert-side buffers, top_k rows per token, before capacity padding

    @property
    def total(self) -> float:
        return self.attention + self.ffn + self.expert_rows


def _rmsnorm(cfg: Config, prec: Precision) -> float:
    """A block or final norm over the residual stream (fp32, or bf16 with bf16 parameters)."""
    d = cfg.model.d_model
    if cfg.model.norm_impl == "recompute":
        return prec.param_bytes * d + FP32  # its input as it came + the fp32 rstd (moebench.model.norm)
    # torch's: input + normalized x, both fp32 (torch upcasts a bf16 stream), + the fp32 rstd
    return 2 * FP32 * d + FP32


def _linear_input(prec: Precision) -> float:
    """Bytes per saved element of a dense linear's input (E4M3 + scales when quantized and saved so)."""
    return saved_bytes_factor(prec) if prec.linears_quantized else prec.compute_bytes


def attention_bytes(cfg: Config, prec: Precision) -> float:
    m, a, s = cfg.model, prec.compute_bytes, _linear_input(prec)
    q, kv = m.n_heads * m.hd, m.n_kv_heads * m.hd
    total = _rmsnorm(cfg, prec) + s * m.d_model  # norm, and the wqkv input (a cast copy under autocast)
    total += a * (q + 2 * kv)  # fused qkv output: v is a view of it, which keeps it alive
    if m.qk_norm:
        rstds = m.n_heads + m.n_kv_heads if m.qk_norm_scope == "per_head" else 2  # one per normalised vector
        total += FP32 * rstds
        if m.norm_impl == "torch":
            # normalized (fp32); under autocast also the fp32 upcast of the bf16 input. The recompute
            # norm keeps its input, a view of the qkv output already counted
            total += (2 * FP32 if prec.mixed else FP32) * (q + kv)
    total += a * (q + kv)  # rotated q and k (RoPE saves only its cos/sin tables)
    total += a * q + FP32 * m.n_heads  # attention output and its logsumexp
    total += s * q  # wo input (transposed copy)
    return total


def moe_bytes(cfg: Config, prec: Precision) -> tuple[float, float]:
    """(MoE block without expert rows, expert rows) per token of one MoE layer."""
    m, e, a = cfg.model, cfg.moe, prec.compute_bytes
    d, k = m.d_model, e.top_k
    # routing runs in fp32 even under autocast: its input, logits, probabilities, z-loss logsumexp
    block = _rmsnorm(cfg, prec) + FP32 * d
    block += 2 * FP32 * e.num_experts + FP32
    block += 3 * INDEX * k + a * k  # top-k ids, dispatch and combine permutations; combine weights
    block += a * k * d  # combined rows (token-major) saved by the weighted sum
    if e.shared_expert_hidden:
        block += _ffn_bytes(prec, d, e.shared_expert_hidden, prec.mixed)
    # expert input, gate|up, silu(gate), product; the GEMMs' inputs (first, last) E4M3 when saved so
    s = saved_bytes_factor(prec)
    rows = k * (s * d + 3 * a * e.expert_hidden + s * e.expert_hidden)
    return block, rows


def _ffn_bytes(prec: Precision, d: int, hidden: int, input_saved: bool) -> float:
    """A SwiGLU FFN's saved tensors per token: its w13 input (when it is not already saved),
    gate|up, silu(gate), and the w2 input."""
    a, s = prec.compute_bytes, _linear_input(prec)
    return (s * d if input_saved or prec.linears_quantized else 0) + 3 * a * hidden + s * hidden


def dense_ffn_bytes(cfg: Config, prec: Precision) -> float:
    m = cfg.model
    return _rmsnorm(cfg, prec) + _ffn_bytes(prec, m.d_model, m.dense_hidden, True)


def layer_token_bytes(cfg: Config, prec: Precision, moe: bool) -> TokenBytes:
    attn = attention_bytes(cfg, prec)
    if moe:
        block, rows = moe_bytes(cfg, prec)
        return TokenBytes(attn, block, rows)
    return TokenBytes(attn, dense_ffn_bytes(cfg, prec), 0.0)


def head_token_bytes(cfg: Config, prec: Precision) -> float:
    """Final norm, LM head input and the fp32 log-softmax the cross-entropy saves; with the head fused
    with the loss (``model.loss_chunk_tokens``), the final norm and the head input's gradient."""
    m = cfg.model
    if m.loss_chunk_tokens is not None:
        return _rmsnorm(cfg, prec) + prec.compute_bytes * m.d_model
    return _rmsnorm(cfg, prec) + prec.compute_bytes * m.d_model + FP32 * m.vocab_size


def loss_transient_bytes(cfg: Config, prec: Precision) -> float:
    """What the loss holds beyond saved activations, at its largest. Reference: the fp32 logits copy
    and its gradient over the whole chunk. Fused (moebench.model.loss.chunked_lm_loss): one token
    chunk's fp32 logits (turned into their gradient in place) and its compute-dtype cast, and the head's
    weight gradient, summed in fp32 and kept in the compute dtype for backward."""
    m, a = cfg.model, prec.compute_bytes
    tokens = micro_batching(cfg).tokens_per_chunk
    if m.loss_chunk_tokens is None:
        return tokens * 2 * FP32 * m.vocab_size
    chunk = min(m.loss_chunk_tokens, tokens)
    return chunk * (FP32 + a) * m.vocab_size + (FP32 + a) * m.vocab_size * m.d_model


@dataclass(frozen=True)
class MemoryBreakdown:
    params: float
    grads: float
    master_weights: float  # separate fp32 master copy: dist_opt's shard, or whole beside bf16 parameters
    optimizer_moments: float
    compute_weight_copies: float  # bf16 casts (E4M3 + scales for quantized GEMMs saving them) saved for backward
    quantized_gemm_operands: float  # the largest quantized expert GEMM's operand buffers, while it runs
    fsdp_unsharded: float
    activations: float  # saved tensors of the chunks in flight, excluding EP padding
    stage_outputs: float  # a non-last pipeline stage's output, per chunk in flight (stage_output_bytes)
    ep_capacity_buffers: float  # padding rows of capacity-sized expert buffers
    logits_transient: float  # the loss: logits, their fp32 copy/gradient (loss_transient_bytes)
    optimizer_step_temp: float  # the optimizer step's temporaries (dist_opt's AdamW denominator), alive only then
    optimizer_state: float  # what the run record's optimizer_state_bytes_per_rank counts
    # fsdp: gradients not yet made at the forward/backward peak (none before a step's first backward),
    # held at the optimizer step
    grads_after_peak: float = 0.0
    # fsdp under per-layer recompute, inside a layer's backward: its activation gradients (_ffn_backward_bytes)
    backward_transient: float = 0.0
    # per-layer recompute: the one layer whose forward a backward recomputes (its saved activations and
    # padding, of one chunk), alive only inside that layer's backward
    recomputed_layer: float = 0.0

    @property
    def state(self) -> float:
        """Alive for the whole run."""
        return self.params + self.grads + self.master_weights + self.optimizer_moments

    @property
    def forward_backward(self) -> float:
        """What lives only while micro-batches run (freed before the optimizer step), at the larger of two
        moments: the loss (its logits) and a layer's GEMM (the largest quantized GEMM's operands, and under
        per-layer recompute the layer recomputed for its backward); what the chunks hold is there at both."""
        held = (self.compute_weight_copies + self.fsdp_unsharded + self.activations + self.stage_outputs
                + self.ep_capacity_buffers + self.backward_transient)
        return held + max(self.logits_transient, self.quantized_gemm_operands + self.recomputed_layer)

    @property
    def total(self) -> float:
        """Peak: model state plus the larger of the forward/backward and optimizer-step phases."""
        return self.state + max(self.forward_backward, self.grads_after_peak + self.optimizer_step_temp)

    def parts(self) -> dict[str, float]:
        """The run record's ``memory_parts_bytes`` (:mod:`moebench.train.memory_parts`) from this
        model: everything autograd saves (activations, capacity padding, weight copies) and the stage outputs
        the pipeline keeps are ``saved_activations``; fsdp's gathered parameters and unsharded gradients are
        the communication buffers; the rest of the peak (GEMM operands, logits, the optimizer step's temporaries) is
        ``transient``."""
        held = (self.params, self.grads, self.master_weights + self.optimizer_moments,
                self.activations + self.stage_outputs + self.ep_capacity_buffers + self.compute_weight_copies
                + self.recomputed_layer,
                self.fsdp_unsharded)
        return dict(zip(PARTS, (*held, self.total - sum(held)), strict=True))

    def as_dict(self) -> dict[str, float]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "optimizer_state"}
        return out | {"total": self.total}


def _layer_saved_bytes(cfg: Config, prec: Precision) -> tuple[float, float, float]:
    """(dense layer, MoE layer, MoE layer's EP capacity padding): saved-activation bytes per token."""
    dense, moe = layer_token_bytes(cfg, prec, False), layer_token_bytes(cfg, prec, True)
    # expert-side buffers hold capacity_factor x the routed rows: below 1 the dropped routes'
    # rows are not there, above 1 the surplus is padding
    kept, routed = kept_route_share(cfg), moe.expert_rows
    return dense.total, moe.attention + moe.ffn + kept * routed, (capacity_factor(cfg) - kept) * routed


def stage_activation_bytes(cfg: Config, prec: Precision, stage: Stage) -> tuple[float, float, float, float]:
    """(saved activations, EP capacity padding) of one chunk on one rank of ``stage``, then
    (saved activations, EP capacity padding) held once whatever the chunks in flight. The head's
    saved tensors are not among them: :func:`head_saved_bytes`."""
    tokens = micro_batching(cfg).tokens_per_chunk
    dense, moe, pad = _layer_saved_bytes(cfg, prec)
    ends = INDEX if stage.has_embed else 0
    if cfg.parallel.activation_checkpointing == "per-layer":
        # Each layer keeps only its input (the residual stream, in the parameters' dtype); backward
        # recomputes one layer of one chunk at a time, so a full layer's activations (and its
        # padding) exist once, not once per chunk in flight.
        largest = moe if stage.n_moe else dense
        per_token = prec.param_bytes * cfg.model.d_model * stage.n_layers + ends
        return tokens * per_token, 0.0, tokens * largest, tokens * (pad if stage.n_moe else 0.0)
    per_token = stage.n_dense * dense + stage.n_moe * moe + ends
    return tokens * per_token, tokens * stage.n_moe * pad, 0.0, 0.0


def head_chunks_held(cfg: Config, in_flight: float) -> float:
    """Chunks of the model's last stage (the head and loss) its rank holds, ``in_flight`` whole-rank
    chunks in flight (chunks_in_flight): all of them with one stage a rank (GPipe all the step's; 1F1B
    one, its last stage running each chunk's backward right after its forward); interleaved, one: the
    rank's warm-up forwards are its earlier virtual stages' chunks, then the head stage's first chunk,
    whose backward comes next."""
    return in_flight if cfg.parallel.virtual_stages == 1 else 1.0


def head_saved_bytes(cfg: Config, prec: Precision, stage: Stage) -> float:
    """What one chunk's final norm, head and loss save (head_token_bytes); 0 off the last stage."""
    return micro_batching(cfg).tokens_per_chunk * head_token_bytes(cfg, prec) if stage.has_head else 0.0


def stage_output_bytes(cfg: Config, prec: Precision, stage: Stage, in_flight: float) -> float:
    """The stage outputs a pipeline rank keeps, ``in_flight`` whole-rank chunks in flight (chunks_in_flight).

    torch's ``PipelineStage`` keeps each chunk's forward output (the residual stream after the stage's last
    layer, in the parameters' dtype) in its forward cache until the chunk's backward, which starts from it.
    Nothing in the stage saves that tensor (a residual add saves no input; the layer that would is on the
    next rank), so it is a term of its own, one per stage chunk whether or not the layers recompute. A
    whole-rank chunk is one chunk of each of the rank's ``v`` stages; the model's last stage keeps its loss
    instead, and of its chunks 1F1B (interleaved too) holds one, GPipe all. The buffers a chunk's
    activation and gradient are received in are no term: the trainer holds them while the chunk is in
    flight only (moebench.parallel.pipeline.ChunkBufferStage): the activation is the first layer's saved
    input, and the gradient (a stage output's size, around the chunk's backward) is not counted."""
    p = cfg.parallel
    if p.pp == 1:
        return 0.0
    v = p.virtual_stages
    outputs = v * in_flight
    if stage.has_head:
        outputs -= head_chunks_held(cfg, in_flight)
    return micro_batching(cfg).tokens_per_chunk * prec.param_bytes * cfg.model.d_model * outputs


def stage_memory(cfg: Config, prec: Precision, stage: Stage) -> MemoryBreakdown:
    p = cfg.parallel
    if p.strategy == "fsdp":
        return _fsdp_memory(cfg, prec, stage)
    in_flight = chunks_in_flight(cfg, stage.index)
    held = stage.dense_params + stage.expert_params_local
    params, grads = prec.param_bytes * held, FP32 * held  # gradients: flat fp32 buffers (buckets)
    if p.dist_opt:
        sharded = _sharded_params(cfg, stage)
        if prec.param_dtype == "fp32":
            grads += FP32 * sharded  # moebench: the reduce-scattered shard next to the full buffer
        # bf16 parameters (OLMo-core): the reduce-scatter leaves this rank's shard in place in its bucket
        master, moments = FP32 * sharded, 2 * FP32 * sharded
        # ShardedAdamW.step: the denominator sqrt(v) / bias + eps, made in place, one flat buffer's shard at a time
        step_temp = FP32 * _largest_shard(cfg, stage)
    else:
        # fp32 parameters are the master weights; bf16 ones need an fp32 copy next to them
        master = FP32 * held if prec.param_dtype == "bf16" else 0.0
        moments = 2 * FP32 * held
        step_temp = 0.0  # FlatBufferGrads.build_optimizer: torch's fused AdamW, which updates in place
    optimizer_state = (master or params) + moments  # fp32 parameters are the master weights
    if p.activation_checkpointing == "per-layer":
        # checkpointed forwards save nothing; the recompute casts one layer at a time
        copies = _weight_copies(prec, stage.max_layer_params_local)
    else:
        quantized = quantized_params_local(cfg, prec, stage) if prec.saves_quantized else 0
        copies = _weight_copies(prec, stage.matmul_params_local - quantized) * in_flight
        copies += prec.quant_bytes * quantized * in_flight
    return MemoryBreakdown(
        params=params, grads=grads, master_weights=master, optimizer_moments=moments,
        compute_weight_copies=copies, fsdp_unsharded=0.0, **_in_flight_parts(cfg, prec, stage, in_flight),
        optimizer_step_temp=step_temp, optimizer_state=optimizer_state,
    )


def _in_flight_parts(cfg: Config, prec: Precision, stage: Stage, in_flight: float,
                     recomputing: bool = True) -> dict[str, float]:
    """What the chunks in flight hold at the end of a forward, the same under every strategy: the saved
    activations and capacity padding (per chunk, and, ``recomputing``, the one layer per-layer recompute
    holds while a backward runs), the stage outputs, the largest quantized GEMM's operands and the loss's
    logits."""
    acts, pad, acts_once, pad_once = stage_activation_bytes(cfg, prec, stage)
    if not recomputing:
        acts_once = pad_once = 0.0
    return {"quantized_gemm_operands": peak_operand_bytes(cfg, prec, stage),
            "activations": acts * in_flight + head_saved_bytes(cfg, prec, stage) * head_chunks_held(cfg, in_flight),
            "recomputed_layer": acts_once + pad_once,
            "stage_outputs": stage_output_bytes(cfg, prec, stage, in_flight),
            "ep_capacity_buffers": pad * in_flight,
            "logits_transient": loss_transient_bytes(cfg, prec) if stage.has_head else 0.0}


def _sharded_params(cfg: Config, stage: Stage) -> float:
    """A rank's share of the stage's parameters when DP shards them (experts: EDP = DP/EP)."""
    p = cfg.parallel
    return stage.dense_params / p.dp + stage.expert_params_local / (p.dp // p.ep)


def _largest_shard(cfg: Config, stage: Stage) -> float:
    """The larger of a rank's two flat-buffer shards (moebench.parallel.ddp: the dense parameters over DP,
    the experts over EDP = DP/EP), in parameters."""
    p = cfg.parallel
    return max(stage.dense_params / p.dp, stage.expert_params_local / (p.dp // p.ep))


@dataclass(frozen=True)
class _FsdpLayer:
    """One layer of a stage as fsdp holds it, in bytes on one rank."""

    gathered: float  # its parameters all-gathered: matmul weights in the compute dtype, norms and router fp32
    unsharded_grad: float  # its gradients in fp32, the reduce-scatter's input
    shard: float  # this rank's share of its fp32 gradients (experts: over EDP)
    saved: float  # what one chunk's forward saves in it
    padding: float  # its EP capacity padding, one chunk
    last_reduce_scatter: float  # the input of its last unit's reduce-scatter (under bf16 the matmul unit's)
    recomputed: float = 0.0  # per-layer recompute: what its recomputed forward saves, one chunk
    recomputed_padding: float = 0.0
    backward_grads: float = 0.0  # per-layer recompute: its activation gradients at their largest, one chunk


def _fsdp_layers(cfg: Config, prec: Precision, stage: Stage) -> list[_FsdpLayer]:
    """The stage's layers in forward order, its dense layers first (as in the model)."""
    p, m = cfg.parallel, cfg.model
    c = layer_costs(cfg)
    tokens = micro_batching(cfg).tokens_per_chunk
    experts = cfg.moe.num_experts // p.ep * c.expert_params
    dense, moe, pad = _layer_saved_bytes(cfg, prec)
    recompute = p.activation_checkpointing == "per-layer"
    kinds = []
    for params, expert, fp32, saved, padding in (
            (c.dense_layer_params, 0, c.norm_params, dense, 0.0),
            (c.moe_nonexpert_params + experts, experts, c.norm_params + m.d_model * cfg.moe.num_experts, moe, pad)):
        full = {"saved": tokens * saved, "padding": tokens * padding}
        if recompute:  # a layer keeps its input; its backward recomputes the rest and frees it
            full = {"saved": tokens * prec.param_bytes * m.d_model, "padding": 0.0,
                    "recomputed": tokens * saved, "recomputed_padding": tokens * padding,
                    "backward_grads": tokens * _ffn_backward_bytes(cfg, prec, moe=bool(expert))}
        kinds.append(_FsdpLayer(gathered=prec.compute_bytes * (params - fp32) + FP32 * fp32,
                                unsharded_grad=FP32 * params,
                                shard=FP32 * ((params - expert) / p.dp + expert / (p.dp // p.ep)),
                                last_reduce_scatter=FP32 * (params - fp32 if prec.mixed else params), **full))
    return [kinds[0]] * stage.n_dense + [kinds[1]] * stage.n_moe


def _ffn_backward_bytes(cfg: Config, prec: Precision, moe: bool) -> float:
    """A layer's activation gradients at their largest, in its FFN's backward, per token: the residual
    stream's incoming gradient (fp32) and the gradient of the gate|up output (compute dtype), over the
    experts' rows (top_k a token, capacity-sized buffers) or a shared expert's tokens, whichever is larger
    (they run one after the other), or a dense FFN's tokens."""
    e = cfg.moe
    hidden = (max(e.top_k * capacity_factor(cfg) * e.expert_hidden, e.shared_expert_hidden) if moe
              else cfg.model.dense_hidden)
    return FP32 * cfg.model.d_model + 2 * prec.compute_bytes * hidden


def _fsdp_memory(cfg: Config, prec: Precision, stage: Stage) -> MemoryBreakdown:
    """fsdp's peak (FSDP2 as ``moebench.parallel.fsdp.apply_fsdp`` applies it), the larger of

    - the end of the last forward, as its backward starts: the loss's logits, every saved activation,
      the root gathered (embedding and final norm in fp32, the LM head in the compute dtype) and, where
      the root holds the head (fp32), the last layer too (the root's pre-backward prefetches it); a
      gradient only if an earlier micro-batch or chunk made it (``zero_grad`` frees fsdp's);
    - a layer's backward: the gradient shards of the layers above made (all of them from a second
      micro-batch on), the saved activations of the layers below still held, the root gathered (a
      bf16 LM head is a unit of its own, resharded after its backward; an fp32 one stays gathered with
      the root, its gradient held for the root's reduce-scatter), and one of three points:
      its gradients complete, the layer and the next one down (prefetched) gathered, and in fp32 the
      layer above's reduce-scatter input, which FSDP2 holds until the next reduce-scatter (under bf16
      the block's own fp32 unit, its norms and router, reduce-scatters first and frees it);
      its post-backward, resharded, its gradients cast to fp32 for the reduce-scatter, the next layer
      prefetched; or the next layer's pre-backward, the layer's fp32 gradients still held and its
      shard made, the next layer's all-gather copied out beside its buffer (two copies). Under
      per-layer recompute a fourth, inside its backward: its recomputed activations and its FFN's
      activation gradients, the layer above's reduce-scatter input held whatever the precision (the
      checkpointed block's outer unit reduce-scatters after its fp32 unit), no recomputed layer at the
      end of the forward.

    Every layer of the stage is a candidate; the optimizer step (all gradients) is the third phase.
    The dry run of the trainer gives each point (docs/plan.md, "Dry run of the real trainer";
    tests/plan/test_plan_verify_families.py). Not modelled: under pp > 1, torch's ``PipelineStage``
    holding resharding and the reduce-scatters back to a step's last chunk (the dry run does not run
    fsdp with pp > 1 to check).
    """
    p = cfg.parallel
    sharded = FP32 * _sharded_params(cfg, stage)
    mb = micro_batching(cfg)
    grads_exist = mb.chunks_per_step > 1
    in_flight = chunks_in_flight(cfg, stage.index)
    acts, pad, _, _ = stage_activation_bytes(cfg, prec, stage)  # one chunk's, for the layers below in backward
    layers = _fsdp_layers(cfg, prec, stage)
    head = stage.head_matmul_params
    root_fp32 = FP32 * (stage.embed_head_params - head)  # the embedding and the final norm
    own_head = prec.mixed and stage.has_head  # apply_fsdp: a head gathered in bf16 is an FSDP unit of its own
    forward_end = MemoryBreakdown(
        params=sharded, grads=sharded if grads_exist else 0.0, master_weights=0.0, optimizer_moments=2 * sharded,
        compute_weight_copies=0.0,  # the layers are gathered in the compute dtype: no autocast casts
        fsdp_unsharded=root_fp32 + prec.compute_bytes * head + (0.0 if own_head else layers[-1].gathered),
        **_in_flight_parts(cfg, prec, stage, in_flight, recomputing=False),
        # ShardedGrads.build_optimizer: torch's fused AdamW updates in place; with ep > 1 its per-parameter
        # loop, counted as foreach's list-wide sqrt(exp_avg_sq)
        optimizer_step_temp=sharded if p.ep > 1 else 0.0, optimizer_state=3 * sharded,
    )
    candidates = [forward_end]
    root = root_fp32 + (0.0 if own_head else 2 * FP32 * head)
    done = sharded if grads_exist else (FP32 * head / p.dp if own_head else 0.0)
    # the other chunks in flight keep all they saved (under per-layer recompute, their layers' inputs:
    # the one recomputed layer is this chunk's); this one, its layers below the one in backward (and the
    # embedding's indices)
    below = ((in_flight - 1) * acts + (mb.tokens_per_chunk * INDEX if stage.has_embed else 0.0)
             + (head_chunks_held(cfg, in_flight) - 1) * head_saved_bytes(cfg, prec, stage))
    below += sum(layer.saved for layer in layers)
    below_pad = (in_flight - 1) * pad + sum(layer.padding for layer in layers)
    for i in reversed(range(len(layers))):
        layer = layers[i]
        below, below_pad = below - layer.saved, below_pad - layer.padding
        nxt = layers[i - 1].gathered if i else 0.0  # below the first layer, the root: gathered already
        above = layers[i + 1].unsharded_grad if i + 1 < len(layers) and not prec.mixed else 0.0
        made = 0.0 if grads_exist else layer.shard
        # (gradient shards, gathered parameters + unsharded gradients + reduce-scatter inputs); a layer's
        # gradients come in the dtype it is gathered in
        points = ((done, root + 2 * layer.gathered + nxt + above),
                  (done, root + layer.gathered + layer.unsharded_grad + nxt),
                  (done + made, root + layer.unsharded_grad + 2 * nxt))
        candidates += [dataclasses.replace(forward_end, grads=grads, fsdp_unsharded=held, activations=below,
                                           ep_capacity_buffers=below_pad, logits_transient=0.0)
                       for grads, held in points]
        if layer.recomputed:
            # inside its backward, its forward recomputed and its FFN's gradients made: the layer gathered, and
            # the next one down too under fp32 (its pre-backward prefetches it; under bf16 it prefetches its own
            # fp32 unit, whose pre-backward, later, the next layer), and the layer above's reduce-scatter input,
            # held until the next reduce-scatter, which is this layer's first unit's (the layer's outer unit
            # reduce-scatters last, after the recompute and backward within it, whatever the precision)
            above = layers[i + 1].last_reduce_scatter if i + 1 < len(layers) else 0.0
            prefetched = 0.0 if prec.mixed else nxt
            candidates.append(dataclasses.replace(
                forward_end, grads=done, fsdp_unsharded=root + layer.gathered + prefetched + above,
                activations=below + layer.recomputed, ep_capacity_buffers=below_pad + layer.recomputed_padding,
                logits_transient=0.0, backward_transient=layer.backward_grads))
        done += made
    peak = max(candidates, key=lambda m: m.forward_backward + m.grads)
    return dataclasses.replace(peak, grads_after_peak=sharded - peak.grads)


def _weight_copies(prec: Precision, matmul_params: int) -> float:
    return prec.compute_bytes * matmul_params if prec.casts_weights else 0.0


def planned_parts(cfg: Config, prec: Precision) -> dict[str, float]:
    """The plan's ``memory_parts_bytes``: its first stage's (rank 0's, as a run records them)."""
    return stage_memory(cfg, prec, stages(cfg)[0]).parts()
