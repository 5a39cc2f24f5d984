"""Synthetic token streams, deterministic in (seed, step), identical on every rank.

Each step draws a *global* batch of ``G`` sequences of ``S + 1`` tokens; a data-parallel
rank takes its contiguous share of rows. So any layout trains on exactly the same tokens
as a single process with the same global batch (what the parity tests rely on).

- ``random``: uniform tokens. The loss cannot fall; for throughput only.
- ``markov``: a fixed random first-order Markov chain in which every token has a few
  likely successors. Its entropy rate is far below ``log(V)``, so a model's loss must
  fall quickly: the learnability check of the trainer.
"""

from __future__ import annotations

import torch
from torch import Tensor

_MARKOV_SUCCESSORS = 4


class TokenStream:
    def __init__(self, kind: str, vocab_size: int, seq_len: int, seed: int) -> None:
        if kind not in ("random", "markov"):
            raise ValueError(f"unknown data source {kind!r}; allowed: random, markov")
        self.kind, self.vocab_size, self.seq_len, self.seed = kind, vocab_size, seq_len, seed
        if kind == "markov":
            g = torch.Generator().manual_seed(seed + 1_000_003)
            self.successors_VK = torch.randint(0, vocab_size, (vocab_size, _MARKOV_SUCCESSORS), generator=g)
            exp_VK = -torch.rand(vocab_size, _MARKOV_SUCCESSORS, generator=g).log()  # Dirichlet(1, ..., 1)
            self.probs_VK = exp_VK / exp_VK.sum(-1, keepdim=True)

    def global_batch(self, step: int, num_seqs: int) -> Tensor:
        """``(num_seqs, seq_len + 1)`` int64 tokens for ``step`` (inputs and shifted targets)."""
        g = torch.Generator().manual_seed(self.seed * 1_000_033 + step)
        length = self.seq_len + 1
        if self.kind == "random":
            return torch.randint(0, self.vocab_size, (num_seqs, length), generator=g)
        tokens_GS = torch.empty(num_seqs, length, dtype=torch.int64)
        tokens_GS[:, 0] = torch.randint(0, self.vocab_size, (num_seqs,), generator=g)
        for s in range(1, length):
            prev_G = tokens_GS[:, s - 1]
            choice_GS = torch.multinomial(self.probs_VK[prev_G], 1, generator=g).squeeze(1)
            tokens_GS[:, s] = self.successors_VK[prev_G, choice_GS]
        return tokens_GS

    def entropy_rate(self) -> float:
        """Nats per token of the chain under its successor distribution (lower bound of the loss)."""
        if self.kind == "random":
            return float(torch.log(torch.tensor(float(self.vocab_size))))
        p = self.probs_VK
        return float(-(p * p.clamp_min(1e-12).log()).sum(-1).mean())


def micro_batches(batch_GS: Tensor, dp_rank: int, dp_size: int, micro_batch_size: int) -> list[tuple[Tensor, Tensor]]:
    """This rank's share of the global batch, split into (inputs, targets) micro-batches."""
    per_rank = batch_GS.shape[0] // dp_size
    rows = batch_GS[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    return [(mb[:, :-1], mb[:, 1:]) for mb in rows.split(micro_batch_size)]
