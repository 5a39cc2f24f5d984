"""Triton grouped GEMM over an expert-sorted buffer, and the ``triton`` expert backend
(:func:`experts_triton`, chosen by name through :mod:`moebench.kernels.expert_backends`).

Shapes: M buffer rows (expert-sorted), K reduction dim, N output dim, E experts.
Groups: ``offsets_E`` int32 cumulative row ends (``offsets[e]`` ends expert e's rows); rows past
``offsets[-1]`` are padding.

Kernels (all read the offsets on the device; nothing syncs to the host):

- ``_grouped_mm_kernel``: ``C[rows_e] = A[rows_e] @ B[e]`` with ``A [M, K]``, ``B [E, K, N]`` given
  by strides, so the same kernel computes the forward (``B = W``) and the input gradient
  (``B = W^T``, a strided view). Program ids along M enumerate every expert's row tiles, then
  the padding tiles, whose output rows are written as zeros (so a gradient never carries
  uninitialised memory). The tile -> expert map is a prefix sum over per-expert tile counts,
  done in registers by each program (E is at most a few hundred).
- ``_grouped_wgrad_kernel``: ``dB[e] = A[rows_e]^T @ G[rows_e]`` (``[E, K, N]``), one program per
  (expert, output tile), looping over that expert's rows; an empty expert gets zeros.

Both run inside ``torch.library.triton_op``s (``moebench::triton_grouped_mm`` and its wgrad), so
``torch.compile`` traces the launches into one graph with the rest of the block.

Accumulation is fp32; outputs take the input dtype. Hopper autotune configs; under
``TRITON_INTERPRET=1`` one small config (the interpreter runs every config it is given).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from moebench.kernels.grouped_mm_op import register_grouped_autograd
from moebench.kernels.swiglu import expert_activation

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _mm_configs() -> list[triton.Config]:
    if _INTERPRET:
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16}, num_warps=4, num_stages=1)]
    # H100/H200 (SM90): 128x128/128x256 tiles with 64-wide K and 3-4 stages are the usual winners
    # for bf16; 64-row tiles help when experts hold few rows.
    # Kept short: every config is compiled and timed once per (N, K, E) key on first use.
    shapes = [(128, 256, 64, 3, 8), (128, 128, 64, 4, 8), (128, 128, 64, 3, 4), (64, 256, 64, 4, 8),
              (64, 128, 64, 4, 4)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k}, num_stages=s, num_warps=w)
            for m, n, k, s, w in shapes]


def _wgrad_configs() -> list[triton.Config]:
    if _INTERPRET:
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16}, num_warps=4, num_stages=1)]
    shapes = [(128, 128, 64, 3, 8), (128, 128, 32, 4, 4), (128, 256, 64, 3, 8)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k}, num_stages=s, num_warps=w)
            for m, n, k, s, w in shapes]


@triton.autotune(configs=_mm_configs(), key=["N", "K", "E"])
@triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})
@triton.jit
def _grouped_mm_kernel(a_ptr, b_ptr, c_ptr, offs_ptr, M, N, K, E,
                       stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_cn,
                       E_POW2: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # N tiles vary fastest: the programs of one row tile run together and share its A rows in
    # L2, and consecutive row tiles of one expert reuse that expert's B from L2.
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // tiles_n
    pid_n = pid % tiles_n

    # Which expert (or the padding tail) owns row tile pid_m.
    e_idx = tl.arange(0, E_POW2)
    ends = tl.load(offs_ptr + e_idx, mask=e_idx < E, other=0)
    starts = tl.load(offs_ptr + e_idx - 1, mask=(e_idx >= 1) & (e_idx < E), other=0)
    counts = tl.where(e_idx < E, ends - starts, 0)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    tile_end = tl.cumsum(tiles, 0)
    total_tiles = tl.sum(tiles, 0)
    group = tl.sum((tile_end <= pid_m).to(tl.int32), 0)
    hit = e_idx == group
    in_group = pid_m < total_tiles
    last = tl.max(ends, 0)
    m_start = tl.where(in_group, tl.sum(tl.where(hit, starts + (pid_m - (tile_end - tiles)) * BLOCK_M, 0), 0),
                       last + (pid_m - total_tiles) * BLOCK_M)
    m_end = tl.where(in_group, tl.sum(tl.where(hit, ends, 0), 0), M)
    k_iters = tl.where(in_group, tl.cdiv(K, BLOCK_K), 0)  # padding tiles: no work, store zeros

    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < m_end
    mask_n = offs_n < N
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + rk[None, :] * stride_ak
    b_ptrs = b_ptr + group.to(tl.int64) * stride_be + rk[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(0, k_iters):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=mask_n[None, :], other=0.0)
        else:
            k_mask = rk + i * BLOCK_K < K
            a = tl.load(a_ptrs, mask=mask_m[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_mask[:, None] & mask_n[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.autotune(configs=_wgrad_configs(), key=["N", "K", "E"])
@triton.jit
def _grouped_wgrad_kernel(a_ptr, g_ptr, c_ptr, offs_ptr, N, K, E,
                          stride_am, stride_ak, stride_gm, stride_gn, stride_ce, stride_ck, stride_cn,
                          IEEE: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # Output tile [BLOCK_M (over K), BLOCK_N (over N)] of expert e; the loop runs over rows.
    pid = tl.program_id(0)
    e = tl.program_id(1)
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid_k = pid // tiles_n
    pid_n = pid % tiles_n
    row_end = tl.load(offs_ptr + e)
    row_start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0)

    offs_k = pid_k * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_k = offs_k < K
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(row_start, row_end, BLOCK_K):
        rows = r0 + tl.arange(0, BLOCK_K)
        mask_r = rows < row_end
        rows64 = rows.to(tl.int64)
        a_t = tl.load(a_ptr + rows64[None, :] * stride_am + offs_k[:, None] * stride_ak,
                      mask=mask_k[:, None] & mask_r[None, :], other=0.0)
        g = tl.load(g_ptr + rows64[:, None] * stride_gm + offs_n[None, :] * stride_gn,
                    mask=mask_r[:, None] & mask_n[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(a_t, g, acc, input_precision="ieee")
        else:
            acc = tl.dot(a_t, g, acc)
    c_ptrs = c_ptr + e.to(tl.int64) * stride_ce + offs_k[:, None] * stride_ck + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_k[:, None] & mask_n[None, :])


def _check(a_MK: Tensor, b_EKN: Tensor, offsets_E: Tensor) -> None:
    if a_MK.ndim != 2 or b_EKN.ndim != 3 or a_MK.shape[1] != b_EKN.shape[1]:
        raise ValueError(
            f"grouped_mm expects a [M, K] and b [E, K, N]; got {tuple(a_MK.shape)} and {tuple(b_EKN.shape)}"
        )
    if offsets_E.ndim != 1 or offsets_E.numel() != b_EKN.shape[0]:
        raise ValueError(f"offsets must hold one entry per expert ({b_EKN.shape[0]}); got {tuple(offsets_E.shape)}")
    if a_MK.dtype != b_EKN.dtype:
        raise ValueError(f"grouped_mm operands must share a dtype; got {a_MK.dtype} and {b_EKN.dtype}")


def grouped_mm_fwd(a_MK: Tensor, b_EKN: Tensor, offsets_E: Tensor) -> Tensor:
    """``out[rows_e] = a[rows_e] @ b[e]``; padding rows of the output are zero."""
    _check(a_MK, b_EKN, offsets_E)
    m, k = a_MK.shape
    e, _, n = b_EKN.shape
    out_MN = torch.empty(m, n, dtype=a_MK.dtype, device=a_MK.device)
    if m == 0 or n == 0:
        return out_MN
    offsets_E = offsets_E.to(torch.int32)

    def grid(meta: dict) -> tuple[int]:
        # every expert can add one partial row tile: at most cdiv(M, BLOCK_M) + E tiles
        return ((triton.cdiv(m, meta["BLOCK_M"]) + e) * triton.cdiv(n, meta["BLOCK_N"]),)

    wrap_triton(_grouped_mm_kernel)[grid](a_MK, b_EKN, out_MN, offsets_E, m, n, k, e,
                                          a_MK.stride(0), a_MK.stride(1), *b_EKN.stride(), out_MN.stride(0),
                                          out_MN.stride(1), E_POW2=triton.next_power_of_2(e),
                                          IEEE=a_MK.dtype == torch.float32)
    return out_MN


def grouped_mm_wgrad(a_MK: Tensor, g_MN: Tensor, offsets_E: Tensor) -> Tensor:
    """``out[e] = a[rows_e]^T @ g[rows_e]`` as ``[E, K, N]``; zero for empty experts."""
    e = offsets_E.numel()
    k, n = a_MK.shape[1], g_MN.shape[1]
    out_EKN = torch.empty(e, k, n, dtype=a_MK.dtype, device=a_MK.device)
    if out_EKN.numel() == 0:
        return out_EKN
    offsets_E = offsets_E.to(torch.int32)

    def grid(meta: dict) -> tuple[int, int]:
        return triton.cdiv(k, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]), e

    wrap_triton(_grouped_wgrad_kernel)[grid](a_MK, g_MN, out_EKN, offsets_E, n, k, e,
                                             a_MK.stride(0), a_MK.stride(1), g_MN.stride(0), g_MN.stride(1),
                                             *out_EKN.stride(), IEEE=a_MK.dtype == torch.float32)
    return out_EKN


# As ops (``torch.library.triton_op``): torch.compile sees the kernels inside (each launch a
# ``wrap_triton`` call), so a compiled block keeps one graph around them and inductor may fuse
# around them; the op's fake implementation is its own function, traced. Backward: the same ops
# (:func:`moebench.kernels.grouped_mm_op.register_grouped_autograd`).


@triton_op("moebench::triton_grouped_mm", mutates_args=())
def _grouped_mm_op(a_MK: Tensor, b_EKN: Tensor, offsets_E: Tensor) -> Tensor:
    return grouped_mm_fwd(a_MK, b_EKN, offsets_E)


@triton_op("moebench::triton_grouped_mm_wgrad", mutates_args=())
def _grouped_wgrad_op(a_MK: Tensor, g_MN: Tensor, offsets_E: Tensor) -> Tensor:
    return grouped_mm_wgrad(a_MK, g_MN, offsets_E)


register_grouped_autograd(_grouped_mm_op, _grouped_wgrad_op)


def triton_grouped_mm(a_MK: Tensor, b_EKN: Tensor, offsets_E: Tensor) -> Tensor:
    """Differentiable ``a [M, K] @ b [E, K, N]`` per expert group; all three GEMMs in Triton."""
    return _grouped_mm_op(a_MK, b_EKN, offsets_E)


def experts_triton(x_ND: Tensor, w13_ED2H: Tensor, w2_EHD: Tensor, offsets_E: Tensor,
                   swiglu_limit: float | None = None) -> Tensor:
    """The ``triton`` expert backend: two Triton grouped GEMMs around SwiGLU (clamped at ``swiglu_limit``)."""
    h_N2H = triton_grouped_mm(x_ND, w13_ED2H, offsets_E)
    return triton_grouped_mm(expert_activation(h_N2H, swiglu_limit), w2_EHD, offsets_E)

