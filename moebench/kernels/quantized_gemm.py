"""Quantized grouped GEMMs (fp8 rowwise, MXFP8): one autograd rule, a native and an emulated GEMM.

Legend: N expert-sorted rows (rows past ``offsets[-1]`` are padding), K the GEMM's reduction
dim, M its output dim, E experts (groups).

``quantized_grouped_mm(a_NK, b_EKM, offsets_E, fmt, impl)`` is ``a[rows_e] @ b[e]`` per expert:

- forward ``out = Q(a) @ Q(b)``, both operands quantized along K;
- input gradient ``grad_a = Q(grad) @ Q(b^T)``, quantized along M (that GEMM's reduction dim);
- weight gradient ``grad_b[e] = a[rows_e]^T @ grad[rows_e]``, whose reduction dim is the ragged
  token dim: fp8 quantizes both operands with one scale per (expert group, column)
  (:func:`moebench.kernels.fp8.quantize_group_columns`); MXFP8 keeps it in the compute dtype on
  the unquantized operands, because 32-element blocks along tokens would need every expert group
  padded to a multiple of 32 rows.

``Q`` is :func:`moebench.kernels.fp8.quantize_rowwise` (fp8: E4M3, one power-of-two scale per
row / column) or MXFP8 (E4M3, one E8M0 scale per 32 elements along the reduction dim). On CUDA
the fp8 quantizes of ``native`` and every MXFP8 quantize run the bit-exact Triton twins
(:func:`fp8_rowwise`, :func:`fp8_group_columns_t`, :func:`mx_quantize`).

The two implementations quantize identically and differ only in how the quantized product is
accumulated, so ``emulated`` is the reference twin of ``native``:

- ``emulated`` (any device, any expert backend): dequantize, then the backend's grouped GEMM in
  the compute dtype. Shows the formats' accuracy, never their speed.
- ``native``: ``torch._scaled_grouped_mm`` on E4M3 operands, rowwise fp32 scales (fp8, SM90+) or
  E8M0 scales in the blocked layout of :mod:`moebench.kernels.scale_layout` (MXFP8, SM100).
  Fast accumulation in the forward GEMM only (the usual fp8 training recipe), bf16 output.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from moebench.kernels import mxfp8
from moebench.kernels.fp8 import (
    dequantize_group_columns,
    dequantize_rowwise,
    quantize_group_columns,
    quantize_rowwise,
)
from moebench.kernels.scale_layout import blocked, grouped_blocked

FORMATS = ("fp8", "mxfp8")
IMPLS = ("native", "emulated")

_HAS_TRITON = importlib.util.find_spec("triton") is not None

GroupedFn = Callable[[Tensor, Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class GroupedGemms:
    """A backend's grouped GEMMs in the compute dtype (no autograd of their own)."""

    mm: GroupedFn  # a [N, K], b [E, K, M], offsets -> [N, M]
    wgrad: GroupedFn  # a [N, K], g [N, M], offsets -> [E, K, M]


def backend_gemms(backend: str) -> GroupedGemms:
    """The grouped GEMMs of an expert backend: Triton's for ``triton``, torch's otherwise."""
    if backend == "triton":
        from moebench.kernels.grouped_gemm import grouped_mm_fwd, grouped_mm_wgrad

        return GroupedGemms(grouped_mm_fwd, grouped_mm_wgrad)
    return GroupedGemms(lambda a, b, offs: F.grouped_mm(a, b, offs=offs),
                        lambda a, g, offs: F.grouped_mm(a.t(), g, offs=offs))


def mx_quantize(x: Tensor, rounding: str = "up") -> tuple[Tensor, Tensor]:
    """MXFP8 along the last dim; the (bit-exact) Triton kernel on CUDA, the torch reference elsewhere."""
    if x.is_cuda and _HAS_TRITON:
        from moebench.kernels import mxfp8_triton

        return mxfp8_triton.quantize(x, rounding)
    return mxfp8.quantize(x, rounding)


def fp8_rowwise(x: Tensor) -> tuple[Tensor, Tensor]:
    """FP8 rowwise along the last dim; the (bit-exact) Triton kernel on CUDA, the torch reference elsewhere."""
    if x.is_cuda and _HAS_TRITON:
        from moebench.kernels import fp8_triton

        return fp8_triton.quantize_rowwise(x)
    return quantize_rowwise(x, dim=-1)


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"quantized GEMM format must be one of {', '.join(FORMATS)}; got {fmt!r}")


def quantize_dequantize(x: Tensor, fmt: str, dim: int, rounding: str = "up") -> Tensor:
    """``x`` rounded to ``fmt`` with rows/blocks along ``dim``, in ``x``'s dtype."""
    _check_format(fmt)
    moved = x.movedim(dim, -1)
    if fmt == "fp8":
        out = dequantize_rowwise(*quantize_rowwise(moved, dim=-1), dtype=x.dtype)
    else:
        out = mxfp8.dequantize(*mx_quantize(moved, rounding), dtype=x.dtype)
    return out.movedim(-1, dim)


def emulated_mm(a_NK: Tensor, b_EKM: Tensor, offsets_E: Tensor, fmt: str, rounding: str = "up",
                gemms: GroupedGemms | None = None) -> Tensor:
    """``Q(a) @ Q(b)`` per group: quantize -> dequantize -> grouped GEMM in the compute dtype."""
    gemms = gemms or backend_gemms("grouped_mm")
    return gemms.mm(quantize_dequantize(a_NK, fmt, -1, rounding), quantize_dequantize(b_EKM, fmt, -2, rounding),
                    offsets_E)


def native_mm(a_NK: Tensor, b_EKM: Tensor, offsets_E: Tensor, fmt: str, rounding: str = "up",
              fast_accum: bool = False) -> Tensor:
    """``Q(a) @ Q(b)`` per group on the fp8 tensor cores (``torch._scaled_grouped_mm``); bf16 out."""
    _check_format(fmt)
    b_EMK = b_EKM.transpose(-2, -1)  # the kernel wants B column-major: quantize [E, M, K] rows along K
    if fmt == "fp8":
        a_data, a_scale = fp8_rowwise(a_NK)  # [N, K], [N, 1]
        b_data, b_scale = fp8_rowwise(b_EMK.contiguous())  # [E, M, K], [E, M, 1]
        a_scale, b_scale = a_scale.squeeze(-1), b_scale.squeeze(-1)  # [N], [E, M]
    else:
        a_data, a_scale = mx_quantize(a_NK.contiguous(), rounding)  # [N, K], [N, K/32]
        b_data, b_scale = mx_quantize(b_EMK.contiguous(), rounding)  # [E, M, K], [E, M, K/32]
        a_scale = grouped_blocked(a_scale, offsets_E)
        b_scale = blocked(b_scale).flatten(1)  # [E, M_pad * B_pad]: one blocked matrix per expert
    return torch._scaled_grouped_mm(a_data, b_data.transpose(-2, -1), a_scale, b_scale, offs=offsets_E,
                                    out_dtype=torch.bfloat16, use_fast_accum=fast_accum and fmt == "fp8")


def _token_major(data_NK: Tensor, rows: int) -> Tensor:
    """E4M3 ``[N, K]`` as a row-major ``[K, rows]`` copy, zero-padded to ``rows`` (16-byte rows)."""
    out = torch.zeros(data_NK.shape[1], rows, dtype=torch.uint8, device=data_NK.device)
    out[:, :data_NK.shape[0]] = data_NK.view(torch.uint8).t()
    return out.view(torch.float8_e4m3fn)


def fp8_group_columns_t(x_NK: Tensor, offsets_E: Tensor, rows: int) -> tuple[Tensor, Tensor]:
    """Per-(group, column) FP8 as ``(data [K, rows] token-major, scale [E, K])``; the Triton kernel
    on CUDA (which writes the transposed layout directly), the torch reference plus a copy elsewhere.
    The two agree on the first ``offsets[-1]`` token rows, all the GEMM reads."""
    if x_NK.is_cuda and _HAS_TRITON:
        from moebench.kernels import fp8_group_triton

        return fp8_group_triton.quantize_group_columns_t(x_NK, offsets_E, rows)
    data_NK, scale_EK = quantize_group_columns(x_NK, offsets_E)
    return _token_major(data_NK, rows), scale_EK


def native_fp8_wgrad(a_NK: Tensor, g_NM: Tensor, offsets_E: Tensor) -> Tensor:
    """``a[rows_e]^T @ g[rows_e]`` per group on the fp8 tensor cores, per-(group, column) scales; bf16 out."""
    rows = -(-a_NK.shape[0] // 16) * 16  # the kernel wants 16-byte aligned rows along the token dim
    a_data, a_scale = fp8_group_columns_t(a_NK, offsets_E, rows)  # [K, rows], [E, K]
    g_data, g_scale = fp8_group_columns_t(g_NM, offsets_E, rows)  # [M, rows], [E, M]
    return torch._scaled_grouped_mm(a_data, g_data.t(), a_scale.flatten(), g_scale.flatten(), offs=offsets_E,
                                    out_dtype=torch.bfloat16)


def _weight_grad(a_NK: Tensor, g_NM: Tensor, offsets_E: Tensor, ctx) -> Tensor:
    gemms = backend_gemms(ctx.backend)
    if ctx.fmt != "fp8":
        return gemms.wgrad(a_NK, g_NM, offsets_E)
    if ctx.impl == "native":
        return native_fp8_wgrad(a_NK, g_NM, offsets_E)
    a_q, g_q = (dequantize_group_columns(*quantize_group_columns(t, offsets_E), offsets_E, dtype=t.dtype)
                for t in (a_NK, g_NM))
    return gemms.wgrad(a_q, g_q, offsets_E)


def _product(a_NK: Tensor, b_EKM: Tensor, offsets_E: Tensor, ctx, fast_accum: bool = False) -> Tensor:
    if ctx.impl == "native":
        return native_mm(a_NK, b_EKM, offsets_E, ctx.fmt, ctx.rounding, fast_accum)
    return emulated_mm(a_NK, b_EKM, offsets_E, ctx.fmt, ctx.rounding, backend_gemms(ctx.backend))


class QuantizedGroupedMM(torch.autograd.Function):
    """The autograd rule of the module docstring around one quantized GEMM implementation."""

    @staticmethod
    def forward(ctx, a_NK: Tensor, b_EKM: Tensor, offsets_E: Tensor, fmt: str, impl: str, rounding: str,
                backend: str) -> Tensor:
        ctx.save_for_backward(a_NK, b_EKM, offsets_E)
        ctx.fmt, ctx.impl, ctx.rounding, ctx.backend = fmt, impl, rounding, backend
        return _product(a_NK, b_EKM, offsets_E, ctx, fast_accum=True)

    @staticmethod
    def backward(ctx, grad_NM: Tensor) -> tuple[Tensor | None, ...]:
        a_NK, b_EKM, offsets_E = ctx.saved_tensors
        grad_NM = grad_NM.contiguous()
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_a = _product(grad_NM, b_EKM.transpose(-2, -1), offsets_E, ctx).to(a_NK.dtype)
        if ctx.needs_input_grad[1]:
            grad_b = _weight_grad(a_NK, grad_NM.to(a_NK.dtype), offsets_E, ctx).to(b_EKM.dtype)
        return grad_a, grad_b, None, None, None, None, None


def quantized_grouped_mm(a_NK: Tensor, b_EKM: Tensor, offsets_E: Tensor, fmt: str, impl: str = "emulated",
                         rounding: str = "up", backend: str = "grouped_mm") -> Tensor:
    """Differentiable quantized ``a[rows_e] @ b[e]`` (see the module docstring)."""
    _check_format(fmt)
    if impl not in IMPLS:
        raise ValueError(f"quantized GEMM impl must be one of {', '.join(IMPLS)}; got {impl!r}")
    mxfp8.check_rounding(rounding)
    return QuantizedGroupedMM.apply(a_NK, b_EKM, offsets_E, fmt, impl, rounding, backend)
