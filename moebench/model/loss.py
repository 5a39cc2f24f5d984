"""The language-model loss every strategy optimises (pipeline stages included).

Shapes: B batch, S sequence, T = B x S tokens, D model dim, V vocab, c tokens of one chunk.

Two implementations of the same mean next-token cross-entropy:

- :func:`lm_loss`, the reference: the LM head's full ``[T, V]`` logits in, their fp32 copy and
  log-softmax saved for backward (what ``model.loss_chunk_tokens=none`` runs);
- :func:`chunked_lm_loss`, the LM head fused with the loss (``model.loss_chunk_tokens=c``): the
  logits exist one chunk of ``c`` tokens at a time, and each chunk's gradients with respect to
  the head's input and weight are computed in the forward, so backward only scales them. What
  stays alive from forward to backward is the input gradient ``[T, D]`` and the weight gradient
  ``[V, D]``, both in the compute dtype, instead of ``[T, V]`` fp32 tensors. The FLOPs are the
  reference's (one logits GEMM and two gradient GEMMs per token), moved into the forward. Targets
  are all real tokens (no ignore index), as the reference's are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def lm_loss(logits_BSV: Tensor, targets_BS: Tensor) -> Tensor:
    """Mean next-token cross-entropy, computed in fp32."""
    return F.cross_entropy(logits_BSV.float().flatten(0, 1), targets_BS.flatten())


def chunked_lm_loss(h_BSD: Tensor, weight_VD: Tensor, targets_BS: Tensor, chunk_tokens: int) -> Tensor:
    """``lm_loss(h_BSD @ weight_VD.T, targets_BS)`` with the logits computed ``chunk_tokens`` tokens
    at a time. Under autocast the GEMMs run in the autocast dtype, as the reference head's do, and
    the log-softmax in fp32."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1")
    device = h_BSD.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight_VD.dtype
    # the casts outside the Function: autograd casts the gradients back to h's and the weight's dtype
    return _FusedHeadLoss.apply(h_BSD.flatten(0, 1).to(dtype), weight_VD.to(dtype), targets_BS.flatten(),
                                chunk_tokens)


class _FusedHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_TD: Tensor, w_VD: Tensor, targets_T: Tensor, chunk: int) -> Tensor:
        T = h_TD.shape[0]
        with torch.autocast(h_TD.device.type, enabled=False):  # the dtypes are chosen by the caller
            grad_h_TD = torch.empty_like(h_TD)
            grad_w_VD = torch.zeros(w_VD.shape, dtype=torch.float32, device=w_VD.device)  # summed over chunks
            total = torch.zeros((), dtype=torch.float32, device=h_TD.device)
            for start in range(0, T, chunk):
                h_cD, t_c = h_TD[start:start + chunk], targets_T[start:start + chunk]
                logits_cV = (h_cD @ w_VD.T).float()
                lse_c = torch.logsumexp(logits_cV, dim=-1)
                total += (lse_c - logits_cV.gather(1, t_c[:, None]).squeeze(1)).sum()
                # d(mean loss)/d(logits) = (softmax - one_hot(target)) / T, in place of the fp32 logits
                grad_cV = logits_cV.sub_(lse_c[:, None]).exp_()
                grad_cV[torch.arange(len(t_c), device=t_c.device), t_c] -= 1.0
                g_cV = grad_cV.div_(T).to(h_TD.dtype)
                torch.mm(g_cV, w_VD, out=grad_h_TD[start:start + chunk])
                if g_cV.dtype == torch.float32:
                    grad_w_VD.addmm_(g_cV.T, h_cD)
                else:  # a bf16 GEMM rounds its output once, as the reference's weight gradient does
                    grad_w_VD.add_(g_cV.T @ h_cD)
        ctx.save_for_backward(grad_h_TD, grad_w_VD.to(w_VD.dtype))
        return total / T

    @staticmethod
    def backward(ctx, grad_loss: Tensor) -> tuple[Tensor, Tensor, None, None]:
        grad_h_TD, grad_w_VD = ctx.saved_tensors
        return grad_h_TD * grad_loss.to(grad_h_TD.dtype), grad_w_VD * grad_loss.to(grad_w_VD.dtype), None, None
