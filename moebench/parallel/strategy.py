"""What a strategy is: the hooks the training loop calls, single-process and distributed.

A :class:`Strategy` owns everything that differs between a single process and the parallel
layouts: how micro-batches run, how gradients are reduced and clipped, how the optimizer is
built. The base class is the single process (no communication); :class:`DistributedStrategy`
holds what every multi-rank strategy shares. :func:`moebench.parallel.parallelize.parallelize`
picks and builds one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moebench.config import Config
from moebench.model.loss import lm_loss
from moebench.parallel.mesh import ParallelDims
from moebench.parallel.optimizer import build_adamw, optimizer_state_bytes


class Strategy:
    """Single process: no communication. Parallel strategies override the hooks."""

    rank = 0
    world_size = 1
    dp_rank = 0
    dp_size = 1

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def build_optimizer(self, cfg: Config) -> torch.optim.Optimizer:
        return build_adamw(self.model.parameters(), cfg)

    @contextlib.contextmanager
    def micro_batch(self, is_last: bool) -> Iterator[None]:
        """Context for one micro-batch's forward+backward (e.g. DDP's no_sync on all but the last)."""
        yield

    def forward_backward(self, micro: list[tuple[Tensor, Tensor]], autocast: contextlib.AbstractContextManager,
                         device: torch.device) -> Tensor:
        """Run every micro-batch; return the summed (already 1/n-scaled) loss as a tensor."""
        total = torch.zeros((), device=device)
        for i, (inputs, targets) in enumerate(micro):
            with self.micro_batch(is_last=i == len(micro) - 1):
                with autocast:
                    logits = self.model(inputs.to(device, non_blocking=True))
                loss = lm_loss(logits, targets.to(device, non_blocking=True)) / len(micro)
                loss.backward()
            total += loss.detach()
        return total

    def finish_gradients(self) -> None:
        """Reduce gradients that were not reduced during backward."""

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)

    def clip_grad_norm(self, max_norm: float) -> Tensor:
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm, foreach=True)

    def all_reduce_sum(self, tensor: Tensor) -> Tensor:
        """Sum a statistics tensor over the data-parallel ranks (in place); identity here."""
        return tensor

    def optimizer_state_bytes(self, optimizer: torch.optim.Optimizer) -> int:
        return optimizer_state_bytes(optimizer)


class DistributedStrategy(Strategy):
    """What every multi-rank strategy shares: coordinates and data-parallel reductions."""

    def __init__(self, model: nn.Module, cfg: Config, dims: ParallelDims) -> None:
        super().__init__(model)
        self.cfg, self.dims = cfg, dims
        self.rank, self.world_size = dims.rank, dims.world_size
        self.dp_rank, self.dp_size = dims.dp_rank, dims.dp

    def all_reduce_sum(self, tensor: Tensor) -> Tensor:
        if self.dims.dp > 1:
            dist.all_reduce(tensor, group=self.dims.groups["dp"])
        return tensor
