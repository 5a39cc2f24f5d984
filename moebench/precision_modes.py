"""The precision modes, spelled once. ``precision.mode`` takes :data:`ConfigMode` (its ``Literal`` is
the config's allowed values); a run resolves ``auto`` to bf16 on a GPU and fp32 on a CPU
(``PrecisionConfig.resolved_mode``), and the run record's ``precision`` is one of :data:`MODES`.

fp8 / mxfp8 compute in bf16 with quantized GEMMs (fp8: E4M3 + one scale per row; mxfp8: E4M3 + one
E8M0 scale per 32 elements), docs/precision.md. No imports beyond typing: the config, the kernels,
the planner, the benches and the report all read these.
"""

from __future__ import annotations

from typing import Literal, get_args

QuantMode = Literal["fp8", "mxfp8"]  # the quantized GEMM formats
UnquantizedMode = Literal["auto", "fp32", "bf16"]
ConfigMode = Literal[UnquantizedMode, QuantMode]

QUANT_MODES: tuple[str, ...] = get_args(QuantMode)
UNQUANTIZED_MODES: tuple[str, ...] = get_args(UnquantizedMode)
# what a run resolves to (``auto`` is not one)
MODES: tuple[str, ...] = tuple(m for m in get_args(ConfigMode) if m != "auto")
# the modes that compute in bf16: bf16 itself and the quantized ones
BF16_MODES: tuple[str, ...] = ("bf16", *QUANT_MODES)
