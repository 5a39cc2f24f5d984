"""RMSNorm that keeps only what its backward needs (``model.norm_impl=recompute``).

Shapes: N rows (every leading dim), D the normalised width.

torch's ``nn.RMSNorm`` (``model.norm_impl=torch``, the slow twin) leaves its backward the fp32
normalised rows besides the input, and under bf16 autocast the q/k norms get an fp32 upcast of their
bf16 input (:func:`moebench.model.transformer.fp32_norm`), which autograd keeps too.
:class:`RecomputeRMSNorm` computes in fp32 whatever the input dtype, returns the input's dtype, and
saves the input as it came (a view of a tensor already kept costs nothing more) and one fp32 rstd a
row; backward recomputes the normalised rows from them. It is an ``nn.RMSNorm`` (same parameter,
same state dict), so every rule for norms (fp32 gains under FSDP, init) applies to it.
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
    @staticmethod
    def forward(ctx, x_ND: Tensor, w_D: Tensor, eps: float) -> Tensor:
        with torch.autocast(x_ND.device.type, enabled=False):
            x32 = x_ND.float()
            rstd_N1 = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
            y_ND = (x32 * rstd_N1 * w_D.float()).to(x_ND.dtype)
        ctx.save_for_backward(x_ND, rstd_N1, w_D)
        return y_ND

    @staticmethod
    def backward(ctx, grad_y_ND: Tensor) -> tuple[Tensor, Tensor, None]:
        x_ND, rstd_N1, w_D = ctx.saved_tensors
        xhat = x_ND.float() * rstd_N1  # recomputed: the forward kept only x and rstd
        g32 = grad_y_ND.float()
        gw = g32 * w_D.float()
        # d/dx of x * rstd(x): rstd * (g - xhat * mean(g * xhat))
        grad_x = rstd_N1 * (gw - xhat * (gw * xhat).mean(-1, keepdim=True))
        grad_w = (g32 * xhat).flatten(0, -2).sum(0)
        return grad_x.to(x_ND.dtype), grad_w.to(w_D.dtype), None
