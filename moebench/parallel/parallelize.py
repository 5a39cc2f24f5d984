"""Applying a parallel layout to a built model, every step in one visible order."""

from __future__ import annotations

import torch
from torch import nn

from moebench.config import Config
from moebench.parallel.checkpoint import apply_activation_checkpointing
from moebench.parallel.ddp import apply_ddp
from moebench.parallel.expert import apply_expert_parallel
from moebench.parallel.fsdp import ShardedGrads, apply_fsdp
from moebench.parallel.mesh import ParallelDims
from moebench.parallel.pipeline import PipelineRunner, split_model
from moebench.parallel.strategy import GradSync, LocalRunner, Runner, Strategy


def parallelize(model: nn.Module, cfg: Config, dims: ParallelDims, device: torch.device,
                bf16: bool = False) -> Strategy:
    """Apply ``cfg.parallel`` to a model built identically on every rank; return its strategy.

    ``bf16``: the compute precision, which FSDP also uses for its parameter all-gathers.
    The steps, in order:

    1. activation checkpointing per block (``parallel.activation_checkpointing=per-layer``);
    2. pipeline split (``pp > 1``): this rank keeps its stages' layers, the rest is deleted;
    3. expert sharding (``ep > 1``): each rank keeps ``num_experts / ep`` experts resident and
       the MoE blocks get an expert-parallel dispatcher;
    4. data-parallel wrapping, which gives the strategy its gradient sync: FSDP2 per block and
       root (``fsdp``: the baseline, experts sharded over ``edp`` when ``ep > 1``; each pipeline
       stage a root of its own), or flat
       gradient buffers reduced once per step (``ddp``);
    5. the micro-batch runner: a pipeline schedule over this rank's stages when ``pp > 1``,
       else the plain loop.
    """
    p = cfg.parallel
    if p.activation_checkpointing == "per-layer":
        apply_activation_checkpointing(model)
    if dims.pp > 1:
        model = split_model(model, cfg, dims)
    apply_expert_parallel(model, cfg, dims)
    grads: GradSync
    if p.strategy == "fsdp":
        apply_fsdp(model, dims, bf16_params=bf16)
        grads = ShardedGrads(model, dims)
    else:
        grads = apply_ddp(model, cfg, dims, overlap=dims.pp == 1)
    runner: Runner = PipelineRunner(model, cfg, dims, device) if dims.pp > 1 else LocalRunner(model)
    return Strategy(model, grads, runner, dims)
