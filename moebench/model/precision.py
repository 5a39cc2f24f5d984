"""The precision policy of a built model: which GEMMs run quantized (``precision.*``).

``fp8`` / ``mxfp8`` quantize the routed experts' GEMMs (:class:`Experts`); with
``precision.scope=linear`` also every attention projection, dense FFN and shared expert, by
swapping their ``nn.Linear`` for a :class:`QuantizedLinear` that holds the same weight (the
state dict is unchanged). The router, the embedding and the LM head stay in the compute dtype.
Applied from outside, before parallelisation: the model code never knows.

The quantized GEMMs themselves, and whether a device runs them natively, are in
:mod:`moebench.kernels.quantized`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from moebench.config import check_backend_features
from moebench.devices import NATIVE_ALIGN
from moebench.errors import ConfigError
from moebench.kernels.mxfp8 import check_rounding
from moebench.kernels.quantized import SCOPE_KINDS, gemm_impl, quant_format
from moebench.kernels.quantized_gemm import check_saved
from moebench.kernels.quantized_linear import quantized_linear
from moebench.model.experts import Experts
from moebench.model.moe import SwiGLU
from moebench.model.transformer import Attention

# the linears precision.scope=linear quantizes, by the module that holds them
LINEARS: dict[type[nn.Module], tuple[str, ...]] = {Attention: ("wqkv", "wo"), SwiGLU: ("w13", "w2")}


class QuantizedLinear(nn.Linear):
    """An ``nn.Linear`` whose matmul runs quantized per ``precision`` (``"none"``: plain)."""

    precision = "none"
    mxfp8_rounding = "up"
    saved_activations = "quantized"
    precision_impl = "emulated"  # resolved when the precision is applied (apply_precision), never in forward

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> QuantizedLinear:
        """A quantized view of ``linear``: the same parameters, no copy."""
        with torch.device("meta"):
            out = cls(linear.in_features, linear.out_features, bias=False)
        out.weight, out.bias = linear.weight, linear.bias
        return out

    def forward(self, x: Tensor) -> Tensor:
        if self.precision == "none":
            return super().forward(x)
        w = self.weight
        if torch.is_autocast_enabled(x.device.type):
            # the quantized GEMM is not on autocast's op lists: cast explicitly to the compute dtype
            dtype = torch.get_autocast_dtype(x.device.type)
            x, w = x.to(dtype), w.to(dtype)
        native = x.dtype == torch.bfloat16 and self.precision_impl == "native"
        out = quantized_linear(x, w, self.precision, "native" if native else "emulated", self.mxfp8_rounding,
                               self.saved_activations)
        return out if self.bias is None else out + self.bias.to(out.dtype)


def _check_dims(quant: str, kind: str, device: torch.device, dims: dict[str, int], what: str) -> None:
    """ConfigError unless every dim is a multiple of 32 (MXFP8 blocks) and, where ``kind`` runs
    natively, of the native kernel's alignment."""
    need = 32 if quant == "mxfp8" else 1
    native = any(d % NATIVE_ALIGN[quant] for d in dims.values()) and gemm_impl(quant, device, kind) == "native"
    if native:
        need = NATIVE_ALIGN[quant]
    if any(d % need for d in dims.values()):
        how = f"runs natively on {device} and needs" if native else "needs"
        sizes = " and ".join(f"{name} ({d})" for name, d in dims.items())
        raise ConfigError(f"precision.mode={quant} {how} {sizes} {what}to be multiples of {need}")


def apply_expert_precision(model: nn.Module, mode: str, rounding: str = "up", saved: str = "quantized") -> int:
    """Set every :class:`Experts` module of ``model`` to ``mode``; return how many were set.

    fp32/bf16/auto leave the experts unquantized (the compute dtype comes from autocast).
    """
    check_rounding(rounding)
    check_saved(saved)
    quant = quant_format(mode)
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    if quant != "none":
        for module in experts:
            _check_dims(quant, "grouped", module.w13.device,
                        {"model.d_model": module.d_model, "moe.expert_hidden": module.hidden}, "")
    for module in experts:
        module.precision = quant
        module.mxfp8_rounding = rounding
        module.saved_activations = saved
        module.precision_impl = gemm_impl(quant, module.w13.device, "grouped") if quant != "none" else "native"
        check_backend_features(module.backend, module.features())
    return len(experts)


def quantized_linears(model: nn.Module) -> list[tuple[str, nn.Module, str, nn.Linear]]:
    """``(path, parent, attribute, linear)`` of every linear ``precision.scope=linear`` quantizes."""
    out = []
    for path, module in model.named_modules():
        for name in LINEARS.get(type(module), ()):
            out.append((f"{path}.{name}" if path else name, module, name, getattr(module, name)))
    return out


def apply_precision(model: nn.Module, mode: str, rounding: str = "up", scope: str = "experts",
                    saved: str = "quantized") -> int:
    """Apply the precision policy: the experts (:func:`apply_expert_precision`), then under
    ``scope="linear"`` the dense linears (any other scope or mode turns linears swapped earlier
    back to plain matmuls). Returns how many modules were set, as :func:`apply_expert_precision`."""
    if scope not in SCOPE_KINDS:
        raise ValueError(f"precision scope must be one of {', '.join(SCOPE_KINDS)}; got {scope!r}")
    count = apply_expert_precision(model, mode, rounding, saved)
    quant = quant_format(mode) if scope == "linear" else "none"
    for path, parent, name, linear in quantized_linears(model):
        if quant == "none" and not isinstance(linear, QuantizedLinear):
            continue
        count += 1
        if quant != "none":
            _check_dims(quant, "linear", linear.weight.device,
                        {"in_features": linear.in_features, "out_features": linear.out_features},
                        f"of {path} (precision.scope=linear) ")
        if not isinstance(linear, QuantizedLinear):
            linear = QuantizedLinear.from_linear(linear)
            setattr(parent, name, linear)
        linear.precision, linear.mxfp8_rounding, linear.saved_activations = quant, rounding, saved
        linear.precision_impl = gemm_impl(quant, linear.weight.device, "linear") if quant != "none" else "native"
    return count
