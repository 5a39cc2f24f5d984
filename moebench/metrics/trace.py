"""Chrome traces of the profiled steps (``train.trace``): each rank runs them under
``torch.profiler`` and exports one trace, in which the phase clock's regions are named ranges
(:mod:`moebench.model.phases`). The timed steps are never traced; the report reads the traces
with :mod:`moebench.report.trace`."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity

from moebench.metrics import TRACE_DIR_ENV, trace_name

DEFAULT_TRACE_DIR = "traces"


def trace_dir() -> Path:
    return Path(os.environ.get(TRACE_DIR_ENV) or DEFAULT_TRACE_DIR)


@contextlib.contextmanager
def tracing(enabled: bool, device: torch.device, rank: int, world_size: int) -> Iterator[list[str] | None]:
    """Profile what runs inside and export this rank's trace on leaving. Yields every rank's trace
    path (absolute, rank order; each rank writes its own), None when not ``enabled``."""
    if not enabled:
        yield None
        return
    folder = trace_dir().absolute()
    folder.mkdir(parents=True, exist_ok=True)
    files = [str(folder / trace_name(r)) for r in range(world_size)]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.profiler.profile(activities=activities) as profiler:
        yield files
    profiler.export_chrome_trace(files[rank])
