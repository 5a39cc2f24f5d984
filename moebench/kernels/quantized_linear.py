"""Quantized dense linear layers (fp8 rowwise, MXFP8): the expert GEMMs' rule with one group.

Legend: T tokens (rows), K input features (the forward's reduction dim), M output features.

``quantized_linear(x_TK, w_MK, fmt, impl, rounding, saved)`` is ``x @ w^T`` (``nn.Linear``'s
weight layout) under the autograd rule of :mod:`moebench.kernels.quantized_gemm`, read with a
single group of T rows: forward ``Q(x) @ Q(w)^T`` along K, input gradient ``Q(g) @ Q(w)`` along
M, weight gradient ``g^T @ x`` over the tokens (fp8: both quantized with one scale per column;
MXFP8: compute dtype, ``x`` as the forward quantized it when ``saved="quantized"``). The
quantizers and the saving policy are the expert GEMMs' own (:class:`quantized_gemm.GemmRule`);
only the GEMM calls differ: plain instead of grouped.

- ``emulated``: dequantize, then ``F.linear`` / a matmul in the compute dtype;
- ``native``: ``torch._scaled_mm`` on the E4M3 operands, fp32 rowwise scales (fp8, SM90+) or
  E8M0 scales in the blocked layout (MXFP8, SM100); fast accumulation in the forward only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from moebench.kernels.quantized_gemm import GemmRule, Quantized, check_args, fp8_group_columns_t
from moebench.kernels.scale_layout import blocked


def _native_mm(a_q: Quantized, bt_q: Quantized, fmt: str, fast_accum: bool) -> Tensor:
    """``a @ bt^T`` on ``torch._scaled_mm``: ``a`` ``[T, K]`` and ``bt`` ``[M, K]`` (B column-major,
    as the kernel wants it) both quantized along K; bf16 out."""
    (a_data, a_scale), (bt_data, bt_scale) = a_q, bt_q
    if fmt == "fp8":
        b_scale = bt_scale.reshape(1, -1)  # [1, M]: one per column of B
    else:
        a_scale, b_scale = blocked(a_scale).flatten(), blocked(bt_scale).flatten()
    return torch._scaled_mm(a_data, bt_data.t(), a_scale, b_scale, out_dtype=torch.bfloat16,
                            use_fast_accum=fast_accum and fmt == "fp8")


class _LinearRule(GemmRule):
    """The grouped rule with plain GEMMs: ``offsets`` is the one group ``[T]``."""

    def product(self, a_q: Quantized, bt_q: Quantized, offsets_E: Tensor, fast_accum: bool = False) -> Tensor:
        if self.impl == "native":
            return _native_mm(a_q, bt_q, self.fmt, fast_accum)
        return F.linear(self.dequantize(a_q, self.dtype), self.dequantize(bt_q, self.b_dtype))

    def wgrad_mm(self, a_TK: Tensor, g_TM: Tensor, offsets_E: Tensor) -> Tensor:
        return a_TK.t() @ g_TM  # [K, M]

    def native_fp8_wgrad(self, a_q: Quantized, g_TM: Tensor, offsets_E: Tensor) -> Tensor:
        (a_data, a_scale), rows = a_q, a_q[0].shape[1]  # [K, rows] token-major, [1, K]
        g_data, g_scale = fp8_group_columns_t(g_TM, offsets_E, rows)  # [M, rows], [1, M]
        return torch._scaled_mm(a_data, g_data.t(), a_scale.reshape(-1, 1), g_scale.reshape(1, -1),
                                out_dtype=torch.bfloat16)


class QuantizedLinearMM(torch.autograd.Function):
    """``x @ w^T`` under the quantized GEMM rule (module docstring); saves what
    :class:`moebench.kernels.quantized_gemm.QuantizedGroupedMM` saves, with one group."""

    @staticmethod
    def forward(ctx, x_TK: Tensor, w_MK: Tensor, fmt: str, impl: str, rounding: str, saved: str) -> Tensor:
        rule = ctx.rule = _LinearRule(fmt, impl, rounding, "grouped_mm", saved, x_TK.dtype, w_MK.dtype)
        offsets_1 = torch.full((1,), x_TK.shape[0], dtype=torch.int32, device=x_TK.device)  # one group: all rows
        x_q = rule.rows(x_TK)
        out = rule.product(x_q, rule.rows(w_MK), offsets_1, fast_accum=True)
        need_x, need_w = ctx.needs_input_grad[:2]
        if saved == "quantized":
            w_form = rule.rows(w_MK.t()) if need_x else ()  # [K, M] along M
            x_form = rule.wgrad_input(x_TK, x_q, offsets_1) if need_w else ()
        else:
            w_form, x_form = (w_MK,), (x_TK,)
        ctx.num_w = len(w_form)
        ctx.save_for_backward(offsets_1, *w_form, *x_form)
        return out

    @staticmethod
    def backward(ctx, grad_TM: Tensor) -> tuple[Tensor | None, ...]:
        rule: _LinearRule = ctx.rule
        offsets_1, *forms = ctx.saved_tensors
        w_form, x_form = tuple(forms[:ctx.num_w]), tuple(forms[ctx.num_w:])
        grad_TM = grad_TM.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            wt_q = w_form if rule.saved == "quantized" else rule.rows(w_form[0].t())
            grad_x = rule.product(rule.rows(grad_TM), wt_q, offsets_1).to(rule.dtype)
        if ctx.needs_input_grad[1]:
            if rule.saved == "compute":
                x_form = rule.wgrad_input(x_form[0], None, offsets_1)
            grad_w = rule.weight_grad(x_form, grad_TM.to(rule.dtype), offsets_1).t().to(rule.b_dtype)
        return grad_x, grad_w, None, None, None, None


def quantized_linear(x: Tensor, w_MK: Tensor, fmt: str, impl: str = "emulated", rounding: str = "up",
                     saved: str = "quantized") -> Tensor:
    """Differentiable quantized ``x @ w^T`` for ``x`` of any ``[..., K]`` shape (module docstring)."""
    check_args(fmt, impl, rounding, saved)
    out = QuantizedLinearMM.apply(x.reshape(-1, x.shape[-1]), w_MK, fmt, impl, rounding, saved)
    return out.view(*x.shape[:-1], w_MK.shape[0])
