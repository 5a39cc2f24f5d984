"""Slow CPU models of ``torch._scaled_grouped_mm`` (with ``offs`` groups) and ``torch._scaled_mm``, for tests.

Two layouts: 2-D A ``[N, K]`` grouped along rows times 3-D B ``[E, K, M]``; and 2-D x 2-D,
A ``[K, N]`` times B ``[N, M]`` grouped along the reduction dim N, giving ``[E, K, M]``.

It decodes the scales as the kernel's documentation lays them out, element by element and
independently of :mod:`moebench.kernels.scale_layout`, so a test that runs the native path with
this model in place of the kernel checks that moebench prepares operands the kernel reads right:

- fp32 rowwise: ``scale_a [N]`` one per row of A, ``scale_b [E, M]`` one per column of ``B[e]``;
  for 2-D x 2-D one per group and row of A (``[E * K]``, group-major) and per group and column
  of B (``[E * M]``);
- E8M0 blocks of 32 along K, in the blocked layout (cuBLAS "1D block scaling factors"): scale
  ``(i, j)`` at ``tile * 512 + (i % 32) * 16 + ((i % 128) // 32) * 4 + j % 4`` with
  ``tile = (i // 128) * ceil(B / 4) + j // 4``; A's groups start at scale rows rounded up to
  128 per group, ``B[e]``'s scales are one blocked ``[M, K/32]`` matrix per expert.

Before computing it enforces what the real kernel enforces (:func:`check_contract`): the
operator's own shape, stride, dtype and scale checks (torch's meta kernel, run on meta copies of
the operands), then what torch's grouped-GEMM preparation checks once the offsets are known
(``prepare_grouped_gemm_data`` in ``aten/src/ATen/native/cuda/GroupMMCommon.cuh`` for CUTLASS,
``CublasGroupedArgs.cu`` for cuBLASLt): offsets non-decreasing and inside the ragged dim; every
group but the last a multiple of 16 bytes along the ragged dim of each operand that has one (it
binds where that dim is the contiguous one: the token dim of the 2-D x 2-D weight gradient, 16
E4M3 rows; the output's columns of 3-D x 2-D, 8 bf16 columns); in 2-D x 2-D with A row-major
(always so for the scaled op) no empty group (CUTLASS cannot run a zero-length reduction) and,
on cuBLASLt, a ragged dim whose total is a multiple of 16 bytes. On a GPU the per-group rules are
device-side asserts, which poison the CUDA context; here they raise :class:`DeviceAssert`.
"""

from __future__ import annotations

import torch
from torch import Tensor


def blocked_index(i: int, j: int, num_blocks: int) -> int:
    tile = (i // 128) * -(-num_blocks // 4) + j // 4
    return tile * 512 + (i % 32) * 16 + ((i % 128) // 32) * 4 + j % 4


def _e8m0_to_float(scales: Tensor) -> Tensor:
    bits = scales.view(torch.uint8).flatten().to(torch.int32)
    return torch.ldexp(torch.ones(bits.shape), bits - 127)


def _unblock(flat: Tensor, rows: range, first_row: int, num_blocks: int) -> Tensor:
    """``[len(rows), num_blocks]`` scales of matrix rows ``rows``, stored from blocked row ``first_row``."""
    out = torch.empty(len(rows), num_blocks)
    for r in range(len(rows)):
        for j in range(num_blocks):
            out[r, j] = flat[blocked_index(first_row + r, j, num_blocks)]
    return out


def _meta(t: Tensor) -> Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


class DeviceAssert(RuntimeError):
    """What the CUDA kernel would raise as a device-side assert."""


def _group_sizes(offs: Tensor, extent: int) -> list[int]:
    ends = [int(v) for v in offs]
    sizes = [e - s for s, e in zip([0, *ends[:-1]], ends, strict=True)]
    if any(n < 0 for n in sizes):
        raise DeviceAssert(f"expected gemm dimension to be greater or equal 0: offsets {ends}")
    if ends and ends[-1] > extent:
        raise DeviceAssert(f"expected offset to be less than tensor size: offsets {ends}, ragged dim {extent}")
    return sizes


def check_contract(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, offs: Tensor | None,
                   out_dtype: torch.dtype | None) -> None:
    """The real kernel's checks: its meta kernel's and cuBLASLt's host checks (RuntimeError), and
    the per-group rules its preparation kernel asserts on the device (DeviceAssert)."""
    torch.ops.aten._scaled_grouped_mm(_meta(a), _meta(b), _meta(scale_a), _meta(scale_b),
                                      offs=None if offs is None else _meta(offs), out_dtype=out_dtype)
    if offs is None:
        return
    out_size = torch.empty((), dtype=out_dtype or torch.bfloat16).element_size()
    # (what, ragged dim's extent, bytes one step along it moves): A row-major and B column-major
    # (the meta kernel checked), so the ragged dim is contiguous in 2-D x 2-D for both operands
    # and in the output of 3-D x 2-D; elsewhere its stride is a multiple of 16 bytes already.
    if a.ndim == 2 and b.ndim == 2:
        ragged = [("input", a.shape[1], a.stride(1) * a.element_size()),
                  ("input", b.shape[0], b.stride(0) * b.element_size())]
        if (a.shape[1] * a.element_size()) % 16:
            raise RuntimeError("cublasLt grouped GEMM with jagged K not aligned to 16 bytes requires transa=t and "
                               f"transb=n, got transa=n transb=t K={a.shape[1]}")
    elif a.ndim == 2:
        ragged = [("input", a.shape[0], a.stride(0) * a.element_size())]
    else:
        ragged = [("input", b.shape[1], b.stride(1) * b.element_size()), ("output", b.shape[1], out_size)]
    sizes = _group_sizes(offs, ragged[0][1])
    for what, _, step in ragged:
        bad = [(g, n) for g, n in enumerate(sizes[:-1]) if (n * step) % 16]
        if bad:
            raise DeviceAssert(f"expected {what} tensor dynamic dimension byte size to be a non-negative multiple "
                               f"of 16: groups (index, size) {bad}")
    empty = [g for g, n in enumerate(sizes) if n == 0]
    if a.ndim == 2 and b.ndim == 2 and empty:
        raise DeviceAssert(f"expected offsets to be greater than 0: empty groups {empty}")


def scaled_grouped_mm_meta_only(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, offs: Tensor | None = None,
                                bias: Tensor | None = None, scale_result: Tensor | None = None,
                                out_dtype: torch.dtype | None = None, use_fast_accum: bool = False) -> Tensor:
    """The meta kernel's checks and an output of its shape (zeros): never reads the offsets, so a
    test can prove the code around the kernel free of host syncs."""
    out = torch.ops.aten._scaled_grouped_mm(_meta(a), _meta(b), _meta(scale_a), _meta(scale_b),
                                            offs=None if offs is None else _meta(offs), out_dtype=out_dtype)
    return torch.zeros(out.shape, dtype=out.dtype, device=a.device)


def scaled_grouped_mm_model(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, offs: Tensor | None = None,
                            bias: Tensor | None = None, scale_result: Tensor | None = None,
                            out_dtype: torch.dtype | None = None, use_fast_accum: bool = False) -> Tensor:
    assert a.dtype == b.dtype == torch.float8_e4m3fn and a.ndim == 2 and offs is not None
    check_contract(a, b, scale_a, scale_b, offs, out_dtype)
    assert bias is None and scale_result is None
    a_f, b_f = a.float(), b.float()
    ends = [int(v) for v in offs]
    starts = [0, *ends[:-1]]
    if b.ndim == 2:  # groups along the reduction dim, rowwise scales per group
        k, m, groups = a.shape[0], b.shape[1], len(ends)
        sa, sb = scale_a.view(groups, k), scale_b.view(groups, m)
        out = torch.stack([(a_f[:, s:e] * sa[g][:, None]) @ (b_f[s:e] * sb[g][None, :])
                           for g, (s, e) in enumerate(zip(starts, ends, strict=True))])
        return out.to(out_dtype or torch.bfloat16)
    n, k = a.shape
    e, _, m = b.shape
    if scale_a.dtype == torch.float32:
        a_f = a_f * scale_a[:, None]
        b_f = b_f * scale_b[:, None, :]
    else:
        blocks = k // 32
        flat_a = _e8m0_to_float(scale_a)
        scales_a = torch.ones(n, blocks)
        padded_row = 0
        for start, end in zip(starts, ends, strict=True):
            scales_a[start:end] = _unblock(flat_a, range(start, end), padded_row, blocks)
            padded_row += -(-(end - start) // 128) * 128
        a_f = a_f * scales_a.repeat_interleave(32, dim=1)
        for g in range(e):
            scales_b = _unblock(_e8m0_to_float(scale_b[g]), range(m), 0, blocks)  # [M, K/32]
            b_f[g] = b_f[g] * scales_b.t().repeat_interleave(32, dim=0)
    out = torch.zeros(n, m)
    for g, (start, end) in enumerate(zip(starts, ends, strict=True)):
        out[start:end] = a_f[start:end] @ b_f[g]
    return out.to(out_dtype or torch.bfloat16)


def scaled_mm_model(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, bias: Tensor | None = None,
                    scale_result: Tensor | None = None, out_dtype: torch.dtype | None = None,
                    use_fast_accum: bool = False) -> Tensor:
    """``torch._scaled_mm`` of A ``[T, K]`` (row-major) and B ``[K, M]`` (column-major): fp32 rowwise
    scales ``scale_a [T, 1]`` and ``scale_b [1, M]``, or E8M0 blocks of 32 along K in the blocked
    layout, A's ``[T, K/32]`` and B's ``[M, K/32]`` (one row per column of B), each flattened.
    torch's meta kernel checks the call first (shapes, strides, scale shapes and dtypes)."""
    torch.ops.aten._scaled_mm(_meta(a), _meta(b), _meta(scale_a), _meta(scale_b), out_dtype=out_dtype)
    assert a.dtype == b.dtype == torch.float8_e4m3fn and a.ndim == b.ndim == 2
    assert a.stride(1) == 1 and b.stride(0) == 1, "A row-major, B column-major"
    assert bias is None and scale_result is None
    (t, k), m = a.shape, b.shape[1]
    a_f, b_f = a.float(), b.float()
    if scale_a.dtype == torch.float32:
        assert scale_a.shape == (t, 1) and scale_b.shape == (1, m)
        return ((a_f * scale_a) @ (b_f * scale_b)).to(out_dtype or torch.bfloat16)
    blocks = k // 32
    scales_a = _unblock(_e8m0_to_float(scale_a), range(t), 0, blocks)  # [T, K/32]
    scales_b = _unblock(_e8m0_to_float(scale_b), range(m), 0, blocks)  # [M, K/32]
    a_f = a_f * scales_a.repeat_interleave(32, dim=1)
    b_f = b_f * scales_b.t().repeat_interleave(32, dim=0)
    return (a_f @ b_f).to(out_dtype or torch.bfloat16)
