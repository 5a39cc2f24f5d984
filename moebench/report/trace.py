"""Compute/communication overlap from the Chrome traces ``train.trace`` writes (one per rank).

A trace holds the phase clock's ranges (:mod:`moebench.model.phases`): ``moebench/<phase>``
regions partitioning each ``moebench/step``, and ``moebench/comm:<phase>`` around every
collective. Per rank, as seconds per profiled step:

- **comm**: the union of the communication intervals: the ``moebench/comm:*`` ranges, the
  ``grad_reduce`` and ``param_gather`` regions, the profiler's own collective events
  (``record_param_comms``, ``gloo:*``, ``nccl:*``, ``c10d::*``) and, in a CUDA trace, the NCCL kernels;
- **compute**: with GPU kernels in the trace, the union of the other kernels (the device's
  timeline); without, the host's phase regions outside the clock's collectives (and outside
  the pipeline bubble, which waits);
- **overlapped**: their intersection, communication that ran while compute did;
- **exposed**: comm minus overlapped.

The profiled steps wait for every collective and (on a GPU) synchronise at every mark, so little
overlaps in them by construction: the record's ``comm_s`` and ``comm_exposed_s`` (what the timed
steps waited in collectives) are the figures for the timed steps; the trace shows where the
profiled step's communication went. Reads the JSON itself, gzip'd or plain. HolisticTraceAnalysis 0.5.0 is not used:
it parses these traces, but its overlap and breakdown work on GPU kernels only (events with a CUDA
stream), so a CPU trace gives it no overlap at all (docs/report.md, "Traces", has the errors); the
report names this reader beside the figures (:data:`READER`).
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moebench.errors import StoreError
from moebench.record import TRACE_COMM_RANGE, TRACE_RANGE_PREFIX, TRACE_STEP_RANGE

PREFIX, STEP = TRACE_RANGE_PREFIX, TRACE_STEP_RANGE
COMM = PREFIX + TRACE_COMM_RANGE
COMM_REGIONS = (PREFIX + "grad_reduce", PREFIX + "param_gather")
IDLE = PREFIX + "pipeline_bubble"  # a stage waiting for its neighbour: neither compute nor communication
COLLECTIVE_PREFIXES = ("record_param_comms", "gloo:", "nccl:", "c10d::")
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")

Interval = tuple[float, float]  # (start, end) in microseconds


@dataclass(frozen=True)
class Overlap:
    """One rank's trace, in seconds per profiled step; ``basis`` is ``gpu`` (kernels) or ``cpu`` (ranges)."""

    steps: int
    compute_s: float
    comm_s: float
    overlapped_s: float
    exposed_s: float
    basis: str
    step_s: float | None = None  # the profiled steps' mean length (None: no step range)


def read_events(path: str | Path) -> list[dict[str, Any]]:
    """The complete (``ph: X``) events of a Chrome trace file; a StoreError names a file that is not one."""
    path = Path(path)
    try:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt") as f:
            data = json.load(f)
    except (OSError, EOFError, ValueError) as exc:  # gzip.BadGzipFile is an OSError
        raise StoreError(f"{path}: not a readable Chrome trace ({exc})") from exc
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise StoreError(f"{path}: a Chrome trace needs a 'traceEvents' list")
    return [e for e in events if isinstance(e, dict) and e.get("ph") == "X"
            and isinstance(e.get("ts"), int | float) and isinstance(e.get("dur"), int | float)]


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same time."""
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def length(intervals: Sequence[Interval]) -> float:
    return sum(b - a for a, b in intervals)


def intersect(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """The intersection of two disjoint, sorted interval lists."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """``a`` less ``b`` (both disjoint and sorted)."""
    out = []
    for start, end in a:
        cursor = start
        for s, e in b:
            if e <= cursor or s >= end:
                continue
            if s > cursor:
                out.append((cursor, s))
            cursor = max(cursor, e)
        if cursor < end:
            out.append((cursor, end))
    return out


def _span(e: dict[str, Any]) -> Interval:
    return float(e["ts"]), float(e["ts"]) + float(e["dur"])


def _is_step(e: dict[str, Any]) -> bool:
    """A ``moebench/step`` range on the host (a CUDA trace repeats it as a GPU annotation)."""
    return e.get("name") == STEP and e.get("cat") != "gpu_user_annotation"


def _is_comm(e: dict[str, Any]) -> bool:
    name = str(e.get("name", ""))
    if e.get("cat") in GPU_CATEGORIES:
        return "nccl" in name.lower()
    return name.startswith(COMM) or name in COMM_REGIONS or name.startswith(COLLECTIVE_PREFIXES)


@dataclass(frozen=True)
class Intervals:
    """One rank's trace as time intervals (microseconds): its profiled steps, and compute and
    communication as the module docstring defines them, ``basis`` ``gpu`` or ``cpu``."""

    steps: list[Interval]
    compute: list[Interval]
    comm: list[Interval]
    basis: str


def intervals(events: Sequence[dict[str, Any]]) -> Intervals:
    """The compute and communication intervals of one rank's events (see the module docstring)."""
    steps = sorted(_span(e) for e in events if _is_step(e))
    kernels = [e for e in events if e.get("cat") in GPU_CATEGORIES]
    host = [e for e in events if e.get("cat") not in GPU_CATEGORIES and e.get("cat") != "gpu_user_annotation"]
    comm_host = [_span(e) for e in host if _is_comm(e)]
    comm = union(comm_host + [_span(e) for e in kernels if _is_comm(e)])
    if kernels:
        basis, compute = "gpu", union(_span(e) for e in kernels if not _is_comm(e))
    else:
        regions = union(_span(e) for e in host if str(e.get("name", "")).startswith(PREFIX)
                        and e.get("name") not in (STEP, IDLE) and not _is_comm(e))
        # the clock's own collectives: the host waits in them (the profiler's collective events may run on
        # other threads, beside the host's compute)
        waiting = union(_span(e) for e in host if str(e.get("name", "")).startswith(COMM)
                        or e.get("name") in COMM_REGIONS)
        basis, compute = "cpu", subtract(regions, waiting)
    return Intervals(steps=steps, compute=compute, comm=comm, basis=basis)


def overlap(events: Sequence[dict[str, Any]]) -> Overlap:
    """The overlap figures of one rank's events (see the module docstring)."""
    found = intervals(events)
    both = length(intersect(found.compute, found.comm))
    per = 1e-6 / max(len(found.steps), 1)  # microseconds -> seconds per step
    total_comm = length(found.comm)
    return Overlap(steps=len(found.steps), compute_s=length(found.compute) * per, comm_s=total_comm * per,
                   overlapped_s=both * per, exposed_s=(total_comm - both) * per, basis=found.basis,
                   step_s=length(found.steps) * per if found.steps else None)


@dataclass(frozen=True)
class PointTraces:
    """What a report shows of one point's traces: every rank's overlap figures, and the path of its
    timeline SVG relative to the report (:mod:`moebench.report.trace_timeline`; None: not drawn)."""

    overlaps: list[Overlap]
    timeline: str | None = None


def profiled_events(path: str | Path) -> list[dict[str, Any]]:
    """:func:`read_events` of one trace file; a StoreError names a file without profiled steps."""
    events = read_events(path)
    if not any(_is_step(e) for e in events):
        raise StoreError(f"{path}: no '{STEP}' range: not a trace of moebench's profiled steps")
    return events


def trace_overlap(path: str | Path) -> Overlap:
    """:func:`overlap` of one trace file; a StoreError names a file without profiled steps."""
    return overlap(profiled_events(path))


# which reader produced the figures: the report says so beside them
READER = "moebench.report.trace (its own JSON reader, not HolisticTraceAnalysis)"
# what the report says of the figures (the module docstring says why)
TRACE_NOTE = ("the profiled steps wait for each collective and synchronise at every phase mark, so they hide "
              "little by construction")
OVERLAP_HEADERS = ["rank", "basis", "compute (ms/step)", "comm (ms/step)", "overlapped (ms/step)",
                   "exposed (ms/step)", "overlapped share"]


def overlap_rows(overlaps: Sequence[Overlap]) -> list[list[str]]:
    """One table row per rank's trace (:data:`OVERLAP_HEADERS`)."""
    rows = []
    for rank, o in enumerate(overlaps):
        share = f"{o.overlapped_s / o.comm_s:.0%}" if o.comm_s > 0 else ""
        rows.append([str(rank), o.basis, *(f"{1e3 * v:,.3f}" for v in (o.compute_s, o.comm_s, o.overlapped_s,
                                                                       o.exposed_s)), share])
    return rows


def read_traces(paths: Sequence[Path], warnings: list[str]) -> list[list[dict[str, Any]]] | None:
    """Every rank's :func:`profiled_events`, each file read once; None without traces; a trace that
    cannot be read adds its line to ``warnings`` (the report goes on without the point's figures)."""
    if not paths:
        return None
    try:
        return [profiled_events(p) for p in paths]
    except StoreError as exc:
        warnings.append(str(exc))
        return None
