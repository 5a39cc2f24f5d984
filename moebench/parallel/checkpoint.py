"""Per-layer activation checkpointing: each block's activations are recomputed in backward."""

from __future__ import annotations

import contextlib

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from moebench.model.router import stats_paused


def _recompute_pauses_stats() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """(forward, recompute) contexts: the recompute does not count in the router statistics
    (a compiled block relies on this; eager code also sees autograd's graph task)."""
    return contextlib.nullcontext(), stats_paused()


def apply_activation_checkpointing(model: nn.Module) -> None:
    layers = model.layers
    for name, block in list(layers.items()):
        layers[name] = checkpoint_wrapper(block, preserve_rng_state=True, context_fn=_recompute_pauses_stats)
