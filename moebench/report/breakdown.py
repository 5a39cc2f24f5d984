"""Why a layout is faster: each point's measured time breakdown next to its baseline's, as a
stacked-bar figure and as one sentence per comparison naming the phases that explain it.

Input is the paired table (:func:`moebench.results.pairing.pair_with_baseline`), whose records
carry ``time_breakdown_s.<phase>`` columns (seconds per step, see :data:`moebench.record.PHASES`):
taken inside the timed steps, or in older records in profiled steps after them, which need not
describe the timed step (:func:`representative`).
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from moebench.record import PHASES, REPRESENTATIVE_TOLERANCE, format_value
from moebench.report.figure import OUTSIDE, height, wrap
from moebench.report.planned import gpu_points, plan_for
from moebench.results.table import is_missing

COLUMN = "time_breakdown_s.{}"
# one fixed colour per phase, the same in every report, from a palette no layout colour comes from
# (figure.PALETTE: tab10 + Dark2), so a phase never reads as a layout
PHASE_COLORS = dict(zip(PHASES, plt.get_cmap("Set3").colors[: len(PHASES)], strict=True))


def phases_of(row: pd.Series) -> dict[str, float] | None:
    """``{phase: seconds per step}`` of one point, None when it was not profiled."""
    values = {p: row.get(COLUMN.format(p)) for p in PHASES}
    if all(is_missing(v) for v in values.values()):
        return None
    return {p: 0.0 if is_missing(v) else float(v) for p, v in values.items()}


def _baseline_rows(t: pd.DataFrame) -> dict[int, int]:
    """Row index -> its baseline's row index, for compared ok points that both have a breakdown."""
    out = {}
    for i, j in t.get("baseline_row", pd.Series(dtype=object)).items():
        if t.at[i, "status"] != "ok" or is_missing(j) or j == i or j not in t.index:
            continue
        if phases_of(t.loc[i]) and phases_of(t.loc[j]):
            out[i] = j
    return out


# a phase smaller than both of these is noise in a sentence ("0.000185 ms in grad_reduce"): left out
MIN_PHASE_S = 1e-3
MIN_PHASE_SHARE = 0.02

def _ms(seconds: float) -> str:
    """``2,640 ms``, ``450 ms``: as every other ms figure of the report (:func:`moebench.record.format_value`)."""
    return f"{format_value(seconds, 'ms')} ms"


def _worth_naming(seconds: float, step_s: float) -> bool:
    return abs(seconds) >= MIN_PHASE_S and abs(seconds) >= MIN_PHASE_SHARE * step_s


def _timed_s(row: pd.Series) -> float | None:
    value = row.get("step_time_median_s")
    return None if is_missing(value) else float(value)


def timed_breakdown(row: pd.Series) -> bool:
    """Whether a point's breakdown was taken inside its timed steps (records since
    ``breakdown_step_s``), not in profiled steps after them."""
    return not is_missing(row.get("breakdown_step_s"))


def representative(row: pd.Series) -> bool:
    """Whether a point's breakdown describes its timed step: always when taken inside the timed
    steps; for a profiled one the record's flag, or for records from before the flag, its profiled
    step within 15% of the timed median."""
    if timed_breakdown(row):
        return True
    flag = row.get("breakdown_representative")
    if not is_missing(flag):
        return bool(flag)
    profiled, timed = row.get("profiled_step_s"), _timed_s(row)
    if is_missing(profiled) or timed is None or not profiled:
        return True  # nothing to check it against
    return abs(timed / float(profiled) - 1) <= REPRESENTATIVE_TOLERANCE


def _totals(row: pd.Series) -> str:
    phases = phases_of(row) or {}
    timed = _timed_s(row)
    source = "phases" if timed_breakdown(row) else "profiled"
    return f"{source} {_ms(sum(phases.values()))}" + ("" if timed is None else f", timed {_ms(timed)}")


def explain(row: pd.Series, base: pd.Series) -> str:
    """One sentence: where the baseline's step goes, and which phases make up the difference
    (the largest savings, then the largest extra costs, in ms per step); or, when a side's
    breakdown does not describe its timed step or the breakdown's difference has the opposite sign
    of the timed speedup, a sentence that says so instead of explaining."""
    mine, theirs = phases_of(row), phases_of(base)
    assert mine is not None and theirs is not None
    off = [r for r in (row, base) if not representative(r)]
    if off:
        return "no explanation: the profiled breakdown does not describe the timed step of " + "; ".join(
            f"{r['variant']} ({_totals(r)})" for r in off)
    base_total = sum(theirs.values())
    gap = base_total - sum(mine.values())
    speedup = row.get("speedup")
    if not is_missing(speedup) and abs(gap) >= 1e-12 and (gap > 0) != (float(speedup) > 1):
        return (f"no explanation: the breakdown has {row['variant']} {'faster' if gap > 0 else 'slower'} "
                f"({_totals(row)} vs {base['variant']} {_totals(base)}), the timed steps "
                f"{'faster' if float(speedup) > 1 else 'slower'} ({float(speedup):.2f}x)")
    top = [p for p in sorted(theirs, key=lambda p: -theirs[p])[:2] if _worth_naming(theirs[p], base_total)]
    text = f"{base['variant']} spends " + " and ".join(f"{theirs[p] / base_total:.0%} of its step in {p}" for p in top)
    if abs(gap) < 1e-12:
        return text
    diffs = {p: theirs[p] - mine[p] for p in PHASES if _worth_naming(theirs[p] - mine[p], base_total)}
    saved = sorted((p for p in diffs if diffs[p] > 0), key=lambda p: -diffs[p])[:3]
    extra = sorted((p for p in diffs if diffs[p] < 0), key=lambda p: diffs[p])[:2]
    text += f"; {row['variant']} is {_ms(abs(gap))} per step {'faster' if gap > 0 else 'slower'}"
    if saved:
        text += ": saves " + ", ".join(f"{_ms(diffs[p])} in {p}" for p in saved)
    if extra:
        text += ("; " if saved else ": ") + "spends " + ", ".join(f"{_ms(-diffs[p])} more in {p}" for p in extra)
    return text


def _width(row: pd.Series) -> float:
    """The relative width of a point's speedup interval (inf without one)."""
    low, high = row.get("speedup_low"), row.get("speedup_high")
    if is_missing(low) or is_missing(high) or is_missing(row.get("speedup")) or not row["speedup"]:
        return float("inf")
    return (float(high) - float(low)) / float(row["speedup"])


def explanations(t: pd.DataFrame) -> list[str]:
    """One sentence per subject (:mod:`moebench.results.subject`: what differs, after its suite / run
    prefix), at its conclusive point of narrowest speedup interval (none for a subject whose every
    comparison is inconclusive), for the report's headline."""
    pairs = _baseline_rows(t)
    if not pairs:
        return []
    out = []
    rows = t.loc[list(pairs)]
    if "inconclusive" in rows.columns:
        rows = rows[~rows["inconclusive"].fillna(False).astype(bool)]
    for _, g in rows.groupby(["run", "subject"], sort=False):
        i = min(g.index, key=lambda k: _width(g.loc[k]))
        where = f" (at {t.at[i, 'subject_at']})" if t.at[i, "subject_at"] else ""
        out.append(f"{t.at[i, 'subject']}{where}: "
                   + explain(t.loc[i], t.loc[pairs[i]]))
    return out


BREAKDOWN_INTRO = ("ms per timed step by phase: the median timed step's, on the rank that set its time / each phase's "
                   "worst rank in that step (older records: each phase's median over the timed steps, mean over ranks "
                   "/ worst rank); the step "
                   "the phases add up to and the timed median; communication the step waited for, mean over ranks "
                   "/ worst rank. Older records: a profiled step after the timed ones, and the communication the "
                   "timed step did not hide as \"exposed\".")


def _cell(row: pd.Series, column: str) -> str:
    value = row.get(column)
    return "" if is_missing(value) else format_value(float(value), "ms")


def breakdown_table(t: pd.DataFrame) -> tuple[list[str], list[list[str]]]:
    """(headers, one row per profiled ok point): each phase that took time anywhere and the
    communication as ``mean / worst rank`` ms, beside the step the phases add up to and the timed one."""
    rows = [r for _, r in t.iterrows() if r.get("status") == "ok" and phases_of(r)]
    used = [p for p in PHASES if any(not is_missing(r.get(COLUMN.format(p))) and r[COLUMN.format(p)] > 0
                                     for r in rows)]
    headers = ["point", "phases ms", "timed ms", *used, "comm ms"]
    out = []
    for r in rows:
        phase_cells = [f"{_cell(r, COLUMN.format(p))} / {_cell(r, f'time_breakdown_max_s.{p}')}" for p in used]
        step = "breakdown_step_s" if timed_breakdown(r) else "profiled_step_s"
        out.append([str(r["label"]), _cell(r, step), _cell(r, "step_time_median_s"), *phase_cells,
                    _comm_cell(r)])
    return headers, out


def _comm_cell(row: pd.Series) -> str:
    """``mean / worst rank`` ms of communication, as the phases show it: a timed breakdown's
    ``comm_exposed_s`` is its worst rank's ``comm_s``; an older record's is the timed median less the
    profiled step's compute, shown as ``exposed``."""
    if timed_breakdown(row):
        return f"{_cell(row, 'comm_s')} / {_cell(row, 'comm_exposed_s')}"
    exposed = _cell(row, "comm_exposed_s")
    return _cell(row, "comm_s") + (f", exposed {exposed}" if exposed else "")


def plot_planned_breakdown(t: pd.DataFrame) -> Figure | str:
    """Measured and planned breakdowns of each GPU point, bar above bar (or why not)."""
    bars: list[tuple[str, dict[str, float]]] = []
    for _, row in gpu_points(t).iterrows():
        measured = phases_of(row)
        planned = plan_for(row) if measured else None
        if measured and isinstance(planned, dict) and planned.get("time_breakdown_s"):
            bars += [(f"{row['label']}: measured", measured), (f"{row['label']}: planned", planned["time_breakdown_s"])]
    if not bars:
        return "no GPU point with a time breakdown that the planner can plan"
    return _stacked(bars, "ms per step (measured: timed steps; planned: roofline of the bottleneck stage)")


def plot_breakdown(t: pd.DataFrame) -> Figure | str:
    """Stacked bars of ms per step by phase: each compared point beside its baseline (or why not)."""
    pairs = _baseline_rows(t)
    if not pairs:
        return "no compared point has a time breakdown (records from before it, or train.profile_steps=0)"
    by_baseline: dict[int, list[int]] = {}
    for i, j in pairs.items():
        by_baseline.setdefault(j, []).append(i)
    # each bar's label states both totals: the phases it draws and the timed median
    bars = [(f"{t.at[k, 'label']} ({_totals(t.loc[k])})", phases_of(t.loc[k]) or {})
            for j, rows in by_baseline.items() for k in (j, *rows)]
    return _stacked(bars, "ms per step (the median timed step; each label: the phases' and the timed totals)")


def _stacked(bars: list[tuple[str, dict[str, float]]], xlabel: str) -> Figure:
    fig, ax = plt.subplots(figsize=(9, height(pd.Series([label for label, _ in bars]))))
    left = np.zeros(len(bars))
    for phase in PHASES:
        widths = np.array([1e3 * phases.get(phase, 0.0) for _, phases in bars])
        if widths.any():
            ax.barh(range(len(bars)), widths, left=left, color=PHASE_COLORS[phase], label=phase,
                    edgecolor="0.4", linewidth=0.4)
            left += widths
    ax.set_yticks(range(len(bars)), labels=[wrap(label) for label, _ in bars])
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.legend(**OUTSIDE)
    return fig
