"""Capacity rules of the row-wise dispatcher: which routes each (source, destination) pair keeps.

Shapes: R EP ranks (S sources = D destinations = R), L local experts per rank, N = T*K routes
per source rank. Inputs are the exchanged counts ``counts_SDL`` (routes source s sends to
local expert l of destination d), identical on every rank, so every rank computes the same
keep matrix ``kept_SDL`` on the device with no host sync. Within one (source, expert) the
routes kept are the first ones by token position (routes are sorted stably by expert).

- ``pair`` (the original rule): every (source, destination) pair has its own capacity
  ``C = ceil(capacity_factor * N / R)``; a source keeps, per destination, the first C routes in
  expert order, so a pair's overflow falls on the destination's highest-numbered experts.
- ``destination`` (receive-side, as OLMo-core's no-sync row-wise EP): each destination rank
  has one capacity ``R * C`` (the rows its receive buffer already held under ``pair``;
  ``ceil(capacity_factor * N)`` rounded up to a multiple of R) shared by all sources. An
  over-full destination gives it max-min fair over its local experts (water-filling: an
  expert at or under its fair share keeps every route; only experts above it are trimmed, to
  a common level), then each expert's quota max-min fair over the sources. A remainder row
  that does not split evenly goes to the lowest index (expert, then source).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

CAPACITY_RULES = ("destination", "pair")


def pair_capacity(capacity_factor: float, num_routes: int, ranks: int) -> int:
    """Rows each source may send each destination under ``pair`` (from shapes only)."""
    return max(1, math.ceil(capacity_factor * num_routes / ranks))


def destination_capacity(capacity_factor: float, num_routes: int, ranks: int) -> int:
    """Rows one destination receives at most, over all sources (the same under both rules)."""
    return ranks * pair_capacity(capacity_factor, num_routes, ranks)


def block_rows(rule: str, capacity_factor: float, num_routes: int, ranks: int) -> int:
    """Rows of one (source, destination) block of the fixed-size all-to-all: the most a pair can
    keep. ``destination`` may grant one source the whole receive capacity (never more than the
    source's ``num_routes``), so its blocks are larger than ``pair``'s and mostly padding; the
    record's ``comm_bytes_padding`` counts them."""
    if rule == "pair":
        return pair_capacity(capacity_factor, num_routes, ranks)
    return min(num_routes, destination_capacity(capacity_factor, num_routes, ranks))


def max_min_fair(demand_BX: Tensor, capacity_B: Tensor) -> Tensor:
    """Integer max-min fair split of ``capacity_B`` over the X demands of each row (water-filling).

    Demands at or under the common level are met in full; the others get the level, and the
    rows of a remainder go to the lowest indices among them. Rows whose total demand fits keep
    everything. Sort, cumsum and gathers only: no host sync, no data-dependent shape.
    """
    X = demand_BX.shape[-1]
    sorted_BX, order_BX = demand_BX.sort(dim=-1, stable=True)  # ascending; ties by index
    before_BX = sorted_BX.cumsum(-1) - sorted_BX  # demand of the smaller ones
    left_BX = capacity_B.unsqueeze(-1) - before_BX  # capacity left for positions k..X-1
    share_k = X - torch.arange(X, device=demand_BX.device)  # how many share what is left at position k
    # position k is met in full when its demand fits the equal split of what is left; sorted
    # ascending, the met positions are a prefix (its length m, 0..X)
    met_BX = sorted_BX * share_k <= left_BX
    m_B = met_BX.long().cumprod(-1).sum(-1)
    m_B1 = m_B.unsqueeze(-1)
    rest_B1 = left_BX.gather(-1, m_B1.clamp(max=X - 1))
    sharers_B1 = (X - m_B1).clamp(min=1)
    level_B1, extra_B1 = rest_B1 // sharers_B1, rest_B1 % sharers_B1
    # among the trimmed (sorted position >= m), the `extra` lowest original indices get one more
    trimmed_sorted_BX = share_k <= X - m_B1
    trimmed_BX = torch.zeros_like(trimmed_sorted_BX).scatter(-1, order_BX, trimmed_sorted_BX)
    rank_BX = trimmed_BX.long().cumsum(-1) - 1  # order of a trimmed demand by original index
    trimmed_alloc_BX = level_B1 + (rank_BX < extra_B1).long()
    return demand_BX.where(~trimmed_BX, trimmed_alloc_BX)


def keep_pair(counts_SDL: Tensor, capacity: int) -> Tensor:
    """``pair``: per (source, destination), the first ``capacity`` routes in expert order."""
    before_SDL = counts_SDL.cumsum(-1) - counts_SDL
    return (capacity - before_SDL).clamp(min=0).minimum(counts_SDL)


def keep_destination(counts_SDL: Tensor, capacity: int) -> Tensor:
    """``destination``: one receive capacity per destination, max-min fair over its local
    experts, then each expert's quota max-min fair over the sources."""
    R, _, L = counts_SDL.shape
    expert_DL = counts_SDL.sum(0)
    quota_DL = max_min_fair(expert_DL, expert_DL.new_full((R,), capacity))
    per_source_XS = counts_SDL.permute(1, 2, 0).reshape(R * L, R)  # [(destination, expert), source]
    kept_XS = max_min_fair(per_source_XS, quota_DL.reshape(R * L))
    return kept_XS.view(R, L, R).permute(2, 0, 1).contiguous()


def keep_matrix(rule: str, counts_SDL: Tensor, capacity_factor: float, num_routes: int) -> Tensor:
    """``kept_SDL`` under ``rule`` (``destination`` | ``pair``) for sources of ``num_routes`` routes."""
    R = counts_SDL.shape[0]
    if rule == "pair":
        return keep_pair(counts_SDL, pair_capacity(capacity_factor, num_routes, R))
    if rule == "destination":
        return keep_destination(counts_SDL, destination_capacity(capacity_factor, num_routes, R))
    raise ValueError(f"unknown row-wise capacity rule {rule!r}; expected one of {', '.join(CAPACITY_RULES)}")
