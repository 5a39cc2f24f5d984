"""Regional compilation: ``torch.compile`` of each transformer block (``train.compile=true``).

Each block's ``forward`` is replaced by its compiled version (the module, its parameters and
their names stay as they are), so whatever is applied around a block afterwards (activation
checkpointing, FSDP2's gather/reshard hooks, pipeline stages) keeps running eagerly around the
compiled region, as in torchtitan and OLMo-core. Every block of a run has the same shapes, so
the kernels are static, and blocks of one kind share them; the one size the data decides (the
rows the sync all-to-all delivers) is marked dynamic where it is made.

Graphs break only where the block calls something that cannot be traced: the expert-parallel
dispatchers (collectives, host split sizes; :mod:`moebench.parallel.dispatch`), the fused CPU
expert kernels (host sizes, a buffer pool; :mod:`moebench.kernels.cpu_experts`), ``grouped_mm``
in fp32 (torch traces it in bf16 only) and the ``loop`` backend's host offsets. Everything else
(norms, attention, RoPE, router and its losses, SwiGLU, residuals) compiles.

The phase marks of the profiled steps (:mod:`moebench.model.phases`) are traced away in
ordinary steps; with a clock active the blocks recompile with a graph break at every mark, so a
profiled step times each region as its own graph. The trainer compiles that variant in its last
warm-up step, under a clock it discards (``Trainer._warmup_clock``).
"""

from __future__ import annotations

import torch
from torch import nn


def compile_blocks(model: nn.Module) -> None:
    """Compile every transformer block of ``model`` in place (compilation happens on first use)."""
    for block in model.layers.values():
        block.forward = torch.compile(block.forward)
