"""Routed SwiGLU experts with stacked weights and interchangeable compute backends.

Shapes: N expert-sorted rows, D model dim, H expert hidden, E local experts.

Input is an expert-sorted buffer ``x_ND`` with int32 cumulative ``offsets_E`` (``offsets[e]``
is the end row of expert e). Rows past ``offsets[-1]`` (padding of capacity buffers) are
not computed: their output is undefined and callers must not read it.

Backends:
- ``loop``: one matmul per expert, slicing on host offsets. The readable reference; it
  syncs to read the offsets.
- ``grouped_mm``: ``torch.nn.functional.grouped_mm`` over the whole buffer; offsets stay
  on the device (on SM90/SM100; other devices fall back to a per-group loop inside torch).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def swiglu(h_N2H: Tensor) -> Tensor:
    gate_NH, up_NH = h_N2H.chunk(2, dim=-1)
    return F.silu(gate_NH) * up_NH


def experts_loop(x_ND: Tensor, w13_ED2H: Tensor, w2_EHD: Tensor, offsets_E: Tensor) -> Tensor:
    """Reference: one matmul pair per expert (host offsets)."""
    out_ND = torch.zeros(x_ND.shape[0], w2_EHD.shape[-1], dtype=x_ND.dtype, device=x_ND.device)
    start = 0
    for e, end in enumerate(offsets_E.tolist()):
        if end > start:
            out_ND[start:end] = swiglu(x_ND[start:end] @ w13_ED2H[e]) @ w2_EHD[e]
        start = end
    return out_ND


def experts_grouped_mm(x_ND: Tensor, w13_ED2H: Tensor, w2_EHD: Tensor, offsets_E: Tensor) -> Tensor:
    """All experts in two grouped GEMMs; gate and up projections fused into one."""
    h_N2H = F.grouped_mm(x_ND, w13_ED2H, offs=offsets_E)
    return F.grouped_mm(swiglu(h_N2H), w2_EHD, offs=offsets_E)


BACKENDS: dict[str, Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]] = {
    "loop": experts_loop,
    "grouped_mm": experts_grouped_mm,
}


def register_backend(name: str, fn: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]) -> None:
    """Add an expert compute backend (e.g. a Triton grouped GEMM) selectable by name."""
    BACKENDS[name] = fn


class Experts(nn.Module):
    """``num_experts`` SwiGLU experts, weights stacked along dim 0 (sharded by EP)."""

    def __init__(self, num_experts: int, d_model: int, hidden: int, backend: str = "grouped_mm") -> None:
        super().__init__()
        self.num_experts = num_experts
        self.d_model = d_model
        self.hidden = hidden
        self.backend = backend
        # Quantized expert GEMMs ("fp8" | "mxfp8"), set from precision.mode by
        # moebench.kernels.quantized.apply_expert_precision; "none" computes in the input dtype.
        self.precision = "none"
        self.mxfp8_rounding = "up"
        self.w13 = nn.Parameter(torch.empty(num_experts, d_model, 2 * hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, d_model))

    def init_weights(self, std: float, out_std: float, generator: torch.Generator | None = None) -> None:
        nn.init.trunc_normal_(self.w13, std=std, a=-3 * std, b=3 * std, generator=generator)
        nn.init.trunc_normal_(self.w2, std=out_std, a=-3 * out_std, b=3 * out_std, generator=generator)

    def forward(self, x_ND: Tensor, offsets_E: Tensor) -> Tensor:
        w13, w2 = self.w13, self.w2
        if torch.is_autocast_enabled(x_ND.device.type):
            # grouped_mm is not on autocast's op lists: cast explicitly to the compute dtype.
            dtype = torch.get_autocast_dtype(x_ND.device.type)
            x_ND, w13, w2 = x_ND.to(dtype), w13.to(dtype), w2.to(dtype)
        if self.precision != "none":
            from moebench.kernels.quantized import quantized_experts  # lazy: kernels import this module

            return quantized_experts(x_ND, w13, w2, offsets_E, self.precision, self.mxfp8_rounding, self.backend)
        return BACKENDS[self.backend](x_ND, w13, w2, offsets_E)

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, d_model={self.d_model}, hidden={self.hidden}, backend={self.backend}"
