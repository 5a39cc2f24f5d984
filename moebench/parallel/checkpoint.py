"""Per-layer activation checkpointing: each block's activations are recomputed in backward."""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper


def apply_activation_checkpointing(model: nn.Module) -> None:
    layers = model.layers
    for name, block in list(layers.items()):
        layers[name] = checkpoint_wrapper(block, preserve_rng_state=True)
