"""History: the headline metrics of one suite's points over many runs, as asv's graphs show them.

When the loaded stores hold three or more runs of one suite (``moebench report
results/smoke/*``), the report gets one figure per such suite: tokens/s per device (with the
95% interval of the median) and the speedup over the baseline (with the 95% interval of the
ratio) of every point, one line per point, over the runs ordered by their ``created_at`` and
labelled by the short commit they ran (``+dirty`` for an uncommitted tree) and when they started. Points are
followed across runs by what a reader sees, their layout and axis values, so a point whose
config gained a field still continues its line. A marker without a whisker, and a whisker cut at the
axis (one far wider than the rest, from too few runs), each get a line in the figure saying why.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from moebench.record import METRICS
from moebench.report import figure as fg
from moebench.report.figure import OUTSIDE, Plot, wrap
from moebench.report.runs import run_order
from moebench.results.stats import CONFIDENCE, MIN_SAMPLES, median_ci, step_runs
from moebench.results.store import commit_label

MIN_RUNS = 3  # two runs are a comparison (the run-vs-run table), not a trend
SPEEDUP = ("speedup", "speedup_low", "speedup_high")
# An interval reaching past this many times its value (or below its value over this) runs past the axis, which
# is fitted to the rest: with two repeats a side the t multiplier is ~18, and one such whisker (7,400 tokens/s
# over a median of 153) would flatten every other line.
CLIP = 2.0


def histories(metas: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The runs of each suite with at least :data:`MIN_RUNS` of them, oldest first."""
    return {s: runs for s, runs in run_order(metas).items() if len(runs) >= MIN_RUNS}


def run_label(meta: dict[str, Any]) -> str:
    """A history tick: the commit and, below it, when the run was created (``0d579b9`` /
    ``11-28 10:00``, UTC as stored), so three runs of one commit read as three runs, not one."""
    created = str(meta.get("created_at") or "")
    when = f"{created[5:10]} {created[11:16]}" if len(created) >= 16 else "time unknown"
    return f"{commit_label(meta)}\n{when}"


def point_name(row: pd.Series) -> str:
    return ", ".join(str(p) for p in (row["variant"], row["axes"]) if p)


def series(t: pd.DataFrame, runs: Sequence[dict[str, Any]]) -> pd.DataFrame:
    """One row per (ok point, run): run position, tokens/s per device and speedup with their intervals."""
    position = {m.get("run_id"): i for i, m in enumerate(runs)}
    rows = []
    for _, r in t[t["run_id"].isin(position) & (t["status"] == "ok")].iterrows():
        value, median = r["tokens_per_s_per_device"], r["step_time_median_s"]
        ci = median_ci(step_runs(r))
        # throughput is work over the step time: the interval of the median time, inverted
        low, high = (value * median / ci[1], value * median / ci[0]) if ci is not None else (value, value)
        # a baseline point is its own baseline: its 1.0 is the reference line, not a result
        own = r.get("baseline_point_id") == r["point_id"]
        rows.append({"point": point_name(r), "variant": r["variant"], "axes": r["axes"], "run": position[r["run_id"]],
                     "tokens": value, "tokens_low": low, "tokens_high": high, "tokens_ci": ci is not None,
                     **{k: None if own else r.get(k) for k in SPEEDUP}})
    return pd.DataFrame(rows)


def _fit(ax, value: pd.Series, low: pd.Series, high: pd.Series, bottom: float | None = None) -> int:
    """Fit the y axis to the values and the intervals within :data:`CLIP` of them (from ``bottom`` when
    given); returns how many intervals run past it (drawn cut at the axis)."""
    v, lo, hi = (x.to_numpy(float) for x in (value, low, high))
    has = np.isfinite(lo) & np.isfinite(hi)
    inside = has & (hi <= CLIP * v) & ((lo >= v / CLIP) if bottom is None else True)  # from 0: no low is cut
    top = float(np.nanmax(np.concatenate([v, hi[inside]])))
    floor = float(np.nanmin(np.concatenate([v, lo[inside]])))
    pad = 0.08 * (top - (floor if bottom is None else bottom) or top or 1.0)
    ax.set_ylim(floor - pad if bottom is None else bottom, top + pad)
    return int((has & ~inside).sum())


def interval_notes(s: pd.DataFrame, clipped: int) -> list[str]:
    """Why a marker has no whisker, and which whiskers run past the axis (empty when every one is whole)."""
    notes = []
    bare = int((~s["tokens_ci"]).sum())
    if bare:
        notes.append(f"{bare} of {len(s)} tokens/s markers have no interval: a run of the point has fewer than "
                     f"{MIN_SAMPLES} timed steps")
    with_speedup = s[s["speedup"].notna()]
    bare = int((with_speedup["speedup_low"].isna()).sum())
    if bare:
        notes.append(f"{bare} of {len(with_speedup)} speedup markers have no interval: a side has one run, or "
                     f"fewer than {MIN_SAMPLES} timed steps (see the points table's verdict)")
    if clipped:
        notes.append(f"{clipped} interval(s) reach past {CLIP:g}x or below 1/{CLIP:g} of their value (too few runs "
                     "for a narrow one): cut at the axis, which is fitted to the others")
    return notes


def _errors(value: pd.Series, low: pd.Series, high: pd.Series) -> np.ndarray:
    err = np.vstack([value.to_numpy(float) - low.to_numpy(float), high.to_numpy(float) - value.to_numpy(float)])
    return np.clip(np.nan_to_num(err), 0, None)


def history_figure(t: pd.DataFrame, runs: Sequence[dict[str, Any]]) -> Figure | str:
    """Tokens/s per device and speedup over the baseline per point, across ``runs`` (oldest first)."""
    s = series(t, runs)
    if s.empty:
        return "no ok point in these runs"
    ci = f"{100 * CONFIDENCE:g}% CI"
    with_speedup = s["speedup"].notna().any()
    # constrained: the legend beside the axes and the two-line ticks below them stay inside the figure
    fig, axes = plt.subplots(2 if with_speedup else 1, 1, figsize=(8, 6.5 if with_speedup else 3.8), sharex=True,
                             squeeze=False, layout="constrained")
    # the layout's colour, as in every figure; points of one layout apart by marker and line style
    colors = fg.colors_of(t)
    looks = {a: i for i, a in enumerate(sorted(s["axes"].unique()))}
    for name, g in s.groupby("point", sort=True):
        g = g.sort_values("run")
        look = looks[g["axes"].iloc[0]]
        style = {"color": colors[g["variant"].iloc[0]], "marker": fg.MARKERS[look % len(fg.MARKERS)],
                 "ls": fg.LINESTYLES[look % len(fg.LINESTYLES)], "capsize": 3}
        axes[0][0].errorbar(g["run"], g["tokens"], yerr=_errors(g["tokens"], g["tokens_low"], g["tokens_high"]),
                            label=wrap(name), **style)
        if with_speedup:
            sp = g[g["speedup"].notna()]
            if sp.empty:
                continue
            axes[1][0].errorbar(sp["run"], sp["speedup"], label=wrap(name),
                                yerr=_errors(sp["speedup"], sp["speedup_low"], sp["speedup_high"]), **style)
    axes[0][0].set_ylabel(f"{METRICS['tokens_per_s_per_device'].label} ({ci})")
    clipped = _fit(axes[0][0], s["tokens"], s["tokens_low"].where(s["tokens_ci"]),
                   s["tokens_high"].where(s["tokens_ci"]), bottom=0)
    axes[0][0].legend(**OUTSIDE)
    if with_speedup:
        axes[1][0].set_ylabel(f"speedup over the baseline ({ci})")
        axes[1][0].axhline(1.0, color="black", lw=1)
        sp = s[s["speedup"].notna()]
        clipped += _fit(axes[1][0], pd.concat([sp["speedup"], pd.Series([1.0])]),
                        pd.concat([sp["speedup_low"], pd.Series([np.nan])]),
                        pd.concat([sp["speedup_high"], pd.Series([np.nan])]))
    for note in interval_notes(s, clipped):
        fg.omitted(fig, note)
    bottom = axes[-1][0]
    bottom.set_xticks(range(len(runs)), [run_label(m) for m in runs], rotation=30, ha="right")
    bottom.set_xlabel("run (oldest first), labelled by commit and start time")
    return fig


def history_plots(metas: Sequence[dict[str, Any]]) -> list[Plot]:
    """One plot per suite with :data:`MIN_RUNS` or more runs among ``metas`` (none otherwise)."""
    out = []
    for suite, runs in histories(metas).items():
        name = "history_" + "".join(c if c.isalnum() or c in "-_" else "_" for c in suite)
        title = f"History of {suite} over {len(runs)} runs (error bars: {100 * CONFIDENCE:g}% CI)"
        out.append(Plot(name, title, lambda t, runs=runs: history_figure(t, runs)))
    return out
