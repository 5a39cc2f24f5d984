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

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def enter(self, key: str) -> None:
        """From now on the time belongs to ``key``."""
        self.key = key
        self.events.append((key, self.now()))

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
            try:
                yield
            finally:
                seconds = self.now() - start
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
