"""Applying a parallel layout to a built model, every step in one visible order."""

from __future__ import annotations

import torch
from torch import nn

from moebench.config import Config
from moebench.parallel.checkpoint import apply_activation_checkpointing
from moebench.parallel.ddp import DataParallel
from moebench.parallel.expert import apply_expert_parallel
from moebench.parallel.fsdp import FullyShardedDP
from moebench.parallel.mesh import ParallelDims
from moebench.parallel.pipeline import PipelineParallel, split_model
from moebench.parallel.strategy import Strategy


def parallelize(model: nn.Module, cfg: Config, dims: ParallelDims, device: torch.device,
                bf16: bool = False) -> Strategy:
    """Apply ``cfg.parallel`` to a model built identically on every rank; return its strategy.

    ``bf16``: the compute precision, which FSDP also uses for its parameter all-gathers.
    The steps, in order:

    1. activation checkpointing per block (``parallel.activation_checkpointing=per-layer``);
    2. pipeline split (``pp > 1``): this rank keeps its stages' layers, the rest is deleted;
    3. expert sharding (``ep > 1``): each rank keeps ``num_experts / ep`` experts resident and
       the MoE blocks get an expert-parallel dispatcher;
    4. data-parallel wrapping: FSDP2 per block and root (``fsdp``: the baseline, experts sharded
       over ``edp`` when ``ep > 1``), or flat gradient buffers reduced once per step (``ddp``),
       run by a pipeline schedule when ``pp > 1``.
    """
    p = cfg.parallel
    if p.activation_checkpointing == "per-layer":
        apply_activation_checkpointing(model)
    if dims.pp > 1:
        model = split_model(model, cfg, dims)
    apply_expert_parallel(model, cfg, dims)
    if p.strategy == "fsdp":
        return FullyShardedDP(model, cfg, dims, bf16_params=bf16)
    if dims.pp > 1:
        return PipelineParallel(model, cfg, dims, device)
    return DataParallel(model, cfg, dims)
