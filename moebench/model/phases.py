"""Where a step's time goes: phase marks the model places at region boundaries, and the clock
that turns them into seconds per phase, forward and backward.

The clock keeps one timeline per step: an event ``(key, stamp)`` says "from now on the time
belongs to ``key``" (``fwd:attention``, ``bwd:experts``, ``optimizer``, ...), so the phases
partition the step by construction. :func:`mark` is an identity on the activation that starts
a region: in forward it opens the region; its backward runs when the gradient reaches that
point, which is where the backward of the region *before* it begins (autograd runs the graph
in reverse), so the mark remembers that region's name. Collectives are attributed by
:mod:`moebench.parallel.comm` (parameter gathers, gradient reductions) and timed as
communication.

Two kinds of clock:

- the **step clock** of every timed step (``train.phase_clock``, on by default) changes nothing it
  times: on CPU a boundary is one host timestamp (``time.perf_counter_ns``; there is no device to
  synchronise); on CUDA a ``torch.cuda.Event`` recorded on the current stream, never waited for,
  read after the timed window (:meth:`PhaseClock.resolve`). Collectives keep their own paths (no
  extra waits), compiled blocks stay whole (their marks are traced away, so under
  ``train.compile`` a compiled block's time counts in the phase current when it starts), and no
  profiler range is opened;
- the **profiling clock** of the extra steps traced under ``train.trace`` synchronises the device
  at every boundary, waits for every collective, and opens a profiler range ``moebench/<phase>``
  per region (``moebench/comm:<phase>`` per collective; NVTX too on CUDA), so a trace shows the
  clock's own timeline. Those steps are kept out of the timed samples.

Nothing is recorded unless a clock is active (:func:`active_clock`), so marks cost one function
call when none is.
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
# collectives (:mod:`moebench.parallel.comm`). Lists, not attributes of an object: an empty
# ``_PROFILING`` is the guard under which torch.compile traces :func:`mark` away, and a step clock
# alone (in ``_ACTIVE`` only) is never read while compiling, so it leaves the compiled graphs as they are.
_ACTIVE: list[PhaseClock] = []
_PROFILING: list[PhaseClock] = []

# a stamp: host nanoseconds (CPU, or a synchronised CUDA device), or an unread CUDA event
Stamp = int | torch.cuda.Event


def phase_of(key: str) -> str:
    """The phase of a timeline key, without its direction: ``bwd:experts`` -> ``experts``."""
    return key.split(":", 1)[-1]


class PhaseClock:
    """A timeline of phase events on one rank (see the module docstring). ``profiling``: the
    profiling clock (synchronises, waits, opens profiler ranges); else the step clock."""

    def __init__(self, device: torch.device, profiling: bool = False) -> None:
        self.device = device
        self.profiling = profiling
        self._events_on_device = device.type == "cuda" and not profiling
        self.events: list[tuple[str, Stamp]] = []
        self.key = "other"  # the key the time now belongs to
        self.comm: list[tuple[str, Stamp, Stamp]] = []  # (phase it counts in, start, end) per collective
        self.wall_s = 0.0  # a profiled step's wall time, measured around it by its owner
        self._range: _Range | None = None  # the profiler range of the current key
        self._seconds: dict[str, float] | None = None
        self._comm_by_phase: dict[str, float] | None = None

    def now(self) -> Stamp:
        if self._events_on_device:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        if self.profiling and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter_ns()

    def enter(self, key: str) -> None:
        """From now on the time belongs to ``key``."""
        self.key = key
        self.events.append((key, self.now()))
        if not self.profiling:
            return
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
            inner = _Range(TRACE_COMM_RANGE + phase, self.device) if self.profiling else None
            try:
                yield
            finally:
                self.comm.append((phase, start, self.now()))
                if inner is not None:
                    inner.close()

    def resolve(self) -> None:
        """Turn the stamps into seconds (on CUDA: wait for the step's events; call it after the
        timed window, never inside it)."""
        if self._seconds is not None:
            return
        out: dict[str, float] = defaultdict(float)
        for (key, t0), (_, t1) in zip(self.events, self.events[1:], strict=False):
            out[key] += _between(t0, t1)
        comm: dict[str, float] = defaultdict(float)
        for phase, t0, t1 in self.comm:
            comm[phase] += _between(t0, t1)
        self._seconds, self._comm_by_phase = dict(out), dict(comm)

    def seconds(self) -> dict[str, float]:
        """Seconds per key between the first and the last event."""
        self.resolve()
        assert self._seconds is not None
        return self._seconds

    @property
    def comm_by_phase(self) -> dict[str, float]:
        """Seconds inside communication by the phase they count in."""
        self.resolve()
        assert self._comm_by_phase is not None
        return self._comm_by_phase

    @property
    def comm_s(self) -> float:
        """Seconds inside communication, wherever it was attributed."""
        return sum(self.comm_by_phase.values())

    @property
    def total_s(self) -> float:
        return _between(self.events[0][1], self.events[-1][1]) if len(self.events) > 1 else 0.0


def _between(t0: Stamp, t1: Stamp) -> float:
    """Seconds from one stamp to a later one."""
    if isinstance(t0, int) and isinstance(t1, int):
        return (t1 - t0) / 1e9
    assert isinstance(t0, torch.cuda.Event) and isinstance(t1, torch.cuda.Event)
    t1.synchronize()
    return t0.elapsed_time(t1) / 1e3


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
    """The clock timing this step, either kind (None: none)."""
    return _ACTIVE[-1] if _ACTIVE else None


def profiling_clock() -> PhaseClock | None:
    """The profiling clock, when one is active: the paths that wait for a collective or leave a
    compiled graph to time it ask this one, so that a step clock never changes what it times."""
    return _PROFILING[-1] if _PROFILING else None


@contextlib.contextmanager
def clock_active(clock: PhaseClock) -> Iterator[PhaseClock]:
    _ACTIVE.append(clock)
    if clock.profiling:
        _PROFILING.append(clock)
    try:
        yield clock
    finally:
        _ACTIVE.pop()
        if clock.profiling:
            _PROFILING.pop()


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
    if _PROFILING:  # under torch.compile: a graph break, behind a guard on the empty list
        return _mark_breaking(x, phase)
    # a step clock marks eager code only: is_compiling() is constant while tracing, so a compiled
    # graph neither reads _ACTIVE nor guards on it
    if not torch.compiler.is_compiling() and _ACTIVE:
        return _mark_now(x, phase)
    return x


def _mark_now(x: Tensor, phase: str) -> Tensor:
    clock = _ACTIVE[-1]
    before = phase_of(clock.key)
    clock.enter(f"fwd:{phase}")
    return _Mark.apply(x, before) if x.requires_grad else x


# Under torch.compile a profiled step recompiles the block with a graph break at every mark (the
# clock reads the host time there): its regions run as separate graphs, timed one by one. Eager
# marks call _mark_now itself: the disabled wrapper costs microseconds a call.
_mark_breaking = torch.compiler.disable(_mark_now)
