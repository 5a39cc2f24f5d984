"""Quantized expert GEMMs (``precision.mode`` fp8 / mxfp8) and where they run natively.

Shapes: N expert-sorted rows, D model dim, H expert hidden, E experts.

Each expert GEMM ``a [N, K] @ w[e] [K, M]`` quantizes both operands along its reduction
dimension K (activations per row, weights per output column):

- ``fp8``: E4M3 with one power-of-two scale per row / column (:mod:`moebench.kernels.fp8`).
- ``mxfp8``: E4M3 with one E8M0 scale per 32 elements along K (:mod:`moebench.kernels.mxfp8`).

Implementations, reported as ``precision_impl`` in the run record:

- ``emulated`` (everywhere): quantize -> dequantize -> grouped GEMM in the compute dtype. The
  rounding is applied in the forward only; gradients pass straight through the quantizers
  (straight-through estimator), so both backward GEMMs run in the compute dtype on the
  dequantized operands. Shows the accuracy effect of the format, never its speed.
- ``native`` fp8 (CUDA SM90+ with ``torch._scaled_grouped_mm``, checked once per device by a
  small probe against the emulation): forward GEMMs in fp8 on the tensor cores; the backward
  GEMMs in bf16 on the saved unquantized bf16 operands (the emulation's backward uses the
  dequantized ones, so the two gradients differ by the operands' quantization error). Needs
  ``d_model`` and ``expert_hidden`` to be multiples of 16 (checked by
  :func:`apply_expert_precision`).
- MXFP8 has no native path here: block-scaled grouped GEMMs need SM100 and a swizzled scale
  layout that this code does not produce, so mxfp8 always reports ``emulated``.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moebench.errors import ConfigError
from moebench.kernels.fp8 import fake_quantize_rowwise, quantize_rowwise
from moebench.kernels.mxfp8 import check_rounding, dequantize, fake_quantize
from moebench.model.experts import Experts, swiglu

QUANT_MODES = ("fp8", "mxfp8")
MODES = ("fp32", "bf16", *QUANT_MODES)


class _StraightThrough(torch.autograd.Function):
    """Forward ``fn(x)``; backward passes the gradient unchanged."""

    @staticmethod
    def forward(ctx, x: Tensor, fn: Callable[[Tensor], Tensor]) -> Tensor:
        return fn(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


_HAS_TRITON = importlib.util.find_spec("triton") is not None


def _mxfp8_fake_quantize_triton(x: Tensor, rounding: str, dim: int) -> Tensor:
    """:func:`moebench.kernels.mxfp8.fake_quantize` with the (bit-exact) Triton quantize kernel."""
    from moebench.kernels import mxfp8_triton

    moved = x.movedim(dim, -1)
    return dequantize(*mxfp8_triton.quantize(moved, rounding), dtype=x.dtype).movedim(-1, dim)


def fake_quant(x: Tensor, mode: str, dim: int, rounding: str = "up") -> Tensor:
    """Quantize-dequantize ``x`` with blocks/rows along ``dim``; straight-through gradient."""
    if mode == "fp8":
        return _StraightThrough.apply(x, functools.partial(fake_quantize_rowwise, dim=dim))
    if mode == "mxfp8":
        fn = _mxfp8_fake_quantize_triton if x.is_cuda and _HAS_TRITON else fake_quantize
        return _StraightThrough.apply(x, functools.partial(fn, rounding=rounding, dim=dim))
    raise ValueError(f"quantized expert mode must be one of {', '.join(QUANT_MODES)}; got {mode!r}")


def grouped_mm_fn(backend: str) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """``mm(a [N, K], b [E, K, M], offsets_E)`` of an expert backend: torch's grouped GEMM, or Triton's."""
    if backend == "triton":
        from moebench.kernels.grouped_gemm import triton_grouped_mm

        return triton_grouped_mm
    return lambda a, b, offs: F.grouped_mm(a, b, offs=offs)


def emulated_grouped_mm(a_NK: Tensor, w_EKM: Tensor, offsets_E: Tensor, mode: str, rounding: str = "up",
                        backend: str = "grouped_mm") -> Tensor:
    """One expert GEMM with both operands quantized along K (emulated, straight-through)."""
    return grouped_mm_fn(backend)(fake_quant(a_NK, mode, -1, rounding), fake_quant(w_EKM, mode, -2, rounding),
                                offsets_E)


class _Fp8NativeGroupedMM(torch.autograd.Function):
    """Forward with ``torch._scaled_grouped_mm`` (fp8 rowwise, SM90+); backward in bf16."""

    @staticmethod
    def forward(ctx, a_NK: Tensor, w_EKM: Tensor, offsets_E: Tensor) -> Tensor:
        a_data, a_scale = quantize_rowwise(a_NK, dim=-1)  # [N, K], [N, 1]
        w_data, w_scale = quantize_rowwise(w_EKM, dim=-2)  # [E, K, M], [E, 1, M]
        w_col = w_data.transpose(-2, -1).contiguous().transpose(-2, -1)  # the kernel wants K-major B
        ctx.save_for_backward(a_NK, w_EKM, offsets_E)
        return torch._scaled_grouped_mm(a_data, w_col, a_scale.squeeze(-1), w_scale.squeeze(-2), offs=offsets_E,
                                        out_dtype=a_NK.dtype, use_fast_accum=True)

    @staticmethod
    def backward(ctx, grad_NM: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        a_NK, w_EKM, offsets_E = ctx.saved_tensors
        grad_NM = grad_NM.contiguous()
        grad_a = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_a = F.grouped_mm(grad_NM, w_EKM.transpose(-2, -1), offs=offsets_E)
        if ctx.needs_input_grad[1]:
            grad_w = F.grouped_mm(a_NK.t(), grad_NM, offs=offsets_E)
        return grad_a, grad_w, None


def native_fp8_grouped_mm(a_NK: Tensor, w_EKM: Tensor, offsets_E: Tensor) -> Tensor:
    return _Fp8NativeGroupedMM.apply(a_NK, w_EKM, offsets_E)


@functools.cache
def _fp8_native_ok(device_index: int) -> bool:
    """Run one small ragged fp8 grouped GEMM and compare it with the emulation."""
    if not hasattr(torch, "_scaled_grouped_mm"):
        return False
    device = torch.device("cuda", device_index)
    if torch.cuda.get_device_capability(device) < (9, 0):
        return False
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(80, 64, device=device, generator=gen).bfloat16()
    w = torch.randn(3, 64, 32, device=device, generator=gen).bfloat16()
    # ragged groups (5, 0, 56 rows: routing never aligns them) and 19 padding rows
    offs = torch.tensor([5, 5, 61], dtype=torch.int32, device=device)
    try:
        got = native_fp8_grouped_mm(a, w, offs)[:61].float()
    except Exception:  # any failure of the native kernel (unsupported layout, build without it) -> emulate
        return False
    want = emulated_grouped_mm(a, w, offs, "fp8")[:61].float()
    return bool(torch.allclose(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item()))


def precision_impl(mode: str, device: torch.device | str) -> str:
    """``native`` or ``emulated``: how ``mode``'s expert GEMMs run on ``device``."""
    device = torch.device(device)
    if mode in ("auto", "fp32", "bf16"):
        return "native"
    if mode == "fp8":
        # a bare "cuda" means the current device (as in torch), not device 0
        ok = device.type == "cuda" and _fp8_native_ok(
            device.index if device.index is not None else torch.cuda.current_device())
        return "native" if ok else "emulated"
    if mode == "mxfp8":
        return "emulated"
    raise ValueError(f"precision mode must be one of auto, {', '.join(MODES)}; got {mode!r}")


def quantized_experts(x_ND: Tensor, w13_ED2H: Tensor, w2_EHD: Tensor, offsets_E: Tensor, mode: str,
                      rounding: str = "up", backend: str = "grouped_mm") -> Tensor:
    """The expert MLP with both GEMMs quantized per ``mode`` (native fp8 where available)."""
    if mode == "fp8" and precision_impl(mode, x_ND.device) == "native" and x_ND.dtype == torch.bfloat16:
        h_N2H = native_fp8_grouped_mm(x_ND, w13_ED2H, offsets_E)
        return native_fp8_grouped_mm(swiglu(h_N2H), w2_EHD, offsets_E)
    h_N2H = emulated_grouped_mm(x_ND, w13_ED2H, offsets_E, mode, rounding, backend)
    return emulated_grouped_mm(swiglu(h_N2H), w2_EHD, offsets_E, mode, rounding, backend)


def apply_expert_precision(model: nn.Module, mode: str, rounding: str = "up") -> int:
    """Set every :class:`Experts` module of ``model`` to ``mode``; return how many were set.

    fp32/bf16/auto leave the experts unquantized (the compute dtype comes from autocast).
    Experts that ask for the ``triton`` backend get it registered here (it imports triton).
    """
    check_rounding(rounding)
    quant = mode if mode in QUANT_MODES else "none"
    if quant == "none" and mode not in ("auto", "fp32", "bf16"):
        raise ValueError(f"precision mode must be one of auto, {', '.join(MODES)}; got {mode!r}")
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    if quant == "mxfp8":
        for module in experts:
            if module.d_model % 32 or module.hidden % 32:
                raise ConfigError(f"precision.mode=mxfp8 needs model.d_model ({module.d_model}) and "
                                  f"moe.expert_hidden ({module.hidden}) to be multiples of 32")
    if quant == "fp8":
        for module in experts:
            # torch._scaled_grouped_mm wants 16-byte aligned rows: K (d_model, then hidden) a multiple of 16
            if (module.d_model % 16 or module.hidden % 16) and precision_impl("fp8", module.w13.device) == "native":
                raise ConfigError(f"precision.mode=fp8 runs natively on {module.w13.device} and needs "
                                  f"model.d_model ({module.d_model}) and moe.expert_hidden ({module.hidden}) "
                                  "to be multiples of 16")
    if any(m.backend == "triton" for m in experts):
        import moebench.kernels.grouped_gemm  # noqa: F401  (registers BACKENDS["triton"])
    for module in experts:
        module.precision = quant
        module.mxfp8_rounding = rounding
    return len(experts)
