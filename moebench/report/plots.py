"""Report figures (matplotlib, Agg backend), one consistent style (:mod:`moebench.report.figure`).

Every plot function takes the paired tidy table and returns a Figure, or a string saying
why the store has nothing to draw (the report prints that note instead of an empty plot).
Colours follow the layout variant (``fsdp``, ``ddp ep8 rowwise`` ...) in every figure.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, MaxNLocator

from moebench.record import METRICS, byte_unit, flop_rate_unit, format_count
from moebench.report import figure as fg
from moebench.report.breakdown import plot_breakdown, plot_planned_breakdown
from moebench.report.figure import CI, OUTSIDE, SERIES, Plot, barh, colors_of, height, legend_for_variants, wrap
from moebench.report.loss import MAX_PANELS, comparison_groups, loss_curves, loss_vs_precision, panels
from moebench.report.memory_parts import plot_memory_parts
from moebench.results.table import norm_value


def throughput_vs_experts(t: pd.DataFrame) -> Figure | str:
    ok = fg.ok_rows(t, "tokens_per_s_per_device")
    moe, dense = ok[~ok["dense"]], ok[ok["dense"]]
    lines = fg.groups_over(moe, ["config.moe.num_experts"], "num_experts")
    if not lines:
        return "no ok points that differ only in the expert count"
    colors, styles = colors_of(t), fg.run_style(t)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for lab, g in lines:
        g = g.sort_values("num_experts")
        color = colors[g["variant"].iloc[0]]
        ax.errorbar(g["num_experts"], g["tokens_per_s_per_device"], yerr=fg.throughput_err(g), capsize=3,
                    label=wrap(lab), color=color, **styles[norm_value(g["run"].iloc[0])])
        fg.mark_emulated(ax, g["num_experts"], g["tokens_per_s_per_device"], g, color)
        fg.mark_repeats(ax, g["num_experts"], g, color)
    multi_run = len(styles) > 1
    for _, row in dense.iterrows():
        run = f", {row['run']}" if multi_run else ""
        ax.axhline(row["tokens_per_s_per_device"], ls="--", lw=1, color=colors[row["variant"]],
                   label=wrap(f"dense equivalent ({row['variant']}{run})"))
    fg.log_x(ax, base=2)
    xs = sorted(moe["num_experts"].dropna().unique())
    ax.set_xticks(xs, [f"{x:g}" for x in xs])
    ax.set_xlabel("routed experts per MoE layer")
    ax.set_ylabel(METRICS["tokens_per_s_per_device"].label)
    ax.set_ylim(bottom=0)
    _unique_legend(ax)
    return fig


def _unique_legend(ax) -> None:
    """The axes' legend with each label once (every line may add the emulated marker's entry)."""
    handles, labels = ax.get_legend_handles_labels()
    seen = dict(zip(labels, handles, strict=True))
    ax.legend(list(seen.values()), list(seen), **OUTSIDE)


def speedup(t: pd.DataFrame) -> Figure | str:
    ok = fg.ok_rows(t, "speedup")
    ok = ok[ok["baseline_point_id"] != ok["point_id"]]
    if ok.empty:
        return "no point has a baseline point to compare with"
    colors = colors_of(t)
    fig, ax = plt.subplots(figsize=(7, height(ok["label"])))
    spec = METRICS["speedup"]
    hot = fg.throttled(ok, with_baseline=True)  # a ratio is off when either side throttled
    baselines = t.attrs.get("baselines", {})
    shown = {s: b for s, b in baselines.items() if s in set(ok["suite"].map(str))}
    # one suite: its baseline on the axis; several: each suite's on a line of its own below
    which = f" {next(iter(shown.values()))}" if len(set(shown.values())) == 1 else ""
    barh(ax, ok, ok["speedup"].to_numpy(), [colors[v] for v in ok["variant"]],
         f"{spec.label} over the baseline{which} ({METRICS['tokens_per_s_per_device'].label}, {spec.unit})", hot)
    if not which:
        for suite, selector in shown.items():
            fg.omitted(fig, f"{suite}: baseline {selector}")
    value = ok["speedup"].to_numpy(float)
    high = ok["speedup_high"].to_numpy(float)
    err = np.nan_to_num(np.vstack([value - ok["speedup_low"].to_numpy(float), high - value]))
    ax.errorbar(value, np.arange(len(ok)), xerr=np.clip(err, 0, None), fmt="none", ecolor="black", capsize=3, lw=1)
    ax.axvline(1.0, color="black", lw=1)
    open_bars = fg.mark_inconclusive(ax, ok)
    # each bar's value past its whisker, so no one reads it off the axis
    ends = np.fmax(value, np.nan_to_num(high, nan=0.0))
    for y, (v, end) in enumerate(zip(value, ends, strict=True)):
        ax.annotate(f"{v:.2f}x", (end, y), xytext=(4, 0), textcoords="offset points", va="center", fontsize=8)
    ax.set_xlim(0, 1.12 * float(np.nanmax([*ends, 1.0])))
    extra = [(plt.Line2D([], [], color="black", lw=1), "1.0: as fast as the baseline")]
    extra += [(fg.inconclusive_handle(), fg.INCONCLUSIVE_LABEL)] if open_bars else []
    legend_for_variants(ax, ok, colors, hot, extra=extra)
    return fig


def mfu_label(t: pd.DataFrame) -> str:
    """The MFU axis names the peak it divides by: the datasheet bf16 peak on a GPU, a calibration
    matmul on a CPU (``peak_flops_source`` of each record)."""
    sources = sorted({str(s) for s in t.get("peak_flops_source", pd.Series(dtype=object)).dropna()})
    peak = sources[0] if len(sources) == 1 else "each point's peak: " + "; ".join(sources) if sources else "peak"
    return f"{METRICS['mfu'].label} (% of {peak})"


def tflops_mfu(t: pd.DataFrame) -> Figure | str:
    ok = fg.ok_rows(t, "tflops_per_device")
    if ok.empty:
        return "no ok point reports its FLOP/s"
    colors = colors_of(t)
    c = [colors[v] for v in ok["variant"]]
    has_mfu = ok["mfu"].notna().any()
    fig, axes = plt.subplots(1, 2 if has_mfu else 1, figsize=(10 if has_mfu else 7, height(ok["label"])), sharey=True,
                             squeeze=False)
    a = axes[0][0]
    scale, unit = flop_rate_unit(1e12 * float(ok["tflops_per_device"].max()))  # GFLOP/s on a CPU
    barh(a, ok, 1e12 * ok["tflops_per_device"].to_numpy() / scale, c, f"{METRICS['tflops_per_device'].label} ({unit})")
    extra = []
    if has_mfu:
        b = axes[0][1]
        barh(b, ok, 100 * ok["mfu"].fillna(0).to_numpy(), c, wrap(mfu_label(ok)))
        b.invert_yaxis()  # sharey: undo the second inversion
        extra = _useful_mfu_bars(b, ok)
    else:
        fg.omitted(fig, f"{METRICS['mfu'].label} panel omitted: no point knows its device's peak FLOP/s")
    legend_for_variants(axes[0][-1], ok, colors, extra=extra)
    return fig


USEFUL_LOOK = {"color": "white", "edgecolor": "black", "hatch": "..", "height": 0.4}


def _useful_mfu_bars(ax, ok: pd.DataFrame) -> list[tuple[object, str]]:
    """Over the MFU bar of each point that dropped routes, a narrower one of its MFU of the kept routes
    (``useful_mfu``): the work it did, not what it would have done. Returns its legend entry (none
    where no point dropped a route)."""
    lossy = (ok["dropped_fraction"].fillna(0) > 0) & ok["useful_mfu"].notna() if "useful_mfu" in ok.columns \
        else pd.Series(False, index=ok.index)
    if not lossy.any():
        return []
    y = np.flatnonzero(lossy.to_numpy())
    bars = ax.barh(y, 100 * ok.loc[lossy, "useful_mfu"].to_numpy(), **USEFUL_LOOK)
    return [(bars, f"{METRICS['useful_mfu'].label}, points that dropped routes")]


def memory(t: pd.DataFrame) -> Figure | str:
    ok = fg.ok_rows(t)
    intervals = ok["nvml_interval_s"].dropna().unique()
    every = f", sampled every {1e3 * intervals[0]:g} ms" if len(intervals) == 1 else ", sampled"
    # On a CPU the trainer's allocator peak is the process RSS: one number, drawn once.
    same = ok["peak_rss_bytes"] == ok["peak_mem_bytes"]
    values = {"peak_rss_bytes": ok["peak_rss_bytes"].where(~same)}
    # the one bar of a CPU point is its RSS: the legend says so, not "allocator peak" alone
    own = {"nvml_peak_mem_used_bytes": every, "peak_mem_bytes": f" (on CPU: the {METRICS['peak_rss_bytes'].label})"
           if same.any() else ""}
    cols = [(c, METRICS[c].label + own.get(c, ""))
            for c in ("peak_mem_bytes", "peak_mem_reserved_bytes", "nvml_peak_mem_used_bytes", "peak_rss_bytes")
            if c in ok.columns and values.get(c, ok[c]).notna().any()]
    if ok.empty or not cols:
        return "no ok point reports memory"
    top = max(float(ok[c].max()) for c, _ in cols)
    scale, unit = byte_unit(top)
    # room for every label and for every bar: 8 points of one series need their 8 labels' height
    fig, ax = plt.subplots(figsize=(10, max(height(ok["label"]), height(len(ok) * len(cols) // 2))))
    y = np.arange(len(ok))
    h = 0.8 / len(cols)
    for j, (c, lab) in enumerate(cols):
        ax.barh(y + j * h, values.get(c, ok[c]).fillna(0).to_numpy() / scale, height=h, label=wrap(lab),
                color=SERIES[j])
    ax.set_yticks(y + h * (len(cols) - 1) / 2, [wrap(lab) for lab in ok["label"]])
    ax.invert_yaxis()
    ax.set_xlabel(f"peak memory ({unit}; allocator and RSS: rank 0, NVML: busiest device)")
    ax.legend(**OUTSIDE)
    if same.any():
        fg.omitted(fig, f"{int(same.sum())} point(s) on CPU: the {METRICS['peak_mem_bytes'].label} is the "
                        f"{METRICS['peak_rss_bytes'].label}, drawn once")
    return fig


def precision(t: pd.DataFrame) -> Figure | str:
    ok = fg.ok_rows(t, "tokens_per_s_per_device")
    groups = fg.groups_over(ok, ["config.precision.mode", "precision"], "precision")
    if not groups:
        return "no points that differ only in precision"
    modes = sorted({p for _, g in groups for p in g["precision_shown"].map(norm_value)})
    fig, axes = plt.subplots(1, 3, figsize=(12, 1.8 + 0.5 * len(groups)), sharey=True)
    y = np.arange(len(groups))
    h = 0.8 / len(modes)
    tok, peak, loss = (METRICS[m] for m in ("tokens_per_s_per_device", "peak_mem_bytes", "loss_last"))
    scale, unit = byte_unit(float(ok[peak.name].max()))
    for ax, (col, div, xlabel) in zip(axes, [(tok.name, 1, tok.label), (peak.name, scale, f"{peak.label} ({unit})"),
                                             (loss.name, 1, f"{loss.label} ({loss.unit})")], strict=True):
        drawn = []
        for j, mode in enumerate(modes):
            vals = [g.loc[g["precision_shown"].map(norm_value) == mode, col].mean() / div for _, g in groups]
            drawn += vals
            hatch = fg.EMULATED_HATCH if mode.endswith("(emulated)") else None
            ax.barh(y + j * h, vals, height=h, label=mode, color=SERIES[j], hatch=hatch, edgecolor="black" if hatch
                    else None)
        if col == loss.name and _zoom_on(ax, drawn):  # final losses differ in the 2nd or 3rd digit
            xlabel = f"{loss.label} ({loss.unit}; the axis does not start at 0)"
        ax.set_xlabel(xlabel)
    axes[0].set_yticks(y + h * (len(modes) - 1) / 2, [wrap(lab) for lab, _ in groups])
    axes[0].invert_yaxis()
    axes[-1].legend(title="precision (hatched: emulated)" if any("(emulated)" in m for m in modes) else "precision",
                    **OUTSIDE)
    return fig


def _zoom_on(ax, values: Sequence[float]) -> bool:
    """Limit the x axis to a range around ``values`` when, from 0, their bars would look equal (their
    spread under a tenth of the largest); True if it was limited."""
    finite = [v for v in values if v == v]
    if not finite or min(finite) <= 0:
        return False
    lo, hi = min(finite), max(finite)
    if hi - lo > 0.1 * hi:
        return False
    pad = max(hi - lo, 1e-3 * hi)
    ax.set_xlim(lo - pad, hi + pad)
    return True


def top_k(t: pd.DataFrame) -> Figure | str:
    ok = fg.ok_rows(t, "tokens_per_s_per_device")
    lines = fg.groups_over(ok, ["config.moe.top_k"], "top_k")
    if not lines:
        return "no points that differ only in top-k"
    colors, styles = colors_of(t), fg.run_style(t)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for lab, g in lines:
        g = g.sort_values("top_k")
        color = colors[g["variant"].iloc[0]]
        style = {"color": color, **styles[norm_value(g["run"].iloc[0])]}
        a.errorbar(g["top_k"], g["tokens_per_s_per_device"], yerr=fg.throughput_err(g), capsize=3, label=wrap(lab),
                   **style)
        b.plot(g["top_k"], g["tflops_per_device"], label=wrap(lab), **style)
        fg.mark_emulated(a, g["top_k"], g["tokens_per_s_per_device"], g, color)
        fg.mark_repeats(a, g["top_k"], g, color)
        fg.mark_emulated(b, g["top_k"], g["tflops_per_device"], g, color)
    for ax, ylabel in ((a, METRICS["tokens_per_s_per_device"].label), (b, METRICS["tflops_per_device"].label)):
        ax.set_xlabel("experts per token (top-k)")
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
    _unique_legend(b)
    return fig


def step_times(t: pd.DataFrame) -> Figure | str:
    ok = fg.ok_rows(t)
    ok = ok[[bool(s) for s in ok["step_times_s"]]]
    if ok.empty:
        return "no ok point kept raw step-time samples"
    colors = colors_of(t)
    fig, ax = plt.subplots(figsize=(8, height(ok["label"])))
    data = [np.asarray(s) * 1e3 for s in ok["step_times_s"]]
    box = ax.boxplot(data, orientation="horizontal", patch_artist=True, widths=0.6, flierprops={"markersize": 3})
    for patch, v, hollow in zip(box["boxes"], ok["variant"], fg.emulated(ok), strict=True):
        patch.set_facecolor(colors[v])
        patch.set_alpha(0.7)
        if hollow:
            patch.set_hatch(fg.EMULATED_HATCH)
    ax.set_yticks(np.arange(1, len(ok) + 1), [wrap(lab) for lab in ok["label"]])
    ax.invert_yaxis()
    lo, hi = min(float(d.min()) for d in data), max(float(d.max()) for d in data)
    scale = "log" if lo > 0 and hi / lo > 10 else "linear"  # log only when the points span decades
    if scale == "log":
        fg.log_x(ax)
    ax.set_xlabel(f"step time (ms{', log scale' if scale == 'log' else ''}; every timed step, warm-up excluded)")
    legend_for_variants(ax, ok, colors)
    return fig


def step_throughput(t: pd.DataFrame) -> Figure | str:
    """Tokens/s per device of every timed step (tokens per step / that step's time / ranks), one panel per
    comparison group, one line per run: a warm-up tail, a drift or a slow stretch shows where a median hides it."""
    ok = fg.ok_rows(t, "tokens_per_step")
    ok = ok[ok["step_runs"].map(bool).astype(bool)] if "step_runs" in ok.columns else ok.iloc[:0]
    groups = comparison_groups(ok)
    if not groups:
        return "no ok point kept its raw step times"
    colors = colors_of(t)
    shown = groups[:MAX_PANELS]
    fig, axes = panels(len(shown), width=WIDE_PANEL if len(shown) == 1 else 4.2)
    for ax, (title, g) in zip(axes, shown, strict=True):
        for _, row in g.iterrows():
            name = row["label"] + (" (baseline)" if row["point_id"] == row["baseline_point_id"] else "")
            for k, steps in enumerate(row["step_runs"]):
                rate = float(row["tokens_per_step"]) / np.asarray(steps, float) / float(row["world_size"] or 1)
                ax.plot(np.arange(1, len(rate) + 1), rate, color=colors[row["variant"]], lw=1.2,
                        alpha=1.0 if len(row["step_runs"]) == 1 else 0.6, label=wrap(name) if k == 0 else None)
        ax.set_title(wrap(title), fontsize=8)
        ax.set_xlabel("timed step (warm-up excluded; a line per run)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are counted: no step 2.5
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: format_count(v)))
        ax.set_ylabel(METRICS["tokens_per_s_per_device"].label)
        ax.legend(fontsize=7, loc="best")
    if len(groups) > len(shown):
        fg.omitted(fig, f"{len(groups) - len(shown)} more comparison group(s) left out: at most {MAX_PANELS} panels")
    return fig


WIDE_PANEL = 9.0  # inches: one panel alone spans the figure instead of a third of it


def comm_bytes(t: pd.DataFrame) -> Figure | str:
    ok = fg.ok_rows(t)
    axes = [a for a in t.attrs.get("comm_axes", []) if ok[f"comm_{a}_bytes"].fillna(0).gt(0).any()]
    if ok.empty or not axes:
        return "no point communicated (single-rank runs, or comm bytes not recorded)"
    fig, ax = plt.subplots(figsize=(8, height(ok["label"])))
    left = np.zeros(len(ok))
    y = np.arange(len(ok))
    scale, unit = byte_unit(float(ok["comm_bytes_total"].max()))
    for j, a in enumerate(axes):
        vals = ok[f"comm_{a}_bytes"].fillna(0).to_numpy() / scale
        ax.barh(y, vals, left=left, label=f"{a} axis", color=SERIES[j])
        left += vals
    ax.set_yticks(y, [wrap(lab) for lab in ok["label"]])
    ax.invert_yaxis()
    ax.set_xlabel(f"{METRICS['comm_bytes_total'].label} ({unit})")
    ax.legend(title="mesh axis", **OUTSIDE)
    return fig


def routing(t: pd.DataFrame) -> Figure | str:
    ok = fg.ok_rows(t, "load_imbalance")
    if ok.empty:
        return "no ok point reports router statistics"
    colors = colors_of(t)
    c = [colors[v] for v in ok["variant"]]
    dropped = ok["dropped_tokens"].fillna(0).to_numpy()
    fig, axes = plt.subplots(1, 2 if dropped.any() else 1, figsize=(10 if dropped.any() else 7, height(ok["label"])),
                             sharey=True, squeeze=False)
    a = axes[0][0]
    mean = ok["load_imbalance"].to_numpy()
    err = np.clip(ok["load_imbalance_max"].to_numpy() - mean, 0, None)
    spec = METRICS["load_imbalance"]
    barh(a, ok, mean, c, f"{spec.label} ({spec.unit}; whisker: worst step)")
    a.errorbar(mean, np.arange(len(ok)), xerr=[np.zeros_like(err), err], fmt="none", ecolor="black", capsize=2)
    a.axvline(1.0, color="black", lw=1)
    if dropped.any():
        b = axes[0][1]
        barh(b, ok, dropped, c, f"{METRICS['dropped_tokens'].label} (count, timed steps)")
        fg.count_axis(b)
        b.invert_yaxis()  # sharey: undo the second inversion
    else:
        fg.omitted(fig, f"{METRICS['dropped_tokens'].label} panel omitted: no point dropped a route")
    legend_for_variants(axes[0][-1], ok, colors)
    return fig


PLOTS = [
    Plot("throughput_vs_experts", f"Tokens/s per device vs experts (error bars: {CI} CI of the median)",
         throughput_vs_experts),
    Plot("speedup", f"Speedup over the baseline (whiskers: {CI} CI of the ratio)", speedup),
    Plot("tflops_mfu", "Model FLOP/s and MFU per device", tflops_mfu),
    Plot("memory", "Peak memory per point", memory),
    Plot("memory_parts", "Memory by part, measured and planned (rank 0)", plot_memory_parts),
    Plot("precision", "Precision comparison: speed, memory, final loss", precision),
    Plot("top_k", f"Effect of top-k (error bars: {CI} CI of the median tokens/s)", top_k),
    Plot("step_times", "Step-time distributions", step_times),
    Plot("step_throughput", "Tokens/s per device of every timed step, each point with its baseline", step_throughput),
    Plot("time_breakdown", "Where each step's time goes: every point beside its baseline", plot_breakdown),
    Plot("time_breakdown_planned", "Time breakdown, measured and planned (GPU points)", plot_planned_breakdown,
         gpu_only=True),
    Plot("comm_bytes", "Communication per step by mesh axis", comm_bytes),
    Plot("routing", "Load imbalance and dropped routes", routing),
    Plot("loss_curves", "LM loss per step, each point with its baseline", loss_curves),
    Plot("loss_vs_precision", "Loss difference against the reference precision (bf16 on GPU, fp32 on CPU)",
         loss_vs_precision),
]


LINE_SPACING = 1.45  # a line of caption or note text is this many times its font size tall


def caption_below(fig: Figure, caption: str) -> None:
    """``caption`` along the bottom edge, the figure's notes (:func:`moebench.report.figure.omitted`)
    stacked above it, each as tall as its lines of text in points (a fixed share of the figure
    would overlap on a short one), and the axes laid out above them all."""
    notes = [x for x in fig.texts if x.get_gid() == "note"]
    y = 0.01
    renderer = fig.canvas.get_renderer()
    for text in [fig.text(0.01, y, caption, fontsize=7, color="0.35", ha="left"), *reversed(notes)]:
        fg.wrap_to_width(text, 0.98 * fig.bbox.width, renderer)  # a line longer than the figure is cut off
        text.set_y(y)
        text.set_va("bottom")
        lines = text.get_text().count("\n") + 1
        y += lines * text.get_fontsize() * LINE_SPACING / 72 / fig.get_figheight()
    fig.tight_layout(rect=(0, y + 0.01, 1, 1))
    if fg.fit_xlabels(fig):  # a narrower label is taller: lay the axes out again around it
        fig.tight_layout(rect=(0, y + 0.01, 1, 1))


def render_all(t: pd.DataFrame, caption: str, extra: Sequence[Plot] = ()) -> list[tuple[Plot, Figure | str]]:
    """Draw every plot (and ``extra`` ones) in the report style; figures get their title at the top and
    ``caption`` (and a line per omitted panel) along the bottom, so a figure file says what it shows on its own."""
    out = []
    with plt.rc_context(fg.STYLE):
        for plot in [*PLOTS, *extra]:
            fig = plot.draw(t)
            if isinstance(fig, Figure):
                fg.widen(fig)
                fig.suptitle(plot.title)
                caption_below(fig, caption)
            out.append((plot, fig))
    return out
