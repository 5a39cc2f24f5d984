"""Loss curves: does every point train the same model?

``loss_curves`` draws the LM loss of every step, one panel per comparison group (a baseline
point and the points paired with it, as in the answer and the speedup column), so a layout or
precision that changes training shows up next to its baseline. ``loss_vs_precision`` draws,
for points that differ only in precision, each one's loss minus the reference precision's at the
same step: bf16 on a GPU, fp32 on a CPU (the precision each device trains in by default).
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from moebench.record import METRICS
from moebench.report import figure as fg
from moebench.report.figure import OUTSIDE, colors_of, wrap
from moebench.results.table import norm_value

# Line style by precision: in a precision suite one layout, so one colour, has a line per precision.
LINESTYLES = {"bf16": "-", "fp32": "--", "fp8": ":", "mxfp8": "-."}
MAX_PANELS = 12  # beyond this a figure is unreadable; the rest are left out with a note


def _has_losses(t: pd.DataFrame) -> pd.DataFrame:
    ok = fg.ok_rows(t)
    # a boolean Series, not a list: an empty list would select no columns instead of no rows
    return ok[ok["losses"].map(bool).astype(bool)]


def _line(ax, row: pd.Series, y: np.ndarray, color: tuple, label: str) -> None:
    style = LINESTYLES.get(norm_value(row["precision"]), "-")
    hollow = row["precision_impl"] == "emulated"
    ax.plot(np.arange(1, len(y) + 1), y, ls=style, color=color, lw=1.2, label=wrap(label),
            marker="o" if hollow else None, mfc="white", markevery=max(len(y) // 8, 1))


def panels(n: int, width: float = 4.2) -> tuple[Figure, list]:
    cols = min(n, 3)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols + 1.5, 2.8 * rows + 0.8), squeeze=False)
    for ax in axes.flat[n:]:
        ax.remove()
    return fig, list(axes.flat[:n])


def comparison_groups(ok: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """(panel title, rows): each baseline point with the points paired with it, then one panel of
    the points without a baseline."""
    # by the baseline's row, not its point id: two runs of one suite share point ids, and one panel
    # of both would list each run's baseline under one name
    base_row = ok["baseline_row"]
    base_id = ok["baseline_point_id"].map(norm_value)
    out = []
    paired = base_row.notna() & (base_id != "none")
    for b, g in ok[paired].groupby(base_row[paired], sort=True):
        base = g[g.index == b]
        out.append((f"vs {(base if len(base) else g)['label'].iloc[0]}", g))
    alone = ok[base_id == "none"]
    return out + ([("points without a baseline", alone)] if len(alone) else [])


def loss_curves(t: pd.DataFrame) -> Figure | str:
    ok = _has_losses(t)
    groups = comparison_groups(ok)
    if not groups:
        return "no ok point recorded its per-step losses"
    colors = colors_of(t)
    shown = groups[:MAX_PANELS]
    fig, axes = panels(len(shown))
    for ax, (title, g) in zip(axes, shown, strict=True):
        for _, row in g.iterrows():
            is_base = row["point_id"] == row["baseline_point_id"]
            name = f"{row['variant']} {norm_value(row['precision'])}" if title.startswith("vs ") else row["label"]
            _line(ax, row, np.asarray(row["losses"]), colors[row["variant"]],
                  name + (" (baseline)" if is_base else ""))
        ax.set_title(wrap(title), fontsize=8)
        ax.set_xlabel("step (warm-up included)")
        ax.set_ylabel(f"LM loss ({METRICS['loss_last'].unit})")
        ax.legend(fontsize=7, loc="best")  # where the curves leave room: panels side by side have none outside
    if len(groups) > len(shown):
        fg.omitted(fig, f"{len(groups) - len(shown)} more comparison group(s) left out: at most {MAX_PANELS} panels")
    return fig


def _reference(g: pd.DataFrame) -> pd.Series | None:
    """The point a precision group is measured against: bf16 on a GPU, fp32 on a CPU."""
    for _, row in g.iterrows():
        if norm_value(row["precision"]) == ("bf16" if row.get("device") == "cuda" else "fp32"):
            return row
    return None


def loss_vs_precision(t: pd.DataFrame) -> Figure | str:
    ok = _has_losses(t)
    groups = []
    for lab, g in fg.groups_over(ok, ["config.precision.mode", "precision"], "precision"):
        ref = _reference(g)
        if ref is not None:
            groups.append((lab, g, ref))
    if not groups:
        return "no points that differ only in precision from a bf16 (GPU) or fp32 (CPU) point"
    colors = colors_of(t)
    shown = groups[:MAX_PANELS]
    fig, axes = panels(len(shown))
    for ax, (lab, g, ref) in zip(axes, shown, strict=True):
        base = np.asarray(ref["losses"])
        for _, row in g[g["point_id"] != ref["point_id"]].iterrows():
            y = np.asarray(row["losses"])
            n = min(len(y), len(base))
            _line(ax, row, y[:n] - base[:n], colors[row["variant"]], norm_value(row["precision_shown"]))
        ax.axhline(0.0, color="black", lw=0.8)
        ax.set_title(wrap(f"{lab}: vs {norm_value(ref['precision'])}"), fontsize=8)
        ax.set_xlabel("step (warm-up included)")
        ax.set_ylabel(f"loss - {norm_value(ref['precision'])} loss ({METRICS['loss_last'].unit})")
        ax.legend(fontsize=7, **OUTSIDE)
    if len(groups) > len(shown):
        fg.omitted(fig, f"{len(groups) - len(shown)} more precision group(s) left out: at most {MAX_PANELS} panels")
    return fig
