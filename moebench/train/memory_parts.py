"""Memory by part, measured from the tensors of one extra, untimed step (``memory_parts_bytes``).

The parts (the planner emits the same keys, :func:`moebench.plan.memory.planned_parts`):

- ``parameters``: the model's parameters on this rank (local shards under fsdp; the flat buffers
  under ddp), unique storages.
- ``gradients``: the gradient tensors after the step's reduction, before the optimizer step (ddp's
  flat buffers and, with the distributed optimizer, the reduce-scattered shards).
- ``optimizer_state``: the AdamW moments (and the distributed optimizer's fp32 master shard).
- ``saved_activations``: the peak over the step of the non-parameter storages autograd holds for
  backward, seen through ``torch.autograd.graph.saved_tensors_hooks``: a storage counts from its
  first pack until backward has unpacked every save of it. Per-layer activation checkpointing saves
  through torch's own hooks, which these do not see (only what runs outside the checkpointed layers
  counts then); None under ``train.compile`` (compiled blocks are not run under extra hooks).
- ``comm_buffers``: 0. The dispatch all-to-all buffers and fsdp's all-gathered layers are
  temporaries of the step that no tensor identifies apart, so they fall in ``transient``.
- ``transient``: the allocator's peak over the step minus the parts above; None on CPU, where no
  allocator peak exists (the process RSS also counts the runtime).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import Tensor, nn


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor's shard on this rank


def storage_bytes(tensors: Iterable[Tensor | None]) -> int:
    """Bytes of the distinct storages under ``tensors`` (views of one flat buffer count it once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            st = _local(t).untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The optimizer's own tensors: AdamW's moments (not its scalar step counts); the distributed
    optimizer's master shard and moments (its ``state_bytes``)."""
    if hasattr(optimizer, "state_bytes"):
        return optimizer.state_bytes()
    return storage_bytes(v for state in optimizer.state.values() for v in state.values()
                         if isinstance(v, Tensor) and v.ndim > 0)


class SavedActivations:
    """Live bytes of the storages autograd saves while active, and their peak (``peak_bytes``).

    Parameters (``nn.Parameter``, also fsdp's gathered ones, and any storage in ``exclude``) are
    not activations and are skipped; every other storage counts once however many nodes save it.
    """

    def __init__(self, exclude: set[int]) -> None:
        self.exclude = exclude
        self.refs: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.live = self.peak_bytes = 0

    def _pack(self, t: Tensor) -> Tensor:
        if isinstance(t, nn.Parameter):
            return t
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr in self.exclude or st.nbytes() == 0:
            return t
        if ptr not in self.refs:
            self.refs[ptr], self.sizes[ptr] = 0, st.nbytes()
            self.live += st.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.live)
        self.refs[ptr] += 1
        return t

    def _unpack(self, t: Tensor) -> Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.refs:
            self.refs[ptr] -= 1
            if self.refs[ptr] == 0:
                self.live -= self.sizes.pop(ptr)
                del self.refs[ptr]
        return t

    @contextlib.contextmanager
    def watching(self) -> Iterator[SavedActivations]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield self


def parameter_storages(model: nn.Module) -> set[int]:
    return {_local(p).untyped_storage().data_ptr() for p in model.parameters()}
