"""How a config and a parallel layout divide the model and the batch: pipeline stages,
per-stage parameter and FLOP counts and micro-batching.

All counts come from the config's cost model (:meth:`Config.total_params`,
:meth:`Config.flops_per_token`, :meth:`Config.expert_params`): a layer's share is the
difference of the model-wide count with and without that layer, so nothing here repeats
the parameter formulas.

Conventions (the trainer's; the layout rules themselves are in :mod:`moebench.layout`):
- Layers are split over ``pp x v`` stages in contiguous blocks (``v`` virtual stages a rank,
  ``parallel.pp_layers`` or the first ``n_layers % stages`` stages taking one layer more), stage
  ``s`` on pipeline rank ``s % pp``; a :class:`Stage` here is one pipeline *rank*, all its
  virtual stages together. The embedding lives on the first stage (rank 0), the final norm and
  LM head on the last (rank ``pp - 1``).
- A rank's batch per optimizer step is ``global_batch_size / dp`` sequences, run as
  ``grad_accum_steps`` micro-batches of ``micro_batch_size``. Under ``pp > 1`` each
  micro-batch is split by the pipeline schedule into ``pp_microbatches`` chunks
  (as ``torch.distributed.pipelining`` schedules do), so a chunk is
  ``micro_batch_size / pp_microbatches`` sequences.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from moebench.config import Config
from moebench.errors import ConfigError
from moebench.layout import pipeline_layer_ranges, rank_stage_ids


def _with_layers(cfg: Config, n_layers: int, n_dense: int) -> Config:
    # replace() rather than deepcopy: the search plans hundreds of layouts, several copies each
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, n_layers=n_layers, n_dense_layers=n_dense))


@dataclass(frozen=True)
class LayerCosts:
    """Per-layer and per-end counts derived from the config's cost model."""

    embed_params: int  # token embedding (first stage)
    head_params: int  # final norm + LM head (last stage)
    head_matmul_params: int  # the LM head alone
    dense_layer_params: int
    moe_layer_params: int  # all routed experts included
    expert_params: int  # one routed expert
    norm_params: int  # per layer: the two RMSNorm gains (+ QK-norm gains); not matmul weights
    head_flops: int  # model FLOPs per token of the LM head
    dense_layer_flops: int  # per token, attention scores included
    moe_layer_flops: int
    attn_layer_flops: int  # attention score/value FLOPs per token of any layer
    expert_layer_flops: int  # routed-expert GEMM FLOPs per token of one MoE layer
    num_experts: int

    @property
    def moe_nonexpert_params(self) -> int:
        """Attention, norms, router and shared expert of one MoE layer."""
        return self.moe_layer_params - self.num_experts * self.expert_params


def layer_costs(cfg: Config) -> LayerCosts:
    m = cfg.model
    ends = _with_layers(cfg, 0, 0)
    dense1, moe1 = _with_layers(cfg, 1, 1), _with_layers(cfg, 1, 0)
    head_flops = ends.flops_per_token()
    embed = m.vocab_size * m.d_model
    # parameters outside every matmul: the embedding, the final norm, and each layer's norm gains
    ends_non_matmul = ends.total_params() - ends.matmul_params_per_token()
    return LayerCosts(
        embed_params=embed,
        head_params=ends.total_params() - embed,
        head_matmul_params=ends.matmul_params_per_token(),
        dense_layer_params=dense1.total_params() - ends.total_params(),
        moe_layer_params=moe1.total_params() - ends.total_params(),
        expert_params=cfg.expert_params(),
        norm_params=dense1.total_params() - dense1.matmul_params_per_token() - ends_non_matmul,
        head_flops=head_flops,
        dense_layer_flops=dense1.flops_per_token() - head_flops,
        moe_layer_flops=moe1.flops_per_token() - head_flops,
        attn_layer_flops=dense1.flops_per_token() - _no_context(dense1).flops_per_token(),
        expert_layer_flops=moe1.flops_per_token() - _no_routes(moe1).flops_per_token(),
        num_experts=cfg.moe.num_experts,
    )


def _no_routes(cfg: Config) -> Config:
    """The same model with top_k = 0: the routed-expert GEMMs drop out of its FLOPs."""
    return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, top_k=0))


def _no_context(cfg: Config) -> Config:
    """The same model with zero context: only weight matmuls are left in its FLOPs."""
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, seq_len=0))


@dataclass(frozen=True)
class Stage:
    """What one rank of pipeline stage ``index`` holds and computes (before DP/EP sharding)."""

    index: int
    n_dense: int  # dense-FFN layers in the stage
    n_moe: int  # MoE layers in the stage
    has_embed: bool
    has_head: bool
    dense_params: int  # every non-expert parameter of the stage (replicated over DP under ddp)
    embed_head_params: int  # embedding (first stage) and final norm + LM head (last stage)
    expert_params_local: int  # routed-expert parameters on one EP rank (num_experts / ep per layer)
    matmul_params_local: int  # weights that enter a matmul on one EP rank (no norms, no embedding)
    max_layer_params_local: int  # the largest layer on one EP rank (FSDP gathers one at a time)
    # of the layers' parameters, those that compute in fp32 whatever the precision (norm gains,
    # routers): FSDP gathers them in fp32 under bf16 (moebench.parallel.fsdp.fp32_modules)
    fp32_layer_params: int
    head_matmul_params: int  # the LM head (last stage): the root's only matmul weight
    flops_per_token: int  # model FLOPs per token of this stage's layers (and head)
    attn_flops_per_token: int  # the attention score/value part of it (not a weight matmul)
    expert_flops_per_token: int  # the routed-expert GEMM part of it (top_k experts per MoE layer)

    @property
    def n_layers(self) -> int:
        return self.n_dense + self.n_moe

    @property
    def params_local(self) -> int:
        return self.dense_params + self.expert_params_local


def stages(cfg: Config) -> list[Stage]:
    """One :class:`Stage` per pipeline rank of ``cfg.parallel``: the layers of all its virtual stages."""
    m, p = cfg.model, cfg.parallel
    c = layer_costs(cfg)
    local_experts = cfg.moe.num_experts // p.ep
    moe_local = c.moe_nonexpert_params + local_experts * c.expert_params
    ranges = pipeline_layer_ranges(cfg)
    out = []
    for s in range(p.pp):
        blocks = [ranges[i] for i in rank_stage_ids(cfg, s)]
        # the dense layers come first (indices below n_dense_layers): count them without a loop over layers
        n_dense = sum(max(0, min(b.stop, m.n_dense_layers) - b.start) for b in blocks)
        n_layers = sum(len(b) for b in blocks)
        n_moe = n_layers - n_dense
        first, last = s == 0, s == p.pp - 1  # the last stage (pp x v - 1) is on the last rank
        dense = (n_dense * c.dense_layer_params + n_moe * c.moe_nonexpert_params
                 + (c.embed_params if first else 0) + (c.head_params if last else 0))
        experts = n_moe * local_experts * c.expert_params
        matmul = (n_dense * (c.dense_layer_params - c.norm_params) + n_moe * (moe_local - c.norm_params)
                  + (c.head_matmul_params if last else 0))
        out.append(Stage(
            index=s, n_dense=n_dense, n_moe=n_moe, has_embed=first, has_head=last,
            dense_params=dense,
            embed_head_params=(c.embed_params if first else 0) + (c.head_params if last else 0),
            expert_params_local=experts, matmul_params_local=matmul,
            max_layer_params_local=max((c.dense_layer_params if n_dense else 0), (moe_local if n_moe else 0)),
            fp32_layer_params=n_layers * c.norm_params + n_moe * m.d_model * cfg.moe.num_experts,
            head_matmul_params=c.head_matmul_params if last else 0,
            flops_per_token=n_dense * c.dense_layer_flops + n_moe * c.moe_layer_flops + (c.head_flops if last else 0),
            attn_flops_per_token=n_layers * c.attn_layer_flops,
            expert_flops_per_token=n_moe * c.expert_layer_flops,
        ))
    return out


@dataclass(frozen=True)
class MicroBatching:
    accum_steps: int  # micro-batches per optimizer step on one rank
    chunks: int  # pipeline chunks per micro-batch (1 without PP)
    seqs_per_chunk: int
    tokens_per_chunk: int

    @property
    def chunks_per_step(self) -> int:
        return self.accum_steps * self.chunks


def micro_batching(cfg: Config) -> MicroBatching:
    p, t = cfg.parallel, cfg.train
    chunks = p.pp_microbatches if p.pp > 1 else 1
    seqs = t.micro_batch_size // chunks
    return MicroBatching(cfg.grad_accum_steps, chunks, seqs, seqs * cfg.model.seq_len)


def capacity_factor(cfg: Config) -> float:
    """Rows allocated per routed row on the expert side: capacity-sized buffers for the
    row-wise dispatcher under EP (:meth:`Config.effective_capacity_factor`: ``ep`` under
    ``moe.capacity=lossless``), exact counts otherwise."""
    p = cfg.parallel
    return cfg.effective_capacity_factor() if (p.ep > 1 and p.dispatcher == "rowwise") else 1.0


def kept_route_share(cfg: Config) -> float:
    """Share of routes the experts compute. Balanced routing brings each destination exactly
    its share, so a capacity factor below 1 drops ``1 - capacity_factor`` of the routes
    (they contribute zero and are not useful FLOPs); at 1 or above nothing is dropped."""
    return min(1.0, capacity_factor(cfg))


def check_capacity(cfg: Config) -> None:
    """Refuse a capacity factor that gives a source-destination pair less than one row.

    The trainer's capacity per (source, destination) pair is ``ceil(capacity_factor * N / R)``
    rows (``moebench.parallel.capacity.pair_capacity``; N routes per rank and chunk, R EP ranks).
    Below ``R / N`` that is under one row: the factor asks for every route to be dropped, while
    the trainer rounds it up to one row per pair, so the factor no longer describes the run and
    the plan's ``1 - capacity_factor`` dropped share would be wrong. Such a factor is an error.
    """
    p = cfg.parallel
    if p.ep == 1 or p.dispatcher != "rowwise" or cfg.moe.capacity != "factor":
        return
    routes = micro_batching(cfg).tokens_per_chunk * cfg.moe.top_k
    rows = cfg.moe.capacity_factor * routes / p.ep
    if rows < 1:
        raise ConfigError(
            f"moe.capacity_factor={cfg.moe.capacity_factor:g} gives each source-destination pair {rows:.3g} rows "
            f"of capacity (factor x {routes:,} routes per rank and chunk / ep {p.ep}): under one row, every route "
            f"would be dropped (the trainer rounds it up to one row per pair); the smallest factor that keeps a row "
            f"is {p.ep / routes:.3g}")


def expert_rows_per_chunk(cfg: Config) -> float:
    """Expert-side rows of one chunk on one rank: ``top_k`` routes per token (balanced routing
    brings an EP rank as many as it sends), sized by the capacity (padding included, dropped
    routes left out)."""
    return micro_batching(cfg).tokens_per_chunk * cfg.moe.top_k * capacity_factor(cfg)


def wire_rows_per_chunk(cfg: Config) -> float:
    """Rows of one rank's dispatch all-to-all buffer per chunk (``(ep - 1) / ep`` of them leave
    the rank). Exact rows under ``sync``; the row-wise dispatcher sends one fixed-size block per
    destination, padding included (``moebench.parallel.capacity.block_rows``): under
    ``rowwise_capacity=pair`` capacity factor x the balanced share, under ``destination`` up to
    the whole receive capacity, ``min(1, capacity factor)`` x all of a rank's routes, per block."""
    p = cfg.parallel
    routed = micro_batching(cfg).tokens_per_chunk * cfg.moe.top_k
    if p.ep == 1 or p.dispatcher != "rowwise":
        return routed
    if p.rowwise_capacity == "pair":
        return routed * capacity_factor(cfg)
    return routed * p.ep * min(1.0, capacity_factor(cfg))


def chunks_in_flight(cfg: Config, stage: int) -> float:
    """Chunks whose activations pipeline rank ``stage`` holds at its peak, in chunks of the whole
    rank (all its virtual stages' layers).

    1F1B: stage s runs ``pp - s`` forwards before its first backward. GPipe: every chunk of
    the micro-batch. Interleaved 1F1B, as torch's ``ScheduleInterleaved1F1B`` orders it: rank r
    runs ``(v - 1) m + 2 (pp - 1 - r)`` warm-up forwards (``m`` chunks a round: ``chunks /
    max(1, chunks // pp)``), then one more before its first backward, at most ``v x chunks``;
    each is one virtual stage's chunk, ``1 / v`` of the rank's layers (layers spread evenly over
    them), so rank 0 holds ``pp + (pp - 1) / v`` whole-rank chunks where chunks are plenty.
    """
    p = cfg.parallel
    if p.pp == 1:
        return 1
    chunks = micro_batching(cfg).chunks
    if p.pp_schedule == "gpipe":
        return chunks
    if p.pp_schedule == "interleaved-1f1b":
        v = p.virtual_stages
        per_round = chunks // max(1, chunks // p.pp)
        warmup = (v - 1) * per_round + 2 * (p.pp - 1 - stage)
        return min(warmup + 1, v * chunks) / v
    return min(chunks, p.pp - stage)
