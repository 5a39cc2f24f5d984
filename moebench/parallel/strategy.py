"""Choosing and applying a parallel strategy to a built model, in one documented order:

1. expert parallelism (slice experts, swap in the EP dispatcher)    -- inside 3/4
2. activation checkpointing per block                                -- optional
3. pipeline stages (copies with the other stages' layers deleted)    -- pp > 1, ddp
4. data parallelism: flat-buffer gradient sync (ddp) or FSDP2 (fsdp)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moebench.config import Config
from moebench.parallel.layout import ParallelDims
from moebench.train.trainer import Strategy


class DistributedStrategy(Strategy):
    """What every multi-rank strategy shares: coordinates and data-parallel reductions."""

    def __init__(self, model: nn.Module, cfg: Config, dims: ParallelDims) -> None:
        super().__init__(model)
        self.cfg, self.dims = cfg, dims
        self.rank, self.world_size = dims.rank, dims.world_size
        self.dp_rank, self.dp_size = dims.dp_rank, dims.dp

    def all_reduce_sum(self, tensor: Tensor) -> Tensor:
        if self.dims.dp > 1:
            dist.all_reduce(tensor, group=self.dims.groups["dp"])
        return tensor


def parallelize(model: nn.Module, cfg: Config, dims: ParallelDims, device: torch.device,
                bf16: bool = False) -> Strategy:
    """Apply ``cfg.parallel`` to a model built identically on every rank (``bf16``: the
    compute precision, which FSDP also uses for its parameter all-gathers)."""
    if cfg.parallel.activation_checkpointing == "per-layer":
        from moebench.parallel.checkpoint import apply_activation_checkpointing

        apply_activation_checkpointing(model)
    if cfg.parallel.strategy == "fsdp":
        from moebench.parallel.fsdp import FullyShardedDP

        return FullyShardedDP(model, cfg, dims, bf16_params=bf16)
    if dims.pp > 1:
        from moebench.parallel.pipeline import PipelineParallel

        return PipelineParallel(model, cfg, dims, device)
    from moebench.parallel.ddp import DataParallel

    return DataParallel(model, cfg, dims)
