"""``torch.nn.functional.grouped_mm`` as a custom op, for the dtypes torch.compile cannot trace.

Shapes: M expert-sorted rows, K reduction dim, N output dim, E experts; ``offsets_E`` int32
cumulative row ends (rows past ``offsets[-1]`` are padding, their output undefined).

torch's fake (shape-only) ``_grouped_mm``, which torch.compile traces with, accepts bf16 only,
while the CPU backends also compute in fp32. :func:`grouped_mm` routes other dtypes through
``moebench::grouped_mm`` (forward and input gradient, ``a @ b[e]``) and
``moebench::grouped_mm_wgrad`` (``a[rows_e]^T @ g[rows_e]``), each recorded by the compiler as one
opaque call; bf16 keeps torch's native op, which inductor can lower itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.library import CustomOpDef


@torch.library.custom_op("moebench::grouped_mm", mutates_args=())
def _grouped_mm_op(a_MK: Tensor, b_EKN: Tensor, offsets_E: Tensor) -> Tensor:
    return F.grouped_mm(a_MK, b_EKN, offs=offsets_E)


@_grouped_mm_op.register_fake
def _(a_MK: Tensor, b_EKN: Tensor, offsets_E: Tensor) -> Tensor:
    return a_MK.new_empty(a_MK.shape[0], b_EKN.shape[2])


@torch.library.custom_op("moebench::grouped_mm_wgrad", mutates_args=())
def _grouped_wgrad_op(a_MK: Tensor, g_MN: Tensor, offsets_E: Tensor) -> Tensor:
    return F.grouped_mm(a_MK.t(), g_MN, offs=offsets_E)  # zero for empty experts


@_grouped_wgrad_op.register_fake
def _(a_MK: Tensor, g_MN: Tensor, offsets_E: Tensor) -> Tensor:
    return a_MK.new_empty(offsets_E.shape[0], a_MK.shape[1], g_MN.shape[1])


def _setup(ctx, inputs: tuple, output: Tensor) -> None:
    ctx.save_for_backward(*inputs)


def register_grouped_autograd(fwd_op: CustomOpDef, wgrad_op: CustomOpDef) -> None:
    """The backward of a grouped GEMM op ``fwd_op(a [M, K], b [E, K, N], offsets_E)``: the input
    gradient is ``fwd_op`` again on ``b[e]^T``, the weight gradient ``wgrad_op(a, g, offsets_E)``
    (``a[rows_e]^T @ g[rows_e]``). Shared by these ops and the Triton ones
    (:mod:`moebench.kernels.grouped_gemm`)."""

    def backward(ctx, grad_MN: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        a_MK, b_EKN, offsets_E = ctx.saved_tensors
        grad_MN = grad_MN.contiguous()  # grouped_mm wants 16-byte strides: an expanded gradient has none
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_a = fwd_op(grad_MN, b_EKN.transpose(1, 2), offsets_E)  # dgrad: G @ B[e]^T
        if ctx.needs_input_grad[1]:
            grad_b = wgrad_op(a_MK, grad_MN, offsets_E)  # wgrad: A[rows_e]^T @ G[rows_e]
        return grad_a, grad_b, None

    fwd_op.register_autograd(backward, setup_context=_setup)


register_grouped_autograd(_grouped_mm_op, _grouped_wgrad_op)


def grouped_mm(a_MK: Tensor, b_EKN: Tensor, offsets_E: Tensor) -> Tensor:
    """``out[rows_e] = a[rows_e] @ b[e]``: torch's op in bf16, ``moebench::grouped_mm`` otherwise."""
    if a_MK.dtype == torch.bfloat16:
        return F.grouped_mm(a_MK, b_EKN, offs=offsets_E)
    return _grouped_mm_op(a_MK, b_EKN, offsets_E)
