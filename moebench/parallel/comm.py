"""Communication accounting: every collective a training step issues, by mesh axis.

Bytes are counted the way collectives move them *per rank* (the planner uses the same
convention): ring all-reduce ``2 (n-1)/n * size``; all-gather and reduce-scatter
``(n-1)/n * full size``; all-to-all the bytes that leave the rank; point-to-point the
bytes sent; broadcast the size (root only).

Python-level ``torch.distributed`` collectives (FSDP2, our gradient sync) are counted by
patching the module functions for the duration of a run; the functional all-to-all of
the EP dispatchers is counted by the dispatchers themselves, forward and backward (see
:func:`count_in_backward`); pipeline sends (point-to-point, which ``P2POp`` does not let
us wrap) by a forward hook on each stage that sees the real activation tensors.

Part of a count may be padding: the row-wise dispatcher's fixed-size blocks hold empty slots.
How many is a device value (it follows the routing), so it is kept as a device tensor per
axis (:meth:`CommCounter.add_padding`) and read once, after the timed steps: counting never
makes a step wait for the device.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor

from moebench.model.phases import active_clock


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


class CommCounter:
    def __init__(self) -> None:
        self.bytes: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.axis_of: Callable[[object], str] = lambda group: "world"
        self.label: str | None = None  # set by :meth:`on_axis`; wins over the group lookup
        self.padding: dict[str, Tensor] = {}  # bytes of the counts above that carried no data (device)

    @contextlib.contextmanager
    def on_axis(self, axis: str) -> Iterator[None]:
        """Attribute the collectives inside to ``axis`` (two axes can share one process
        group, e.g. ``dp`` and ``edp`` when ``ep == 1``)."""
        previous, self.label = self.label, axis
        try:
            yield
        finally:
            self.label = previous

    def add(self, axis: str, nbytes: float) -> None:
        self.bytes[axis] += nbytes
        self.calls[axis] += 1

    def add_padding(self, axis: str, nbytes: Tensor) -> None:
        """``nbytes`` (a device scalar) of what was counted on ``axis`` were padding."""
        # out of place: a snapshot keeps the tensor it saw
        self.padding[axis] = self.padding[axis] + nbytes if axis in self.padding else nbytes.float()

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()
        self.padding = {}

    def snapshot(self) -> dict[str, float]:
        return dict(self.bytes)

    def padding_snapshot(self) -> dict[str, Tensor]:
        return dict(self.padding)


    @contextlib.contextmanager
    def counting(self, axis_of: Callable[[object], str]) -> Iterator[CommCounter]:
        """Count into this counter the collectives issued through ``torch.distributed`` inside the
        block (``axis_of`` names a process group's mesh axis); the module's functions and
        :attr:`axis_of` are restored on leaving."""
        saved = {name: getattr(dist, name) for name in _PATCHES if hasattr(dist, name)}
        previous, self.axis_of = self.axis_of, axis_of
        try:
            for name, size_fn in _PATCHES.items():
                if name in saved:
                    setattr(dist, name, self._wrap(name, size_fn))
            yield self
        finally:
            for name, fn in saved.items():
                setattr(dist, name, fn)
            self.axis_of = previous

    def _wrap(self, name: str, size_fn: Callable[..., float]) -> Callable:
        original = getattr(dist, name)

        def counted(*args, **kwargs):
            group = kwargs.get("group")
            if group is None:
                group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
            nbytes = size_fn(dist.get_world_size(group), dist.get_rank(group), *args, **kwargs)
            axis = self.label or self.axis_of(group)
            self.add(axis, nbytes)
            clock = active_clock()
            if clock is None:
                return original(*args, **kwargs)
            with clock.communication(_phase(name, axis, clock.key)):
                work = original(*args, **kwargs)
                # a profiling clock times each collective whole: wait here (a later wait is a no-op);
                # a step clock times the call as it is, and its owner times the wait (timed_wait)
                if kwargs.get("async_op") and clock.profiling:
                    work.wait()
            return work

        counted.__wrapped__ = original  # type: ignore[attr-defined]
        return counted


# The one counter of the process, and the only one: the functions it patches (:meth:`CommCounter.counting`)
# are torch.distributed's, shared by the whole process, and the counts made without any handle to pass one
# through (the backward of the dispatchers' all-to-all run by autograd, a compiled graph counted as it is
# traced, a pipeline stage's forward hook) must land in the same counter as the patched collectives.
COUNTER = CommCounter()


def _phase(name: str, axis: str, current: str) -> str | None:
    """The step phase a collective's time belongs to (None: the region it runs in, e.g. the EP
    count exchange inside dispatch): gathers of parameters over the data-parallel axes (FSDP,
    the sharded optimizer) are ``param_gather``; reduce-scatters and the all-reduces issued
    during backward (the gradient buckets) are ``grad_reduce``."""
    if name.startswith("all_gather") and axis in ("dp", "edp"):
        return "param_gather"
    if name.startswith("reduce_scatter") or (name == "all_reduce" and current.startswith("bwd:")):
        return "grad_reduce"
    return None


def _all_reduce(n: int, me: int, tensor: Tensor, *args, **kwargs) -> float:
    return 2 * (n - 1) / n * _nbytes(tensor)


def _all_gather(n: int, me: int, output: Tensor, input: Tensor, *args, **kwargs) -> float:
    return (n - 1) / n * _nbytes(output)


def _reduce_scatter(n: int, me: int, output: Tensor, input: Tensor, *args, **kwargs) -> float:
    return (n - 1) / n * _nbytes(input)


def _all_to_all_single(n: int, me: int, output: Tensor, input: Tensor, output_split_sizes=None,
                       input_split_sizes=None, *args, **kwargs) -> float:
    rows = input.shape[0]
    own = input_split_sizes[me] if input_split_sizes else rows // n
    return (rows - own) * (_nbytes(input) / max(rows, 1))


def _broadcast(n: int, me: int, tensor: Tensor, src: int | None = None, *args, **kwargs) -> float:
    return _nbytes(tensor) if src is None or dist.get_rank() == src else 0.0


_PATCHES = {
    "all_reduce": _all_reduce,
    "all_gather_into_tensor": _all_gather,
    "all_gather_single": _all_gather,
    "reduce_scatter_tensor": _reduce_scatter,
    "reduce_scatter_single": _reduce_scatter,
    "all_to_all_single": _all_to_all_single,
    "broadcast": _broadcast,
}


def timed_wait(work, key: str | None = None) -> None:
    """``work.wait()``, timed as communication under a clock (``key``: the phase it counts in; None
    the current one): where a step waits for an async collective, the time it did not hide."""
    clock = active_clock()
    with clock.communication(key) if clock is not None else contextlib.nullcontext():
        work.wait()


def count_collectives(axis_of: Callable[[object], str]) -> contextlib.AbstractContextManager[CommCounter]:
    """Count the collectives issued through ``torch.distributed`` inside the block, into :data:`COUNTER`."""
    return COUNTER.counting(axis_of)


def all_gather_single(output: Tensor, input: Tensor, group: dist.ProcessGroup | None = None) -> None:
    """``dist.all_gather_single`` (torch 2.13+), ``all_gather_into_tensor`` on older torch (a CUDA
    torch a cluster already has is kept). Looked up per call, so the counters above see it."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(output, input, group=group)


def reduce_scatter_single(output: Tensor, input: Tensor, group: dist.ProcessGroup | None = None) -> None:
    """``dist.reduce_scatter_single`` (torch 2.13+), ``reduce_scatter_tensor`` on older torch."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(output, input, group=group)


def all_gather_functional(x: Tensor, group: dist.ProcessGroup, axis: str) -> Tensor:
    """All-gather along dim 0 as a functional collective (torch.compile traces it), counted on
    ``axis`` as the patched ``all_gather_single`` would count it."""
    out = funcol.all_gather_tensor(x, 0, group)
    COUNTER.add(axis, _all_gather(dist.get_world_size(group), dist.get_rank(group), out, x))
    return out


class _CountBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, axis: str, nbytes: float, padding: Tensor | None) -> Tensor:  # type: ignore[override]
        ctx.axis, ctx.nbytes, ctx.padding = axis, nbytes, padding
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        COUNTER.add(ctx.axis, ctx.nbytes)
        if ctx.padding is not None:
            COUNTER.add_padding(ctx.axis, ctx.padding)
        return grad, None, None, None


def count_in_backward(x: Tensor, axis: str, nbytes: float, padding: Tensor | None = None) -> Tensor:
    """Identity that records ``nbytes`` (``padding`` of them empty slots) on ``axis`` when its
    gradient passes (the mirrored collective of an autograd all-to-all)."""
    if not x.requires_grad:
        return x
    if torch.compiler.is_compiling():
        # a compiled backward runs no Python: count the mirrored collective when it is traced (a
        # forward that builds this gradient's graph is followed by its backward in training)
        COUNTER.add(axis, nbytes)
        if padding is not None:
            COUNTER.add_padding(axis, padding)
        return x
    return _CountBackward.apply(x, axis, nbytes, padding)
