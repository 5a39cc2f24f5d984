"""RMSNorm that keeps only what its backward needs (``model.norm_impl=recompute``).

Shapes: N rows (every leading dim), D the normalised width.

torch's ``nn.RMSNorm`` (``model.norm_impl=torch``, the slow twin) leaves its backward the fp32
normalised rows besides the input, and under bf16 autocast the q/k norms get an fp32 upcast of their
bf16 input (:func:`moebench.model.transformer.fp32_norm`), which autograd keeps too.
:class:`RecomputeRMSNorm` computes in at least fp32 whatever the input dtype, returns the input's
dtype, and saves the input as it came (a view of a tensor already kept costs nothing more) and one
rstd a row (fp32; float64 for float64 input); backward recomputes the normalised rows from them. It
is an ``nn.RMSNorm`` (same parameter, same state dict), so every rule for norms (fp32 gains under
FSDP, init) applies to it.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from moebench.config import ModelConfig


class RecomputeRMSNorm(nn.RMSNorm):
    def forward(self, x: Tensor) -> Tensor:
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        return _RMSNorm.apply(x, self.weight, eps)


def make_norm(cfg: ModelConfig, width: int) -> nn.RMSNorm:
    """The RMSNorm ``model.norm_impl`` selects, over ``width`` features."""
    norm = RecomputeRMSNorm if cfg.norm_impl == "recompute" else nn.RMSNorm
    return norm(width, eps=cfg.norm_eps)


class _RMSNorm(torch.autograd.Function):
    """Few ops over the rows: the forward is one call of torch's ``_fused_rms_norm`` (normalised rows
    and rstd together; on CPU torch composes it of a few elementwise and reducing ops); the backward is
    seven elementwise or reducing ops, with ``gw = g * w`` and ``xhat = x * rstd``:
    ``grad_x = rstd * gw - x * rstd^3 * <gw, x> / D`` and ``grad_w = sum over rows of g * x * rstd``."""

    @staticmethod
    def forward(ctx, x_ND: Tensor, w_D: Tensor, eps: float) -> Tensor:
        dt = torch.promote_types(x_ND.dtype, torch.float32)  # at least fp32
        with torch.autocast(x_ND.device.type, enabled=False):
            y_ND, rstd_N1 = torch.ops.aten._fused_rms_norm(x_ND.to(dt), [x_ND.shape[-1]], w_D.to(dt), eps)
        ctx.save_for_backward(x_ND, rstd_N1, w_D)
        return y_ND.to(x_ND.dtype)

    @staticmethod
    def backward(ctx, grad_y_ND: Tensor) -> tuple[Tensor, Tensor, None]:
        x_ND, rstd_N1, w_D = ctx.saved_tensors
        dt = rstd_N1.dtype
        x32, g32 = x_ND.to(dt), grad_y_ND.to(dt)  # recomputed from x and rstd: the forward kept no more
        gw = g32 * w_D.to(dt)
        coef_N1 = (gw * x32).sum(-1, keepdim=True).mul_(rstd_N1.pow(3)).div_(-x_ND.shape[-1])
        grad_x = gw.mul_(rstd_N1).addcmul_(x32, coef_N1)
        grad_w = torch.mv((g32 * x32).flatten(0, -2).t(), rstd_N1.flatten())
        return grad_x.to(x_ND.dtype), grad_w.to(w_D.dtype), None
