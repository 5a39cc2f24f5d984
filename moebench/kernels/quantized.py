"""Precision modes of the quantized GEMMs, where each runs natively, and the quantized expert MLP.

Shapes: N expert-sorted rows, D model dim, H expert hidden, E experts.

``fp8`` and ``mxfp8`` quantize both operands of every expert GEMM along its reduction dim
(:mod:`moebench.kernels.quantized_gemm` has the GEMMs, their gradient rule and the two
implementations); with ``precision.scope=linear`` the dense linears too
(:mod:`moebench.kernels.quantized_linear`, the same rule on plain GEMMs). Which implementation
runs is reported as ``precision_impl`` in the run record:

- ``native`` fp8: ``torch._scaled_grouped_mm`` / ``torch._scaled_mm`` (rowwise scales) on a CUDA
  device the installed torch's kernels serve (torch 2.13's grouped one: SM 9.0 and 10.0);
- ``native`` mxfp8: the same kernels on E8M0 block scales (torch 2.13's grouped one: SM 10.0, in
  builds with MSLK, formerly FBGEMM GenAI);
- ``emulated`` everywhere else: the same quantization, dequantized into a compute-dtype GEMM.

Native support is decided once per device, format and GEMM kind (``grouped`` for the experts,
``linear`` for the dense layers) by a probe: a small GEMM (forward and both gradients; ragged
groups for ``grouped``) through the native kernel, compared with its emulated twin. The probe runs
in a process of its own (:mod:`moebench.kernels.native_probe`), so that a device-side assert, which
poisons the CUDA context for good, costs the probe and not the run. A kernel that is missing,
refuses the layout, crashes or disagrees means ``emulated``, never a wrong result, and the reason
is kept (:func:`probe_error`, the run record's ``precision_probe_error``). A run whose scope has
any GEMM kind emulated reports ``emulated``.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys

import torch
from torch import Tensor

from moebench.config import SCOPE_KINDS
from moebench.devices import TORCH_GROUPED_CAPABILITIES, TORCH_VERSION_PINNED, capability_text, torch_serves
from moebench.kernels.quantized_gemm import alignment_padding_rows, quantized_grouped_mm
from moebench.kernels.quantized_linear import quantized_linear
from moebench.kernels.swiglu import expert_activation
from moebench.kernels.torch_build import KERNEL_OPS
from moebench.precision_modes import MODES, QUANT_MODES, UNQUANTIZED_MODES

KINDS = ("grouped", "linear")  # the expert GEMMs; the dense linears of precision.scope=linear


PROBE_TIMEOUT_S = 300


# build flags of the library that holds torch's MXFP8 grouped GEMM (MSLK, named FBGEMM GenAI before),
# looked for in torch.__config__.show() as torch's own platform check does
MXFP8_GROUPED_BUILD_FLAGS = ("USE_MSLK", "USE_FBGEMM_GENAI")


def missing_kernel(fmt: str, kind: str = "grouped") -> str | None:
    """Why this torch build cannot run ``fmt``'s native ``kind`` GEMMs on any device: no CUDA, no
    such op, or (MXFP8 grouped) built without MSLK, whose kernel it is; None if it has them.

    Read from the build, never from a device (no CUDA context). Without MSLK torch would hand the
    E8M0 scales to its rowwise fp8 branch, so this is decided before any probe runs."""
    if torch.version.cuda is None:
        return f"this torch {torch.__version__} is not a CUDA build"
    op = KERNEL_OPS[kind]
    if not hasattr(torch, op):
        return f"this torch {torch.__version__} has no torch.{op}"
    if fmt == "mxfp8" and kind == "grouped":
        config = torch.__config__.show()
        if not any(flag in config for flag in MXFP8_GROUPED_BUILD_FLAGS):
            return (f"this torch {torch.__version__} is built without MSLK (FBGEMM GenAI), which holds its "
                    "MXFP8 grouped GEMM")
    return None


@functools.cache
def _native_status(fmt: str, device_index: int, kind: str = "grouped") -> str | None:
    """Why ``fmt``'s ``kind`` GEMMs cannot run natively on CUDA device ``device_index``; None if they can.

    The installed torch decides, not moebench's table: its kernels check the device against an
    allow-list of their own (which differs between builds and misses newer devices), so the probe
    runs whatever the capability. The pinned torch's allow-list of the grouped GEMM
    (:data:`TORCH_GROUPED_CAPABILITIES`) only names the likely reason beside the probe's when a device
    outside it fails. Cached: one probe per process, device, format and kind.
    """
    missing = missing_kernel(fmt, kind)
    if missing:
        return missing
    why = run_probe(fmt, device_index, kind)
    capability = torch.cuda.get_device_capability(device_index)
    if why is not None and kind == "grouped" and not torch_serves(fmt, capability):
        allowed = capability_text(TORCH_GROUPED_CAPABILITIES[fmt])
        return (f"compute capability {capability_text(capability)} is outside torch {TORCH_VERSION_PINNED}'s "
                f"native grouped {fmt} allow-list ({allowed}) ({why})")
    return why


def run_probe(fmt: str, device_index: int, kind: str, argv: list[str] | None = None) -> str | None:
    """The probe in a process of its own: None if the native kernel agrees with the emulation, else why not."""
    argv = argv or [sys.executable, "-m", "moebench.kernels.native_probe", fmt, kind, str(device_index)]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"the {fmt} {kind} probe did not finish in {PROBE_TIMEOUT_S} s"
    except OSError as exc:
        return f"the {fmt} {kind} probe could not start: {exc}"
    lines = out.stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else None
    except ValueError:
        answer = None
    if out.returncode != 0 or not isinstance(answer, dict):
        tail = (out.stderr.strip().splitlines() or ["no output"])[-1][:300]
        return f"the {fmt} {kind} probe process exited {out.returncode}: {tail}"
    return answer.get("error")


def _probe(fmt: str, impl: str, kind: str, a: Tensor, b: Tensor, offsets: Tensor) -> Tensor:
    if kind == "grouped":
        return quantized_grouped_mm(a, b, offsets, fmt, impl)
    return quantized_linear(a, b.transpose(1, 2).flatten(0, 1), fmt, impl)  # w [E * M, K]: the experts side by side


def native_agrees(fmt: str, device: torch.device, kind: str = "grouped") -> bool:
    """Run one small quantized GEMM of ``kind`` (forward and both gradients) natively on ``device``
    and compare it with the emulation: False if the kernel fails or disagrees."""
    return native_disagreement(fmt, device, kind) is None


def native_disagreement(fmt: str, device: torch.device, kind: str = "grouped") -> str | None:
    """:func:`native_agrees`'s test, in this process: None if they agree, else what went wrong."""
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
            except Exception as exc:  # any failure of the native kernel (unsupported layout, build without it)
                return f"{impl} {fmt} {kind} GEMM raised {type(exc).__name__}: {str(exc).strip()[:200]}"
            results[impl] = (out[:rows].float(), a_.grad[:rows].float(), b_.grad.float())
    # bf16 outputs, fast accumulation in the forward: a few bf16 ulps of the largest value
    for name, got, want in zip(("output", "input gradient", "weight gradient"), results["native"],
                               results["emulated"], strict=True):
        if not torch.allclose(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item()):
            err = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
            return f"native {fmt} {kind} {name} disagrees with the emulation (relative error {err:.2e})"
    return None


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
    return "native" if _why_emulated(mode, device, kind) is None else "emulated"


def _why_emulated(mode: str, device: torch.device, kind: str) -> str | None:
    if device.type != "cuda":
        return f"{mode} GEMMs run natively only on CUDA devices; this run is on {device.type}"
    # a bare "cuda" means the current device (as in torch), not device 0
    return _native_status(mode, device.index if device.index is not None else torch.cuda.current_device(), kind)


def probe_error(mode: str, device: torch.device | str, scope: str = "experts") -> str | None:
    """Why ``mode``'s GEMMs of ``scope`` run emulated on ``device`` (the first kind that does), or None."""
    if scope not in SCOPE_KINDS:
        raise ValueError(f"precision scope must be one of {', '.join(SCOPE_KINDS)}; got {scope!r}")
    device = torch.device(device)
    if quant_format(mode) == "none":
        return None
    for kind in SCOPE_KINDS[scope]:
        why = _why_emulated(mode, device, kind)
        if why is not None:
            return f"{kind}: {why}"
    return None


def precision_impl(mode: str, device: torch.device | str, scope: str = "experts") -> str:
    """``native`` or ``emulated``: how ``mode``'s quantized GEMMs of ``scope`` run on ``device``
    (``native`` only when every GEMM kind of the scope does: :func:`probe_error` finds no reason)."""
    return "native" if probe_error(mode, device, scope) is None else "emulated"


def expert_gemms_that_run(backend: str, device_type: str, mode: str, impl: str) -> str:
    """What computes the expert GEMMs of a run with backend ``backend`` (``auto`` resolved) on
    ``device_type`` in precision ``mode`` with ``impl``: ``scaled_grouped_mm`` for native quantized
    GEMMs whatever the backend; the backend's compute-dtype GEMMs under emulation (Triton's, else
    torch's ``grouped_mm``); ``cpu_fused`` off the CPU runs ``grouped_mm``."""
    if quant_format(mode) != "none":
        if impl == "native":
            return "scaled_grouped_mm"
        return "triton" if backend == "triton" else "grouped_mm"
    if backend == "cpu_fused" and device_type != "cpu":
        return "grouped_mm"
    return backend


def padding_flops(x_ND: Tensor, w13_ED2H: Tensor, w2_EHD: Tensor, offsets_E: Tensor, mode: str,
                  impl: str) -> Tensor | None:
    """FLOPs the quantized expert GEMMs of one forward and backward spend on padding rows (a
    zero-dim tensor on the device, no host sync); None where they compute none.

    Only native fp8 does: its weight gradients (of ``w13`` and ``w2``, ``2 * D * 2H + 2 * H * D``
    FLOPs a row) run on every group aligned to 16 rows with zero rows
    (:func:`moebench.kernels.quantized_gemm.aligned_groups`). Emulated GEMMs, MXFP8's weight
    gradient (compute dtype) and every unquantized backend stop at each group's last row. Tile
    tails inside a kernel (e.g. the Triton grouped GEMM's last partial tile of a group) are that
    kernel's efficiency, not padding rows, and are not counted."""
    if quant_format(mode) != "fp8" or impl != "native" or x_ND.dtype != torch.bfloat16:
        return None
    d_model, hidden = w2_EHD.shape[-1], w2_EHD.shape[-2]
    return alignment_padding_rows(offsets_E).to(torch.float64) * (6 * d_model * hidden)


def quantized_experts(x_ND: Tensor, w13_ED2H: Tensor, w2_EHD: Tensor, offsets_E: Tensor, mode: str,
                      rounding: str = "up", backend: str = "grouped_mm", saved: str = "quantized", *,
                      impl: str, swiglu_limit: float | None = None) -> Tensor:
    """The expert MLP with both GEMMs quantized per ``mode``: natively where ``impl`` (resolved once,
    when the precision is applied: :func:`gemm_impl`; never probed here, so a compiled block cannot
    trace into the probe) says so and the input is bf16; the activation between them is SwiGLU,
    clamped at ``swiglu_limit`` when set."""
    native = x_ND.dtype == torch.bfloat16 and impl == "native"
    impl = "native" if native else "emulated"
    h_N2H = quantized_grouped_mm(x_ND, w13_ED2H, offsets_E, mode, impl, rounding, backend, saved)
    act_N2H = expert_activation(h_N2H, swiglu_limit)
    return quantized_grouped_mm(act_N2H, w2_EHD, offsets_E, mode, impl, rounding, backend, saved)
