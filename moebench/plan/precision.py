"""Byte widths and the quantized-GEMM implementation the planner uses for each precision mode,
mirroring how moebench trains.

moebench keeps parameters in fp32 (they are the master weights) and computes under
autocast, so in ``bf16`` mode matmul inputs and outputs are bf16 while the residual
stream, norms and parameters stay fp32. The ``fp8`` / ``mxfp8`` modes are bf16 plus
quantized GEMMs (:mod:`moebench.kernels.quantized_gemm`, planned by
:mod:`moebench.plan.quantized`): E4M3 operands with one scale per row/column (``fp8``) or one
E8M0 scale per 32 elements (``mxfp8``), in the routed experts (``precision.scope=experts``) or
also in every attention projection, dense FFN and shared expert (``linear``); the GEMMs save
their E4M3 operands for backward (``precision.saved_activations=quantized``) or their
compute-dtype inputs (``compute``). Whether they run ``native`` (fp8 tensor cores) or
``emulated`` (quantize -> dequantize -> compute-dtype GEMM) depends on the GPU: the trainer's
:data:`moebench.devices.NATIVE_CAPABILITY` against the device's compute capability (the hardware);
the planner's assumptions add where the pinned torch's allow-list or the installed torch would not.
Tokens are quantized for the dispatch in ``mxfp8`` mode (E4M3 rows + E8M0 scales on the wire,
forward only); every other EP transfer carries compute-dtype rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from moebench.config import SCOPE_KINDS, Config
from moebench.devices import NATIVE_CAPABILITY, Device
from moebench.precision_modes import QUANT_MODES

MX_BLOCK = 32  # elements sharing one E8M0 scale byte in MXFP8
# (fmt, GEMM kind) -> why the installed torch has no native kernel for it, or None
KernelGap = Callable[[str, str], "str | None"]


@dataclass(frozen=True)
class Precision:
    mode: str  # resolved: fp32 | bf16 | fp8 | mxfp8
    compute_bytes: int  # matmul operands/outputs under autocast (4 in fp32 mode)
    impl: str = "native"  # the run record's precision_impl: native | emulated (quantized GEMMs)
    scope: str = "experts"  # precision.scope: experts | linear
    saved: str = "quantized"  # precision.saved_activations: quantized | compute
    param_dtype: str = "fp32"  # precision.param_dtype: fp32 (autocast) | bf16 (bf16 compute weights, fp32 main)

    @property
    def param_bytes(self) -> int:
        """Bytes of a held parameter: fp32 master weights, or bf16 compute weights."""
        return 2 if self.param_dtype == "bf16" else 4

    @property
    def casts_weights(self) -> bool:
        """Autocast casts fp32 weights to the compute dtype, and the casts are saved for backward."""
        return self.mixed and self.param_dtype == "fp32"

    @property
    def mixed(self) -> bool:
        """Matmuls run in a narrower dtype than fp32 (autocast, or bf16 parameters)."""
        return self.compute_bytes != 4

    @property
    def quantized(self) -> bool:
        return self.mode in QUANT_MODES

    @property
    def quant_bytes(self) -> float:
        """Bytes per quantized element, its share of the scales included (per-row fp8 scales
        are one per thousands of elements and left out)."""
        return 1 + 1 / MX_BLOCK if self.mode == "mxfp8" else 1.0

    @property
    def saves_quantized(self) -> bool:
        """The quantized GEMMs keep E4M3 operands (``quant_bytes`` each) for backward."""
        return self.quantized and self.saved == "quantized"

    @property
    def linears_quantized(self) -> bool:
        """Attention projections, dense FFNs and the shared expert run quantized too."""
        return self.quantized and self.scope == "linear"


def plan_precision(cfg: Config, device: Device | None) -> Precision:
    """The mode and implementation the trainer would run on ``device`` (None: on CPU).

    ``auto`` is bf16 on GPU and fp32 on CPU. Quantized modes run natively where the device's
    compute capability reaches the format's native kernel, emulated elsewhere (always on CPU);
    the trainer confirms it with a probe at run time, so a torch build without the kernel
    runs emulated where this says native.
    """
    mode = cfg.precision.resolved_mode(on_gpu=device is not None)
    impl = "native"
    if mode in NATIVE_CAPABILITY:
        native = device is not None and device.compute_capability >= NATIVE_CAPABILITY[mode]
        impl = "native" if native else "emulated"
    return Precision(mode=mode, compute_bytes=4 if mode == "fp32" else 2, impl=impl, scope=cfg.precision.scope,
                     saved=cfg.precision.saved_activations, param_dtype=cfg.precision.param_dtype)


def installed_torch_gap(prec: Precision, kernel_gap: KernelGap | None) -> str | None:
    """Why the torch where the plan is made would run ``prec``'s native GEMMs emulated on any device
    (``kernel_gap(fmt, kind)``: :func:`moebench.kernels.quantized.missing_kernel`, passed in by the
    command line because plan imports no torch), or None (no gap, or ``kernel_gap`` not given). The
    kernels' own device allow-list only shows on a GPU: the trainer's probe checks it at run time."""
    if kernel_gap is None or not prec.quantized or prec.impl != "native":
        return None
    gaps = [why for kind in SCOPE_KINDS[prec.scope] if (why := kernel_gap(prec.mode, kind))]
    return "; ".join(dict.fromkeys(gaps)) or None
