"""Where a profiled CPU step's time goes, by kind of kernel: which part any implementation of the
same model pays (the GEMMs, the attention kernel, the optimizer) and which part is its own.

Every profiled op's *self* time (its own, not its children's) lands in exactly one class, so the
classes sum to the profiled ops' total; what no op covers (Python between ops) is the step's wall
time minus that total (``between_ops``, computed by the caller, who has the wall time).

Classes, first rule that matches, an op's ancestors included:

- ``optimizer``: inside ``Optimizer.step`` (torch's own annotation), a ``_foreach_`` op, a fused
  AdamW kernel or a :data:`CLIP_RANGE` range (gradient clipping: foreach ops, or that range around
  a per-tensor clip);
- ``gemm``: ``mm`` / ``addmm`` / ``bmm`` / ``baddbmm`` (MKL or oneDNN);
- ``attention_kernel``: sdpa's fused kernels (flash / efficient, forward and backward; the math
  fallback's own matmuls count as ``gemm``);
- ``expert_op_copies``: ``copy_`` / ``_to_copy`` inside a ``moebench::`` custom op (in bf16 the
  casts of the fp32 weights and of the weight gradients);
- ``expert_op_other``: anything else inside it, its own Python included (the per-expert loop of
  ``cpu_fused``), gathers and elementwise work;
- ``copies``: ``copy_`` / ``_to_copy`` (dtype casts, contiguous copies) outside it;
- ``other_ops``: every other ``aten::`` op (elementwise, norms, reductions, indexing, loss);
- ``framework``: self time of non-``aten`` ranges: autograd nodes, compiled regions (inductor's
  own kernels run in them), torch's dispatch annotations.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

CLASSES = ("gemm", "attention_kernel", "optimizer", "expert_op_copies", "expert_op_other", "copies", "other_ops",
           "framework")
GEMMS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"})
COPIES = frozenset({"aten::copy_", "aten::_to_copy"})
CLIP_RANGE = "clip_grad_norm"  # a caller's profiler range around gradient clipping done tensor by tensor
# torch's annotation of every optimizer step; foreach ops (on CPU a loop over per-tensor ops inside
# them) are gradient clipping's norms and scaling and the foreach AdamW
OPTIMIZER = ("Optimizer.step", "aten::_foreach_", "aten::_fused_adam", CLIP_RANGE)


class ProfiledOp(Protocol):
    """What this module reads of a ``torch.autograd.profiler_util.FunctionEvent``."""

    name: str
    self_cpu_time_total: float
    cpu_parent: Any


def _ancestors(op: ProfiledOp) -> list[str]:
    names, parent = [], op.cpu_parent
    while parent is not None:
        names.append(parent.name)
        parent = parent.cpu_parent
    return names


def op_class(name: str, ancestors: Iterable[str]) -> str:
    """The class (one of :data:`CLASSES`) of an op called ``name`` under ``ancestors``."""
    above = list(ancestors)
    if any(a.startswith(OPTIMIZER) for a in (name, *above)):
        return "optimizer"
    if name in GEMMS:
        return "gemm"
    if name.startswith("aten::_scaled_dot_product") and not name.startswith("aten::_scaled_dot_product_attention_math"):
        return "attention_kernel"
    if name.startswith("moebench::") or any(a.startswith("moebench::") for a in above):
        return "expert_op_copies" if name in COPIES else "expert_op_other"
    if name in COPIES:
        return "copies"
    return "other_ops" if name.startswith("aten::") else "framework"


def account(ops: Iterable[ProfiledOp]) -> dict[str, float]:
    """Seconds of self time in each of :data:`CLASSES` (every class present, zero if none)."""
    seconds = dict.fromkeys(CLASSES, 0.0)
    for op in ops:
        seconds[op_class(op.name, _ancestors(op))] += op.self_cpu_time_total * 1e-6
    return seconds
