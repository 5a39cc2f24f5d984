"""The single-device dispatcher on the Triton permute/unpermute kernels (imports triton).

Shapes: T tokens, K top-k, D model dim, N buffer rows.
"""

from __future__ import annotations

from torch import Tensor

from moebench.kernels.permute import destination_rows, permute, unpermute
from moebench.model.moe import Dispatched


class TritonLocalDispatcher:
    """:class:`moebench.model.moe.LocalDispatcher` with the Triton permute/unpermute kernels."""

    fusable = False  # chosen for its own kernels

    def dispatch(self, x_TD: Tensor, idx_TK: Tensor, num_experts: int) -> Dispatched:
        dest_TK, offsets_E = destination_rows(idx_TK, num_experts)
        x_ND = permute(x_TD, dest_TK, idx_TK.numel())
        return Dispatched(x_ND, offsets_E, dest_TK)  # lossless: no drop count

    def combine(self, y_ND: Tensor, weight_TK: Tensor, dispatched: Dispatched) -> Tensor:
        return unpermute(y_ND, dispatched.state, weight_TK)
