"""Triton MXFP8 quantize kernel; the twin of :func:`moebench.kernels.mxfp8.quantize`.

Shapes: ``x`` viewed as ``[R, D]`` rows; G = R * D / 32 blocks of 32, BLOCK_G blocks per program.

The exponent arithmetic works on the fp32 bit pattern, so it is exact and matches the torch
reference bit for bit: ``floor(log2(amax))`` is the biased exponent field minus 127, and
``amax / 2**(e - 8) > 448`` holds exactly when the 23-bit mantissa field exceeds ``0x600000``
(1.75 = 448 / 2**8). A subnormal or zero ``amax`` clamps to ``s = -127`` in both modes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from moebench.kernels.mxfp8 import BLOCK, check_last_dim, check_rounding


@triton.jit
def _e4m3_bits(v):
    """fp32 -> E4M3FN bit pattern (uint8), round to nearest even, saturating at +-448, NaN -> 0x7F.

    Written out in integer arithmetic rather than ``v.to(tl.float8e4nv)`` because the Triton
    interpreter's float conversion mishandles E4M3 subnormal outputs; the hardware cast and this
    agree on every finite input.
    """
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    a = bits & 0x7FFFFFFF
    is_nan = a > 0x7F800000
    a = tl.minimum(a, 0x43E00000)  # 448.0: saturate (Inf included)
    exp = a >> 23
    # Normal E4M3 (|v| >= 2**-6, fp32 exponent field >= 121): keep 3 mantissa bits, RTNE; a
    # mantissa carry rolls into the exponent, which is the right answer.
    normal = (a + 0x7FFFF + ((a >> 20) & 1)) >> 20
    normal = normal - (120 << 3)
    # Subnormal E4M3: the code is round(|v| * 2**9); code 8 is the smallest normal, 2**-6.
    m = (a & 0x7FFFFF) | 0x800000
    sh = tl.minimum(141 - exp, 31)
    q = m >> sh
    rem = m & ((1 << sh) - 1)
    half = 1 << (sh - 1)
    q = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    q = tl.where(exp == 0, 0, q)  # fp32 subnormals are far below 2**-10
    mag = tl.where(exp >= 121, normal, q)
    mag = tl.where(is_nan, 0x7F, mag)
    return ((sign << 7) | mag).to(tl.uint8)


@triton.jit
def scale_exponent(amax, has_nan, ROUND_UP: tl.constexpr):
    """``(s, non_finite)`` per group from its fp32 ``amax`` (``has_nan``: NaN is tracked on its own,
    as a max may drop it): ``s = floor(log2(amax)) - 8``, plus one where rounding up and
    ``amax / 2**s > 448`` (mantissa field above ``0x600000``); -127 for a zero or subnormal amax and
    for non-finite groups (as the reference does; their NaN scale voids them anyway)."""
    bits = amax.to(tl.int32, bitcast=True)
    biased = (bits >> 23) & 0xFF
    non_finite = (biased == 255) | has_nan  # an Inf (or a kept NaN) makes the field 255
    s = biased - 127 - 8
    if ROUND_UP:
        s = s + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    s = tl.where(biased == 0, -127, s)
    s = tl.minimum(tl.maximum(s, -127), 127)
    return tl.where(non_finite, -127, s), non_finite


@triton.jit
def _mxfp8_quantize_kernel(x_ptr, data_ptr, scale_ptr, num_blocks,
                           ROUND_UP: tl.constexpr, BF16_BITS: tl.constexpr, BLOCK_G: tl.constexpr):
    pid = tl.program_id(0)
    g = pid * BLOCK_G + tl.arange(0, BLOCK_G)  # block ids
    j = tl.arange(0, 32)
    mask_g = g < num_blocks
    offs = g.to(tl.int64)[:, None] * 32 + j[None, :]
    if BF16_BITS:  # bf16 passed as int16: widening is a 16-bit shift (exact, also for subnormals)
        x = (tl.load(x_ptr + offs, mask=mask_g[:, None], other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        x = tl.load(x_ptr + offs, mask=mask_g[:, None], other=0.0).to(tl.float32)

    amax = tl.max(tl.abs(x), axis=1)  # [BLOCK_G]
    s, non_finite = scale_exponent(amax, tl.sum((x != x).to(tl.int32), axis=1) > 0, ROUND_UP)
    inv_scale = ((127 - s) << 23).to(tl.float32, bitcast=True)  # 2**-s; 127 - s in [1, 254]

    scaled = x * inv_scale[:, None]  # exact: power-of-two scaling
    tl.store(data_ptr + offs, _e4m3_bits(scaled), mask=mask_g[:, None])
    scale_bits = tl.where(non_finite, 255, s + 127)
    tl.store(scale_ptr + g, scale_bits.to(tl.uint8), mask=mask_g)


def quantize(x: Tensor, rounding: str = "up", block_g: int = 64) -> tuple[Tensor, Tensor]:
    """Same contract as :func:`moebench.kernels.mxfp8.quantize` (fp32/bf16/fp16 input)."""
    check_last_dim(x)  # also rejects integer tensors, which the kernel would quantize as numbers
    check_rounding(rounding)
    x = x.contiguous()
    data = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    scales = torch.empty((*x.shape[:-1], x.shape[-1] // BLOCK), dtype=torch.uint8, device=x.device)
    num_blocks = scales.numel()
    if num_blocks:
        grid = (triton.cdiv(num_blocks, block_g),)
        bf16 = x.dtype == torch.bfloat16
        _mxfp8_quantize_kernel[grid](x.view(torch.int16) if bf16 else x, data, scales, num_blocks,
                                     ROUND_UP=rounding == "up", BF16_BITS=bf16, BLOCK_G=block_g)
    return data.view(torch.float8_e4m3fn), scales.view(torch.float8_e8m0fnu)
