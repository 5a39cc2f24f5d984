"""Shared builders for the MoE-layer tests."""

from __future__ import annotations

import torch

from moebench.config import MoEConfig
from moebench.model.moe import MoE


def make_moe(backend: str = "grouped_mm", starved: int = 0, swiglu_limit: float | None = None) -> MoE:
    """A small MoE block (E=8, K=2, D=32, H=32, shared expert 16) with O(1) weights;
    ``starved`` experts get a large negative selection bias, so they receive no tokens;
    ``swiglu_limit``: gpt-oss's clamped SwiGLU."""
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=8, top_k=2, expert_hidden=32, shared_expert_hidden=16, bias_gamma=0.01,
                    backend=backend, swiglu_limit=swiglu_limit)
    moe = MoE(32, cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    if starved:
        moe.router.expert_bias[-starved:] = -1e4
    return moe
