"""The MoE block: route -> dispatch -> experts -> combine, plus an optional shared expert.

Shapes: T tokens, D model dim, E experts, K top-k, N expert-sorted rows.

The block is single-device code. Moving tokens is delegated to a *dispatcher*: the
:class:`LocalDispatcher` here permutes tokens into expert order on one device; the
expert-parallel dispatchers in :mod:`moebench.parallel.dispatch` implement the same
interface with communication and are swapped in from outside.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from moebench.config import MoEConfig, check_backend_features
from moebench.kernels.routing import inverse_permutation, sort_routes, weighted_sum_routes
from moebench.kernels.swiglu import swiglu
from moebench.model.experts import Experts
from moebench.model.phases import mark
from moebench.model.router import Router, attach_aux_loss, in_recompute


@dataclass
class Dispatched:
    x_ND: Tensor  # expert-sorted rows for the local experts
    offsets_E: Tensor  # int32 cumulative row ends, one per local expert
    state: Any  # whatever combine() needs to invert the dispatch
    dropped: Tensor | None = None  # scalar: routes dropped over capacity; None for lossless dispatchers


class Dispatcher(Protocol):
    # whether the block may leave this dispatch to an experts backend that fuses gather and combine
    # into its kernel (``Experts.fuses_routes``): only the plain single-device permute can be
    fusable: bool

    def dispatch(self, x_TD: Tensor, idx_TK: Tensor, num_experts: int) -> Dispatched: ...

    def combine(self, y_ND: Tensor, weight_TK: Tensor, dispatched: Dispatched) -> Tensor: ...


class LocalDispatcher:
    """Single-device dispatch: gather rows into expert order, and the exact inverse."""

    fusable = True

    def dispatch(self, x_TD: Tensor, idx_TK: Tensor, num_experts: int) -> Dispatched:
        order_N, _, offsets_E = sort_routes(idx_TK, num_experts)
        token_N = order_N // idx_TK.shape[1]
        return Dispatched(x_TD.index_select(0, token_N), offsets_E, order_N)

    def combine(self, y_ND: Tensor, weight_TK: Tensor, dispatched: Dispatched) -> Tensor:
        y_routes_ND = y_ND.index_select(0, inverse_permutation(dispatched.state))
        return weighted_sum_routes(y_routes_ND, weight_TK)


class SwiGLU(nn.Module):
    """Dense SwiGLU MLP (dense layers and the shared expert); gate and up fused."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.w13 = nn.Linear(d_model, 2 * hidden, bias=False)
        self.w2 = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(swiglu(self.w13(x)))


class MoE(nn.Module):
    def __init__(self, d_model: int, cfg: MoEConfig, layer_id: int = 0) -> None:
        super().__init__()
        check_backend_features(cfg.backend, cfg.features())  # no backend may skip a feature's math
        self.cfg = cfg
        self.router = Router(d_model, cfg, layer_id)
        self.experts = Experts(cfg.num_experts, d_model, cfg.expert_hidden, cfg.backend, cfg.swiglu_limit)
        self.shared = SwiGLU(d_model, cfg.shared_expert_hidden) if cfg.shared_expert_hidden else None
        self.dispatcher: Dispatcher = LocalDispatcher()

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x_TD = x.reshape(-1, shape[-1])
        routing = self.router(x_TD)
        rows_TD = x_TD
        if torch.is_autocast_enabled(x.device.type):  # move rows in the compute dtype, not fp32
            rows_TD = x_TD.to(torch.get_autocast_dtype(x.device.type))
        if self.dispatcher.fusable and self.experts.fuses_routes(rows_TD):
            # single device: the backend fuses gather and combine in (timed as experts: one kernel)
            out_TD = self.experts.fused_routes(mark(rows_TD, "experts"), routing.idx_TK, routing.weight_TK)
        else:
            dispatched = self.dispatcher.dispatch(mark(rows_TD, "dispatch"), routing.idx_TK, self.cfg.num_experts)
            y_ND = self.experts(mark(dispatched.x_ND, "experts"), dispatched.offsets_E)
            out_TD = self.dispatcher.combine(mark(y_ND, "combine"), routing.weight_TK, dispatched)
            if dispatched.dropped is not None and not in_recompute():
                with torch.no_grad():
                    self.router.step_dropped += dispatched.dropped
        if self.shared is not None:
            out_TD = out_TD + self.shared(mark(x_TD, "dense"))
        out_TD = attach_aux_loss(out_TD.to(x.dtype), routing.aux_loss, self.router.aux_grad_scale)
        return out_TD.view(shape)
