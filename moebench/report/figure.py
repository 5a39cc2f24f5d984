"""What every report figure shares: the style, colours and markers, the groups a line joins, bars and legends."""

from __future__ import annotations

import io
import textwrap
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, NullFormatter

from moebench.record import format_count
from moebench.results.stats import CONFIDENCE, median_ci, step_runs
from moebench.results.table import axis_name, is_set, norm_value, variant_label

STYLE = {
    "figure.dpi": 100, "savefig.dpi": 100, "font.size": 9, "axes.titlesize": 10, "axes.grid": True,
    "grid.alpha": 0.3, "axes.spines.top": False, "axes.spines.right": False, "legend.fontsize": 8,
    "legend.frameon": False,
    "text.parse_math": False,  # labels come from results: a "$" in a config value is text, not math
    # Text stays text in the SVG: searchable, and a label is written exactly as the results spell it.
    "svg.fonttype": "none",
}
CI = f"{100 * CONFIDENCE:g}%"
LINESTYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D", "v", "P")
PALETTE = (*plt.get_cmap("tab10").colors, *plt.get_cmap("Dark2").colors)  # layouts
# Layouts most suites compare, (strategy, ep, pp, dispatcher), keep these slots of PALETTE in every report
# (slot 7 is free); any other label hashes to one. Labelled as the table labels them (variant_label).
_KNOWN_SLOTS = {0: ("fsdp", 1, 1, "sync"), 1: ("ddp", 1, 1, "sync"), 2: ("ddp", 2, 1, "sync"),
                3: ("ddp", 8, 1, "sync"), 4: ("ddp", 4, 1, "sync"), 5: ("ddp", 4, 1, "rowwise"),
                6: ("ddp", 2, 1, "rowwise"), 8: ("ddp", 1, 2, "sync"), 9: ("ddp", 8, 1, "rowwise")}
KNOWN_LAYOUTS = {variant_label(s, ep, pp, d, False): slot for slot, (s, ep, pp, d) in _KNOWN_SLOTS.items()}
SERIES = plt.get_cmap("Set2").colors  # anything else (memory kinds, mesh axes, precisions): never a layout's colour
EMULATED_HATCH = "///"  # emulated fp8/mxfp8 bars; emulated points on lines get a hollow marker
EMULATED_LABEL = "emulated fp8/mxfp8 (not its real speed)"
THROTTLED_EDGE = {"edgecolor": "#d62728", "linewidth": 2.0, "linestyle": "--"}  # a bar whose GPU clocks throttled
THROTTLED_LABEL = "GPU clocks throttled (dashed red outline)"
# A ratio bar without a conclusive verdict (faster or slower, its interval clear of 1.0): pale and cross-hatched
INCONCLUSIVE_HATCH = "xx"
INCONCLUSIVE_LABEL = "no conclusive verdict (within noise, inconclusive, or no interval): pale, cross-hatched"
WRAP = 42  # characters per line of a tick label or legend entry
OUTSIDE = {"loc": "upper left", "bbox_to_anchor": (1.01, 1.0)}  # legends right of the axes, never on data
# Every report figure is at least this wide (inches; SVG points are 4/3 px): 1200 px of the 1400 px page's
# 1336 px of text width, so no figure is drawn at half the page beside empty space.
WIDTH = 12.5


@dataclass
class Plot:
    name: str
    title: str
    draw: Callable[[pd.DataFrame], Figure | str]
    gpu_only: bool = False  # drawn from GPU points only: a report without any says nothing of it


def colors_of(t: pd.DataFrame) -> dict[str, tuple]:
    """One colour per layout label, the same in every plot of every report.

    A label has a fixed slot in :data:`PALETTE` (:data:`KNOWN_LAYOUTS`, else a checksum of its
    text: not ``hash()``, which changes per process), so ``fsdp`` keeps its colour whatever else a
    store holds. Only when two labels of one report land on one slot does the later one (in sort
    order) move to the next free slot, so a report never shows two layouts in one colour.
    """
    labels = sorted(t["variant"].map(str).unique(), key=lambda v: (v not in KNOWN_LAYOUTS, v))
    taken: set[int] = set()
    out = {}
    for label in labels:
        slot = KNOWN_LAYOUTS.get(label, zlib.crc32(label.encode()) % len(PALETTE))
        while slot in taken and len(taken) < len(PALETTE):
            slot = (slot + 1) % len(PALETTE)
        taken.add(slot)
        out[label] = PALETTE[slot]
    return out


def wrap(label: str) -> str:
    """A long point label over several lines, so it does not squeeze the axes."""
    return textwrap.fill(str(label), WRAP, break_on_hyphens=False)


def emulated(rows: pd.DataFrame) -> list[bool]:
    return [impl == "emulated" for impl in rows["precision_impl"]]


def throttled(rows: pd.DataFrame, with_baseline: bool = False) -> list[bool]:
    """Which rows ran with throttled GPU clocks; ``with_baseline``: or their baseline did (a ratio's bar)."""
    own = [is_set(v) for v in rows["throttled"]] if "throttled" in rows.columns else [False] * len(rows)
    if not with_baseline or "baseline_throttled" not in rows.columns:
        return own
    return [a or is_set(b) for a, b in zip(own, rows["baseline_throttled"], strict=True)]


def mark_emulated(ax, x: pd.Series, y: pd.Series, rows: pd.DataFrame, color: tuple) -> None:
    """Hollow markers over the points of a line that ran their quantized GEMMs emulated."""
    flags = emulated(rows)
    if any(flags):
        ax.plot(x[flags], y[flags], ls="none", marker="o", ms=9, mfc="white", mec=color, mew=1.5, zorder=3,
                label=EMULATED_LABEL)


def omitted(fig: Figure, why: str) -> None:
    """Say in the figure which panel was left out and why, instead of drawing an empty one."""
    fig.text(0.01, 0.0, why, fontsize=8, style="italic", color="0.3", gid="note")


def run_style(t: pd.DataFrame) -> dict[str, dict[str, str]]:
    """Line style and marker of each loaded run, so runs of one suite stay apart in line plots."""
    runs = sorted(t["run"].map(norm_value).unique())
    return {r: {"ls": LINESTYLES[i % len(LINESTYLES)], "marker": MARKERS[i % len(MARKERS)]}
            for i, r in enumerate(runs)}


def throughput_err(g: pd.DataFrame) -> np.ndarray:
    """Distance from each point's tokens/s per device to the ends of the interval of its median.

    Throughput is work per step over the step time, so the interval of the median step time,
    inverted, is the interval of the median throughput (over the runs of a point with repeats).
    """
    err = np.zeros((2, len(g)))
    for j, (value, median, (_, row)) in enumerate(zip(g["tokens_per_s_per_device"], g["step_time_median_s"],
                                                      g.iterrows(), strict=True)):
        ci = median_ci(step_runs(row))
        if ci is not None and median == median:
            err[:, j] = (max(value - value * median / ci[1], 0.0), max(value * median / ci[0] - value, 0.0))
    return err


def mark_repeats(ax, x: pd.Series, g: pd.DataFrame, color: tuple) -> None:
    """A small hollow marker per repeat of each point (its tokens/s per device), so the spread of the runs
    behind a point is visible next to its interval."""
    if "run_tokens" not in g.columns:
        return
    xs, ys = [], []
    for xv, values in zip(x, g["run_tokens"], strict=True):
        if isinstance(values, list) and len(values) > 1:
            xs += [xv] * len(values)
            ys += values
    if xs:
        ax.scatter(xs, ys, s=14, facecolors="none", edgecolors=[color], linewidths=0.8, alpha=0.8, zorder=3,
                   label="_nolegend_", gid="repeats")


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


def barh(ax, rows: pd.DataFrame, values: np.ndarray, colors: list, xlabel: str,
         hot: list[bool] | None = None) -> None:
    """One bar per row, labelled by the point; emulated fp8/mxfp8 points hatched, throttled ones (``hot``,
    by default :func:`throttled`) outlined."""
    y = np.arange(len(rows))
    bars = ax.barh(y, values, color=colors)
    for bar, hollow, warm in zip(bars, emulated(rows), throttled(rows) if hot is None else hot, strict=True):
        if hollow:
            bar.set_hatch(EMULATED_HATCH)
            bar.set_edgecolor("black")
        if warm:
            bar.set(**THROTTLED_EDGE, gid="throttled")
    ax.set_yticks(y, [wrap(lab) for lab in rows["label"]])
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)


def conclusive(rows: pd.DataFrame) -> list[bool]:
    """Which rows' speedups have a verdict: faster or slower, the interval clear of 1.0 (``speedup_verdict``)."""
    verdicts = rows["speedup_verdict"] if "speedup_verdict" in rows.columns else pd.Series(None, index=rows.index)
    flags = rows["inconclusive"] if "inconclusive" in rows.columns else pd.Series(False, index=rows.index)
    return [v in ("faster", "slower") and not is_set(f) for v, f in zip(verdicts, flags, strict=True)]


def mark_inconclusive(ax, rows: pd.DataFrame) -> bool:
    """Pale, cross-hatched bars (the axes' bars, one per row in order) for the rows without a conclusive
    speedup verdict; True if any."""
    bars = [p for p in ax.patches if isinstance(p, plt.Rectangle)][: len(rows)]
    marked = False
    for bar, sure in zip(bars, conclusive(rows), strict=True):
        if not sure:
            # over an emulated bar's hatch, and inside a throttled bar's red outline: each mark stays
            bar.set(alpha=0.45, hatch=(bar.get_hatch() or "") + INCONCLUSIVE_HATCH)
            if bar.get_gid() != "throttled":
                bar.set(edgecolor="0.25", gid="inconclusive")
            marked = True
    return marked


def inconclusive_handle() -> plt.Rectangle:
    return plt.Rectangle((0, 0), 1, 1, facecolor="0.85", edgecolor="0.25", hatch=INCONCLUSIVE_HATCH)


def legend_for_variants(ax, rows: pd.DataFrame, colors: dict[str, tuple], hot: list[bool] | None = None,
                        extra: Sequence[tuple[Any, str]] = ()) -> None:
    """A legend of the layouts' colours, the marks (emulated, throttled) and the ``extra`` (handle, label)
    entries; none when it would say only the one layout every bar has (each bar's label starts with it)."""
    variants = sorted(set(rows["variant"]))
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[v]) for v in variants]
    labels = [wrap(v) for v in variants]
    for handle, label in extra:
        handles.append(handle)
        labels.append(wrap(label))
    if any(emulated(rows)):
        handles.append(plt.Rectangle((0, 0), 1, 1, facecolor="white", edgecolor="black", hatch=EMULATED_HATCH))
        labels.append(wrap(EMULATED_LABEL))
    if any(throttled(rows) if hot is None else hot):
        handles.append(plt.Rectangle((0, 0), 1, 1, facecolor="white", **THROTTLED_EDGE))
        labels.append(wrap(THROTTLED_LABEL))
    if len(handles) > 1:
        ax.legend(handles, labels, title="layout", **OUTSIDE)


def wrap_to_width(text, room: float, renderer) -> bool:
    """Wrap a Text artist's lines so that it is at most ``room`` display units wide, measured as drawn
    (the characters that fit, at its font); True if it was wrapped."""
    lines = text.get_text().split("\n")
    width = text.get_window_extent(renderer).width
    if not text.get_text() or width <= room:
        return False
    chars = max(int(max(map(len, lines)) * room / width), 12)
    text.set_text(textwrap.fill(" ".join(lines), chars, break_on_hyphens=False))
    return True


def fit_xlabels(fig: Figure) -> bool:
    """Wrap each axes' x label to the width of its axes: a label wider than its panel runs into the
    next panel's, or past the figure's edges. True if any label was wrapped."""
    renderer = fig.canvas.get_renderer()
    return any([wrap_to_width(ax.xaxis.label, ax.get_window_extent(renderer).width, renderer) for ax in fig.axes])


def widen(fig: Figure) -> None:
    """Draw ``fig`` :data:`WIDTH` wide if it is narrower (its height, sized for its rows, stays)."""
    if fig.get_figwidth() < WIDTH:
        fig.set_figwidth(WIDTH)


def height(labels: pd.Series | int) -> float:
    """Figure height for bars of ``labels`` (or that many one-line rows): each wrapped line needs room."""
    lines = labels if isinstance(labels, int) else sum(wrap(lab).count("\n") + 1 for lab in labels)
    return 1.6 + 0.28 * lines


def log_x(ax, base: float = 10) -> None:
    """A log scale whose ticks read 10, 100 (matplotlib's log labels are mathtext, which the report
    style turns off, so they would show as ``$\\mathdefault{10^{1}}$``); minor ticks unlabelled."""
    ax.set_xscale("log", base=base)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())


def count_axis(ax) -> None:
    """Tick labels of a count axis as 250 K, 1.20 M: long raw numbers run into each other."""
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: format_count(v)))


def svg_bytes(fig: Figure) -> bytes:
    """The figure as SVG, drawn in the report style (tick labels are made at draw time, so the style,
    with its no-mathtext rule, must hold here too); the figure is closed."""
    buf = io.BytesIO()
    with plt.rc_context(STYLE):
        fig.savefig(buf, format="svg", metadata={"Date": None})  # same stores, same bytes
    plt.close(fig)
    return buf.getvalue()
