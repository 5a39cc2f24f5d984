"""FP8 rowwise quantization (E4M3, one fp32 scale per row along the reduction dimension).

Shapes: ``x`` any ``[..., K]`` tensor quantized along ``dim`` (the GEMM's reduction dimension).

``x ~= data * scale`` with ``scale = 2**s``, ``s = ceil(log2(amax / 448))`` per row: the same
exact power-of-two "round up" rule as MXFP8's default (see :mod:`moebench.kernels.mxfp8`), so
dequantization is exact scaling and nothing saturates. Power-of-two scales are what torchao's
rowwise recipe uses too. All-zero rows get scale ``2**-127``.

NaN/Inf policy (same as MXFP8): a row with any NaN or +-Inf gets a NaN scale and dequantizes to
NaN in full.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moebench.kernels.mxfp8 import scale_to_e4m3


def quantize_rowwise(x: Tensor, dim: int = -1) -> tuple[Tensor, Tensor]:
    """``(data float8_e4m3fn like x, scale fp32 with dim kept as size 1)``; ``x ~= data * scale``."""
    if not x.is_floating_point():
        raise ValueError(f"fp8 quantizes floating-point tensors; got {x.dtype}")
    xf = x.float()
    data, s, finite = scale_to_e4m3(xf, xf.abs().amax(dim=dim, keepdim=True), "up")
    scale = torch.ldexp(torch.ones_like(s, dtype=torch.float32), s)
    scale = torch.where(finite, scale, torch.full_like(scale, float("nan")))
    return data, scale


def dequantize_rowwise(data: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    return (data.float() * scale).to(dtype)


def fake_quantize_rowwise(x: Tensor, dim: int = -1) -> Tensor:
    """``dequantize_rowwise(quantize_rowwise(x, dim))`` in ``x``'s dtype."""
    return dequantize_rowwise(*quantize_rowwise(x, dim), dtype=x.dtype)
