"""Synchronised step timing: the device is synchronised at both ends of every step."""

from __future__ import annotations

import statistics
import time

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepTimer:
    """Collects per-step wall times; the first ``warmup`` steps are kept out of the samples."""

    def __init__(self, device: torch.device, warmup: int) -> None:
        self.device, self.warmup = device, warmup
        self.samples: list[float] = []
        self.warmup_samples: list[float] = []
        self._start: float | None = None

    def start(self) -> None:
        synchronize(self.device)
        self._start = time.perf_counter()

    def stop(self) -> float:
        assert self._start is not None, "stop() without start()"
        synchronize(self.device)
        elapsed = time.perf_counter() - self._start
        target = self.warmup_samples if len(self.warmup_samples) < self.warmup else self.samples
        target.append(elapsed)
        self._start = None
        return elapsed

    @property
    def median(self) -> float:
        return statistics.median(self.samples)
