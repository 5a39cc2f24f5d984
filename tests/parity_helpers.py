"""The parity tests' training run: the tiny preset on one shared global batch, 3 steps, with the
final weights and the record saved by rank 0, and the check of the record's router statistics."""

from __future__ import annotations

import os

import pytest
import torch

from moebench.presets import load_config
from moebench.testing import full_state_dict
from moebench.train.run import run_training

BASE = ["train.steps=3", "train.warmup_steps=1", "train.global_batch_size=8", "train.micro_batch_size=2",
        "train.lr=1e-3", "model.n_layers=2", "moe.num_experts=8", "moe.top_k=2", "moe.bias_gamma=0.001"]


def train_and_save(overrides: list[str], out_path: str | None):
    """Train ``BASE + overrides``; rank 0 saves losses, full final weights and the record to ``out_path``."""
    cfg = load_config("tiny", BASE + overrides)
    captured = {}

    def grab(trainer, dims):
        captured["state"] = full_state_dict(trainer.model, dims)

    record = run_training(cfg, on_finish=grab)
    if int(os.environ.get("RANK", "0")) == 0 and out_path:
        torch.save({"losses": record["losses"], "state": captured["state"], "record": record}, out_path)
    return record["losses"]


def assert_router_stats_match(got: dict, ref: dict, name: str) -> None:
    """Run-record router statistics of a parallel run equal the single-process run's.

    The single-process run averages lb/z over all the global batch's micro-batches; each dp
    rank runs some of those same micro-batches, so only the mean over every rank (not rank
    0's own) matches. Expert loads come from counts summed over every rank.
    """
    for key in ("lb_loss", "z_loss"):
        assert got[key] == pytest.approx(ref[key], rel=1e-5), f"{name}: {key}"
    torch.testing.assert_close(torch.tensor(got["expert_load_max_over_mean"]),
                               torch.tensor(ref["expert_load_max_over_mean"]), rtol=1e-5, atol=1e-5, msg=name)
