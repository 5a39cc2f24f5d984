"""Synchronised timing, the one way moebench times work: the trainer's steps (:class:`StepTimer`)
and the benchmarks' calls (:func:`time_call`, :func:`time_calls`)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from moebench.metrics.instructions import InstructionCounter


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds one call of ``fn`` takes on ``device``: CUDA events around it on a GPU (work queued
    before the call is not counted), a synchronised ``perf_counter`` elsewhere."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - t0


def time_calls(fn: Callable[[], Any], device: torch.device, warmup: int, repeats: int) -> list[float]:
    """``repeats`` samples of :func:`time_call` after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    return [time_call(fn, device) for _ in range(repeats)]


class StepTimer:
    """Collects per-step wall times, and beside them the process CPU time each step took (every thread of
    this process: ``time.process_time``); warm-up steps are kept out of the samples.

    The timer warms up until :meth:`end_warmup` (the trainer decides when: after a fixed count, or
    by the steady rule of :mod:`moebench.metrics.steady`); ``warming=False`` times every step.
    """

    def __init__(self, device: torch.device, warming: bool, instructions: InstructionCounter | None = None) -> None:
        self.device = device
        self.warming = warming
        self.samples: list[float] = []
        self.warmup_samples: list[float] = []
        self.cpu_samples: list[float] = []  # the timed steps' process CPU seconds
        # the timed steps' instructions in billions, with ``instructions`` (a process under callgrind)
        self.ginstruction_samples: list[float] = []
        self.instructions = instructions
        self._start: float | None = None
        self._cpu_start = 0.0

    def start(self) -> None:
        synchronize(self.device)
        if self.instructions is not None and not self.warming:
            self.instructions.start()
        self._cpu_start = time.process_time()
        self._start = time.perf_counter()

    def stop(self) -> float:
        assert self._start is not None, "stop() without start()"
        synchronize(self.device)
        elapsed = time.perf_counter() - self._start
        cpu = time.process_time() - self._cpu_start
        if self.instructions is not None and not self.warming:
            self.ginstruction_samples.append(self.instructions.stop() / 1e9)
        (self.warmup_samples if self.warming else self.samples).append(elapsed)
        if not self.warming:
            self.cpu_samples.append(cpu)
        self._start = None
        return elapsed

    def end_warmup(self) -> None:
        """The next steps are timed."""
        self.warming = False

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def warmup_excess_s(self) -> float:
        """Seconds the warm-up steps took beyond as many median timed steps: their one-off work
        (under ``train.compile``, tracing and compiling the blocks), never negative."""
        return max(0.0, sum(self.warmup_samples) - len(self.warmup_samples) * self.median)
