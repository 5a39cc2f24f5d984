"""Where a step's time goes: phase marks the model places at region boundaries, and the clock
that turns them into seconds per phase, forward and backward.

The clock keeps one timeline per step: an event ``(key, time)`` says "from now on the time
belongs to ``key``" (``fwd:attention``, ``bwd:experts``, ``optimizer``, ...), so the phases
partition the step by construction. :func:`mark` is an identity on the activation that starts
a region: in forward it opens the region; its backward runs when the gradient reaches that
point, which is where the backward of the region *before* it begins (autograd runs the graph
in reverse), so the mark remembers that region's name. Collectives are attributed by
:mod:`moebench.parallel.comm` (parameter gathers, gradient reductions) and timed as
communication.

Every region is also a profiler range named ``moebench/<phase>`` (and every collective a range
``moebench/comm:<phase>`` inside it), NVTX ranges too on CUDA: under ``train.trace`` the profiled
steps run under ``torch.profiler`` (:mod:`moebench.metrics.trace`), and the trace shows the
clock's own timeline. Without a profiler only the NVTX ranges (on CUDA) are opened.

Nothing is recorded unless a clock is active (:func:`active_clock`), so marks cost one
function call in ordinary steps. The trainer activates one for a few dedicated profiled steps
after the timed window: on a GPU every event synchronises the device (exact per-phase times,
no overlap between phases), so those steps are kept out of the timed samples.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator

import torch
from torch import Tensor

from moebench.record import TRACE_COMM_RANGE, TRACE_RANGE_PREFIX

# The active clocks (innermost last), written only by :func:`clock_active`. Process-wide because its
# readers get no argument to carry a clock: the model's marks (single-device model code that must not
# know about profiling), autograd running their backward, and the patched torch.distributed
# collectives (:mod:`moebench.parallel.comm`). A list, not an attribute of an object: an empty list is
# the guard under which torch.compile traces :func:`mark` away.
_ACTIVE: list[PhaseClock] = []


def phase_of(key: str) -> str:
    """The phase of a timeline key, without its direction: ``bwd:experts`` -> ``experts``."""
    return key.split(":", 1)[-1]


class PhaseClock:
    """A timeline of phase events on one rank (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.events: list[tuple[str, float]] = []
        self.key = "other"  # the key the time now belongs to
        self.comm_s = 0.0  # seconds inside communication, wherever it was attributed
        self.comm_by_phase: dict[str, float] = defaultdict(float)  # the same seconds by the phase they went to
        self.wall_s = 0.0  # the step's wall time, measured around it by its owner
        self._range: _Range | None = None  # the profiler range of the current key

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def enter(self, key: str) -> None:
        """From now on the time belongs to ``key``."""
        self.key = key
        self.events.append((key, self.now()))
        if self._range is not None:
            self._range.close()
        self._range = _Range(phase_of(key), self.device) if key != "end" else None

    @contextlib.contextmanager
    def region(self, key: str) -> Iterator[None]:
        """The time inside belongs to ``key``; afterwards to whatever it belonged to before."""
        previous = self.key
        self.enter(key)
        try:
            yield
        finally:
            self.enter(previous)

    @contextlib.contextmanager
    def communication(self, key: str | None = None) -> Iterator[None]:
        """Time a collective as communication; ``key`` moves it to a phase of its own
        (``param_gather``, ``grad_reduce``), None leaves it in the current region."""
        start, phase = self.now(), phase_of(key or self.key)
        with self.region(key) if key else contextlib.nullcontext():
            inner = _Range(TRACE_COMM_RANGE + phase, self.device)
            try:
                yield
            finally:
                seconds = self.now() - start
                inner.close()
                self.comm_s += seconds
                self.comm_by_phase[phase] += seconds

    def seconds(self) -> dict[str, float]:
        """Seconds per key between the first and the last event."""
        out: dict[str, float] = defaultdict(float)
        for (key, t0), (_, t1) in zip(self.events, self.events[1:], strict=False):
            out[key] += t1 - t0
        return dict(out)

    @property
    def total_s(self) -> float:
        return self.events[-1][1] - self.events[0][1] if len(self.events) > 1 else 0.0


class _Range:
    """A profiler range opened now and closed by :meth:`close`, possibly on another thread (a region
    that starts in forward on the main thread can end in autograd's device thread on CUDA), so
    not the thread-local ``nvtx.range_push`` / ``range_pop`` nor a ``with`` block."""

    def __init__(self, name: str, device: torch.device) -> None:
        # a record_function costs tens of microseconds even without a profiler to see it: only under one
        name = TRACE_RANGE_PREFIX + name
        self._fn = torch.profiler.record_function(name) if torch.autograd._profiler_enabled() else None
        if self._fn is not None:
            self._fn.__enter__()
        self._nvtx = torch.cuda.nvtx.range_start(name) if device.type == "cuda" else None

    def close(self) -> None:
        if self._fn is not None:
            self._fn.__exit__(None, None, None)
        if self._nvtx is not None:
            torch.cuda.nvtx.range_end(self._nvtx)


def active_clock() -> PhaseClock | None:
    return _ACTIVE[-1] if _ACTIVE else None


@contextlib.contextmanager
def clock_active(clock: PhaseClock) -> Iterator[PhaseClock]:
    _ACTIVE.append(clock)
    try:
        yield clock
    finally:
        _ACTIVE.pop()


class _Mark(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, before: str) -> Tensor:  # type: ignore[override]
        ctx.before = before
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        clock = active_clock()
        if clock is not None:
            clock.enter(f"bwd:{ctx.before}")
        return grad, None


def mark(x: Tensor, phase: str) -> Tensor:
    """Identity on ``x`` that starts region ``phase`` here (forward) and ends it here (backward)."""
    if not _ACTIVE:  # under torch.compile: traced away, behind a guard on the empty list
        return x
    return _mark_active(x, phase)


# Under torch.compile a profiled step recompiles the block with a graph break at every mark (the
# clock reads the host time there): its regions run as separate graphs, timed one by one.
@torch.compiler.disable
def _mark_active(x: Tensor, phase: str) -> Tensor:
    clock = _ACTIVE[-1]
    before = phase_of(clock.key)
    clock.enter(f"fwd:{phase}")
    return _Mark.apply(x, before) if x.requires_grad else x
