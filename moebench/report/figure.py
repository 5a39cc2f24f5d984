"""What every report figure shares: the style, colours and markers, the groups a line joins, bars and legends."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from moebench.report.stats import CONFIDENCE, median_ci
from moebench.report.table import axis_name, norm_value

STYLE = {
    "figure.dpi": 100, "savefig.dpi": 100, "font.size": 9, "axes.titlesize": 10, "axes.grid": True,
    "grid.alpha": 0.3, "axes.spines.top": False, "axes.spines.right": False, "legend.fontsize": 8,
    "legend.frameon": False,
    "text.parse_math": False,  # labels come from results: a "$" in a config value is text, not math
}
CI = f"{100 * CONFIDENCE:g}%"
LINESTYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D", "v", "P")
PALETTE = plt.get_cmap("tab10").colors
OUTSIDE = {"loc": "upper left", "bbox_to_anchor": (1.01, 1.0)}  # legends right of the axes, never on data


@dataclass
class Plot:
    name: str
    title: str
    draw: Callable[[pd.DataFrame], Figure | str]


def colors_of(t: pd.DataFrame) -> dict[str, tuple]:
    return {v: PALETTE[i % len(PALETTE)] for i, v in enumerate(sorted(t["variant"].unique()))}


def run_style(t: pd.DataFrame) -> dict[str, dict[str, str]]:
    """Line style and marker of each loaded run, so runs of one suite stay apart in line plots."""
    runs = sorted(t["run"].map(norm_value).unique())
    return {r: {"ls": LINESTYLES[i % len(LINESTYLES)], "marker": MARKERS[i % len(MARKERS)]}
            for i, r in enumerate(runs)}


def throughput_err(g: pd.DataFrame) -> np.ndarray:
    """Distance from each point's tokens/s per device to the ends of the interval of its median.

    Throughput is work per step over the step time, so the interval of the median step time,
    inverted, is the interval of the median throughput.
    """
    err = np.zeros((2, len(g)))
    for j, (value, median, steps) in enumerate(zip(g["tokens_per_s_per_device"], g["step_time_median_s"],
                                                    g["step_times_s"], strict=True)):
        ci = median_ci(steps) if steps else None
        if ci is not None and median == median:
            err[:, j] = (max(value - value * median / ci[1], 0.0), max(value * median / ci[0] - value, 0.0))
    return err


def ok_rows(t: pd.DataFrame, col: str | None = None) -> pd.DataFrame:
    ok = t[t["status"] == "ok"]
    return ok[ok[col].notna()] if col else ok


def groups_over(t: pd.DataFrame, axis_cols: list[str], sweep_col: str) -> list[tuple[str, pd.DataFrame]]:
    """Groups of rows whose config agrees on everything but ``axis_cols`` (and the preset name).

    Only groups with at least two values of ``sweep_col`` are kept: each is one line (or bar
    cluster) of a plot, labelled by its variant plus the config fields that set it apart
    from the other kept groups.
    """
    skip = {"config.preset", *axis_cols}
    cols = sorted(c for c in t.columns if c.startswith("config.") and c not in skip)
    cols += [c for c in ("precision", "world_size", "device_name", "dense", "run") if c in t.columns
             and c not in axis_cols]
    grouped: dict[tuple, list] = {}
    for i, row in zip(t.index, t[cols].itertuples(index=False), strict=True):
        grouped.setdefault(tuple(norm_value(v) for v in row), []).append(i)
    kept = {k: t.loc[rows] for k, rows in grouped.items() if t.loc[rows, sweep_col].nunique() > 1}
    varying = [j for j, c in enumerate(cols)
               if len({k[j] for k in kept}) > 1 and not c.startswith("config.parallel.")]
    out = []
    for k, sub in kept.items():
        extra = ", ".join(f"{axis_name(cols[j].removeprefix('config.'))}={k[j]}" for j in varying)
        out.append((sub["variant"].iloc[0] + (f" ({extra})" if extra else ""), sub))
    return sorted(out, key=lambda g: g[0])


def barh(ax, labels: list[str], values: np.ndarray, colors: list, xlabel: str) -> None:
    y = np.arange(len(labels))
    ax.barh(y, values, color=colors)
    ax.set_yticks(y, labels)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)


def legend_for_variants(ax, variants: list[str], colors: dict[str, tuple]) -> None:
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[v]) for v in sorted(set(variants))]
    ax.legend(handles, sorted(set(variants)), title="layout", **OUTSIDE)


def height(n: int) -> float:
    return 1.6 + 0.28 * n
