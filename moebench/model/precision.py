"""The precision policy of a built model: which expert GEMMs run quantized (``precision.mode``).

The quantized GEMMs themselves, and whether a device runs them natively, are in
:mod:`moebench.kernels.quantized`.
"""

from __future__ import annotations

from torch import nn

from moebench.devices import NATIVE_ALIGN
from moebench.errors import ConfigError
from moebench.kernels.mxfp8 import check_rounding
from moebench.kernels.quantized import MODES, QUANT_MODES, precision_impl
from moebench.model.experts import Experts


def apply_expert_precision(model: nn.Module, mode: str, rounding: str = "up") -> int:
    """Set every :class:`Experts` module of ``model`` to ``mode``; return how many were set.

    fp32/bf16/auto leave the experts unquantized (the compute dtype comes from autocast).
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
    if quant in QUANT_MODES:
        align = NATIVE_ALIGN[quant]
        for module in experts:
            if (module.d_model % align or module.hidden % align) and \
                    precision_impl(quant, module.w13.device) == "native":
                raise ConfigError(f"precision.mode={quant} runs natively on {module.w13.device} and needs "
                                  f"model.d_model ({module.d_model}) and moe.expert_hidden ({module.hidden}) "
                                  f"to be multiples of {align}")
    for module in experts:
        module.precision = quant
        module.mxfp8_rounding = rounding
    return len(experts)
