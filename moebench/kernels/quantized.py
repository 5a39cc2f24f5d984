"""Precision modes of the quantized GEMMs, where each runs natively, and the quantized expert MLP.

Shapes: N expert-sorted rows, D model dim, H expert hidden, E experts.

``fp8`` and ``mxfp8`` quantize both operands of every expert GEMM along its reduction dim
(:mod:`moebench.kernels.quantized_gemm` has the GEMMs, their gradient rule and the two
implementations); with ``precision.scope=linear`` the dense linears too
(:mod:`moebench.kernels.quantized_linear`, the same rule on plain GEMMs). Which implementation
runs is reported as ``precision_impl`` in the run record:

- ``native`` fp8: CUDA SM90+ with ``torch._scaled_grouped_mm`` / ``torch._scaled_mm`` (rowwise scales);
- ``native`` mxfp8: CUDA SM100+ with the same kernels on E8M0 block scales (the grouped one ships
  in torch builds with FBGEMM's grouped GEMMs);
- ``emulated`` everywhere else: the same quantization, dequantized into a compute-dtype GEMM.

Native support is decided once per device, format and GEMM kind (``grouped`` for the experts,
``linear`` for the dense layers) by a probe: a small GEMM (forward and both gradients; ragged
groups for ``grouped``) through the native kernel, compared with its emulated twin. A kernel that
is missing, refuses the layout or disagrees means ``emulated``, never a wrong result. A run whose
scope has any GEMM kind emulated reports ``emulated``.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from moebench.devices import NATIVE_CAPABILITY
from moebench.kernels.quantized_gemm import FORMATS, quantized_grouped_mm
from moebench.kernels.quantized_linear import quantized_linear
from moebench.kernels.swiglu import swiglu

QUANT_MODES = FORMATS
UNQUANTIZED_MODES = ("auto", "fp32", "bf16")  # auto: bf16 on a GPU, fp32 on CPU (PrecisionConfig.resolved)
MODES = ("fp32", "bf16", *QUANT_MODES)
KINDS = ("grouped", "linear")  # the expert GEMMs; the dense linears of precision.scope=linear
SCOPE_KINDS = {"experts": ("grouped",), "linear": KINDS}


@functools.cache
def _native_ok(fmt: str, device_index: int, kind: str = "grouped") -> bool:
    if not hasattr(torch, "_scaled_grouped_mm" if kind == "grouped" else "_scaled_mm"):
        return False
    device = torch.device("cuda", device_index)
    if torch.cuda.get_device_capability(device) < NATIVE_CAPABILITY[fmt]:
        return False
    return native_agrees(fmt, device, kind)


def _probe(fmt: str, impl: str, kind: str, a: Tensor, b: Tensor, offsets: Tensor) -> Tensor:
    if kind == "grouped":
        return quantized_grouped_mm(a, b, offsets, fmt, impl)
    return quantized_linear(a, b.transpose(1, 2).flatten(0, 1), fmt, impl)  # w [E * M, K]: the experts side by side


def native_agrees(fmt: str, device: torch.device, kind: str = "grouped") -> bool:
    """Run one small quantized GEMM of ``kind`` (forward and both gradients) natively on ``device``
    and compare it with the emulation: False if the kernel fails or disagrees."""
    if kind not in KINDS:
        raise ValueError(f"quantized GEMM kind must be one of {', '.join(KINDS)}; got {kind!r}")
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(80, 128, device=device, generator=gen).bfloat16()
    b = torch.randn(3, 128, 64, device=device, generator=gen).bfloat16()
    out_dim = 64 if kind == "grouped" else 3 * 64  # linear: the three experts' columns side by side
    grad = torch.randn(80, out_dim, device=device, generator=gen).bfloat16()
    # ragged groups (5, 0, 56 rows: routing never aligns them) and 19 padding rows
    offsets = torch.tensor([5, 5, 61], dtype=torch.int32, device=device)
    rows = 61 if kind == "grouped" else 80
    results = {}
    # the first call may come from inside a model's forward: autograd on, autocast off, whatever the caller runs
    with torch.enable_grad(), torch.autocast("cuda", enabled=False):
        for impl in ("native", "emulated"):
            a_, b_ = a.clone().requires_grad_(), b.clone().requires_grad_()
            try:
                out = _probe(fmt, impl, kind, a_, b_, offsets)
                out.backward(grad)
            except Exception:  # any failure of the native kernel (unsupported layout, build without it) -> emulate
                return False
            results[impl] = (out[:rows].float(), a_.grad[:rows].float(), b_.grad.float())
    # bf16 outputs, fast accumulation in the forward: a few bf16 ulps of the largest value
    return all(torch.allclose(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
               for got, want in zip(results["native"], results["emulated"], strict=True))


def quant_format(mode: str) -> str:
    """The quantized GEMM format of precision ``mode`` (``fp8``, ``mxfp8``), or ``none`` (ValueError: no such mode)."""
    if mode in QUANT_MODES:
        return mode
    if mode not in UNQUANTIZED_MODES:
        raise ValueError(f"precision mode must be one of auto, {', '.join(MODES)}; got {mode!r}")
    return "none"


def gemm_impl(mode: str, device: torch.device | str, kind: str = "grouped") -> str:
    """``native`` or ``emulated``: how ``mode``'s quantized GEMMs of ``kind`` run on ``device``."""
    device = torch.device(device)
    if quant_format(mode) == "none":
        return "native"
    # a bare "cuda" means the current device (as in torch), not device 0
    ok = device.type == "cuda" and _native_ok(
        mode, device.index if device.index is not None else torch.cuda.current_device(), kind)
    return "native" if ok else "emulated"


def precision_impl(mode: str, device: torch.device | str, scope: str = "experts") -> str:
    """``native`` or ``emulated``: how ``mode``'s quantized GEMMs of ``scope`` run on ``device``
    (``native`` only when every GEMM kind of the scope does)."""
    if scope not in SCOPE_KINDS:
        raise ValueError(f"precision scope must be one of {', '.join(SCOPE_KINDS)}; got {scope!r}")
    impls = {gemm_impl(mode, device, kind) for kind in SCOPE_KINDS[scope]}
    return "native" if impls == {"native"} else "emulated"


def quantized_experts(x_ND: Tensor, w13_ED2H: Tensor, w2_EHD: Tensor, offsets_E: Tensor, mode: str,
                      rounding: str = "up", backend: str = "grouped_mm", saved: str = "quantized") -> Tensor:
    """The expert MLP with both GEMMs quantized per ``mode`` (natively where the device can)."""
    native = x_ND.dtype == torch.bfloat16 and gemm_impl(mode, x_ND.device) == "native"
    impl = "native" if native else "emulated"
    h_N2H = quantized_grouped_mm(x_ND, w13_ED2H, offsets_E, mode, impl, rounding, backend, saved)
    return quantized_grouped_mm(swiglu(h_N2H), w2_EHD, offsets_E, mode, impl, rounding, backend, saved)
