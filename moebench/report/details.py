"""The report's completeness and per-point detail sections, as HTML and Markdown: how many points
ran, which are still pending, each point's resolved config and log, and the table of contents."""

from __future__ import annotations

import html
import json
import shlex
from collections.abc import Sequence
from typing import Any

import pandas as pd

from moebench.record import REPRESENTATIVE_TOLERANCE, format_value
from moebench.report.completeness import RunStatus, duration_text
from moebench.report.planned import config_dict
from moebench.report.reproduce import run_argv
from moebench.report.trace import OVERLAP_HEADERS, READER, TRACE_NOTE, Overlap, PointTraces, overlap_rows
from moebench.results.table import is_missing, norm_value, run_name


def points_heading(t: pd.DataFrame, runs: Sequence[RunStatus]) -> str:
    """``Points (4: 1 ok, 0 not ok, 3 pending)``: planned points count, not only recorded ones."""
    ok = int((t["status"] == "ok").sum())
    parts = [f"{ok} ok", f"{len(t) - ok} not ok"]
    for state in ("running", "pending"):
        n = sum(len(r.pending) for r in runs if r.state == state)
        parts += [f"{n} {state}"] if n else []
    total = len(t) + sum(len(r.pending) for r in runs)
    return f"Points ({total}: {', '.join(parts)})"


def run_notes(runs: Sequence[RunStatus]) -> list[tuple[str, str]]:
    """(the run's name as its own line has it (:func:`~moebench.results.table.run_name`), line) per run
    with a description or a duration."""
    out = []
    for r in runs:
        took = duration_text(r.duration_s)
        description = (r.description or "").strip().rstrip(".")  # the duration follows after "; "
        bits = [description, f"ran {took} (start to the last finished point)" if took else ""]
        if r.running:
            bits.append("the sweep is still running")
        if any(bits):
            out.append((run_name(r.suite, r.store.name), "; ".join(b for b in bits if b)))
    return out


def pending_rows(runs: Sequence[RunStatus]) -> list[list[str]]:
    return [[r.suite, pid, r.state, axes] for r in runs for pid, axes in r.pending]


PENDING_HEADERS = ["suite", "point", "state", "axes"]
PENDING_INTRO = "Planned in the store's points.json, no record yet: not run, or still running."


def log_html(link: str | None) -> str:
    return f" <a href=\"{html.escape(link)}\">log</a>" if link else ""


Logs = Sequence[tuple[str, str]]  # (name shown, path relative to the report folder) of each log a point has


def reproduce_command(row: pd.Series, meta: dict[str, Any] | None = None) -> str:
    """``moebench run smoke --filter parallel.strategy=fsdp``: the suite's own point, rerun from the repo root,
    so the suite's fixed settings come with it; with its store's ``meta``, the suite as that run named it
    (a path stays a path) and its ``--set`` and ``--repeats`` (:func:`moebench.report.reproduce.run_argv`)."""
    filters = [arg for c in sorted(row.index) if str(c).startswith("point.") and norm_value(row[c]) != "none"
               for arg in ("--filter", f"{str(c).removeprefix('point.')}={norm_value(row[c])}")]
    argv = run_argv(meta) if meta else ["moebench", "run", norm_value(row.get("suite"))]
    return shlex.join([*argv, *filters])


# Config fields that ``auto`` resolves at run time, and the record field that says what ran.
RESOLVED = {("moe", "backend"): "moe_backend", ("precision", "mode"): "precision", ("train", "device"): "device"}


def shown_config(row: pd.Series) -> dict[str, Any]:
    """The point's config as its record has it, each ``auto`` of :data:`RESOLVED` followed by what ran
    (``"backend": "auto (ran cpu_fused)"``); a record without that field keeps its bare ``auto``."""
    config = config_dict(row)
    for (section, name), field in RESOLVED.items():
        node = config.get(section)
        if isinstance(node, dict) and node.get(name) == "auto" and not is_missing(row.get(field)):
            node[name] = f"auto (ran {norm_value(row.get(field))})"
    return config


def hardware_text(row: pd.Series, machines: dict[str, str]) -> str:
    """``2 ranks on ci-runner-3 (CPU: Intel(R) Xeon(R) Platinum 8480+), device cpu``."""
    world = norm_value(row.get("world_size"))
    ranks = "1 rank" if world == "1" else f"{world} ranks"
    return f"{ranks} on {machines.get(norm_value(row.get('run_id')), 'an unrecorded host')}, " \
           f"device {norm_value(row.get('device_name'))}"


def phase_rows(row: pd.Series) -> list[list[str]]:
    """Per phase of the step: the median timed step's (older records: the mean over ranks), the
    phase's worst rank in it (``time_breakdown_s`` and ``time_breakdown_max_s``, ms per step) and
    worst / step, the imbalance between ranks."""
    out = []
    for col in sorted(c for c in row.index if str(c).startswith("time_breakdown_s.")):
        phase = str(col).removeprefix("time_breakdown_s.")
        mean, top = row[col], row.get(f"time_breakdown_max_s.{phase}")
        if is_missing(mean):
            continue
        ratio = f"{top / mean:.2f}" if not is_missing(top) and mean > 0 else ""
        out.append([phase, f"{1000 * mean:,.3f}", "" if is_missing(top) else f"{1000 * top:,.3f}", ratio])
    return out


PHASE_HEADERS = ["phase", "median step (ms/step)", "worst rank (ms/step)", "worst / step"]


def _cells(rows: Sequence[Sequence[str]], headers: Sequence[str]) -> str:
    e = html.escape
    return ("<table><thead><tr>" + "".join(f"<th>{e(h)}</th>" for h in headers) + "</tr></thead><tbody>"
            + "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>" for r in rows)
            + "</tbody></table>")


def _ms(value: Any) -> str:
    return "n/a" if is_missing(value) else f"{1e3 * float(value):,.3f} ms"


def _comm_steps(row: pd.Series) -> str:
    """Which steps a record's ``comm_s`` was taken in: the timed ones, or in older records profiled ones."""
    return "profiled steps" if is_missing(row.get("breakdown_step_s")) else "timed steps"


def longer_step(row: pd.Series, overlaps: Sequence[Overlap]) -> str:
    """``the profiled step was 3.3x the timed one (41.2 ms vs 12.5 ms): ...`` when the traces' steps (mean over
    ranks) are longer than the timed median by more than REPRESENTATIVE_TOLERANCE (the rule that judges an old
    profiled breakdown), else empty: the traces' milliseconds are then not the timed step's."""
    steps = [o.step_s for o in overlaps if o.step_s]
    timed = row.get("step_time_median_s")
    if not steps or is_missing(timed) or not timed:
        return ""
    profiled = sum(steps) / len(steps)
    if profiled / float(timed) - 1 <= REPRESENTATIVE_TOLERANCE:
        return ""
    return (f"the profiled step was {format_value(profiled / float(timed), 'x')} the timed one "
            f"({format_value(profiled, 'ms')} ms vs {format_value(float(timed), 'ms')} ms): the figures below "
            "describe the profiled step, not the timed one. ")


def overlap_text(row: pd.Series, overlaps: Sequence[Overlap]) -> str:
    """The sentence above a point's overlap table: the traces' exposed communication beside the record's,
    after a warning when the profiled step is much longer than the timed one (:func:`longer_step`)."""
    worst = max(o.exposed_s for o in overlaps)
    basis = "/".join(sorted({o.basis for o in overlaps}))  # gpu: kernels; cpu: the phase clock's ranges
    return (f"{longer_step(row, overlaps)}trace of the profiled steps, per rank, read by {READER} from the {basis} "
            f"timeline ({TRACE_NOTE}): exposed communication "
            f"{_ms(worst)} on the worst rank; the record's comm_exposed_s "
            f"{_ms(row.get('comm_exposed_s'))} (worst rank), "
            f"comm_s {_ms(row.get('comm_s'))} ({_comm_steps(row)}, mean over ranks, "
            f"{_ms(sum(o.comm_s for o in overlaps) / len(overlaps))} in the traces)")


def overlap_html(row: pd.Series, traces: PointTraces | None) -> str:
    """The point's traces, per rank: compute, communication, their overlap and the exposed rest (ms per
    profiled step), beside the record's own figures for the same ranks, and the step's timeline."""
    if traces is None or not traces.overlaps:
        return ""
    timeline = (f"<figure><img alt=\"trace timeline of {html.escape(norm_value(row['label']))}\" "
                f"src=\"{html.escape(traces.timeline)}\"></figure>" if traces.timeline else "")
    return (f"<p>{html.escape(overlap_text(row, traces.overlaps))}</p>"
            + _cells(overlap_rows(traces.overlaps), OVERLAP_HEADERS) + timeline)


def configs_html(t: pd.DataFrame, logs: Sequence[Logs], machines: dict[str, str],
                 traces: Sequence[PointTraces | None] | None = None,
                 metas: dict[str, dict[str, Any]] | None = None) -> str:
    """Each point, folded: the command that reruns it, its hardware, its time per phase on the mean and
    the slowest rank, its traces' overlap figures, links to every log and trace it left (copied into the
    report folder) and its resolved config."""
    e = html.escape
    parts = []
    traces = list(traces) if traces is not None else [None] * len(t)
    for (_, row), point_logs, point_traces in zip(t.iterrows(), logs, traces, strict=True):
        config = json.dumps(shown_config(row), indent=2, sort_keys=True, default=str)
        links = " ".join(f"<a href=\"{e(path)}\">{e(name)}</a>" for name, path in point_logs)
        phases = phase_rows(row)
        commit = e(norm_value(row.get("commit"))[:10])
        table = _cells(phases, PHASE_HEADERS) if phases else ""
        parts.append(f"<details><summary>{e(norm_value(row['label']))} ({e(norm_value(row['status']))})"
                     f"{log_html(point_logs[0][1] if point_logs else None)}</summary>"
                     f"<p>reproduce (from the repository root, at the run's commit {commit}):"
                     f" <code>{e(reproduce_command(row, (metas or {}).get(norm_value(row.get('run_id')))))}</code></p>"
                     f"<p>hardware: {e(hardware_text(row, machines))}</p>"
                     + (f"<p>logs: {links}</p>" if links else "<p>logs: none kept</p>")
                     + table + overlap_html(row, point_traces)
                     + f"<p>resolved config (each <code>auto</code> with what ran, from the record):</p>"
                     f"<pre>{e(config)}</pre></details>")
    return "\n".join(parts)


def toc_html(sections: Sequence[tuple[str, str, int]]) -> str:
    """Contents: (anchor, title, depth) per entry; depth 1 (a figure under Plots) is indented."""
    e = html.escape
    items = "".join(f"<li class=\"{'sub' if depth else 'top'}\"><a href=\"#{e(anchor)}\">{e(title)}</a></li>"
                    for anchor, title, depth in sections)
    return f"<nav class=\"toc\"><b>Contents</b><ul>{items}</ul></nav>"
