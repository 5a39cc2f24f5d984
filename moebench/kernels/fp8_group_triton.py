"""Triton FP8 per-(group, column) quantize for the weight-gradient GEMM, written token-major.

The twin of :func:`moebench.kernels.fp8.quantize_group_columns` followed by the transposed,
zero-padded copy that ``torch._scaled_grouped_mm`` wants for the weight gradient
(``quantized_gemm._token_major``).

Legend: N expert-sorted rows (tokens; rows past ``offsets[-1]`` are padding), K columns, E
groups (experts), ``rows`` the token dim of the output (N rounded up to 16 by the caller).

Two kernels, both reading the int32 offsets on the device (no host sync; grids from shapes):

- ``_group_amax_kernel``, programs over (column blocks, groups): walks the group's rows for the
  column maxima and NaN counts and stores the scale ``[E, K]`` as fp32 bits (``2**-127`` is the
  subnormal ``0x00400000``, a non-finite (group, column) torch's NaN ``0x7FC00000``).
- ``_group_cast_t_kernel``, programs over (row tiles, column blocks): finds each row's group
  by counting the offsets at or below it, scales by ``2**-s`` decoded from the stored bits and
  writes the ``[K, rows]`` E4M3 tile transposed; padding rows and rows past N come out zero.

So ``x`` is read twice and the data written once, where the torch path makes about six
passes over ``[N, K]`` and then copies the result again to transpose it.

Bit-exact with the reference: the exponent comes from the fp32 bits of the maximum
(:func:`moebench.kernels.mxfp8_triton.scale_exponent`), power-of-two scaling is exact, and E4M3
is encoded in integer arithmetic (:func:`moebench.kernels.mxfp8_triton._e4m3_bits`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from moebench.kernels.fp8_triton import _load_row_chunk, fp32_scale_bits
from moebench.kernels.mxfp8_triton import _e4m3_bits, scale_exponent

# amax pass: 32 rows x 128 columns per step (256-byte bf16 row segments); cast pass: 128 token
# rows x 64 columns, so each output row of the [K, rows] buffer gets 128 contiguous bytes.
_AMAX_BLOCK_R, _AMAX_BLOCK_K = 32, 128
_CAST_BLOCK_R, _CAST_BLOCK_K = 128, 64
_NUM_WARPS = 4


@triton.jit
def _group_amax_kernel(x_ptr, offs_ptr, scale_bits_ptr, N, K,
                       BF16_BITS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_k = tl.program_id(0)
    g = tl.program_id(1)
    row_end = tl.minimum(tl.load(offs_ptr + g), N)
    row_start = tl.load(offs_ptr + g - 1, mask=g > 0, other=0)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_k = cols < K

    amax = tl.zeros([BLOCK_K], dtype=tl.float32)  # an empty group keeps 0: scale 2**-127
    nan_count = tl.zeros([BLOCK_K], dtype=tl.int32)
    for r0 in range(row_start, row_end, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        mask = (r < row_end)[:, None] & mask_k[None, :]
        x = _load_row_chunk(x_ptr, r.to(tl.int64)[:, None] * K + cols[None, :], mask, BF16_BITS)
        amax = tl.maximum(amax, tl.max(tl.abs(x), axis=0))
        nan_count += tl.sum((x != x).to(tl.int32), axis=0)

    s, non_finite = scale_exponent(amax, nan_count > 0, True)  # ceil(log2(amax / 448)), exact
    tl.store(scale_bits_ptr + g.to(tl.int64) * K + cols, fp32_scale_bits(s, non_finite), mask=mask_k)


@triton.jit
def _group_cast_t_kernel(x_ptr, offs_ptr, scale_bits_ptr, data_t_ptr, N, K, E, rows,
                         E_POW2: tl.constexpr, BF16_BITS: tl.constexpr,
                         BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_k = cols < K

    # Each row's group: how many group ends are at or below it (E for padding rows).
    e_idx = tl.arange(0, E_POW2)
    ends = tl.load(offs_ptr + e_idx, mask=e_idx < E, other=0)
    at_or_below = (ends[None, :] <= r[:, None]) & (e_idx < E)[None, :]
    group = tl.sum(at_or_below.to(tl.int32), axis=1)
    in_group = (group < E) & (r < N)

    mask = in_group[:, None] & mask_k[None, :]
    x = _load_row_chunk(x_ptr, r.to(tl.int64)[:, None] * K + cols[None, :], mask, BF16_BITS)
    bits = tl.load(scale_bits_ptr + group.to(tl.int64)[:, None] * K + cols[None, :], mask=mask, other=0)
    # 2**-s from the scale bits: exponent field 254 - (s + 127); s = -127 for 2**-127 (field 0)
    # and for NaN scales (field 255), as the reference scales a non-finite group.
    biased = (bits >> 23) & 0xFF
    inv_scale = (tl.where((biased == 0) | (biased == 255), 254, 254 - biased) << 23).to(tl.float32, bitcast=True)
    q = tl.where(mask, _e4m3_bits(x * inv_scale), 0).to(tl.uint8)

    out = data_t_ptr + cols.to(tl.int64)[None, :] * rows + r[:, None]
    tl.store(out, q, mask=(r < rows)[:, None] & mask_k[None, :])


def quantize_group_columns_t(x_NK: Tensor, offsets_E: Tensor, rows: int) -> tuple[Tensor, Tensor]:
    """``(data_t float8_e4m3fn [K, rows], scale fp32 [E, K])``: one power-of-two scale per
    (expert group, column), the data transposed to token-major rows.

    ``data_t[:, :offsets[-1]]`` is ``fp8.quantize_group_columns(x_NK, offsets_E)[0].t()`` bit for
    bit and the rest is zero; the scale equals the reference's (NaN and ``2**-127`` bits too).
    ``rows >= N`` is the padded token dim (the fp8 GEMM wants 16-byte rows).
    """
    if not x_NK.is_floating_point():
        raise ValueError(f"fp8 quantizes floating-point tensors; got {x_NK.dtype}")
    if x_NK.ndim != 2:
        raise ValueError(f"per-group column quantize expects x [N, K]; got shape {tuple(x_NK.shape)}")
    if offsets_E.ndim != 1 or offsets_E.numel() == 0:
        raise ValueError(f"offsets must be a non-empty 1-D tensor; got shape {tuple(offsets_E.shape)}")
    n, k = x_NK.shape
    if rows < n:
        raise ValueError(f"rows ({rows}) must be at least the number of rows of x ({n})")
    if x_NK.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        x_NK = x_NK.float()  # the kernels read fp32, bf16 and fp16; this cast is the reference's own
    x_NK = x_NK.contiguous()
    offsets_E = offsets_E.to(device=x_NK.device, dtype=torch.int32)
    e = offsets_E.numel()
    data_t = torch.empty(k, rows, dtype=torch.uint8, device=x_NK.device)
    scale = torch.empty(e, k, dtype=torch.float32, device=x_NK.device)
    if k:
        bf16 = x_NK.dtype == torch.bfloat16
        x_arg = x_NK.view(torch.int16) if bf16 else x_NK
        _group_amax_kernel[(triton.cdiv(k, _AMAX_BLOCK_K), e)](
            x_arg, offsets_E, scale.view(torch.int32), n, k,
            BF16_BITS=bf16, BLOCK_R=_AMAX_BLOCK_R, BLOCK_K=_AMAX_BLOCK_K, num_warps=_NUM_WARPS)
        if rows:
            _group_cast_t_kernel[(triton.cdiv(rows, _CAST_BLOCK_R), triton.cdiv(k, _CAST_BLOCK_K))](
                x_arg, offsets_E, scale.view(torch.int32), data_t, n, k, e, rows,
                E_POW2=triton.next_power_of_2(e), BF16_BITS=bf16,
                BLOCK_R=_CAST_BLOCK_R, BLOCK_K=_CAST_BLOCK_K, num_warps=_NUM_WARPS)
    return data_t.view(torch.float8_e4m3fn), scale
