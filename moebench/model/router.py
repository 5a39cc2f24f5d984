"""Top-k token router with load-balancing loss, z-loss and aux-loss-free bias.

Shapes: T tokens, D model dim, E experts, K top-k.

Routing runs in fp32 whatever the compute dtype: the softmax over experts and the
losses are sensitive to rounding, and the router is a tiny share of the FLOPs.
Nothing here reads a device value on the host, so routing never stalls the GPU.

Every call also knows where its tokens sit in the global batch (``positions``, set by the trainer
each step, see :func:`set_route_positions`): ``moe.routing=skewed`` draws from it, and every mode
adds its routes to ``step_checksum`` (:mod:`moebench.model.route_keys`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moebench.config import MoEConfig
from moebench.model.route_keys import add_checksums, route_checksum, skewed_topk, token_keys

# Router.positions: (seed, step, global index of this rank's first token in the step, tokens per step)
_SEED, _STEP, _FIRST, _PER_STEP = range(4)


@dataclass
class Routing:
    idx_TK: Tensor  # int64 expert ids, distinct within a row
    weight_TK: Tensor  # fp32 combine weights
    counts_E: Tensor  # fp32 routes per expert in this batch
    lb_loss: Tensor  # scalar, unweighted
    z_loss: Tensor  # scalar, unweighted
    aux_loss: Tensor  # lb_loss_weight * lb_loss + z_loss_weight * z_loss


def load_balancing_loss(probs_TE: Tensor, counts_E: Tensor, top_k: int) -> Tensor:
    """Switch-style loss ``E / K * sum_e f_e * p_e``.

    ``f_e`` is the fraction of tokens routed to expert e (``counts / T``, summing to K) and
    ``p_e`` the mean router probability of e, so a perfectly balanced router scores 1.0.
    """
    num_tokens, num_experts = probs_TE.shape
    f_E = counts_E / num_tokens
    p_E = probs_TE.mean(dim=0)
    return num_experts / top_k * torch.sum(f_E * p_E)


def z_loss(logits_TE: Tensor) -> Tensor:
    """Router z-loss: mean over tokens of ``logsumexp(logits) ** 2``."""
    return torch.logsumexp(logits_TE, dim=-1).square().mean()


class Router(nn.Module):
    def __init__(self, d_model: int, cfg: MoEConfig, layer_id: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer_id = layer_id
        self.num_experts = cfg.num_experts
        self.top_k = cfg.top_k
        self.gate = nn.Linear(d_model, cfg.num_experts, bias=cfg.router_bias)
        # Aux-loss-free balancing: a per-expert bias used only to *select* experts.
        self.register_buffer("expert_bias", torch.zeros(cfg.num_experts))
        # Per-optimizer-step statistics, accumulated over micro-batches (never synced here).
        self.register_buffer("step_counts", torch.zeros(cfg.num_experts), persistent=False)
        self.register_buffer("step_dropped", torch.zeros(()), persistent=False)
        self.register_buffer("step_aux", torch.zeros(2), persistent=False)  # lb, z sums
        self.register_buffer("step_calls", torch.zeros(()), persistent=False)
        self.register_buffer("step_checksum", torch.zeros((), dtype=torch.int64), persistent=False)
        self.register_buffer("positions", torch.zeros(4, dtype=torch.int64), persistent=False)
        # the layer's index as a tensor, not a Python int: compiled blocks share one graph across layers,
        # where an int would become a symbolic size that inductor's CPU code casts to float in the hash
        self.register_buffer("layer_key", torch.tensor(layer_id, dtype=torch.int64), persistent=False)
        # Gradient scale of this router's aux losses: the trainer sets it to the LM loss's scale
        # (the strategy's Runner.loss_scale: 1 / micro-batches, and 1 / chunks more under a
        # pipeline), so accumulation and pipeline schedules need no aux plumbing.
        self.aux_grad_scale = 1.0

    def token_positions(self, num_tokens: int) -> Tensor:
        """int64 ``[T]``: the global index within the step of each token of this call.

        The k-th call of a step (a rank runs its micro-batches in order) starts at this rank's first
        token plus k micro-batches; a recompute (activation checkpointing, inside the backward of
        the micro-batch it recomputes) repeats the last call's positions.
        """
        calls = self.step_calls.long() - (1 if in_recompute() else 0)
        first = self.positions[_FIRST] + calls.clamp_min(0) * num_tokens
        return first + torch.arange(num_tokens, device=self.positions.device)

    def _skewed(self, token_T: Tensor, keys_T: Tensor) -> Tensor:
        """``moe.routing=skewed``: source j of ``routing_sources`` (the j-th equal share of the
        step's tokens, a data-parallel rank's share when it equals dp) prefers the experts rotated
        by ``j * E // routing_sources``."""
        sources = self.cfg.routing_sources
        source_T = token_T * sources // self.positions[_PER_STEP].clamp_min(1)
        rotation_T = (source_T * self.num_experts // sources) % self.num_experts
        return skewed_topk(keys_T, self.positions[_SEED], rotation_T, self.num_experts, self.top_k,
                           self.cfg.routing_skew)

    def _limit_to_groups(self, scores_TE: Tensor) -> Tensor:
        """``scores_TE`` with the experts outside each token's ``expert_groups_per_token`` best groups
        at -inf; a group scores the sum of its two best scores (DeepSeek-V3's group-limited routing)."""
        T, groups = scores_TE.shape[0], self.cfg.expert_groups
        grouped_TGn = scores_TE.view(T, groups, self.num_experts // groups)
        group_TG = grouped_TGn.topk(min(2, grouped_TGn.shape[-1]), dim=-1).values.sum(-1)
        best_TG = group_TG.topk(self.cfg.expert_groups_per_token, dim=-1).indices
        keep_TG = torch.zeros_like(group_TG, dtype=torch.bool).scatter_(1, best_TG, True)
        return grouped_TGn.masked_fill(~keep_TG[:, :, None], float("-inf")).view(T, self.num_experts)

    def forward(self, x_TD: Tensor) -> Routing:
        with torch.autocast(x_TD.device.type, enabled=False):  # fp32 routing even under autocast
            bias_E = self.gate.bias.float() if self.gate.bias is not None else None
            logits_TE = F.linear(x_TD.float(), self.gate.weight.float(), bias_E)
        num_tokens = logits_TE.shape[0]
        counting = not in_recompute()
        # the tokens' keys feed the skewed draw and the step's checksum, to which a recompute adds nothing
        token_T = keys_T = None
        if counting or self.cfg.routing == "skewed":
            token_T = self.token_positions(num_tokens)
            keys_T = token_keys(self.positions[_STEP], token_T, self.layer_key)
        if self.cfg.gating == "softmax":
            probs_TE = logits_TE.softmax(dim=-1)
        else:
            probs_TE = torch.sigmoid(logits_TE)

        if self.cfg.routing == "learned":
            scores_TE = probs_TE.detach()
            if self.cfg.bias_gamma > 0:
                scores_TE = scores_TE + self.expert_bias
            if self.cfg.expert_groups > 1:
                scores_TE = self._limit_to_groups(scores_TE)
            idx_TK = scores_TE.topk(self.top_k, dim=-1).indices
        elif self.cfg.routing == "random":
            noise_TE = torch.rand(probs_TE.shape, device=probs_TE.device)
            idx_TK = noise_TE.topk(self.top_k, dim=-1).indices
        elif self.cfg.routing == "skewed":
            idx_TK = self._skewed(token_T, keys_T)
        else:  # uniform: token t takes experts t*K .. t*K+K-1 (mod E); exactly balanced
            base_T1 = torch.arange(num_tokens, device=logits_TE.device).unsqueeze(1) * self.top_k
            idx_TK = (base_T1 + torch.arange(self.top_k, device=logits_TE.device)) % self.num_experts

        weight_TK = probs_TE.gather(1, idx_TK)
        if self.cfg.norm_topk_prob or self.cfg.gating == "sigmoid":
            weight_TK = weight_TK / weight_TK.sum(dim=-1, keepdim=True)
        if self.cfg.routed_scaling != 1.0:
            weight_TK = weight_TK * self.cfg.routed_scaling

        counts_E = torch.zeros(self.num_experts, device=logits_TE.device)
        counts_E.scatter_add_(0, idx_TK.reshape(-1), torch.ones(idx_TK.numel(), device=logits_TE.device))

        lb_probs_TE = probs_TE if self.cfg.gating == "softmax" else probs_TE / probs_TE.sum(-1, keepdim=True)
        lb = load_balancing_loss(lb_probs_TE, counts_E, self.top_k)
        z = z_loss(logits_TE)
        aux = self.cfg.lb_loss_weight * lb + self.cfg.z_loss_weight * z

        if counting:
            with torch.no_grad():
                self.step_counts += counts_E
                self.step_aux += torch.stack([lb, z])
                self.step_calls += 1
                self.step_checksum.copy_(add_checksums(self.step_checksum, route_checksum(keys_T, idx_TK)))
        return Routing(idx_TK, weight_TK, counts_E, lb, z, aux)

    @torch.no_grad()
    def update_bias(self, counts_E: Tensor) -> None:
        """Aux-loss-free update after an optimizer step: ``bias += gamma * sign(mean - count)``."""
        if self.cfg.bias_gamma > 0:
            self.expert_bias += self.cfg.bias_gamma * torch.sign(counts_E.mean() - counts_E)

    @torch.no_grad()
    def reset_step_stats(self) -> None:
        for buf in (self.step_counts, self.step_dropped, self.step_aux, self.step_calls, self.step_checksum):
            buf.zero_()


@torch.no_grad()
def set_route_positions(routers: list[Router], seed: int, step: int, first_token: int, tokens_per_step: int) -> None:
    """Tell ``routers`` where this rank's tokens of ``step`` sit in the global batch (one copy to the
    device a step); ``first_token``: the global index of the rank's first token in the step."""
    if not routers:
        return
    values = torch.tensor([seed, step, first_token, tokens_per_step], dtype=torch.int64)
    values = values.to(routers[0].positions.device, non_blocking=True)
    for router in routers:
        router.positions.copy_(values)


class _StatsPause:
    """How many :func:`stats_paused` blocks are open, the only owner of that count. Process-wide because
    the forwards it pauses are started by torch, not by moebench: activation checkpointing's recompute
    runs inside autograd's backward and the pipeline's shape inference inside torch's PipelineStage,
    and neither passes anything down to the router's forward that reads it (:func:`in_recompute`)."""

    depth = 0


@contextlib.contextmanager
def stats_paused() -> Iterator[None]:
    """Forwards inside do not count in the per-step router statistics (e.g. the extra
    forward a pipeline stage runs once to infer shapes)."""
    _StatsPause.depth += 1
    try:
        yield
    finally:
        _StatsPause.depth -= 1


def in_recompute() -> bool:
    """True when a forward must not count in the per-step statistics: activation
    checkpointing re-running it inside the backward pass, or inside :func:`stats_paused`.

    A compiled block cannot see autograd's running graph task (reading it breaks the graph), so
    the per-layer checkpointing also pauses the statistics around its recompute
    (:mod:`moebench.parallel.checkpoint`): under ``torch.compile`` that pause is what counts.
    """
    if _StatsPause.depth > 0:
        return True
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on ``out``; backward feeds ``scale`` into ``aux`` as its gradient.

    This adds the aux loss to the objective without returning it through every module,
    which keeps the aux losses correct under pipeline stages and accumulation.
    """

    @staticmethod
    def forward(ctx, out: Tensor, aux: Tensor, scale: float) -> Tensor:  # type: ignore[override]
        ctx.aux_dtype = aux.dtype
        ctx.scale = scale
        # A compiled graph hands an output that aliases one of its inputs back as a view replayed
        # outside the graph, which would drop this function's backward (and the aux gradient) when
        # ``out`` comes from outside it (e.g. the eager fused CPU kernel): a copy there, none in eager.
        return out.clone() if torch.compiler.is_compiling() else out

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor, Tensor, None]:  # type: ignore[override]
        scale = torch.full((), ctx.scale, dtype=ctx.aux_dtype, device=grad_out.device)
        return grad_out, scale, None


def attach_aux_loss(out: Tensor, aux: Tensor, scale: float) -> Tensor:
    """``out``, with ``aux`` added to the objective at gradient scale ``scale`` (the LM loss's
    scale, :attr:`Router.aux_grad_scale`)."""
    if not aux.requires_grad:
        return out
    return _AttachAuxLoss.apply(out, aux, scale)
