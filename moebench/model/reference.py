"""Slow, obviously-correct twins of the MoE layer, for tests and benchmarks.

Shapes: T tokens, D model dim, H expert hidden, E experts, K top-k.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from moebench.kernels.swiglu import swiglu


def naive_per_token(x_TD: Tensor, idx_TK: Tensor, weight_TK: Tensor, w13_ED2H: Tensor, w2_EHD: Tensor) -> Tensor:
    """Send every token through each of its top-k experts, one (token, k) at a time."""
    rows = []
    for t in range(x_TD.shape[0]):
        acc_D = torch.zeros_like(x_TD[t])
        for k in range(idx_TK.shape[1]):
            e = int(idx_TK[t, k])
            h = x_TD[t] @ w13_ED2H[e]
            gate, up = h.chunk(2)
            acc_D = acc_D + weight_TK[t, k].to(x_TD.dtype) * ((F.silu(gate) * up) @ w2_EHD[e])
        rows.append(acc_D)
    return torch.stack(rows)


def masked_expert_loop(x_TD: Tensor, idx_TK: Tensor, weight_TK: Tensor, w13_ED2H: Tensor, w2_EHD: Tensor) -> Tensor:
    """The common reference style: per expert, mask -> gather -> compute -> index_add."""
    out_TD = torch.zeros_like(x_TD)
    # unbind: one parameter per expert, as in implementations with a ModuleList of experts
    for e, (w13_D2H, w2_HD) in enumerate(zip(w13_ED2H.unbind(0), w2_EHD.unbind(0), strict=True)):
        token_M, slot_M = torch.where(idx_TK == e)
        if token_M.numel() == 0:
            continue
        y_MD = swiglu(x_TD[token_M] @ w13_D2H) @ w2_HD
        out_TD = out_TD.index_add(0, token_M, y_MD * weight_TK[token_M, slot_M, None].to(y_MD.dtype))
    return out_TD
