"""Regional compilation: ``torch.compile`` of each transformer block (``train.compile=true``).

Each block's ``forward`` is replaced by its compiled version (the module, its parameters and
their names stay as they are), so whatever is applied around a block afterwards (activation
checkpointing, FSDP2's gather/reshard hooks, pipeline stages) keeps running eagerly around the
compiled region, as in torchtitan and OLMo-core. Every block of a run has the same shapes, so
the kernels are static, and blocks of one kind share them; the one size the data decides (the
rows the sync all-to-all delivers) is marked dynamic where it is made.

Graphs break only where the block calls something that cannot be traced: the sync expert-parallel
dispatcher (host split sizes by design; :mod:`moebench.parallel.dispatch`), the row-wise one only
in profiled steps or with MXFP8 rows on the wire, and the ``loop`` backend's host offsets. The
fused CPU expert kernels (:mod:`moebench.kernels.cpu_experts`) and fp32 ``grouped_mm``
(:mod:`moebench.kernels.grouped_mm_op`) are custom ops the graph records as one call each; the
row-wise dispatcher's collectives are functional collectives. Everything else (norms, attention,
RoPE, router and its losses, SwiGLU, residuals) compiles. tests/model/test_compile_graph_breaks.py
counts the breaks.

The phase marks (:mod:`moebench.model.phases`) are traced away in ordinary steps, also under the
timed steps' step clock (so a compiled block's regions are not told apart in the timed breakdown);
with a profiling clock active (the traced steps) the blocks recompile with a graph break at every
mark, so a profiled step times each region as its own graph. The trainer compiles that variant in
its last warm-up step, under a profiling clock it discards (``Trainer._warmup_clock``).
"""

from __future__ import annotations

import torch
from torch import nn


def compile_blocks(model: nn.Module) -> None:
    """Compile every transformer block of ``model`` in place (compilation happens on first use)."""
    for block in model.layers.values():
        block.forward = torch.compile(block.forward)
