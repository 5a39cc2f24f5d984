"""SwiGLU's elementwise part, ``silu(gate) * up`` over a fused ``[gate | up]`` buffer, and
gpt-oss's clamped variant (:func:`swiglu_clamped`).

Shapes: N rows, H hidden.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


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
        if torch.compiler.is_compiling():  # dynamo cannot trace out= into strided halves; inductor fuses the cat
            return torch.cat([torch.ops.aten.silu_backward(grad_NH * up_NH, gate_NH), grad_NH * silu_NH], dim=-1)
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


# gpt-oss's sigmoid slope: gate * sigmoid(1.702 * gate) approximates GELU
GPT_OSS_ALPHA = 1.702


def swiglu_clamped(h_N2H: Tensor, limit: float) -> Tensor:
    """gpt-oss's SwiGLU with ``h = [gate | up]``: ``gate`` clamped above at ``limit``, ``up`` to
    ``[-limit, limit]``, then ``gate * sigmoid(1.702 gate) * (up + 1)`` (``moe.swiglu_limit``)."""
    gate_NH, up_NH = h_N2H.chunk(2, dim=-1)
    gate_NH = gate_NH.clamp(max=limit)
    up_NH = up_NH.clamp(-limit, limit)
    return gate_NH * torch.sigmoid(GPT_OSS_ALPHA * gate_NH) * (up_NH + 1)


def expert_activation(h_N2H: Tensor, limit: float | None = None) -> Tensor:
    """The routed experts' activation: :func:`swiglu`, or :func:`swiglu_clamped` at ``limit``."""
    return swiglu(h_N2H) if limit is None else swiglu_clamped(h_N2H, limit)


# The activation's two factors written into caller-owned buffers, for kernels that run it one
# expert at a time (moebench.kernels.cpu_experts): ``act = glu(gate) * up_term(up)``, with
# ``glu = silu`` and ``up_term = up`` for SwiGLU, and gpt-oss's clamped forms at ``limit``.


def glu_out(gate_MH: Tensor, limit: float | None, out: Tensor) -> Tensor:
    """``silu(gate)``, or at ``limit`` ``g * sigmoid(1.702 g)`` with ``g = min(gate, limit)``, into ``out``."""
    if limit is None:
        return torch.ops.aten.silu.out(gate_MH, out=out)
    torch.clamp(gate_MH, max=limit, out=out)
    return out.mul_(torch.sigmoid(out * GPT_OSS_ALPHA))


def up_term(up_MH: Tensor, limit: float | None) -> Tensor:
    """``up``, or at ``limit`` ``clamp(up, -limit, limit) + 1`` (a new tensor)."""
    return up_MH if limit is None else up_MH.clamp(-limit, limit).add_(1)


def glu_backward_out(grad_MH: Tensor, gate_MH: Tensor, limit: float | None, out: Tensor) -> Tensor:
    """``grad * d glu / d gate`` into ``out``: zero where the clamp cut ``gate`` (``gate > limit``)."""
    if limit is None:
        return torch.ops.aten.silu_backward.grad_input(grad_MH, gate_MH, grad_input=out)
    g = gate_MH.clamp(max=limit)
    s = torch.sigmoid(g * GPT_OSS_ALPHA)
    # d/dg g*s(a g) = s + a g s (1 - s)
    torch.mul(grad_MH, (1 - s).mul_(g).mul_(GPT_OSS_ALPHA).add_(1).mul_(s), out=out)
    return out.masked_fill_(gate_MH > limit, 0)


def up_backward_(grad_up_MH: Tensor, up_MH: Tensor, limit: float | None) -> Tensor:
    """The gradient of ``up_term`` applied in place to ``grad_up``: zero where the clamp cut ``up``."""
    return grad_up_MH if limit is None else grad_up_MH.masked_fill_(up_MH.abs() > limit, 0)
