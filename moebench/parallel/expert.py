"""Expert parallelism: keep each rank's block of experts resident, swap in an EP dispatcher."""

from __future__ import annotations

from torch import nn

from moebench.config import Config
from moebench.model.moe import MoE
from moebench.parallel.dispatch import RowwiseDispatch, SyncAllToAll
from moebench.parallel.mesh import ParallelDims


def apply_expert_parallel(model: nn.Module, cfg: Config, dims: ParallelDims) -> None:
    """Slice every MoE block's stacked expert weights to this EP rank's experts, in place.

    The full model was built (identically, from one seed) on every rank, so rank r keeps
    experts ``r*L .. r*L+L-1``: the same weights a single process would use for them.
    """
    if dims.ep == 1:
        return
    group = dims.groups["ep"]
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        experts = moe.experts
        local = cfg.moe.num_experts // dims.ep
        sl = slice(dims.ep_rank * local, (dims.ep_rank + 1) * local)
        experts.w13 = nn.Parameter(experts.w13.detach()[sl].clone())
        experts.w2 = nn.Parameter(experts.w2.detach()[sl].clone())
        experts.num_local_experts = local
        # mxfp8 runs dispatch quantized rows (the expert GEMM quantizes them anyway)
        wire = "mxfp8" if cfg.precision.mode == "mxfp8" else None
        if cfg.parallel.dispatcher == "rowwise":
            moe.dispatcher = RowwiseDispatch(group, cfg.moe.num_experts, cfg.effective_capacity_factor(), wire,
                                             rule=cfg.parallel.rowwise_capacity)
        else:
            moe.dispatcher = SyncAllToAll(group, cfg.moe.num_experts, wire)


def is_expert_param(name: str) -> bool:
    return ".experts." in f".{name}"
