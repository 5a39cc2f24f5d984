"""Quantized grouped GEMMs (fp8 rowwise, MXFP8): one autograd rule, a native and an emulated GEMM.

Legend: N expert-sorted rows (rows past ``offsets[-1]`` are padding), K the GEMM's reduction
dim, M its output dim, E experts (groups).

``quantized_grouped_mm(a_NK, b_EKM, offsets_E, fmt, impl)`` is ``a[rows_e] @ b[e]`` per expert:

- forward ``out = Q(a) @ Q(b)``, both operands quantized along K;
- input gradient ``grad_a = Q(grad) @ Q(b^T)``, quantized along M (that GEMM's reduction dim);
- weight gradient ``grad_b[e] = a[rows_e]^T @ grad[rows_e]``, whose reduction dim is the ragged
  token dim: fp8 quantizes both operands with one scale per (expert group, column)
  (:func:`moebench.kernels.fp8.quantize_group_columns`; natively each group first aligned to 16
  rows, an empty one given 16 zero rows, :func:`aligned_groups`); MXFP8 runs it in the compute dtype,
  because 32-element blocks along tokens would need every expert group padded to a multiple of
  32 rows. Its ``a`` operand depends on what is saved for backward (``saved``):

  - ``"quantized"`` (the default): each GEMM saves the E4M3 operands its backward reads instead
    of the compute-dtype ones: the weight quantized along M (the input gradient's operand), and
    ``a`` as the weight gradient reads it: fp8 per (group, column), quantized in the forward
    instead of the backward (the same numbers); MXFP8 the forward's own ``Q(a)`` along K, so the
    weight gradient is ``deq(Q(a))^T @ grad``. That is the only numerical change against
    ``"compute"``: the weight gradient sees ``a`` with the forward's rounding (at most half an
    E4M3 step per element, as the forward GEMM sees it) instead of ``a`` itself.
  - ``"compute"``: ``a`` and ``b`` are saved as given and quantized again in backward; MXFP8's
    weight gradient reads the unquantized ``a``.

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
from torch._subclasses.fake_tensor import is_fake

from moebench.kernels import mxfp8
from moebench.kernels.fp8 import (
    dequantize_group_columns,
    dequantize_rowwise,
    quantize_group_columns,
    quantize_rowwise,
)
from moebench.kernels.groups import group_sizes
from moebench.kernels.scale_layout import blocked, grouped_blocked
from moebench.precision_modes import QUANT_MODES

IMPLS = ("native", "emulated")
# what the GEMMs save for backward: the E4M3 operands the backward reads, or the compute-dtype inputs
SAVED = ("quantized", "compute")

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
        from moebench.kernels.grouped_gemm import grouped_mm_fwd, grouped_mm_wgrad  # imports triton (optional)

        return GroupedGemms(grouped_mm_fwd, grouped_mm_wgrad)
    return GroupedGemms(lambda a, b, offs: F.grouped_mm(a, b, offs=offs),
                        lambda a, g, offs: F.grouped_mm(a.t(), g, offs=offs))


# The torch reference quantizers hold a few fp32 copies of their input at once (about 12 bytes per
# element). Off CUDA the GEMMs run them over slices of the leading dim of about this many elements,
# so their transient memory is that of their outputs (E4M3 data, dequantized copies), as the planner
# counts it (moebench.plan.quantized), also where the GEMM is emulated. Rows quantize independently:
# bit-exact. On CUDA the quantizers are Triton kernels that write their outputs directly, and one
# pass of the dequantize beats a launch per slice. A dry run (fake tensors, moebench.train.dry_run) runs
# as a GPU run does, one pass: slices of a 1.2T model's operands were thousands of extra ops a step.
CHUNK_ELEMENTS = 1 << 20


def _chunks(x: Tensor) -> int | None:
    """Leading-dim slice length of about :data:`CHUNK_ELEMENTS` elements; None: one pass."""
    if is_fake(x) or x.is_cuda or x.ndim < 2 or x.numel() <= CHUNK_ELEMENTS:
        return None
    return max(1, CHUNK_ELEMENTS // max(x[0].numel(), 1))


def _cat_bytes(parts: list[Tensor]) -> Tensor:
    # concatenated as raw bytes: not every device implements copies for the float8 dtypes
    return torch.cat([p.view(torch.uint8) for p in parts]).view(parts[0].dtype)


def _quantize_by_rows(quantize: Callable[[Tensor], tuple[Tensor, Tensor]], x: Tensor) -> tuple[Tensor, Tensor]:
    rows = _chunks(x)
    if rows is None:
        return quantize(x)
    data, scale = zip(*(quantize(part) for part in x.split(rows)), strict=True)
    return _cat_bytes(list(data)), (torch.cat(scale) if scale[0].dtype == torch.float32 else _cat_bytes(list(scale)))


def mx_quantize(x: Tensor, rounding: str = "up") -> tuple[Tensor, Tensor]:
    """MXFP8 along the last dim; the (bit-exact) Triton kernel on CUDA, the torch reference elsewhere."""
    if x.is_cuda and _HAS_TRITON:
        from moebench.kernels import mxfp8_triton  # imports triton (optional)

        return mxfp8_triton.quantize(x, rounding)
    return _quantize_by_rows(lambda part: mxfp8.quantize(part, rounding), x)


def fp8_rowwise(x: Tensor) -> tuple[Tensor, Tensor]:
    """FP8 rowwise along the last dim; the (bit-exact) Triton kernel on CUDA, the torch reference elsewhere."""
    if x.is_cuda and _HAS_TRITON:
        from moebench.kernels import fp8_triton  # imports triton (optional)

        return fp8_triton.quantize_rowwise(x)
    return _quantize_by_rows(lambda part: quantize_rowwise(part, dim=-1), x)


def _check_format(fmt: str) -> None:
    if fmt not in QUANT_MODES:
        raise ValueError(f"quantized GEMM format must be one of {', '.join(QUANT_MODES)}; got {fmt!r}")


def check_saved(saved: str) -> None:
    if saved not in SAVED:
        raise ValueError(f"saved activations must be one of {', '.join(SAVED)}; got {saved!r}")


def quantize_rows(x: Tensor, fmt: str, rounding: str = "up") -> tuple[Tensor, Tensor]:
    """``(E4M3 data like x, scales)`` along the last dim: fp8 one fp32 scale per row (``[..., 1]``),
    MXFP8 one E8M0 scale per 32 elements (``[..., K/32]``)."""
    _check_format(fmt)
    return fp8_rowwise(x) if fmt == "fp8" else mx_quantize(x, rounding)


def dequantize_rows(data: Tensor, scale: Tensor, fmt: str, dtype: torch.dtype) -> Tensor:
    """Inverse of :func:`quantize_rows`, as ``dtype`` (slice by slice, see :data:`CHUNK_ELEMENTS`)."""
    def dequantize(d: Tensor, s: Tensor) -> Tensor:
        return dequantize_rowwise(d, s, dtype) if fmt == "fp8" else mxfp8.dequantize(d, s, dtype)

    rows = _chunks(data)
    if rows is None:
        return dequantize(data, scale)
    out = torch.empty(data.shape, dtype=dtype, device=data.device)
    for d, s, o in zip(data.split(rows), scale.split(rows), out.split(rows), strict=True):
        o.copy_(dequantize(d, s))
    return out


def quantize_dequantize(x: Tensor, fmt: str, dim: int, rounding: str = "up") -> Tensor:
    """``x`` rounded to ``fmt`` with rows/blocks along ``dim``, in ``x``'s dtype."""
    moved = x.movedim(dim, -1)
    return dequantize_rows(*quantize_rows(moved, fmt, rounding), fmt, x.dtype).movedim(-1, dim)


Quantized = tuple[Tensor, Tensor]  # (E4M3 data, scales) of quantize_rows


def _native_grouped(a_q: Quantized, bt_q: Quantized, offsets_E: Tensor, fmt: str, fast_accum: bool) -> Tensor:
    """``a @ bt[e]^T`` per group on ``torch._scaled_grouped_mm``: ``a`` ``[N, K]`` and ``bt``
    ``[E, M, K]`` (B column-major, as the kernel wants it) both quantized along K; bf16 out."""
    (a_data, a_scale), (bt_data, bt_scale) = a_q, bt_q
    if fmt == "fp8":
        a_scale, b_scale = a_scale.squeeze(-1), bt_scale.squeeze(-1)  # [N], [E, M]
    else:
        a_scale = grouped_blocked(a_scale, offsets_E)
        b_scale = blocked(bt_scale).flatten(1)  # [E, M_pad * B_pad]: one blocked matrix per expert
    return torch._scaled_grouped_mm(a_data, bt_data.transpose(-2, -1), a_scale, b_scale, offs=offsets_E,
                                    out_dtype=torch.bfloat16, use_fast_accum=fast_accum and fmt == "fp8")


def emulated_mm(a_NK: Tensor, b_EKM: Tensor, offsets_E: Tensor, fmt: str, rounding: str = "up",
                gemms: GroupedGemms | None = None) -> Tensor:
    """``Q(a) @ Q(b)`` per group: quantize -> dequantize -> grouped GEMM in the compute dtype."""
    gemms = gemms or backend_gemms("grouped_mm")
    return gemms.mm(quantize_dequantize(a_NK, fmt, -1, rounding), quantize_dequantize(b_EKM, fmt, -2, rounding),
                    offsets_E)


def native_mm(a_NK: Tensor, b_EKM: Tensor, offsets_E: Tensor, fmt: str, rounding: str = "up",
              fast_accum: bool = False) -> Tensor:
    """``Q(a) @ Q(b)`` per group on the fp8 tensor cores (``torch._scaled_grouped_mm``); bf16 out."""
    a_q = quantize_rows(a_NK.contiguous(), fmt, rounding)  # [N, K] along K
    bt_q = quantize_rows(b_EKM.transpose(-2, -1).contiguous(), fmt, rounding)  # [E, M, K] along K
    return _native_grouped(a_q, bt_q, offsets_E, fmt, fast_accum)


def _token_major(data_NK: Tensor, rows: int) -> Tensor:
    """E4M3 ``[N, K]`` as a row-major ``[K, rows]`` copy, zero-padded to ``rows`` (16-byte rows)."""
    out = torch.zeros(data_NK.shape[1], rows, dtype=torch.uint8, device=data_NK.device)
    out[:, :data_NK.shape[0]] = data_NK.view(torch.uint8).t()
    return out.view(torch.float8_e4m3fn)


def token_rows(num_rows: int) -> int:
    """The token dim of a native fp8 weight-gradient operand: ``num_rows`` rounded up to 16-byte rows."""
    return -(-num_rows // 16) * 16


def fp8_group_columns_t(x_NK: Tensor, offsets_E: Tensor, rows: int) -> tuple[Tensor, Tensor]:
    """Per-(group, column) FP8 as ``(data [K, rows] token-major, scale [E, K])``; the Triton kernel
    on CUDA (which writes the transposed layout directly), the torch reference plus a copy elsewhere.
    The two agree on the first ``offsets[-1]`` token rows, all the GEMM reads."""
    if x_NK.is_cuda and _HAS_TRITON:
        from moebench.kernels import fp8_group_triton  # imports triton (optional)

        return fp8_group_triton.quantize_group_columns_t(x_NK, offsets_E, rows)
    data_NK, scale_EK = quantize_group_columns(x_NK, offsets_E, _chunks(x_NK))
    return _token_major(data_NK, rows), scale_EK


# The native weight gradient is a 2-D x 2-D grouped GEMM whose ragged dim (tokens) is the contiguous
# one in both operands; torch._scaled_grouped_mm then asserts on the device that every group but the
# last holds a multiple of 16 bytes (16 E4M3 rows) along it, and (CUTLASS, torch's
# prepare_grouped_gemm_data: it "cannot handle delta=0" there) that no group is empty. Real routing
# almost never gives the first and often breaks the second (an expert no token chose), and a
# device-side assert poisons the CUDA context, so each group is moved to start at a multiple of 16 rows
# and an empty group gets 16 zero rows. That keeps the weight gradient on the fp8 tensor cores at a cost
# of at most 16 rows a group; the MXFP8 recipe's way out (that GEMM in bf16, where the token dim is not
# the contiguous one) needs no padding but runs a third of the GEMMs at bf16 speed, and fp8's
# per-(group, column) scales fit ragged groups, where MXFP8's 32-row blocks would not. Zero rows change
# neither a group's column amax (its fp8 scale) nor its product: an empty group's gradient is zero.
GROUP_ROW_ALIGN = 16


def _aligned_sizes(sizes_E: Tensor) -> Tensor:
    """Each group's row count rounded up to :data:`GROUP_ROW_ALIGN`, at least one block of it."""
    return ((sizes_E + GROUP_ROW_ALIGN - 1) // GROUP_ROW_ALIGN * GROUP_ROW_ALIGN).clamp_min(GROUP_ROW_ALIGN)


def alignment_padding_rows(offsets_E: Tensor) -> Tensor:
    """The zero rows :func:`aligned_groups` inserts for these groups (int64 scalar, on the device, no
    host sync): each group's aligned size less its size."""
    sizes = group_sizes(offsets_E)
    return (_aligned_sizes(sizes) - sizes).sum()


def aligned_groups(x_NK: Tensor, offsets_E: Tensor) -> tuple[Tensor, Tensor]:
    """``x`` with every expert group moved to start at a multiple of :data:`GROUP_ROW_ALIGN` rows
    (zero rows between groups, an empty group :data:`GROUP_ROW_ALIGN` zero rows), and the groups'
    new end offsets (int32).

    On the device, with no host sync: the output has the static size ``N + 16 E`` rows (each group
    grows by at most 16), and rows past ``offsets[-1]`` (capacity padding) keep their place after the
    last group."""
    n = x_NK.shape[0]
    ends = offsets_E.to(torch.int64)
    aligned_ends = torch.cumsum(_aligned_sizes(group_sizes(offsets_E)), 0)
    shift = aligned_ends - ends  # how far each group's rows move: its start's shift plus its own padding
    group_start_shift = torch.cat([shift.new_zeros(1), shift[:-1]])
    rows = torch.arange(n, device=x_NK.device)
    group = torch.searchsorted(ends, rows, right=True)  # E for rows past the last group
    dest = rows + torch.cat([group_start_shift, shift[-1:]])[group]
    out = x_NK.new_zeros(n + GROUP_ROW_ALIGN * offsets_E.numel(), x_NK.shape[1])
    out[dest] = x_NK
    return out, aligned_ends.to(torch.int32)


def native_fp8_wgrad(a_NK: Tensor, g_NM: Tensor, offsets_E: Tensor) -> Tensor:
    """``a[rows_e]^T @ g[rows_e]`` per group on the fp8 tensor cores, per-(group, column) scales; bf16 out."""
    return _native_fp8_wgrad(_fp8_wgrad_operand(a_NK, offsets_E), g_NM, offsets_E)


def _fp8_wgrad_operand(x_NK: Tensor, offsets_E: Tensor) -> Quantized:
    """``x`` as the native fp8 weight gradient reads it: groups aligned, per (group, column), token-major."""
    x_aligned, aligned_offsets = aligned_groups(x_NK, offsets_E)
    return fp8_group_columns_t(x_aligned, aligned_offsets, token_rows(x_aligned.shape[0]))


def _native_fp8_wgrad(a_q: Quantized, g_NM: Tensor, offsets_E: Tensor) -> Tensor:
    (a_data, a_scale), rows = a_q, a_q[0].shape[1]  # [K, rows], [E, K]
    g_aligned, aligned_offsets = aligned_groups(g_NM, offsets_E)
    g_data, g_scale = fp8_group_columns_t(g_aligned, aligned_offsets, rows)  # [M, rows], [E, M]
    return torch._scaled_grouped_mm(a_data, g_data.t(), a_scale.flatten(), g_scale.flatten(), offs=aligned_offsets,
                                    out_dtype=torch.bfloat16)


class GemmRule:
    """What one quantized GEMM call needs in its backward besides the saved tensors."""

    def __init__(self, fmt: str, impl: str, rounding: str, backend: str, saved: str, dtype: torch.dtype,
                 b_dtype: torch.dtype) -> None:
        self.fmt, self.impl, self.rounding, self.backend, self.saved = fmt, impl, rounding, backend, saved
        self.dtype, self.b_dtype = dtype, b_dtype

    def rows(self, x: Tensor) -> Quantized:
        """``x`` quantized along its last dim (made contiguous first for the native kernels' layouts)."""
        return quantize_rows(x.contiguous() if self.impl == "native" else x, self.fmt, self.rounding)

    def product(self, a_q: Quantized, bt_q: Quantized, offsets_E: Tensor, fast_accum: bool = False) -> Tensor:
        """``a @ bt[e]^T`` per group from both quantized operands: natively, or dequantized."""
        if self.impl == "native":
            return _native_grouped(a_q, bt_q, offsets_E, self.fmt, fast_accum)
        bt = self.dequantize(bt_q, self.b_dtype)
        return backend_gemms(self.backend).mm(self.dequantize(a_q, self.dtype), bt.transpose(-2, -1), offsets_E)

    def dequantize(self, q: Quantized, dtype: torch.dtype) -> Tensor:
        return dequantize_rows(*q, self.fmt, dtype)

    def wgrad_input(self, a_NK: Tensor, a_q: Quantized | None, offsets_E: Tensor) -> tuple[Tensor, ...]:
        """What the weight gradient reads of ``a``: fp8 ``a`` per (group, column) along the tokens
        (token-major for the native kernel); MXFP8 the forward's ``Q(a)`` along K when ``a_q`` is
        given (``saved="quantized"``), else ``a`` itself."""
        if self.fmt == "mxfp8":
            return a_q if a_q is not None else (a_NK,)
        if self.impl == "native":
            return _fp8_wgrad_operand(a_NK, offsets_E)
        return quantize_group_columns(a_NK, offsets_E, _chunks(a_NK))

    def weight_grad(self, a_form: tuple[Tensor, ...], g_NM: Tensor, offsets_E: Tensor) -> Tensor:
        """``a^T @ g`` per group from what :meth:`wgrad_input` gave."""
        if self.fmt == "mxfp8":
            a = a_form[0] if len(a_form) == 1 else mxfp8.dequantize(*a_form, dtype=self.dtype)
            return self.wgrad_mm(a, g_NM, offsets_E)
        if self.impl == "native":
            return self.native_fp8_wgrad(a_form, g_NM, offsets_E)
        a = dequantize_group_columns(*a_form, offsets_E, dtype=self.dtype, chunk_rows=_chunks(a_form[0]))
        g_q = quantize_group_columns(g_NM, offsets_E, _chunks(g_NM))
        g = dequantize_group_columns(*g_q, offsets_E, dtype=g_NM.dtype, chunk_rows=_chunks(g_NM))
        return self.wgrad_mm(a, g, offsets_E)

    def wgrad_mm(self, a_NK: Tensor, g_NM: Tensor, offsets_E: Tensor) -> Tensor:
        return backend_gemms(self.backend).wgrad(a_NK, g_NM, offsets_E)

    def native_fp8_wgrad(self, a_q: Quantized, g_NM: Tensor, offsets_E: Tensor) -> Tensor:
        return _native_fp8_wgrad(a_q, g_NM, offsets_E)


class QuantizedGroupedMM(torch.autograd.Function):
    """The autograd rule of the module docstring around one quantized GEMM implementation.

    Saved for backward (``saved``): ``"quantized"`` keeps the E4M3 operands each backward GEMM
    reads (the weight along M for the input gradient, ``a`` as the weight gradient reads it) and
    drops the compute-dtype tensors; ``"compute"`` keeps ``a`` and ``b`` and quantizes in backward.
    """

    @staticmethod
    def forward(ctx, a_NK: Tensor, b_EKM: Tensor, offsets_E: Tensor, fmt: str, impl: str, rounding: str,
                backend: str, saved: str) -> Tensor:
        rule = ctx.rule = GemmRule(fmt, impl, rounding, backend, saved, a_NK.dtype, b_EKM.dtype)
        a_q = rule.rows(a_NK)  # [N, K] along K
        out = rule.product(a_q, rule.rows(b_EKM.transpose(-2, -1)), offsets_E, fast_accum=True)
        need_a, need_b = ctx.needs_input_grad[:2]
        if saved == "quantized":
            # the backward GEMMs' operands, quantized now: no compute-dtype a or b outlives the forward
            b_form = rule.rows(b_EKM) if need_a else ()  # [E, K, M] along M
            a_form = rule.wgrad_input(a_NK, a_q, offsets_E) if need_b else ()
        else:
            b_form, a_form = (b_EKM,), (a_NK,)
        ctx.num_b = len(b_form)
        ctx.save_for_backward(offsets_E, *b_form, *a_form)
        return out

    @staticmethod
    def backward(ctx, grad_NM: Tensor) -> tuple[Tensor | None, ...]:
        rule: GemmRule = ctx.rule
        offsets_E, *forms = ctx.saved_tensors
        b_form, a_form = tuple(forms[:ctx.num_b]), tuple(forms[ctx.num_b:])
        grad_NM = grad_NM.contiguous()
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            b_q = b_form if rule.saved == "quantized" else rule.rows(b_form[0])
            grad_a = rule.product(rule.rows(grad_NM), b_q, offsets_E).to(rule.dtype)
        if ctx.needs_input_grad[1]:
            if rule.saved == "compute":
                a_form = rule.wgrad_input(a_form[0], None, offsets_E)
            grad_b = rule.weight_grad(a_form, grad_NM.to(rule.dtype), offsets_E).to(rule.b_dtype)
        return grad_a, grad_b, None, None, None, None, None, None


def check_args(fmt: str, impl: str, rounding: str, saved: str) -> None:
    """ValueError for an unknown format, implementation, MXFP8 rounding or saving policy."""
    _check_format(fmt)
    if impl not in IMPLS:
        raise ValueError(f"quantized GEMM impl must be one of {', '.join(IMPLS)}; got {impl!r}")
    mxfp8.check_rounding(rounding)
    check_saved(saved)


def quantized_grouped_mm(a_NK: Tensor, b_EKM: Tensor, offsets_E: Tensor, fmt: str, impl: str = "emulated",
                         rounding: str = "up", backend: str = "grouped_mm", saved: str = "quantized") -> Tensor:
    """Differentiable quantized ``a[rows_e] @ b[e]`` (see the module docstring)."""
    check_args(fmt, impl, rounding, saved)
    return QuantizedGroupedMM.apply(a_NK, b_EKM, offsets_E, fmt, impl, rounding, backend, saved)
