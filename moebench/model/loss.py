"""The language-model loss every strategy optimises (pipeline stages included)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def lm_loss(logits_BSV: Tensor, targets_BS: Tensor) -> Tensor:
    """Mean next-token cross-entropy, computed in fp32."""
    return F.cross_entropy(logits_BSV.float().flatten(0, 1), targets_BS.flatten())
