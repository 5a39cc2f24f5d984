"""The resident-expert strategy: replicated dense weights, EP-sharded experts, gradients
reduced once per optimizer step (never per micro-batch), optional sharded optimizer.

Gradients live in flat fp32 buffers (``param.grad`` are views into them), one for the
dense parameters (reduced over ``dp``) and one for the expert parameters (reduced over
``edp``, the ranks holding the same experts). One collective per buffer per step.

Scaling: every rank's loss is the mean over its own tokens, and the objective is their
mean over the ``dp`` ranks. A dense gradient is therefore averaged over ``dp``. An
expert's gradient on its owner already *sums* the contributions of its EP group (they
came back through the all-to-all), so it is summed over ``edp`` and divided by ``dp``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moebench.config import Config
from moebench.parallel.comm import COUNTER
from moebench.parallel.expert import is_expert_param
from moebench.parallel.mesh import ParallelDims
from moebench.parallel.optimizer import FlatParams, ShardedAdamW, build_adamw, optimizer_state_bytes


class FlatBufferGrads:
    """ddp's gradient sync: flat fp32 buffers reduced once per optimizer step (see the module doc)."""

    def __init__(self, model: nn.Module, cfg: Config, dims: ParallelDims, overlap: bool) -> None:
        """``overlap``: all-reduce each full bucket during the last micro-batch's backward."""
        self.model, self.dims = model, dims
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.dense = FlatParams([p for n, p in named if not is_expert_param(n)], dims.groups["dp"], "dp",
                                cfg.parallel.dist_opt)
        self.expert = FlatParams([p for n, p in named if is_expert_param(n)], dims.groups["edp"], "edp",
                                 cfg.parallel.dist_opt)
        self.buffers = [b for b in (self.dense, self.expert) if b.numel]
        self.sharded = cfg.parallel.dist_opt
        # not with dist_opt, whose reduce-scatter runs at the end
        self.overlap = overlap and not self.sharded
        self._last_micro_batch = False

    def register_hooks(self) -> None:
        """The runtime half: post-accumulate hooks that start a bucket's reduction once it is full."""
        if self.overlap:
            for buf in self.buffers:
                for p in buf.params:
                    p.register_post_accumulate_grad_hook(self._make_hook(buf))

    def _make_hook(self, buf: FlatParams):
        def hook(p: nn.Parameter) -> None:
            if self._last_micro_batch:
                buf.grad_ready(p)

        return hook

    @contextlib.contextmanager
    def micro_batch(self, is_last: bool) -> Iterator[None]:
        self._last_micro_batch = is_last and self.overlap
        try:
            yield
        finally:
            self._last_micro_batch = False

    def build_optimizer(self, cfg: Config) -> torch.optim.Optimizer | ShardedAdamW:
        if self.sharded:
            return ShardedAdamW(self.buffers, cfg)
        return build_adamw(self.model.parameters(), cfg)

    def zero_grad(self, optimizer) -> None:
        for buf in self.buffers:
            buf.grad.zero_()

    def finish_gradients(self) -> None:
        dp = self.dims.dp
        for buf in self.buffers:
            if self.sharded:
                buf.reduce_scatter_grad()
                buf.grad_shard.div_(dp)
            else:
                buf.all_reduce_grad()
                buf.grad.div_(dp)

    def clip_grad_norm(self, max_norm: float, extra_group: dist.ProcessGroup | None = None) -> Tensor:
        """Global gradient norm over every parameter, counted once, then clip in place."""
        dev = self.dense.grad.device
        if self.sharded:
            # dense shards partition over dp; expert shards over edp x ep = dp as well
            sq = sum((_squared_sum(b.grad_shard) for b in self.buffers), torch.zeros((), device=dev))
            dist.all_reduce(sq, group=self.dims.groups["dp"])
        else:
            sq = _squared_sum(self.dense.grad)
            if self.expert.numel:
                expert_sq = _squared_sum(self.expert.grad)
                if self.dims.ep > 1:
                    with COUNTER.on_axis("ep"):
                        dist.all_reduce(expert_sq, group=self.dims.groups["ep"])
                sq = sq + expert_sq
        if extra_group is not None:
            dist.all_reduce(sq, group=extra_group)
        norm = sq.sqrt()
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for buf in self.buffers:
            (buf.grad_shard if self.sharded else buf.grad).mul_(coef)
        return norm

    def optimizer_state_bytes(self, optimizer) -> int:
        if isinstance(optimizer, ShardedAdamW):
            return optimizer.state_bytes()
        return optimizer_state_bytes(optimizer)

    def gradient_tensors(self) -> list[Tensor]:
        """The flat buffers (``param.grad`` are views of them) and their reduce-scatter shards (the
        distributed optimizer's; empty without it)."""
        return [t for buf in self.buffers for t in (buf.grad, buf.grad_shard)]


def _squared_sum(flat: Tensor) -> Tensor:
    """The sum of ``flat``'s squares (fp32) by a norm reduction, which allocates its result only:
    ``flat.square().sum()`` makes an fp32 copy of the whole buffer first (the dense gradient buffer
    is most of a rank's parameters)."""
    return torch.linalg.vector_norm(flat, dtype=torch.float32).square()


def apply_ddp(model: nn.Module, cfg: Config, dims: ParallelDims, overlap: bool = True) -> FlatBufferGrads:
    """Give ``model``'s gradients flat buffers (dense over dp, experts over edp) and return their sync.

    ``overlap=False`` under a pipeline schedule, whose several backward passes per micro-batch make
    "the last micro-batch's backward" ambiguous: everything is then reduced after backward.
    """
    grads = FlatBufferGrads(model, cfg, dims, overlap)
    grads.register_hooks()
    return grads
