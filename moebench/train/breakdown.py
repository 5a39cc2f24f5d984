"""Where a step's time goes: the timed steps' step clocks turned into run-record fields.

Each timed step's clock partitions that step (:mod:`moebench.model.phases`). Per rank, each named
phase is its median over the timed steps, and ``other`` is what remains of the rank's median step
(``breakdown_step_s``, the clock's own span of the step) after them: the time outside every named
region (embedding, the step's statistics, host time between regions) plus the difference between
a median of sums and a sum of medians, so the phases add up to the median step by construction
(``other`` can be negative when the phases vary from step to step). Then the mean (and the max)
over ranks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from moebench.model.phases import PhaseClock, phase_of
from moebench.record import PHASES

_NONE = {"time_breakdown_s": None, "time_breakdown_max_s": None, "time_breakdown_backward_s": None,
         "breakdown_step_s": None, "breakdown_steps": 0, "comm_s": None, "comm_breakdown_s": None,
         "comm_exposed_s": None}


def _phase_index(key: str) -> int:
    phase = phase_of(key)
    return PHASES.index(phase) if phase in PHASES else PHASES.index("other")


def _step_row(clock: PhaseClock) -> torch.Tensor:
    """``[phase seconds (P), backward seconds (P), comm, step, comm seconds by phase (P)]`` of one
    step, float64."""
    n = len(PHASES)
    out = torch.zeros(3 * n + 2, dtype=torch.float64)
    for key, seconds in clock.seconds().items():
        if key == "end":
            continue
        i = _phase_index(key)
        out[i] += seconds
        if key.startswith("bwd:"):
            out[n + i] += seconds
    for phase, seconds in clock.comm_by_phase.items():
        out[2 * n + 2 + _phase_index(phase)] += seconds
    out[2 * n] = clock.comm_s
    out[2 * n + 1] = clock.total_s
    return out


def time_breakdown(clocks: list[PhaseClock], device: torch.device, distributed: bool) -> dict[str, Any]:
    """The record's breakdown fields from this rank's timed steps' clocks (a collective when
    ``distributed``: call it on every rank, each with as many clocks). All None without clocks
    (``train.phase_clock=false``)."""
    if not clocks:
        return dict(_NONE)
    n = len(PHASES)
    # per rank, the median over the timed steps of every entry (interpolated, as statistics.median)
    mine = torch.stack([_step_row(c) for c in clocks]).quantile(0.5, dim=0)
    other = PHASES.index("other")
    mine[other] = mine[2 * n + 1] - (mine[:n].sum() - mine[other])
    mine = mine.to(device)
    mean, worst = mine.clone(), mine.clone()
    if distributed:
        dist.all_reduce(mean)
        mean /= dist.get_world_size()
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    mean_l, worst_l = mean.tolist(), worst.tolist()
    return {
        "time_breakdown_s": dict(zip(PHASES, mean_l[:n], strict=True)),
        "time_breakdown_max_s": dict(zip(PHASES, worst_l[:n], strict=True)),
        "time_breakdown_backward_s": dict(zip(PHASES, mean_l[n:2 * n], strict=True)),
        "breakdown_step_s": mean_l[2 * n + 1],
        "breakdown_steps": len(clocks),
        "comm_s": mean_l[2 * n],
        "comm_breakdown_s": dict(zip(PHASES, mean_l[2 * n + 2:], strict=True)),
        # what a step waited in collectives is the part it did not hide: the worst rank's
        "comm_exposed_s": worst_l[2 * n],
    }
