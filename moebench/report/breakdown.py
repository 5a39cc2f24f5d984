"""Why a layout is faster: each point's measured time breakdown next to its baseline's, as a
stacked-bar figure and as one sentence per comparison naming the phases that explain it.

Input is the paired table (:func:`moebench.report.pairing.pair_with_baseline`), whose records
carry ``time_breakdown_s.<phase>`` columns (seconds per step, see :data:`moebench.record.PHASES`).
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from moebench.record import PHASES
from moebench.report.figure import OUTSIDE, height, wrap
from moebench.report.planned import gpu_points, plan_for
from moebench.report.table import is_missing

COLUMN = "time_breakdown_s.{}"
# one fixed colour per phase, the same in every report
PHASE_COLORS = dict(zip(PHASES, plt.get_cmap("tab20").colors[: len(PHASES)], strict=True))


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


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def explain(row: pd.Series, base: pd.Series) -> str:
    """One sentence: where the baseline's step goes, and which phases make up the difference
    (the largest savings, then the largest extra costs, in ms per step)."""
    mine, theirs = phases_of(row), phases_of(base)
    assert mine is not None and theirs is not None
    base_total = sum(theirs.values())
    top = sorted(theirs, key=lambda p: -theirs[p])[:2]
    text = f"{base['variant']} spends " + " and ".join(f"{theirs[p] / base_total:.0%} of its step in {p}" for p in top)
    gap = base_total - sum(mine.values())
    if abs(gap) < 1e-12:
        return text
    diffs = {p: theirs[p] - mine[p] for p in PHASES}
    saved = sorted((p for p in PHASES if diffs[p] > 0), key=lambda p: -diffs[p])[:3]
    extra = sorted((p for p in PHASES if diffs[p] < 0), key=lambda p: diffs[p])[:2]
    text += f"; {row['variant']} is {_ms(abs(gap))} per step {'faster' if gap > 0 else 'slower'}"
    if saved:
        text += ": saves " + ", ".join(f"{_ms(diffs[p])} in {p}" for p in saved)
    if extra:
        text += ("; " if saved else ": ") + "spends " + ", ".join(f"{_ms(-diffs[p])} more in {p}" for p in extra)
    return text


def explanations(t: pd.DataFrame) -> list[str]:
    """One sentence per layout pair (at its point of largest speedup), for the report's headline."""
    pairs = _baseline_rows(t)
    if not pairs:
        return []
    out = []
    rows = t.loc[list(pairs)]
    group_cols = [c for c in ("run", "variant", "baseline_variant") if c in rows.columns]
    for _, g in rows.groupby(group_cols, sort=False):
        i = g["speedup"].idxmax() if g["speedup"].notna().any() else g.index[0]
        where = f" (at {t.at[i, 'axes']})" if t.at[i, "axes"] else ""
        out.append(f"{t.at[i, 'variant']} vs {t.at[i, 'baseline_variant']}{where}: "
                   + explain(t.loc[i], t.loc[pairs[i]]))
    return out


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
    return _stacked(bars, "ms per step (measured: profiled steps; planned: roofline of the bottleneck stage)")


def plot_breakdown(t: pd.DataFrame) -> Figure | str:
    """Stacked bars of ms per step by phase: each compared point beside its baseline (or why not)."""
    pairs = _baseline_rows(t)
    if not pairs:
        return "no compared point has a time breakdown (records from before it, or train.profile_steps=0)"
    by_baseline: dict[int, list[int]] = {}
    for i, j in pairs.items():
        by_baseline.setdefault(j, []).append(i)
    bars = [(str(t.at[k, "label"]), phases_of(t.loc[k]) or {})
            for j, rows in by_baseline.items() for k in (j, *rows)]
    return _stacked(bars, "ms per step (profiled steps, mean over ranks)")


def _stacked(bars: list[tuple[str, dict[str, float]]], xlabel: str) -> Figure:
    fig, ax = plt.subplots(figsize=(9, height(pd.Series([label for label, _ in bars]))))
    left = np.zeros(len(bars))
    for phase in PHASES:
        widths = np.array([1e3 * phases.get(phase, 0.0) for _, phases in bars])
        if widths.any():
            ax.barh(range(len(bars)), widths, left=left, color=PHASE_COLORS[phase], label=phase)
            left += widths
    ax.set_yticks(range(len(bars)), labels=[wrap(label) for label, _ in bars])
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.legend(**OUTSIDE)
    return fig
