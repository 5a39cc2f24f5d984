"""The row-wise dispatcher's capacity rules (moebench.parallel.capacity): hand-computed keep
matrices, invariants over random counts, and the receive-side rule through the real dispatcher
on 2 gloo ranks against a single-process reference that applies the same keep rule.

Tolerance (fp32): the dispatcher and the reference run the same per-expert matmuls on the same
rows; only the order of the weighted top-k sum and of the gradient sums differs (a few ulps).
"""

import itertools

import pytest
import torch

from moebench.config import Config
from moebench.errors import ConfigError
from moebench.parallel.capacity import (
    block_rows,
    destination_capacity,
    keep_destination,
    keep_matrix,
    keep_pair,
    max_min_fair,
    pair_capacity,
)
from moebench.testing import run_distributed

# 3 ranks x 2 local experts, 12 routes per source, capacity factor 1.0: the pair rule gives each
# (source, destination) 4 rows, the receive-side rule each destination 12 from all sources.
# Destination 0 is over-full (expert 0 wanted by 13 routes, expert 1 by 4); source 2 sends
# destination 1 six routes for one expert, which the destination can take but a pair cannot.
COUNTS_SDL = torch.tensor([
    [[8, 0], [1, 1], [1, 1]],
    [[3, 2], [2, 1], [2, 2]],
    [[2, 2], [0, 6], [1, 1]],
])
# destination 0: expert 1 (4 routes) is under the fair share 6 and keeps all; expert 0 gets the
# other 8, split max-min fair over its sources' demands 8, 3, 2 -> 3, 3, 2. Destinations 1 and 2
# receive 11 and 8 <= 12 routes: nothing dropped.
KEPT_DESTINATION = torch.tensor([
    [[3, 0], [1, 1], [1, 1]],
    [[3, 2], [2, 1], [2, 2]],
    [[2, 2], [0, 6], [1, 1]],
])
# pair: the first 4 routes per (source, destination) in expert order; source 1's overflow at
# destination 0 lands on expert 1, which is under its share, and source 2 loses 2 at destination 1
KEPT_PAIR = torch.tensor([
    [[4, 0], [1, 1], [1, 1]],
    [[3, 1], [2, 1], [2, 2]],
    [[2, 2], [0, 4], [1, 1]],
])


def test_hand_computed_keep_matrices():
    assert pair_capacity(1.0, 12, 3) == 4 and destination_capacity(1.0, 12, 3) == 12
    assert torch.equal(keep_matrix("destination", COUNTS_SDL, 1.0, 12), KEPT_DESTINATION)
    assert torch.equal(keep_matrix("pair", COUNTS_SDL, 1.0, 12), KEPT_PAIR)
    # both drop 5 routes here, but the pair rule drops one of an expert under its share
    assert (COUNTS_SDL - KEPT_DESTINATION).sum() == 5 and (COUNTS_SDL - KEPT_PAIR).sum() == 7


def test_max_min_fair_remainder_goes_to_lowest_index():
    demand = torch.tensor([[5, 1, 10], [5, 1, 10], [7, 7, 0], [2, 2, 2]])
    # 10: 1 is met, 9 left for two -> 4 each + 1 to the lower index; 9 over [7, 7]: 5, 4; all fit
    got = max_min_fair(demand, torch.tensor([10, 9, 9, 100]))
    assert got.tolist() == [[5, 1, 4], [4, 1, 4], [5, 4, 0], [2, 2, 2]]


def _old_pair_rule(counts_SDL: torch.Tensor, capacity: int) -> torch.Tensor:
    """The original rule, spelled out: per (source, destination) the first C routes in expert order."""
    kept = torch.zeros_like(counts_SDL)
    S, D, L = counts_SDL.shape
    for s, d in itertools.product(range(S), range(D)):
        left = capacity
        for e in range(L):
            kept[s, d, e] = min(left, int(counts_SDL[s, d, e]))
            left -= int(kept[s, d, e])
    return kept


def _random_counts(g: torch.Generator, R: int, L: int, N: int, skew: float) -> torch.Tensor:
    """Each source routes N routes over R * L experts, preferring its own random experts by ``skew``."""
    rows = []
    for _ in range(R):
        logits = skew * 4 * torch.randn(R * L, generator=g)
        idx = torch.multinomial(logits.softmax(0), N, replacement=True, generator=g)
        rows.append(torch.bincount(idx, minlength=R * L).view(R, L))
    return torch.stack(rows)


@pytest.mark.parametrize("R,L,cf", [(2, 2, 1.0), (3, 2, 1.25), (4, 3, 0.5), (8, 4, 1.0)])
def test_keep_rules_invariants(R, L, cf):
    g = torch.Generator().manual_seed(R * 100 + L)
    N = 48
    C = destination_capacity(cf, N, R)
    for skew in (0.0, 0.5, 1.0):
        counts = _random_counts(g, R, L, N, skew)
        kept = keep_destination(counts, C)
        assert torch.equal(keep_pair(counts, pair_capacity(cf, N, R)), _old_pair_rule(counts, pair_capacity(cf, N, R)))
        assert ((kept >= 0) & (kept <= counts)).all()
        assert kept.max() <= block_rows("destination", cf, N, R)  # the transport's blocks hold every grant
        per_dest = kept.sum((0, 2))
        assert (per_dest <= C).all()
        # on the same counts the receive-side rule never keeps fewer rows at a destination than pairs do
        assert (per_dest >= keep_pair(counts, pair_capacity(cf, N, R)).sum((0, 2))).all()
        expert_DL, quota_DL = counts.sum(0), kept.sum(0)
        for d in range(R):
            if expert_DL[d].sum() <= C:
                assert torch.equal(kept[:, d], counts[:, d])  # a destination with room drops nothing
                continue
            assert per_dest[d] == C  # an over-full one fills its capacity
            trimmed = quota_DL[d] < expert_DL[d]
            level = quota_DL[d][trimmed].min()
            # no expert under the level loses a route; the trimmed ones sit at the level (+1 remainder)
            assert (expert_DL[d][~trimmed] <= level + 1).all()
            assert (quota_DL[d][trimmed] <= level + 1).all()
            assert (expert_DL[d][expert_DL[d] <= C // L] == quota_DL[d][expert_DL[d] <= C // L]).all()
            for e in range(L):  # the same over the sources within one expert
                got, want = kept[:, d, e], counts[:, d, e]
                cut = got < want
                if cut.any():
                    assert (want[~cut] <= got[cut].min() + 1).all() and (got[cut] <= got[cut].min() + 1).all()


def test_config_field_validated():
    cfg = Config()
    assert cfg.parallel.rowwise_capacity == "destination"
    with pytest.raises(ConfigError, match=r"parallel\.rowwise_capacity"):
        cfg.set("parallel.rowwise_capacity", "source")


CF = 0.75  # tight enough that the skew below drops routes under both rules


def _dispatch_vs_reference(rule: str):
    """Skewed routing on 2 ranks at capacity 0.75: the dispatcher's forward and gradients (x,
    expert weights) equal a single-process computation that keeps the routes keep_matrix
    grants, by token position within each (source, expert)."""
    import torch.distributed as dist

    from moebench.parallel.dispatch import RowwiseDispatch
    from moebench.train.distributed import init_process_group

    init_process_group("cpu")
    try:
        me, R, E, T, K, D = dist.get_rank(), 2, 4, 16, 2, 8
        L = E // R
        g = torch.Generator().manual_seed(3)  # the same on every rank: each can build the reference
        x_RTD = torch.randn(R, T, D, generator=g)
        # source 0 sends most routes to expert 0, source 1 to expert 2 (its own locality)
        bias_RE = torch.tensor([[3.0, 0, 0, 0], [0, 0, 3.0, 0]])
        idx_RTK = (torch.rand(R, T, E, generator=g) + bias_RE[:, None]).topk(K, dim=-1).indices
        w_RTK = torch.rand(R, T, K, generator=g)
        weight_EDD = torch.randn(E, D, D, generator=g) / D**0.5
        grad_RTD = torch.randn(R, T, D, generator=g)

        # the dispatcher on this rank's tokens and experts
        x_TD = x_RTD[me].clone().requires_grad_(True)
        weight_LDD = weight_EDD[me * L:(me + 1) * L].clone().requires_grad_(True)
        dispatcher = RowwiseDispatch(dist.group.WORLD, E, capacity_factor=CF, rule=rule)
        d = dispatcher.dispatch(x_TD, idx_RTK[me], E)
        ends = d.offsets_E.tolist()
        parts = [torch.tanh(d.x_ND[lo:hi] @ weight_LDD[e])
                 for e, (lo, hi) in enumerate(zip([0, *ends[:-1]], ends, strict=True))]
        y_ND = torch.cat([*parts, d.x_ND[ends[-1]:] * 0])
        out_TD = dispatcher.combine(y_ND, w_RTK[me], d)
        (out_TD * grad_RTD[me]).sum().backward()

        # reference: every rank's tokens in one process, the routes keep_matrix grants
        counts_SDL = torch.stack([torch.bincount(idx_RTK[s].flatten(), minlength=E).view(R, L) for s in range(R)])
        kept_SDL = keep_matrix(rule, counts_SDL, CF, T * K)
        x_ref = x_RTD.clone().requires_grad_(True)
        w_ref = weight_EDD.clone().requires_grad_(True)
        total = 0.0
        for s in range(R):
            flat = idx_RTK[s].flatten()
            seen = [0] * E
            keep = torch.zeros(T * K)
            for r, e in enumerate(flat.tolist()):  # token order: the first routes of an expert are kept
                keep[r] = float(seen[e] < kept_SDL[s, e // L, e % L])
                seen[e] += 1
            y_TKD = torch.tanh(torch.einsum("td,tkde->tke", x_ref[s], w_ref[idx_RTK[s]]))
            out_ref = (y_TKD * (w_RTK[s] * keep.view(T, K))[..., None]).sum(1)
            total = total + (out_ref * grad_RTD[s]).sum()
            if s == me:
                expected_TD = out_ref.detach()
        total.backward()
        return {
            "out": (out_TD.detach() - expected_TD).abs().max().item(),
            "grad_x": (x_TD.grad - x_ref.grad[me]).abs().max().item(),
            "grad_w": (weight_LDD.grad - w_ref.grad[me * L:(me + 1) * L]).abs().max().item(),
            "dropped": int(d.dropped.item()),
            "expected_dropped": int((counts_SDL[me] - kept_SDL[me]).sum()),
        }
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["destination", "pair"])
def test_dispatcher_matches_single_process_keep_rule(rule):
    results = run_distributed(_dispatch_vs_reference, 2, rule)
    for got in results:
        assert got["out"] < 1e-5 and got["grad_x"] < 1e-5 and got["grad_w"] < 1e-5, got
        assert got["dropped"] == got["expected_dropped"]
    assert sum(r["dropped"] for r in results) > 0, "test setup: the capacity must drop routes under this skew"
