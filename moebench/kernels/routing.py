"""Routing arithmetic on the device: expert order of the routes, its inverse, the weighted combine.

Shapes: T tokens, K top-k, E experts, N = T*K routes (route r belongs to token r // K), D model dim.
"""

from __future__ import annotations

import torch
from torch import Tensor


def sort_routes(idx_TK: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """Order routes by expert on the device.

    Returns ``order_N`` (route ids in expert order; route r belongs to token r // K),
    ``counts_E`` (int64 routes per expert) and ``offsets_E`` (int32 cumulative ends).
    """
    flat_N = idx_TK.reshape(-1)
    order_N = flat_N.argsort(stable=True)
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=idx_TK.device)
    counts_E.scatter_add_(0, flat_N, torch.ones_like(flat_N))
    offsets_E = counts_E.cumsum(0).to(torch.int32)
    return order_N, counts_E, offsets_E


def inverse_permutation(order_N: Tensor) -> Tensor:
    inv_N = torch.empty_like(order_N)
    inv_N.scatter_(0, order_N, torch.arange(order_N.numel(), device=order_N.device))
    return inv_N


def weighted_sum_routes(y_routes_ND: Tensor, weight_TK: Tensor) -> Tensor:
    """Combine per-route outputs (token-major, N = T*K) into tokens: ``sum_k w_tk * y_tk``.

    A batched matmul rather than ``index_add``: deterministic (no atomics) and one kernel.
    """
    num_tokens, top_k = weight_TK.shape
    y_TKD = y_routes_ND.view(num_tokens, top_k, -1)
    return torch.bmm(weight_TK.unsqueeze(1).to(y_TKD.dtype), y_TKD).squeeze(1)
