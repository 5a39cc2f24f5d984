"""Flat parameter/gradient buffers and the distributed (sharded-state) AdamW.

``FlatParams`` moves a group of parameters into one flat fp32 buffer (``param.data`` and
``param.grad`` become views), padded to a multiple of the group size so it splits into
equal shards. ``ShardedAdamW`` is ZeRO-1: each rank keeps fp32 master weights and Adam
moments for its shard only; gradients are reduce-scattered, the shard is updated, and
the updated shards are all-gathered back into every rank's parameters.

The update is exactly ``torch.optim.AdamW`` (decoupled weight decay on matrices only,
bias-corrected moments), so sharded and replicated runs agree to fp32 rounding.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moebench.config import Config
from moebench.parallel.comm import COUNTER, all_gather_single, reduce_scatter_single, timed_wait

BUCKET_BYTES = 25 * 2**20  # gradient all-reduce granularity when overlapping with backward


def build_adamw(params: Iterable[nn.Parameter], cfg: Config, fused: bool = True) -> torch.optim.AdamW:
    """:func:`adamw` with ``cfg.train``'s learning rate, betas and weight decay."""
    t = cfg.train
    return adamw(params, t.lr, (t.beta1, t.beta2), t.weight_decay, fused)


def adamw(params: Iterable[nn.Parameter], lr: float, betas: tuple[float, float], weight_decay: float,
          fused: bool = True, foreach: bool = False) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (norm gains and biases are not decayed).

    ``fused``: torch's fused kernel, one pass over each parameter's weights, gradient and moments
    (on CPU about 5x faster than the multi-pass ``foreach`` update, which was a quarter of a
    CPU training step); False: the multi-tensor ``foreach`` update when ``foreach``, else the
    per-parameter loop, for parameters no fused kernel can group.
    """
    params = [p for p in params if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    kernel = {"fused": True} if fused else {"foreach": foreach}
    return torch.optim.AdamW(groups, lr=lr, betas=betas, **kernel)


def fused_adamw_supported(device: torch.device) -> bool:
    """Whether this torch has a fused AdamW kernel for tensors on ``device`` (CPU since torch 2.4)."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices  # torch's own list

    return device.type in _get_fused_kernels_supported_devices()


def adamw_kernel(optimizer: torch.optim.Optimizer) -> str:
    """Which of torch's AdamW kernels ``optimizer`` runs and what it decays, for a report: e.g.
    ``AdamW fused, decay 0.1 on 12 of 17 tensors`` (``foreach``, ``for-loop``, or ``torch's
    default`` when neither is chosen: foreach on CUDA tensors, the for-loop on CPU ones)."""
    d = optimizer.defaults
    loops = {True: "foreach", False: "for-loop"}
    kernel = "fused" if d.get("fused") else loops.get(d.get("foreach"), "torch's default")
    groups = optimizer.param_groups
    decayed = sum(len(g["params"]) for g in groups if g["weight_decay"])
    rates = sorted({g["weight_decay"] for g in groups if g["weight_decay"]})
    decay = f"decay {', '.join(f'{r:g}' for r in rates)} on {decayed}" if decayed else "no decay on any"
    return f"{type(optimizer).__name__} {kernel}, {decay} of {sum(len(g['params']) for g in groups)} tensors"


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state plus the fp32 master weights it updates."""
    total = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            local = p.to_local() if hasattr(p, "to_local") else p
            total += local.numel() * local.element_size()
            for value in optimizer.state.get(p, {}).values():
                if isinstance(value, Tensor) and value.ndim > 0:
                    local_v = value.to_local() if hasattr(value, "to_local") else value
                    total += local_v.numel() * local_v.element_size()
    return total


class FlatParams:
    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup, axis: str, sharded: bool = True) -> None:
        """``sharded``: the distributed optimizer reduce-scatters into a gradient shard of this rank's own;
        without it the buffer is all-reduced in place and no shard is allocated."""
        # Matrices (weight-decayed) first: decay then applies to one prefix of the buffer, so
        # no per-element mask is needed. Within each class, reverse forward order: backward
        # finishes the last layers first, so their buckets fill (and can be sent) first.
        params = sorted(reversed(params), key=lambda p: p.ndim < 2)
        self.params = params
        self.group = group
        self.axis = axis
        self.group_size = dist.get_world_size(group)
        self.group_rank = dist.get_rank(group)
        self.numel = sum(p.numel() for p in params)
        size = math.ceil(self.numel / self.group_size) * self.group_size if self.numel else 0
        device = params[0].device if params else torch.device("cpu")
        self.data = torch.zeros(size, device=device)
        self.grad = torch.zeros(size, device=device)
        offset = 0
        for p in params:
            n = p.numel()
            self.data[offset:offset + n].copy_(p.data.flatten())
            p.data = self.data[offset:offset + n].view_as(p)
            p.grad = self.grad[offset:offset + n].view_as(p)
            offset += n
        self.decay_numel = sum(p.numel() for p in params if p.ndim >= 2)
        self.shard_size = size // self.group_size if size else 0
        self.grad_shard = torch.zeros(self.shard_size if sharded else 0, device=device)
        self._make_buckets(size)

    # ---------------------------------------------------------------- gradient all-reduce
    def _make_buckets(self, size: int) -> None:
        """Contiguous ranges of whole parameters of about BUCKET_BYTES (the last one also
        covers the padding), and which bucket each parameter lands in."""
        self.buckets: list[tuple[int, int]] = []
        self.bucket_of: dict[nn.Parameter, int] = {}
        self._members: list[int] = []  # parameters per bucket
        start = offset = members = 0
        for p in self.params:
            self.bucket_of[p] = len(self.buckets)
            offset += p.numel()
            members += 1
            if (offset - start) * 4 >= BUCKET_BYTES:
                self.buckets.append((start, offset))
                self._members.append(members)
                start, members = offset, 0
        if start < size or not self.buckets:
            self.buckets.append((start, size))
            self._members.append(members)
        self._pending: list[int] = []
        self._works: list[object | None] = []
        self.reset_buckets()

    def reset_buckets(self) -> None:
        self._pending = list(self._members)
        self._works = [None] * len(self.buckets)

    def _launch(self, b: int, async_op: bool) -> None:
        start, end = self.buckets[b]
        with COUNTER.on_axis(self.axis):
            self._works[b] = dist.all_reduce(self.grad[start:end], group=self.group, async_op=async_op) or True

    def grad_ready(self, p: nn.Parameter) -> None:
        """Called once ``p``'s gradient of the last micro-batch is final: send its bucket
        as soon as every parameter in it is done, while backward goes on."""
        b = self.bucket_of[p]
        self._pending[b] -= 1
        if self._pending[b] == 0 and self.group_size > 1:
            self._launch(b, async_op=True)

    def all_reduce_grad(self) -> None:
        """Finish the all-reduce: buckets not yet sent go now; then wait for all of them."""
        if self.group_size > 1:
            for b, work in enumerate(self._works):
                if work is None:
                    self._launch(b, async_op=False)
            for work in self._works:
                if hasattr(work, "wait"):
                    timed_wait(work)
        self.reset_buckets()

    def shard(self, flat: Tensor) -> Tensor:
        return flat[self.group_rank * self.shard_size:(self.group_rank + 1) * self.shard_size]

    def reduce_scatter_grad(self) -> None:
        if self.group_size > 1:
            with COUNTER.on_axis(self.axis):
                reduce_scatter_single(self.grad_shard, self.grad, group=self.group)
        else:
            self.grad_shard.copy_(self.grad)

    def all_gather_data(self, shard: Tensor) -> None:
        if self.group_size > 1:
            with COUNTER.on_axis(self.axis):
                all_gather_single(self.data, shard, group=self.group)
        else:
            self.data.copy_(shard)


class ShardedAdamW:
    """AdamW over the shards of :class:`FlatParams` buffers (gradients already reduced)."""

    def __init__(self, buffers: list[FlatParams], cfg: Config) -> None:
        t = cfg.train
        self.buffers = buffers
        self.lr, self.betas, self.weight_decay, self.eps = t.lr, (t.beta1, t.beta2), t.weight_decay, 1e-8
        self.master = [b.shard(b.data).clone() for b in buffers]
        self.exp_avg = [torch.zeros_like(m) for m in self.master]
        self.exp_avg_sq = [torch.zeros_like(m) for m in self.master]
        # how many leading elements of each shard are weight-decayed
        self.decay = [min(max(b.decay_numel - b.group_rank * b.shard_size, 0), b.shard_size) for b in buffers]
        self.steps = 0

    @torch.no_grad()
    def step(self) -> None:
        self.steps += 1
        beta1, beta2 = self.betas
        bias1 = 1 - beta1**self.steps
        bias2_sqrt = math.sqrt(1 - beta2**self.steps)
        for buf, p, m, v, decay in zip(self.buffers, self.master, self.exp_avg, self.exp_avg_sq, self.decay,
                                       strict=True):
            g = buf.grad_shard
            p[:decay].mul_(1 - self.lr * self.weight_decay)
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            # the denominator made in place in one temporary, which dies with this statement: one shard's
            # worth at a time, not sqrt(v) beside its scaled copy, nor a buffer's beside the next one's
            p.addcdiv_(m, v.sqrt().div_(bias2_sqrt).add_(self.eps), value=-self.lr / bias1)
            buf.all_gather_data(p)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for buf in self.buffers:
            buf.grad_shard.zero_()

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for ts in (self.master, self.exp_avg, self.exp_avg_sq) for t in ts)
