"""Where a step's time goes: the timed steps' step clocks turned into run-record fields.

Each timed step's clock partitions that step on its rank (:mod:`moebench.model.phases`), and the
step timer's time outside the clock's span (the host time between the timer's and the clock's
reads) counts in ``other``, so one rank's phases add up to its timed step exactly. A step lasts as
long as its slowest rank (:func:`moebench.train.measure.over_ranks`), and the timed median is the
median of those steps. The breakdown is the breakdown of the step that makes that median (with an
even count, the mean of the two middle steps, as ``statistics.median`` takes), each on the rank
that set its time: so the phases add up to ``step_time_median_s`` by construction. The waiting is
not hidden: a rank that waited for a slower peer waited inside a collective, which its clock names
(``grad_reduce``, ``param_gather``, ``dispatch``, ...). Taking each phase's median separately would
not add up (a sum of medians is not the median of sums), nor would the mean rank's (shorter than
the slowest rank's). Each phase's worst rank and the communication figures are read in the same
steps.
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

# a step row (:func:`step_row`): [phase seconds (P), backward seconds (P), comm, step, comm seconds by phase (P)]
_N = len(PHASES)
_COMM, _STEP = 2 * _N, 2 * _N + 1


def _phase_index(key: str) -> int:
    phase = phase_of(key)
    return PHASES.index(phase) if phase in PHASES else PHASES.index("other")


def step_row(clock: PhaseClock, elapsed_s: float) -> torch.Tensor:
    """One timed step of one rank, float64: ``[phase seconds (P), backward seconds (P), comm, step,
    comm seconds by phase (P)]``. ``elapsed_s``: the step timer's time for it, the step; what the
    clock's span of it leaves out counts in ``other``."""
    out = torch.zeros(3 * _N + 2, dtype=torch.float64)
    for key, seconds in clock.seconds().items():
        if key == "end":
            continue
        i = _phase_index(key)
        out[i] += seconds
        if key.startswith("bwd:"):
            out[_N + i] += seconds
    for phase, seconds in clock.comm_by_phase.items():
        out[_STEP + 1 + _phase_index(phase)] += seconds
    out[PHASES.index("other")] += elapsed_s - clock.total_s
    out[_COMM] = clock.comm_s
    out[_STEP] = elapsed_s
    return out


def median_steps(rows_RSK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From every rank's step rows (R ranks, S timed steps, K entries of :func:`step_row`): the
    rows of the median step (the mean of the two middle ones for an even S) on the rank that set
    each one's time, their max over ranks, and their mean over ranks."""
    steps_RS = rows_RSK[:, :, _STEP]
    slowest_S = steps_RS.max(dim=0)
    order = torch.argsort(slowest_S.values, stable=True)
    s = len(order)
    middle = order[(s - 1) // 2: s // 2 + 1]  # one step, or the two whose mean statistics.median takes
    own = rows_RSK[slowest_S.indices[middle], middle]
    in_middle = rows_RSK[:, middle]
    return own.mean(dim=0), in_middle.max(dim=0).values.mean(dim=0), in_middle.mean(dim=(0, 1))


def time_breakdown(clocks: list[PhaseClock], step_times_s: list[float], device: torch.device,
                   distributed: bool) -> dict[str, Any]:
    """The record's breakdown fields from this rank's timed steps' clocks and the step timer's
    times of the same steps (a collective when ``distributed``: call it on every rank, each with as
    many steps). All None without clocks (``train.phase_clock=false``)."""
    if not clocks:
        return dict(_NONE)
    assert len(clocks) == len(step_times_s), (len(clocks), len(step_times_s))
    mine_SK = torch.stack([step_row(c, t) for c, t in zip(clocks, step_times_s, strict=True)]).to(device)
    if distributed:
        # every rank's rows, gathered by a sum into its own slot (one collective on every backend)
        rows_RSK = torch.zeros(dist.get_world_size(), *mine_SK.shape, dtype=mine_SK.dtype, device=device)
        rows_RSK[dist.get_rank()] = mine_SK
        dist.all_reduce(rows_RSK)
    else:
        rows_RSK = mine_SK.unsqueeze(0)
    own, worst, mean = (x.tolist() for x in median_steps(rows_RSK))
    return {
        "time_breakdown_s": dict(zip(PHASES, own[:_N], strict=True)),
        "time_breakdown_max_s": dict(zip(PHASES, worst[:_N], strict=True)),
        "time_breakdown_backward_s": dict(zip(PHASES, own[_N:2 * _N], strict=True)),
        "breakdown_step_s": own[_STEP],
        "breakdown_steps": len(clocks),
        "comm_s": mean[_COMM],
        "comm_breakdown_s": dict(zip(PHASES, mean[_STEP + 1:], strict=True)),
        # what a step waited in collectives is the part it did not hide: the worst rank's
        "comm_exposed_s": worst[_COMM],
    }
