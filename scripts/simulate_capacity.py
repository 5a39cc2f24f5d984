"""Dropped share of routes under the row-wise capacity rules, simulated at the reference shape.

Seeded routing, no model: each of R source ranks routes T tokens to top-K of E experts,
sampled without replacement (Gumbel top-k) from its own distribution ``softmax(skew * z_s)``
with ``z_s ~ N(0, 1)`` per (source, expert): skew 0 is uniform routing, larger skews give each
source its own favourite experts (data locality, learned routing) while the experts' load over
all sources stays near balanced. The keep matrix is the dispatcher's own
(``moebench.parallel.capacity.keep_matrix``). Prints a markdown table, mean over seeds.

    python scripts/simulate_capacity.py            # E=128, top-4, EP8, 8192 tokens per rank
"""

from __future__ import annotations

import argparse

import torch

from moebench.parallel.capacity import keep_matrix


def counts_for(g: torch.Generator, ranks: int, experts: int, tokens: int, top_k: int, skew: float) -> torch.Tensor:
    """``[source, destination, local expert]`` route counts of one simulated step."""
    rows = []
    for _ in range(ranks):
        logits_E = skew * torch.randn(experts, generator=g)
        gumbel_TE = -torch.log(-torch.log(torch.rand(tokens, experts, generator=g).clamp_min(1e-20)))
        idx_TK = (logits_E + gumbel_TE).topk(top_k, dim=-1).indices
        rows.append(torch.bincount(idx_TK.flatten(), minlength=experts).view(ranks, experts // ranks))
    return torch.stack(rows)


def dropped_share(rule: str, counts_SDL: torch.Tensor, capacity_factor: float, num_routes: int) -> float:
    kept = keep_matrix(rule, counts_SDL, capacity_factor, num_routes)
    return float((counts_SDL - kept).sum() / counts_SDL.sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--ep", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per rank")
    ap.add_argument("--seeds", type=int, default=5)
    args = ap.parse_args()
    N = args.tokens * args.top_k
    print(f"E={args.experts}, top-{args.top_k}, EP{args.ep}, {args.tokens} tokens per rank, "
          f"mean over {args.seeds} seeds\n")
    print("| per-source skew | capacity factor | dropped, pair | dropped, destination |")
    print("|---:|---:|---:|---:|")
    for skew in (0.0, 0.5, 1.0):
        samples = [counts_for(torch.Generator().manual_seed(seed), args.ep, args.experts, args.tokens, args.top_k,
                              skew) for seed in range(args.seeds)]
        for cf in (1.0, 1.25):
            pair, dest = (sum(dropped_share(rule, c, cf, N) for c in samples) / len(samples)
                          for rule in ("pair", "destination"))
            print(f"| {skew:g} | {cf:g} | {pair:.2%} | {dest:.2%} |")


if __name__ == "__main__":
    main()
