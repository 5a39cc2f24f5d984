"""Slow, obviously-correct twins of the MoE layer, for tests and benchmarks.

Shapes: T tokens, D model dim, H expert hidden, E experts, K top-k.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from moebench.kernels.swiglu import swiglu


def clamped_swiglu_reference(gate: Tensor, up: Tensor, limit: float) -> Tensor:
    """gpt-oss's activation as its reference code writes it (alpha 1.702, ``up + 1``)."""
    gate = torch.where(gate > limit, torch.full_like(gate, limit), gate)
    up = torch.where(up > limit, torch.full_like(up, limit), torch.where(up < -limit, torch.full_like(up, -limit), up))
    glu = gate / (1 + torch.exp(-1.702 * gate))
    return (up + 1) * glu


def naive_per_token(x_TD: Tensor, idx_TK: Tensor, weight_TK: Tensor, w13_ED2H: Tensor, w2_EHD: Tensor,
                    swiglu_limit: float | None = None) -> Tensor:
    """Send every token through each of its top-k experts, one (token, k) at a time; the clamped
    SwiGLU (:func:`clamped_swiglu_reference`) at ``swiglu_limit`` when set."""
    rows = []
    for t in range(x_TD.shape[0]):
        acc_D = torch.zeros_like(x_TD[t])
        for k in range(idx_TK.shape[1]):
            e = int(idx_TK[t, k])
            h = x_TD[t] @ w13_ED2H[e]
            gate, up = h.chunk(2)
            act = F.silu(gate) * up if swiglu_limit is None else clamped_swiglu_reference(gate, up, swiglu_limit)
            acc_D = acc_D + weight_TK[t, k].to(x_TD.dtype) * (act @ w2_EHD[e])
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


def naive_attention(q_BHSd: Tensor, k_BGSd: Tensor, v_BGSd: Tensor, window: int | None = None,
                    sinks_H: Tensor | None = None) -> Tensor:
    """Causal attention spelled out: kv heads repeated to the query heads (G kv heads), scores,
    keys outside ``[i - window + 1, i]`` set to -inf, and with ``sinks_H`` one more logit per head in
    the softmax denominator that attends to nothing (gpt-oss's attention sinks)."""
    heads, seq = q_BHSd.shape[1], q_BHSd.shape[2]
    k_BHSd = k_BGSd.repeat_interleave(heads // k_BGSd.shape[1], dim=1)
    v_BHSd = v_BGSd.repeat_interleave(heads // v_BGSd.shape[1], dim=1)
    scores_BHSS = q_BHSd @ k_BHSd.transpose(-1, -2) / q_BHSd.shape[-1] ** 0.5
    for i in range(seq):
        for j in range(seq):
            if j > i or (window is not None and i - j >= window):
                scores_BHSS[..., i, j] = float("-inf")
    if sinks_H is None:
        return scores_BHSS.softmax(-1) @ v_BHSd
    sink_BHS1 = sinks_H[:, None, None].expand(*scores_BHSS.shape[:-1], 1)
    probs = torch.cat([scores_BHSS, sink_BHS1.to(scores_BHSS.dtype)], dim=-1).softmax(-1)
    return probs[..., :-1] @ v_BHSd
