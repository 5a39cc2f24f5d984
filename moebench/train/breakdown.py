"""Where a step's time goes: the profiled steps' phase clocks turned into run-record fields."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from moebench.model.phases import PhaseClock, phase_of
from moebench.record import PHASES, REPRESENTATIVE_TOLERANCE

_NONE = {"time_breakdown_s": None, "time_breakdown_max_s": None, "time_breakdown_backward_s": None,
         "profiled_steps": 0, "profiled_step_s": None, "comm_s": None, "comm_breakdown_s": None,
         "comm_exposed_s": None,
         "comm_exposed_mean_s": None, "breakdown_scale": None, "breakdown_representative": None,
         "time_breakdown_scaled_s": None}


def _phase_index(key: str) -> int:
    phase = phase_of(key)
    return PHASES.index(phase) if phase in PHASES else PHASES.index("other")


def _per_rank(clocks: list[PhaseClock]) -> torch.Tensor:
    """``[phase seconds (P), backward seconds (P), comm, wall, comm seconds by phase (P)]`` per step
    on this rank, float64."""
    n = len(PHASES)
    out = torch.zeros(3 * n + 2, dtype=torch.float64)
    for clock in clocks:
        for key, seconds in clock.seconds().items():
            if key == "end":
                continue
            i = _phase_index(key)
            out[i] += seconds
            if key.startswith("bwd:"):
                out[n + i] += seconds
        out[2 * n] += clock.comm_s
        for phase, seconds in clock.comm_by_phase.items():
            out[2 * n + 2 + _phase_index(phase)] += seconds
        out[2 * n + 1] += clock.wall_s
    return out / len(clocks)


def exposed_comm(compute_s: float, timed_s: float) -> float:
    """One rank's communication the timed (overlapped) steps did not hide: its timed median beyond
    its profiled step's compute (the phases without communication). Not clamped to ``comm_s``:
    more than the rank's communication means the timed step was slower than the profiled one."""
    return max(0.0, timed_s - compute_s)


def time_breakdown(clocks: list[PhaseClock], step_time_median_s: float, device: torch.device,
                   distributed: bool, own_step_time_median_s: float | None = None) -> dict[str, Any]:
    """The record's breakdown fields: means over ranks (and the max of each phase), from every
    rank's profiled steps (a collective when ``distributed``: call it on every rank).
    ``own_step_time_median_s``: this rank's timed median (default ``step_time_median_s``), against
    which this rank's exposed communication is computed."""
    if not clocks:
        return dict(_NONE)
    rank = _per_rank(clocks)
    n = len(PHASES)
    own = step_time_median_s if own_step_time_median_s is None else own_step_time_median_s
    rank_comm = float(rank[2 * n])
    # a rank that ran no collective has none to expose, however its timed step compares (that
    # mismatch is breakdown_scale's to say)
    exposed = exposed_comm(float(rank[:n].sum()) - rank_comm, own) if rank_comm > 0 else 0.0
    mine = torch.cat([rank, torch.tensor([exposed], dtype=torch.float64)]).to(device)
    mean, worst = mine.clone(), mine.clone()
    if distributed:
        dist.all_reduce(mean)
        mean /= dist.get_world_size()
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    mean_l, worst_l = mean.tolist(), worst.tolist()
    comm, wall = mean_l[2 * n], mean_l[2 * n + 1]
    phases = dict(zip(PHASES, mean_l[:n], strict=True))
    # reconcile with the timed step: the profiled step's phases scaled by timed median / profiled
    # step, so that they sum to the timed median (as far as they partition the profiled step)
    scale = step_time_median_s / wall if wall > 0 else None
    return {
        "time_breakdown_s": phases,
        "breakdown_scale": scale,
        "breakdown_representative": scale is not None and abs(scale - 1) <= REPRESENTATIVE_TOLERANCE,
        "time_breakdown_scaled_s": None if scale is None else {p: v * scale for p, v in phases.items()},
        "time_breakdown_max_s": dict(zip(PHASES, worst_l[:n], strict=True)),
        "time_breakdown_backward_s": dict(zip(PHASES, mean_l[n:2 * n], strict=True)),
        "profiled_steps": len(clocks),
        "profiled_step_s": wall,
        "comm_s": comm,
        # per rank (its timed median against its own profiled compute), then the worst rank and the mean
        "comm_breakdown_s": dict(zip(PHASES, mean_l[2 * n + 2:3 * n + 2], strict=True)),
        "comm_exposed_s": worst_l[3 * n + 2],
        "comm_exposed_mean_s": mean_l[3 * n + 2],
    }
