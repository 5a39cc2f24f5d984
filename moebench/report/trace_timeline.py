"""A point's traces as a timeline: per rank, its first profiled step's phases and communication.

Two lanes a rank, drawn from that step's start so the ranks line up: the phase clock's regions
(``moebench/<phase>``, coloured as in the time-breakdown plot) and the communication intervals of
:func:`moebench.report.trace.intervals`, the ones the overlap table sums, with the part that ran
under compute drawn darker. What the figure shows is what the trace file holds; the file itself
opens in Perfetto (https://ui.perfetto.dev) or ``chrome://tracing``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from moebench.report.breakdown import PHASE_COLORS
from moebench.report.trace import COMM, IDLE, PREFIX, STEP, Interval, intersect, intervals

COMM_COLOR, OVERLAP_COLOR, OTHER_COLOR = "#7f7f7f", "#262626", "#d9d9d9"


def clip(spans: Sequence[Interval], start: float, end: float) -> list[Interval]:
    """``spans`` cut to ``[start, end]``, shifted to start at 0 (microseconds)."""
    return [(max(a, start) - start, min(b, end) - start) for a, b in spans if b > start and a < end]


def first_step(events: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """One rank's first profiled step: ``{"length": us, "phases": [(phase, (start, end))], "comm": [...],
    "overlapped": [...]}`` from the step's start; None without a step range."""
    found = intervals(events)
    if not found.steps:
        return None
    start, end = found.steps[0]
    phases = []
    for e in events:
        name = str(e.get("name", ""))
        if (e.get("cat") == "gpu_user_annotation" or not name.startswith(PREFIX) or name == STEP
                or name.startswith(COMM)):
            continue
        span = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        phases += [(name.removeprefix(PREFIX), s) for s in clip([span], start, end)]
    comm = clip(found.comm, start, end)
    return {"length": end - start, "phases": sorted(phases, key=lambda p: p[1]), "comm": comm,
            "overlapped": intersect(comm, clip(found.compute, start, end))}


def timeline_figure(ranks: Sequence[Sequence[dict[str, Any]]], title: str) -> Figure | None:
    """The timeline of every rank's events (rank order); None when no rank has a profiled step."""
    steps = [first_step(events) for events in ranks]
    if all(s is None for s in steps):
        return None
    fig, ax = plt.subplots(figsize=(11, 1.8 + 0.6 * len(steps)), layout="constrained")
    labels, seen = [], {}
    for rank, step in enumerate(steps):
        y = 2 * (len(steps) - 1 - rank)  # rank 0 on top
        labels += [(y + 1, f"rank {rank} phases"), (y, f"rank {rank} comm")]
        if step is None:
            continue
        for phase, (a, b) in step["phases"]:
            color = OTHER_COLOR if phase == IDLE.removeprefix(PREFIX) else PHASE_COLORS.get(phase, OTHER_COLOR)
            seen.setdefault(phase, color)
            ax.broken_barh([(a / 1e3, (b - a) / 1e3)], (y + 1.1, 0.8), color=color)
        ax.broken_barh([(a / 1e3, (b - a) / 1e3) for a, b in step["comm"]], (y + 0.1, 0.8), color=COMM_COLOR)
        ax.broken_barh([(a / 1e3, (b - a) / 1e3) for a, b in step["overlapped"]], (y + 0.1, 0.8),
                       color=OVERLAP_COLOR)
    ax.set_yticks([y + 0.5 for y, _ in labels], [text for _, text in labels])
    longest = max(s["length"] for s in steps if s is not None)
    ax.set_xlim(0, longest / 1e3)
    ax.set_xlabel("ms from the start of each rank's first profiled step")
    ax.set_title(title, loc="left")
    handles = [Patch(color=c, label=p) for p, c in seen.items()]
    handles += [Patch(color=COMM_COLOR, label="communication, exposed"),
                Patch(color=OVERLAP_COLOR, label="communication under compute")]
    # below the lanes, never beside them: a few lanes leave too little height for a legend of every phase
    fig.legend(handles=handles, fontsize="small", loc="outside lower center", ncols=min(len(handles), 6))
    return fig
