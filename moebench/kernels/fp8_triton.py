"""Triton FP8 rowwise quantize kernel; the twin of :func:`moebench.kernels.fp8.quantize_rowwise` (``dim=-1``).

Shapes: ``x`` viewed as ``[R, K]`` contiguous rows, quantized along K; each program owns BLOCK_R
rows and walks K in BLOCK_K chunks.

The torch reference makes about six elementwise passes over ``[R, K]`` (cast, abs, amax, ldexp,
clamp, cast); this reads ``x`` once for the row maxima and once for the cast (once in all when a
row fits in one chunk, the second read then comes from registers) and writes the data once.

Bit-exact with the reference: the scale exponent comes from the fp32 bits of the row maximum as
in :mod:`moebench.kernels.mxfp8_triton` (``floor(log2(amax))`` is the exponent field minus 127;
``amax / 2**(e - 8) > 448`` holds exactly when the mantissa field exceeds ``0x600000``), scaling
by ``2**-s`` is exact, and E4M3 is encoded in integer arithmetic by
:func:`moebench.kernels.mxfp8_triton._e4m3_bits` (the interpreter's fp8 cast mishandles
subnormals). The scale is stored as fp32 bits: ``2**-127`` is an fp32 subnormal.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from moebench.kernels.mxfp8_triton import _e4m3_bits, scale_exponent

_TILE = 4096  # elements per program: rows shorter than a chunk are batched BLOCK_R at a time
_NUM_WARPS = 8  # 16 elements per thread at a full tile: one 16-byte load each (bf16), four (fp32)


@triton.jit
def _load_row_chunk(x_ptr, offs, mask, BF16_BITS: tl.constexpr):
    if BF16_BITS:  # bf16 passed as int16: widening is a 16-bit shift (exact, also for subnormals)
        return (tl.load(x_ptr + offs, mask=mask, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def fp32_scale_bits(s, non_finite):
    """The fp32 bits of ``2**s``: exponent field ``s + 127``, except ``2**-127``, the subnormal
    ``0x00400000``; NaN (torch's ``0x7FC00000``) where the scaled values were not finite."""
    scale_bits = tl.where(s == -127, 0x00400000, (s + 127) << 23)
    return tl.where(non_finite, 0x7FC00000, scale_bits)


@triton.jit
def _fp8_rowwise_kernel(x_ptr, data_ptr, scale_bits_ptr, num_rows, K,
                        BF16_BITS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                        ONE_CHUNK: tl.constexpr):
    pid = tl.program_id(0)
    r = pid * BLOCK_R + tl.arange(0, BLOCK_R)  # row ids
    mask_r = r < num_rows
    row_start = r.to(tl.int64)[:, None] * K
    cols = tl.arange(0, BLOCK_K)[None, :]

    if ONE_CHUNK:
        mask = mask_r[:, None] & (cols < K)
        x = _load_row_chunk(x_ptr, row_start + cols, mask, BF16_BITS)
        amax = tl.max(tl.abs(x), axis=1)
        nan_count = tl.sum((x != x).to(tl.int32), axis=1)
    else:
        amax = tl.zeros([BLOCK_R], dtype=tl.float32)
        nan_count = tl.zeros([BLOCK_R], dtype=tl.int32)
        for k0 in range(0, K, BLOCK_K):
            mask = mask_r[:, None] & (k0 + cols < K)
            xk = _load_row_chunk(x_ptr, row_start + k0 + cols, mask, BF16_BITS)
            amax = tl.maximum(amax, tl.max(tl.abs(xk), axis=1))
            nan_count += tl.sum((xk != xk).to(tl.int32), axis=1)

    s, non_finite = scale_exponent(amax, nan_count > 0, True)  # ceil(log2(amax / 448)), exact
    inv_scale = ((127 - s) << 23).to(tl.float32, bitcast=True)  # 2**-s; s <= 120, so 127 - s in [7, 254]

    if ONE_CHUNK:
        tl.store(data_ptr + row_start + cols, _e4m3_bits(x * inv_scale[:, None]), mask=mask)
    else:
        for k0 in range(0, K, BLOCK_K):
            mask = mask_r[:, None] & (k0 + cols < K)
            xk = _load_row_chunk(x_ptr, row_start + k0 + cols, mask, BF16_BITS)
            tl.store(data_ptr + row_start + k0 + cols, _e4m3_bits(xk * inv_scale[:, None]), mask=mask)

    tl.store(scale_bits_ptr + r, fp32_scale_bits(s, non_finite), mask=mask_r)


def quantize_rowwise(x: Tensor, block_k: int = 4096) -> tuple[Tensor, Tensor]:
    """``(data float8_e4m3fn [..., K], scale fp32 [..., 1])``, ``x ~= data * scale``, rows along the last dim.

    Same contract as ``moebench.kernels.fp8.quantize_rowwise(x, dim=-1)``. ``block_k`` (a power of
    two) is the chunk of a row held at once; rows up to that length are read once.
    """
    if not x.is_floating_point():
        raise ValueError(f"fp8 quantizes floating-point tensors; got {x.dtype}")
    if x.ndim == 0 or x.shape[-1] == 0:
        raise ValueError(f"fp8 rowwise needs a non-empty last dimension; got shape {tuple(x.shape)}")
    if block_k < 1 or block_k & (block_k - 1):
        raise ValueError(f"block_k must be a power of two; got {block_k}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        x = x.float()  # the kernel reads fp32, bf16 and fp16; this cast is the reference's own
    x = x.contiguous()
    k = x.shape[-1]
    data = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    scale = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)
    num_rows = scale.numel()
    if num_rows:
        chunk = min(triton.next_power_of_2(k), block_k)
        block_r = max(1, _TILE // chunk)
        bf16 = x.dtype == torch.bfloat16
        _fp8_rowwise_kernel[(triton.cdiv(num_rows, block_r),)](
            x.view(torch.int16) if bf16 else x, data, scale.view(torch.int32), num_rows, k,
            BF16_BITS=bf16, BLOCK_R=block_r, BLOCK_K=chunk, ONE_CHUNK=k <= chunk, num_warps=_NUM_WARPS)
    return data.view(torch.float8_e4m3fn), scale
