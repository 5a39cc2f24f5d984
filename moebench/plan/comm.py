"""Bytes each rank moves per optimizer step, per mesh axis (``dp``, ``ep``, ``edp``, ``pp``).

Counting convention (the one the run record's ``comm_bytes_per_step`` uses), for a group
of ``n`` ranks and a full tensor of ``B`` bytes:

- all-reduce (ring): ``2 * (n - 1) / n * B`` per rank;
- all-gather, reduce-scatter: ``(n - 1) / n * B`` per rank (``B`` the unsharded size);
- all-to-all: the bytes that leave the rank (rows for the other ``n - 1`` ranks);
- send/recv (pipeline): the bytes the rank sends.

What moves, as moebench trains (fp32 parameters and gradients, see :mod:`moebench.plan.memory`):

- ``ddp``: one gradient all-reduce per step and buffer (``no_sync`` on the other micro-batches):
  the dense gradients over DP (axis ``dp``), the expert gradients over the DP/EP ranks holding
  the same experts (axis ``edp``; with ``ep == 1`` that group is all of DP, counted as ``edp``
  as the trainer counts it). The distributed optimizer replaces each all-reduce by a
  reduce-scatter of gradients plus an all-gather of updated fp32 parameters: the same bytes.
  Under ``precision.param_dtype=bf16`` the gather moves bf16 compute weights: 4 + 2 bytes a
  parameter (fp32 reduce-scatter, bf16 all-gather), as OLMo-core's DDP path.
- ``fsdp``: per chunk, every layer's parameters are all-gathered in forward and again in
  backward (resharded after forward); the root group (embedding, final norm, LM head) is
  gathered once, as FSDP2 keeps the root unsharded between forward and backward; gradients
  are reduce-scattered per chunk in fp32. Matmul weights (experts and LM head included) are
  gathered in the compute dtype; norm gains, routers, the embedding and the final norm in
  fp32, as they compute in fp32 on every layout (:func:`moebench.parallel.fsdp.apply_fsdp`).
  With ``ep > 1`` experts are sharded over EDP instead of DP.
- ``ep``: per MoE layer and chunk, dispatch and combine in forward and again in backward
  (four all-to-alls; six with per-layer recompute, which re-runs the forward pair).
  Routing is taken as balanced, so ``(ep - 1) / ep`` of the rows leave the rank. The
  ``sync`` dispatcher sends exact rows after an all-to-all of per-expert counts (int64);
  the ``rowwise`` one sends fixed-size blocks after an all-gather of the counts
  (:func:`moebench.plan.stages.wire_rows_per_chunk`: ``capacity_factor`` times the rows under
  ``rowwise_capacity=pair``, ``ep * min(1, capacity_factor)`` times under ``destination``).
  Dispatch and combine carry rows in the compute dtype (the MoE block casts its input
  before dispatch under autocast), except the forward
  dispatch of ``mxfp8`` runs, which sends MXFP8 rows: D bytes of E4M3 + D/32 of scales.
- ``pp``: per chunk, a stage sends its fp32 hidden states forward (all but the last stage)
  and their gradients backward (all but the first); under interleaved 1F1B each rank runs
  ``v`` virtual stages (``r``, ``r + pp``, ...; ``parallel.virtual_stages``), and sends for each.
"""

from __future__ import annotations

from dataclasses import dataclass

from moebench.config import Config
from moebench.plan.memory import FP32, INDEX
from moebench.plan.precision import Precision
from moebench.plan.stages import Stage, kept_route_share, micro_batching, wire_rows_per_chunk


def all_reduce(nbytes: float, n: int) -> float:
    return 2 * (n - 1) / n * nbytes if n > 1 else 0.0


def all_gather(nbytes: float, n: int) -> float:
    """Also reduce-scatter: ``nbytes`` is the unsharded size."""
    return (n - 1) / n * nbytes if n > 1 else 0.0


def all_to_all(nbytes_per_rank: float, n: int) -> float:
    """Bytes leaving a rank that spreads ``nbytes_per_rank`` evenly over ``n`` ranks (itself included)."""
    return (n - 1) / n * nbytes_per_rank if n > 1 else 0.0


OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "send")  # the collectives a term can be


@dataclass(frozen=True)
class CommTerm:
    axis: str  # dp | ep | edp | pp
    what: str
    bytes_per_step: float
    group: int  # ranks in the collective
    overlap: str  # "backward": hidden behind the last chunk's backward; "chunk": behind each chunk's
    #               compute; "exposed": on the critical path; "after_step": after the optimizer step
    # the record phases (moebench.record.PHASES) the trainer's phase clock counts this transfer in,
    # its time split evenly over them
    phases: tuple[str, ...]
    op: str  # the collective, one of OPS
    padding_bytes: float = 0.0  # of bytes_per_step, the empty slots (row-wise dispatch's fixed blocks)


def stage_comm(cfg: Config, prec: Precision, stage: Stage) -> list[CommTerm]:
    """Every communication term of one rank of ``stage``."""
    p = cfg.parallel
    mb = micro_batching(cfg)
    chunks = mb.chunks_per_step
    edp = p.dp // p.ep
    terms: list[CommTerm] = []
    dense_b, expert_b = FP32 * stage.dense_params, FP32 * stage.expert_params_local

    if p.strategy == "ddp":
        # one flat buffer each (moebench.parallel.ddp), counted on its own axis even where ep == 1 makes
        # edp the dp group
        grads = [("dp", "dense gradients", dense_b, p.dp), ("edp", "expert gradients", expert_b, edp)]
        for axis, what, nbytes, n in grads:
            if p.dist_opt:
                terms.append(CommTerm(axis, f"{what}: reduce-scatter", all_gather(nbytes, n), n, "backward",
                                      ("grad_reduce",), "reduce-scatter"))
                # the updated parameters travel in their own dtype: fp32, or bf16 compute weights
                gathered = nbytes * prec.param_bytes / FP32
                terms.append(CommTerm(axis, f"updated {prec.param_dtype} parameters: all-gather",
                                      all_gather(gathered, n), n, "after_step", ("param_gather",), "all-gather"))
            else:
                terms.append(CommTerm(axis, f"{what}: all-reduce", all_reduce(nbytes, n), n, "backward",
                                      ("grad_reduce",), "all-reduce"))
    else:
        # matmul weights travel in the compute dtype; norm gains, routers, the embedding and the
        # final norm in fp32 (moebench.parallel.fsdp.apply_fsdp)
        low = prec.compute_bytes
        root = stage.embed_head_params
        root_bytes = low * stage.head_matmul_params + FP32 * (root - stage.head_matmul_params)
        layer_dense = stage.dense_params - root
        dense_bytes = low * (layer_dense - stage.fp32_layer_params) + FP32 * stage.fp32_layer_params
        expert_bytes = low * stage.expert_params_local
        if p.ep == 1:
            shards = [("dp", layer_dense + stage.expert_params_local, dense_bytes + expert_bytes, root, root_bytes,
                       p.dp)]
        else:
            shards = [("dp", layer_dense, dense_bytes, root, root_bytes, p.dp),
                      ("edp", stage.expert_params_local, expert_bytes, 0, 0, edp)]
        for axis, layer_params, layer_bytes, root_params, root_gathered, n in shards:
            gathered = (2 * layer_bytes + root_gathered) * chunks
            terms.append(CommTerm(axis, "parameters: all-gather (fwd + bwd)", all_gather(gathered, n), n, "chunk",
                                  ("param_gather",), "all-gather"))
            reduced = FP32 * (layer_params + root_params) * chunks
            terms.append(CommTerm(axis, "gradients: reduce-scatter", all_gather(reduced, n), n, "chunk",
                                  ("grad_reduce",), "reduce-scatter"))

    if p.ep > 1 and stage.n_moe:
        rows = wire_rows_per_chunk(cfg)
        d = cfg.model.d_model
        forwards = 1 if p.activation_checkpointing == "none" else 2  # + the recomputed forward
        # dispatch + combine (compute dtype), in each forward and once in backward
        row_bytes = (forwards + 1) * rows * d * 2 * prec.compute_bytes
        if prec.mode == "mxfp8":  # forward dispatches go out as MXFP8 rows
            row_bytes -= forwards * rows * d * (prec.compute_bytes - prec.quant_bytes)
        # counts: all-to-all of per-expert counts (sync) or all-gather of them (rowwise); forward only
        counts = INDEX * cfg.moe.num_experts * (1 if p.dispatcher == "sync" else p.ep)
        layers = stage.n_moe * chunks
        total = all_to_all((row_bytes + forwards * counts) * layers, p.ep)
        padding = all_to_all(row_bytes * padded_row_share(cfg) * layers, p.ep)
        terms.append(CommTerm("ep", "tokens: dispatch + combine all-to-all (fwd + bwd)", total, p.ep, "exposed",
                              ("dispatch", "combine"), "all-to-all", padding))

    if p.pp > 1:
        hidden = FP32 * mb.tokens_per_chunk * cfg.model.d_model * chunks
        # each of the rank's virtual stages sends both ways, but at the ends of the pipeline
        sends = 2 * p.virtual_stages - (1 if stage.has_head else 0) - (1 if stage.has_embed else 0)
        terms.append(CommTerm("pp", "hidden states fwd / gradients bwd: send", hidden * sends, 2, "exposed",
                              ("pipeline_bubble",), "send"))
    return [t for t in terms if t.bytes_per_step > 0]


def padded_row_share(cfg: Config) -> float:
    """Share of the dispatch buffer's rows that carry no route: the row-wise dispatcher's fixed
    blocks (:func:`moebench.plan.stages.wire_rows_per_chunk`) less the routes kept
    (:func:`moebench.plan.stages.kept_route_share` of them, routing balanced); 0 for exact rows."""
    wire = wire_rows_per_chunk(cfg)
    kept = micro_batching(cfg).tokens_per_chunk * cfg.moe.top_k * kept_route_share(cfg)
    return max(0.0, 1.0 - kept / wire) if cfg.parallel.dispatcher == "rowwise" and cfg.parallel.ep > 1 else 0.0


def bytes_per_axis(terms: list[CommTerm], part: str = "all") -> dict[str, float]:
    """Bytes per step and axis: ``all`` of them, the ``padding`` (empty slots) or the ``valid``
    rest (the record's ``comm_bytes_per_step``, ``comm_bytes_padding``, ``comm_bytes_valid``)."""
    out: dict[str, float] = {}
    for t in terms:
        nbytes = {"all": t.bytes_per_step, "padding": t.padding_bytes,
                  "valid": t.bytes_per_step - t.padding_bytes}[part]
        out[t.axis] = out.get(t.axis, 0.0) + nbytes
    return out
