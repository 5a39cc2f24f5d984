"""What a strategy is: the hooks the training loop calls, composed from two independent parts.

A :class:`Strategy` is what the trainer talks to. It is not a class hierarchy: it joins

- a **gradient sync** (:class:`LocalGrads` on one process; ``FlatBufferGrads`` for ddp in
  :mod:`moebench.parallel.ddp`; ``ShardedGrads`` for fsdp in :mod:`moebench.parallel.fsdp`): how
  gradients are kept, reduced and clipped and how the optimizer is built; and
- a **micro-batch runner** (:class:`LocalRunner`, or ``PipelineRunner`` in
  :mod:`moebench.parallel.pipeline`): how the micro-batches of one step run forward and backward.

:func:`moebench.parallel.parallelize.parallelize` applies a layout to a built model and picks one
of each; any runner works with any gradient sync.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moebench.config import Config
from moebench.parallel.mesh import ParallelDims
from moebench.parallel.optimizer import build_adamw, optimizer_state_bytes

MicroBatchContext = Callable[[bool], contextlib.AbstractContextManager]


class GradSync(Protocol):
    """How a strategy's gradients are kept, reduced and clipped, and its optimizer built."""

    def build_optimizer(self, cfg: Config) -> torch.optim.Optimizer: ...

    def micro_batch(self, is_last: bool) -> contextlib.AbstractContextManager:
        """Context for one micro-batch's forward+backward (e.g. overlapped reduction on the last)."""
        ...

    def finish_gradients(self) -> None:
        """Reduce gradients that were not reduced during backward."""
        ...

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None: ...

    def clip_grad_norm(self, max_norm: float, extra_group: dist.ProcessGroup | None = None) -> Tensor:
        """Clip to the global norm; ``extra_group``: ranks holding *other* parameters (pipeline
        stages) whose squared norms are summed in too."""
        ...

    def optimizer_state_bytes(self, optimizer: torch.optim.Optimizer) -> int: ...

    def gradient_tensors(self) -> list[Tensor]:
        """Every gradient tensor this rank holds between backward and the optimizer step."""
        ...


class LocalGrads:
    """One process: gradients stay where autograd puts them."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def build_optimizer(self, cfg: Config) -> torch.optim.Optimizer:
        return build_adamw(self.model.parameters(), cfg)

    def micro_batch(self, is_last: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def finish_gradients(self) -> None:
        pass

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)

    def clip_grad_norm(self, max_norm: float, extra_group: dist.ProcessGroup | None = None) -> Tensor:
        assert extra_group is None, "a single process has no other stages"
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm, foreach=True)

    def optimizer_state_bytes(self, optimizer: torch.optim.Optimizer) -> int:
        return optimizer_state_bytes(optimizer)

    def gradient_tensors(self) -> list[Tensor]:
        return [p.grad for p in self.model.parameters() if p.grad is not None]


class Runner(Protocol):
    """How the micro-batches of one step run forward and backward."""

    # the ranks holding other parameters (pipeline stages), for the global gradient norm
    norm_group: dist.ProcessGroup | None

    def forward_backward(self, micro: list[tuple[Tensor, Tensor]], autocast: contextlib.AbstractContextManager,
                         device: torch.device, micro_batch: MicroBatchContext) -> Tensor:
        """Run every micro-batch; return the summed (already 1/n-scaled) loss as a tensor."""
        ...

    def loss_scale(self, micro_batches: int) -> float:
        """The factor on each forward's LM loss in a step of ``micro_batches`` micro-batches (the
        router aux losses take the same, :attr:`moebench.model.router.Router.aux_grad_scale`)."""
        ...


class LocalRunner:
    """Every micro-batch through the whole model on this rank, one after another."""

    norm_group = None

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def loss_scale(self, micro_batches: int) -> float:
        return 1.0 / micro_batches

    def forward_backward(self, micro: list[tuple[Tensor, Tensor]], autocast: contextlib.AbstractContextManager,
                         device: torch.device, micro_batch: MicroBatchContext) -> Tensor:
        total = torch.zeros((), device=device)
        for i, (inputs, targets) in enumerate(micro):
            with micro_batch(i == len(micro) - 1):
                with autocast:  # the model ends in the loss (model.loss_chunk_tokens: fused with its head)
                    loss = self.model(inputs.to(device, non_blocking=True),
                                      targets.to(device, non_blocking=True)) / len(micro)
                loss.backward()
            total += loss.detach()
        return total


class Strategy:
    """What the training loop calls: a gradient sync and a micro-batch runner over one model.

    ``Strategy(model)`` is the single process; :func:`moebench.parallel.parallelize.parallelize`
    builds the others.
    """

    def __init__(self, model: nn.Module, grads: GradSync | None = None, runner: Runner | None = None,
                 dims: ParallelDims | None = None) -> None:
        self.model = model
        self.grads = grads if grads is not None else LocalGrads(model)
        self.runner = runner if runner is not None else LocalRunner(model)
        self.dims = dims
        self.rank, self.world_size = (dims.rank, dims.world_size) if dims is not None else (0, 1)
        self.dp_rank, self.dp_size = (dims.dp_rank, dims.dp) if dims is not None else (0, 1)

    def build_optimizer(self, cfg: Config) -> torch.optim.Optimizer:
        return self.grads.build_optimizer(cfg)

    def forward_backward(self, micro: list[tuple[Tensor, Tensor]], autocast: contextlib.AbstractContextManager,
                         device: torch.device) -> Tensor:
        """Run every micro-batch; return the summed (already 1/n-scaled) loss as a tensor."""
        return self.runner.forward_backward(micro, autocast, device, self.grads.micro_batch)

    def loss_scale(self, micro_batches: int) -> float:
        return self.runner.loss_scale(micro_batches)

    def finish_gradients(self) -> None:
        self.grads.finish_gradients()

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        self.grads.zero_grad(optimizer)

    def clip_grad_norm(self, max_norm: float) -> Tensor:
        return self.grads.clip_grad_norm(max_norm, self.runner.norm_group)

    def all_reduce_sum(self, tensor: Tensor) -> Tensor:
        """Sum a statistics tensor over the data-parallel ranks (in place); identity on one."""
        if self.dims is not None and self.dims.dp > 1:
            dist.all_reduce(tensor, group=self.dims.groups["dp"])
        return tensor

    def optimizer_state_bytes(self, optimizer: torch.optim.Optimizer) -> int:
        return self.grads.optimizer_state_bytes(optimizer)
