"""FP8 rowwise quantization (E4M3, one fp32 scale per row along the reduction dimension).

Shapes: ``x`` any ``[..., K]`` tensor quantized along ``dim`` (the GEMM's reduction dimension).

``x ~= data * scale`` with ``scale = 2**s``, ``s = ceil(log2(amax / 448))`` per row: the same
exact power-of-two "round up" rule as MXFP8's default (see :mod:`moebench.kernels.mxfp8`), so
dequantization is exact scaling and nothing saturates. Power-of-two scales are what torchao's
rowwise recipe uses too. All-zero rows get scale ``2**-127``.

NaN/Inf policy (same as MXFP8): a row with any NaN or +-Inf gets a NaN scale and dequantizes to
NaN in full.

Per-group columns (:func:`quantize_group_columns`): for a weight-gradient GEMM the reduction
dim is the token dim, split into expert groups by offsets, so each (group, column) pair gets
its own scale: ``[N, K]`` rows of group g are scaled by ``scale[g]``. Padding rows past
``offsets[-1]`` belong to no group and quantize to zero.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moebench.kernels.groups import group_of_rows
from moebench.kernels.mxfp8 import scale_exponent, scale_to_e4m3


def quantize_rowwise(x: Tensor, dim: int = -1) -> tuple[Tensor, Tensor]:
    """``(data float8_e4m3fn like x, scale fp32 with dim kept as size 1)``; ``x ~= data * scale``."""
    if not x.is_floating_point():
        raise ValueError(f"fp8 quantizes floating-point tensors; got {x.dtype}")
    xf = x.float()
    data, s, finite = scale_to_e4m3(xf, xf.abs().amax(dim=dim, keepdim=True), "up")
    return data, _power_of_two_scales(s, finite)


def _power_of_two_scales(s: Tensor, finite: Tensor) -> Tensor:
    """fp32 ``2**s``, NaN where the scaled values were not finite."""
    scale = torch.ldexp(torch.ones_like(s, dtype=torch.float32), s)
    return torch.where(finite, scale, torch.full_like(scale, float("nan")))


def quantize_group_columns(x_NK: Tensor, offsets_E: Tensor, chunk_rows: int | None = None) -> tuple[Tensor, Tensor]:
    """``(data float8_e4m3fn [N, K], scale fp32 [E, K])``: one scale per expert group and column.

    ``chunk_rows``: work through the rows this many at a time (the same result), so the fp32
    intermediates are those of one slice, not of all of ``x``.
    """
    if not x_NK.is_floating_point():
        raise ValueError(f"fp8 quantizes floating-point tensors; got {x_NK.dtype}")
    n, num_groups = x_NK.shape[0], offsets_E.numel()
    step = chunk_rows or max(n, 1)
    # segments: the E groups, then the padding rows past offsets[-1]
    ends = torch.cat([offsets_E.to(torch.int64), offsets_E.new_full((1,), n, dtype=torch.int64)])
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    # rows are sorted by group: one segmented max per (group, column) and slice, no atomics.
    # NaN propagates, Inf stays Inf, an empty group gives 0.
    amax = x_NK.new_zeros(num_groups + 1, x_NK.shape[1], dtype=torch.float32)
    for c0 in range(0, n, step):
        c1 = min(c0 + step, n)
        lengths = ends.clamp(c0, c1) - starts.clamp(c0, c1)
        part = torch.segment_reduce(x_NK[c0:c1].float().abs(), "max", lengths=lengths, axis=0, unsafe=True,
                                    initial=0.0)
        amax = torch.maximum(amax, part)
    group_N = group_of_rows(offsets_E, n)
    data = [scale_to_e4m3(x_NK[c0:c0 + step].float(), amax[group_N[c0:c0 + step]], "up")[0]
            for c0 in range(0, n, step)]
    amax = amax[:num_groups]
    finite = torch.isfinite(amax)
    scale = _power_of_two_scales(scale_exponent(torch.where(finite, amax, 0.0), "up"), finite)
    if not data:
        return torch.empty_like(x_NK, dtype=torch.float8_e4m3fn), scale
    return torch.cat([d.view(torch.uint8) for d in data]).view(torch.float8_e4m3fn), scale


def dequantize_group_columns(data: Tensor, scale: Tensor, offsets_E: Tensor,
                             dtype: torch.dtype = torch.float32, chunk_rows: int | None = None) -> Tensor:
    """Inverse of :func:`quantize_group_columns`; padding rows come back as zeros."""
    padded = torch.cat([scale, scale.new_zeros(1, scale.shape[1])])
    group_N = group_of_rows(offsets_E, data.shape[0])
    if chunk_rows is None:
        return (data.float() * padded[group_N]).to(dtype)
    out = torch.empty(data.shape, dtype=dtype, device=data.device)
    for d, g, o in zip(data.split(chunk_rows), group_N.split(chunk_rows), out.split(chunk_rows), strict=True):
        o.copy_(d.float() * padded[g])
    return out


def dequantize_rowwise(data: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    return (data.float() * scale).to(dtype)


def fake_quantize_rowwise(x: Tensor, dim: int = -1) -> Tensor:
    """``dequantize_rowwise(quantize_rowwise(x, dim))`` in ``x``'s dtype."""
    return dequantize_rowwise(*quantize_rowwise(x, dim), dtype=x.dtype)
