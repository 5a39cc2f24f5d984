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
- ``cpu_fused``: on CPU, :func:`moebench.kernels.cpu_experts.fused_experts_cpu` (forward and
  backward one expert at a time, intermediates cache-resident; reads offsets on the host,
  which costs nothing on CPU); on any other device exactly ``grouped_mm``, so it never
  stalls a GPU. With the single-device dispatcher the MoE block goes further and calls
  :meth:`Experts.fused_routes`, which also fuses the gather and the weighted combine in.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moebench.kernels.cpu_experts import fused_experts_cpu, fused_moe_cpu
from moebench.kernels.groups import group_sizes


class _SwiGLU(torch.autograd.Function):
    """``silu(gate) * up`` over a fused ``[gate | up]`` input, with a hand-written backward.

    Autograd's version of ``chunk -> silu -> mul`` ends in a ``cat`` of the two input
    gradients; here they are written straight into the halves of one buffer, and the
    gate gradient uses the single-pass ``silu_backward`` kernel. Same math, fewer passes
    over ``[N, 2H]`` memory (the elementwise tail is a large share of a CPU MoE layer).
    """

    @staticmethod
    def forward(ctx, h_N2H: Tensor) -> Tensor:  # type: ignore[override]
        gate_NH, up_NH = h_N2H.chunk(2, dim=-1)
        silu_NH = F.silu(gate_NH)
        ctx.save_for_backward(h_N2H, silu_NH)
        return silu_NH * up_NH

    @staticmethod
    def backward(ctx, grad_NH: Tensor) -> Tensor:  # type: ignore[override]
        h_N2H, silu_NH = ctx.saved_tensors
        gate_NH, up_NH = h_N2H.chunk(2, dim=-1)
        grad_N2H = torch.empty_like(h_N2H)
        grad_gate_NH, grad_up_NH = grad_N2H.chunk(2, dim=-1)
        torch.mul(grad_NH, silu_NH, out=grad_up_NH)
        torch.ops.aten.silu_backward.grad_input(grad_NH * up_NH, gate_NH, grad_input=grad_gate_NH)
        return grad_N2H


def swiglu(h_N2H: Tensor) -> Tensor:
    """``silu(gate) * up`` where ``h = [gate | up]`` along the last dimension."""
    if h_N2H.requires_grad and h_N2H.dim() == 2:
        return _SwiGLU.apply(h_N2H)
    gate_NH, up_NH = h_N2H.chunk(2, dim=-1)
    return F.silu(gate_NH) * up_NH


def experts_loop(x_ND: Tensor, w13_ED2H: Tensor, w2_EHD: Tensor, offsets_E: Tensor) -> Tensor:
    """Reference: one matmul pair per expert (host offsets)."""
    sizes = group_sizes(offsets_E).tolist()
    padding = x_ND.shape[0] - sum(sizes)  # capacity padding past the last expert: not computed
    # split/unbind (not x[a:b], w[e]): their backward is one cat/stack, not E full-size zero fills.
    chunks = x_ND.split([*sizes, padding])
    experts = zip(chunks[:-1], w13_ED2H.unbind(0), w2_EHD.unbind(0), strict=True)
    outs = [swiglu(x_MD @ w13) @ w2 for x_MD, w13, w2 in experts]
    if padding:
        outs.append(x_ND.new_zeros(padding, w2_EHD.shape[-1]))
    return torch.cat(outs)


def experts_grouped_mm(x_ND: Tensor, w13_ED2H: Tensor, w2_EHD: Tensor, offsets_E: Tensor) -> Tensor:
    """All experts in two grouped GEMMs; gate and up projections fused into one."""
    h_N2H = F.grouped_mm(x_ND, w13_ED2H, offs=offsets_E)
    return F.grouped_mm(swiglu(h_N2H), w2_EHD, offs=offsets_E)


def experts_cpu_fused(x_ND: Tensor, w13_ED2H: Tensor, w2_EHD: Tensor, offsets_E: Tensor) -> Tensor:
    """The per-expert fused kernel on CPU; ``grouped_mm`` (device offsets, no sync) elsewhere."""
    if x_ND.device.type == "cpu":
        return fused_experts_cpu(x_ND, w13_ED2H, w2_EHD, offsets_E)
    return experts_grouped_mm(x_ND, w13_ED2H, w2_EHD, offsets_E)


BACKENDS: dict[str, Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]] = {
    "loop": experts_loop,
    "grouped_mm": experts_grouped_mm,
    "cpu_fused": experts_cpu_fused,
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

    def _compute_dtype(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        w13, w2 = self.w13, self.w2
        if torch.is_autocast_enabled(x.device.type):
            # grouped_mm is not on autocast's op lists: cast explicitly to the compute dtype.
            dtype = torch.get_autocast_dtype(x.device.type)
            x, w13, w2 = x.to(dtype), w13.to(dtype), w2.to(dtype)
        return x, w13, w2

    def fused_routes(self, x_TD: Tensor, idx_TK: Tensor, weight_TK: Tensor) -> Tensor | None:
        """``sum_k weight[t, k] * expert_{idx[t, k]}(x[t])`` in one fused CPU kernel, or None.

        Only the ``cpu_fused`` backend on CPU (unquantized) fuses; None tells the caller to
        dispatch, call :meth:`forward` on the expert-sorted rows, and combine.
        """
        if self.backend != "cpu_fused" or x_TD.device.type != "cpu" or self.precision != "none":
            return None
        x_TD, w13, w2 = self._compute_dtype(x_TD)
        return fused_moe_cpu(x_TD, idx_TK, weight_TK, w13, w2)

    def forward(self, x_ND: Tensor, offsets_E: Tensor) -> Tensor:
        x_ND, w13, w2 = self._compute_dtype(x_ND)
        if self.precision != "none":
            from moebench.kernels.quantized import quantized_experts  # lazy: kernels import this module

            return quantized_experts(x_ND, w13, w2, offsets_E, self.precision, self.mxfp8_rounding, self.backend)
        return BACKENDS[self.backend](x_ND, w13, w2, offsets_E)

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, d_model={self.d_model}, hidden={self.hidden}, backend={self.backend}"
