"""Triton permute / unpermute: tokens into the expert-sorted buffer and back.

Shapes: T tokens, K top-k, D model dim, N buffer rows.

Routes are described by ``dest_TK``: int64 buffer row of route (t, k), or -1 for a dropped
route. Both kernels run one program per (token, D tile), so no two programs write one row and
nothing needs atomics:

- ``permute``: scatter. Token t's row is read once and written to its K destination rows.
  Its gradient is ``unpermute`` with unit weights.
- ``unpermute``: weighted inverse gather, ``out[t] = sum_k w[t, k] * y[dest[t, k]]`` in fp32.
  Its input gradient is ``permute`` with weights; the weight gradient is a row dot product.

Buffer rows that no route writes (capacity padding) are zero. The torch reference twins below
are written with ``index_select``/``index_add`` and, for lossless routing, agree with
:class:`moebench.model.moe.LocalDispatcher` (:class:`moebench.model.triton_dispatch.TritonLocalDispatcher`
is that dispatcher on these kernels).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from moebench.kernels.routing import inverse_permutation, sort_routes

_BLOCK_D = 128


@triton.jit
def _scatter_rows_kernel(x_ptr, dest_ptr, w_ptr, out_ptr, D, TOP_K: tl.constexpr,
                         HAS_W: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    x = tl.load(x_ptr + t.to(tl.int64) * D + offs_d, mask=mask_d, other=0.0)
    for k in range(TOP_K):
        dest = tl.load(dest_ptr + t * TOP_K + k)
        row = x
        if HAS_W:
            row = (x.to(tl.float32) * tl.load(w_ptr + t * TOP_K + k)).to(x.dtype)
        safe = tl.maximum(dest, 0)
        tl.store(out_ptr + safe * D + offs_d, row, mask=mask_d & (offs_d * 0 + dest >= 0))  # vector mask


@triton.jit
def _gather_rows_kernel(y_ptr, dest_ptr, w_ptr, out_ptr, D, TOP_K: tl.constexpr,
                        HAS_W: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for k in range(TOP_K):
        dest = tl.load(dest_ptr + t * TOP_K + k)
        safe = tl.maximum(dest, 0)
        row = tl.load(y_ptr + safe * D + offs_d, mask=mask_d & (offs_d * 0 + dest >= 0), other=0.0).to(tl.float32)
        if HAS_W:
            row = row * tl.load(w_ptr + t * TOP_K + k)
        acc += row
    tl.store(out_ptr + t.to(tl.int64) * D + offs_d, acc.to(out_ptr.dtype.element_ty), mask=mask_d)


def _scatter(x_TD: Tensor, dest_TK: Tensor, weight_TK: Tensor | None, num_rows: int) -> Tensor:
    x_TD = x_TD.contiguous()
    out_ND = torch.zeros(num_rows, x_TD.shape[1], dtype=x_TD.dtype, device=x_TD.device)
    if x_TD.numel():
        w = weight_TK.float().contiguous() if weight_TK is not None else x_TD  # dummy pointer when unused
        grid = (x_TD.shape[0], triton.cdiv(x_TD.shape[1], _BLOCK_D))
        _scatter_rows_kernel[grid](x_TD, dest_TK.contiguous(), w, out_ND, x_TD.shape[1], TOP_K=dest_TK.shape[1],
                                   HAS_W=weight_TK is not None, BLOCK_D=_BLOCK_D)
    return out_ND


def _gather(y_ND: Tensor, dest_TK: Tensor, weight_TK: Tensor | None) -> Tensor:
    y_ND = y_ND.contiguous()
    out_TD = torch.empty(dest_TK.shape[0], y_ND.shape[1], dtype=y_ND.dtype, device=y_ND.device)
    if out_TD.numel():
        w = weight_TK.float().contiguous() if weight_TK is not None else y_ND
        grid = (dest_TK.shape[0], triton.cdiv(y_ND.shape[1], _BLOCK_D))
        _gather_rows_kernel[grid](y_ND, dest_TK.contiguous(), w, out_TD, y_ND.shape[1], TOP_K=dest_TK.shape[1],
                                  HAS_W=weight_TK is not None, BLOCK_D=_BLOCK_D)
    return out_TD


def _route_rows(y_ND: Tensor, dest_TK: Tensor) -> Tensor:
    """``[T, K, D]``: the buffer row of every route (row 0 for a dropped route; callers mask it)."""
    return y_ND.index_select(0, dest_TK.clamp(min=0).flatten()).view(*dest_TK.shape, -1)


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD: Tensor, dest_TK: Tensor, num_rows: int) -> Tensor:
        ctx.save_for_backward(dest_TK)
        return _scatter(x_TD, dest_TK, None, num_rows)

    @staticmethod
    def backward(ctx, grad_ND: Tensor) -> tuple[Tensor, None, None]:
        (dest_TK,) = ctx.saved_tensors
        return _gather(grad_ND, dest_TK, None), None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_ND: Tensor, dest_TK: Tensor, weight_TK: Tensor) -> Tensor:
        ctx.save_for_backward(y_ND, dest_TK, weight_TK)
        return _gather(y_ND, dest_TK, weight_TK)

    @staticmethod
    def backward(ctx, grad_TD: Tensor) -> tuple[Tensor | None, None, Tensor | None]:
        y_ND, dest_TK, weight_TK = ctx.saved_tensors
        grad_y = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_y = _scatter(grad_TD, dest_TK, weight_TK, y_ND.shape[0])
        if ctx.needs_input_grad[2]:
            grad_w = torch.einsum("tkd,td->tk", _route_rows(y_ND, dest_TK).float(), grad_TD.float())
            grad_w = grad_w.masked_fill(dest_TK < 0, 0.0).to(weight_TK.dtype)
        return grad_y, None, grad_w


def permute(x_TD: Tensor, dest_TK: Tensor, num_rows: int) -> Tensor:
    """Scatter token rows into an ``[num_rows, D]`` buffer: ``out[dest[t, k]] = x[t]`` (Triton)."""
    return _Permute.apply(x_TD, dest_TK, num_rows)


def unpermute(y_ND: Tensor, dest_TK: Tensor, weight_TK: Tensor) -> Tensor:
    """Weighted inverse gather: ``out[t] = sum_k w[t, k] * y[dest[t, k]]`` (Triton)."""
    return _Unpermute.apply(y_ND, dest_TK, weight_TK)


def permute_reference(x_TD: Tensor, dest_TK: Tensor, num_rows: int) -> Tensor:
    """Torch twin of :func:`permute`."""
    top_k = dest_TK.shape[1]
    flat = dest_TK.flatten()
    keep = flat >= 0
    token = torch.arange(flat.numel(), device=flat.device) // top_k
    out = x_TD.new_zeros(num_rows, x_TD.shape[1])
    return out.index_copy(0, flat[keep], x_TD.index_select(0, token[keep]))


def unpermute_reference(y_ND: Tensor, dest_TK: Tensor, weight_TK: Tensor) -> Tensor:
    """Torch twin of :func:`unpermute` (fp32 accumulation, output in ``y``'s dtype)."""
    w_TK = weight_TK.float().masked_fill(dest_TK < 0, 0.0)
    return torch.einsum("tkd,tk->td", _route_rows(y_ND, dest_TK).float(), w_TK).to(y_ND.dtype)


def destination_rows(idx_TK: Tensor, num_experts: int) -> tuple[Tensor, Tensor]:
    """Lossless expert-sorted placement: ``(dest_TK, offsets_E)``, computed on the device."""
    order_N, _, offsets_E = sort_routes(idx_TK, num_experts)
    return inverse_permutation(order_N).view(idx_TK.shape), offsets_E
