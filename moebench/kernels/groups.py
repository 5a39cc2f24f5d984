"""Expert groups of an expert-sorted row buffer, from its device offsets.

Legend: N rows sorted by expert, E experts; ``offsets_E[e]`` is the end row of expert e's group
(int32 or int64, on the device). Rows past ``offsets[-1]`` are padding (e.g. capacity buffers).
Everything stays on the device: no host sync.
"""

from __future__ import annotations

import torch
from torch import Tensor


def group_sizes(offsets_E: Tensor) -> Tensor:
    """Rows per expert, int64 ``[E]``."""
    offsets = offsets_E.to(torch.int64)
    return torch.diff(offsets, prepend=offsets.new_zeros(1))


def group_of_rows(offsets_E: Tensor, num_rows: int) -> Tensor:
    """Each row's expert, int64 ``[N]``; ``E`` for padding rows past ``offsets[-1]``."""
    row = torch.arange(num_rows, device=offsets_E.device)
    return torch.searchsorted(offsets_E.to(torch.int64), row, right=True)
