"""Report figures (matplotlib, Agg backend), one consistent style (:mod:`moebench.report.figure`).

Every plot function takes the paired tidy table and returns a Figure, or a string saying
why the store has nothing to draw (the report prints that note instead of an empty plot).
Colours follow the layout variant (``fsdp``, ``ddp ep8 rowwise`` ...) in every figure.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from moebench.record import METRICS
from moebench.report.breakdown import plot_breakdown
from moebench.report.figure import (
    CI,
    OUTSIDE,
    PALETTE,
    STYLE,
    Plot,
    barh,
    colors_of,
    groups_over,
    height,
    legend_for_variants,
    ok_rows,
    run_style,
    throughput_err,
)
from moebench.report.table import GIB, norm_value


def throughput_vs_experts(t: pd.DataFrame) -> Figure | str:
    ok = ok_rows(t, "tokens_per_s_per_device")
    moe, dense = ok[~ok["dense"]], ok[ok["dense"]]
    lines = groups_over(moe, ["config.moe.num_experts"], "num_experts")
    if not lines:
        return "no ok points that differ only in the expert count"
    colors, styles = colors_of(t), run_style(t)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for lab, g in lines:
        g = g.sort_values("num_experts")
        ax.errorbar(g["num_experts"], g["tokens_per_s_per_device"], yerr=throughput_err(g), capsize=3, label=lab,
                    color=colors[g["variant"].iloc[0]], **styles[norm_value(g["run"].iloc[0])])
    multi_run = len(styles) > 1
    for _, row in dense.iterrows():
        run = f", {row['run']}" if multi_run else ""
        ax.axhline(row["tokens_per_s_per_device"], ls="--", lw=1, color=colors[row["variant"]],
                   label=f"dense equivalent ({row['variant']}{run})")
    ax.set_xscale("log", base=2)
    xs = sorted(moe["num_experts"].dropna().unique())
    ax.set_xticks(xs, [f"{x:g}" for x in xs])
    ax.set_xlabel("routed experts per MoE layer")
    ax.set_ylabel(METRICS["tokens_per_s_per_device"].label)
    ax.set_ylim(bottom=0)
    ax.legend(**OUTSIDE)
    return fig


def speedup(t: pd.DataFrame) -> Figure | str:
    ok = ok_rows(t, "speedup")
    ok = ok[ok["baseline_point_id"] != ok["point_id"]]
    if ok.empty:
        return "no point has a baseline point to compare with"
    colors = colors_of(t)
    fig, ax = plt.subplots(figsize=(7, height(len(ok))))
    spec = METRICS["speedup"]
    barh(ax, list(ok["label"]), ok["speedup"].to_numpy(), [colors[v] for v in ok["variant"]],
          f"{spec.label} over the baseline {t.attrs.get('baseline', '')} "
          f"({METRICS['tokens_per_s_per_device'].label}, {spec.unit})")
    value = ok["speedup"].to_numpy()
    err = np.nan_to_num(np.vstack([value - ok["speedup_low"].to_numpy(), ok["speedup_high"].to_numpy() - value]))
    ax.errorbar(value, np.arange(len(ok)), xerr=np.clip(err, 0, None), fmt="none", ecolor="black", capsize=3, lw=1)
    ax.axvline(1.0, color="black", lw=1)
    legend_for_variants(ax, list(ok["variant"]), colors)
    return fig


def tflops_mfu(t: pd.DataFrame) -> Figure | str:
    ok = ok_rows(t, "tflops_per_device")
    if ok.empty:
        return "no ok point reports TFLOP/s"
    colors = colors_of(t)
    c = [colors[v] for v in ok["variant"]]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, height(len(ok))), sharey=True)
    barh(a, list(ok["label"]), ok["tflops_per_device"].to_numpy(), c, METRICS["tflops_per_device"].label)
    barh(b, list(ok["label"]), 100 * ok["mfu"].fillna(0).to_numpy(), c,
          f"{METRICS['mfu'].label} (% of bf16 dense peak)")
    b.invert_yaxis()  # sharey: undo the second inversion
    legend_for_variants(b, list(ok["variant"]), colors)
    return fig


def memory(t: pd.DataFrame) -> Figure | str:
    ok = ok_rows(t)
    intervals = ok["nvml_interval_s"].dropna().unique()
    every = f", sampled every {1e3 * intervals[0]:g} ms" if len(intervals) == 1 else ", sampled"
    cols = [(c, METRICS[c].label + (every if c == "nvml_peak_mem_used_bytes" else ""))
            for c in ("peak_mem_bytes", "peak_mem_reserved_bytes", "nvml_peak_mem_used_bytes", "peak_rss_bytes")
            if c in ok.columns and ok[c].notna().any()]
    if ok.empty or not cols:
        return "no ok point reports memory"
    fig, ax = plt.subplots(figsize=(10, height(len(ok) * len(cols) / 2)))
    y = np.arange(len(ok))
    h = 0.8 / len(cols)
    for j, (c, lab) in enumerate(cols):
        ax.barh(y + j * h, ok[c].fillna(0).to_numpy() / GIB, height=h, label=lab, color=PALETTE[j])
    ax.set_yticks(y + h * (len(cols) - 1) / 2, list(ok["label"]))
    ax.invert_yaxis()
    ax.set_xlabel("peak memory (GiB; allocator and RSS: rank 0, NVML: busiest device)")
    ax.legend(**OUTSIDE)
    return fig


def precision(t: pd.DataFrame) -> Figure | str:
    ok = ok_rows(t, "tokens_per_s_per_device")
    groups = groups_over(ok, ["config.precision.mode", "precision"], "precision")
    if not groups:
        return "no points that differ only in precision"
    modes = sorted({p for _, g in groups for p in g["precision_shown"].map(norm_value)})
    fig, axes = plt.subplots(1, 3, figsize=(12, 1.8 + 0.5 * len(groups)), sharey=True)
    y = np.arange(len(groups))
    h = 0.8 / len(modes)
    tok, peak, loss = (METRICS[m] for m in ("tokens_per_s_per_device", "peak_mem_bytes", "loss_last"))
    for ax, (col, scale, xlabel) in zip(axes, [(tok.name, 1, tok.label), (peak.name, GIB, f"{peak.label} (GiB)"),
                                               (loss.name, 1, f"{loss.label} ({loss.unit})")], strict=True):
        for j, mode in enumerate(modes):
            vals = [g.loc[g["precision_shown"].map(norm_value) == mode, col].mean() / scale for _, g in groups]
            ax.barh(y + j * h, vals, height=h, label=mode, color=PALETTE[j])
        ax.set_xlabel(xlabel)
    axes[0].set_yticks(y + h * (len(modes) - 1) / 2, [lab for lab, _ in groups])
    axes[0].invert_yaxis()
    axes[-1].legend(title="precision", **OUTSIDE)
    return fig


def top_k(t: pd.DataFrame) -> Figure | str:
    ok = ok_rows(t, "tokens_per_s_per_device")
    lines = groups_over(ok, ["config.moe.top_k"], "top_k")
    if not lines:
        return "no points that differ only in top-k"
    colors, styles = colors_of(t), run_style(t)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for lab, g in lines:
        g = g.sort_values("top_k")
        style = {"color": colors[g["variant"].iloc[0]], **styles[norm_value(g["run"].iloc[0])]}
        a.errorbar(g["top_k"], g["tokens_per_s_per_device"], yerr=throughput_err(g), capsize=3, label=lab, **style)
        b.plot(g["top_k"], g["tflops_per_device"], label=lab, **style)
    for ax, ylabel in ((a, METRICS["tokens_per_s_per_device"].label), (b, METRICS["tflops_per_device"].label)):
        ax.set_xlabel("experts per token (top-k)")
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
    b.legend(**OUTSIDE)
    return fig


def step_times(t: pd.DataFrame) -> Figure | str:
    ok = ok_rows(t)
    ok = ok[[bool(s) for s in ok["step_times_s"]]]
    if ok.empty:
        return "no ok point kept raw step-time samples"
    colors = colors_of(t)
    fig, ax = plt.subplots(figsize=(8, height(len(ok))))
    data = [np.asarray(s) * 1e3 for s in ok["step_times_s"]]
    box = ax.boxplot(data, orientation="horizontal", patch_artist=True, widths=0.6, flierprops={"markersize": 3})
    for patch, v in zip(box["boxes"], ok["variant"], strict=True):
        patch.set_facecolor(colors[v])
        patch.set_alpha(0.7)
    ax.set_yticks(np.arange(1, len(ok) + 1), list(ok["label"]))
    ax.invert_yaxis()
    lo, hi = min(float(d.min()) for d in data), max(float(d.max()) for d in data)
    scale = "log" if lo > 0 and hi / lo > 10 else "linear"  # log only when the points span decades
    ax.set_xscale(scale)
    ax.set_xlabel(f"step time (ms{', log scale' if scale == 'log' else ''}; every timed step, warm-up excluded)")
    legend_for_variants(ax, list(ok["variant"]), colors)
    return fig


def comm_bytes(t: pd.DataFrame) -> Figure | str:
    ok = ok_rows(t)
    axes = [a for a in t.attrs.get("comm_axes", []) if ok[f"comm_{a}_bytes"].fillna(0).gt(0).any()]
    if ok.empty or not axes:
        return "no point communicated (single-rank runs, or comm bytes not recorded)"
    fig, ax = plt.subplots(figsize=(8, height(len(ok))))
    left = np.zeros(len(ok))
    y = np.arange(len(ok))
    for j, a in enumerate(axes):
        vals = ok[f"comm_{a}_bytes"].fillna(0).to_numpy() / GIB
        ax.barh(y, vals, left=left, label=f"{a} axis", color=PALETTE[j])
        left += vals
    ax.set_yticks(y, list(ok["label"]))
    ax.invert_yaxis()
    ax.set_xlabel(f"{METRICS['comm_bytes_total'].label} (GiB)")
    ax.legend(title="mesh axis", **OUTSIDE)
    return fig


def routing(t: pd.DataFrame) -> Figure | str:
    ok = ok_rows(t, "load_imbalance")
    if ok.empty:
        return "no ok point reports router statistics"
    colors = colors_of(t)
    c = [colors[v] for v in ok["variant"]]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, height(len(ok))), sharey=True)
    y = np.arange(len(ok))
    mean = ok["load_imbalance"].to_numpy()
    err = np.clip(ok["load_imbalance_max"].to_numpy() - mean, 0, None)
    a.barh(y, mean, xerr=[np.zeros_like(err), err], color=c, capsize=2)
    a.set_yticks(y, list(ok["label"]))
    a.invert_yaxis()
    a.axvline(1.0, color="black", lw=1)
    spec = METRICS["load_imbalance"]
    a.set_xlabel(f"{spec.label} ({spec.unit}; whisker: worst step)")
    b.barh(y, ok["dropped_tokens"].fillna(0).to_numpy(), color=c)
    b.set_xlabel(f"{METRICS['dropped_tokens'].label} (count, timed steps)")
    legend_for_variants(b, list(ok["variant"]), colors)
    return fig


PLOTS = [
    Plot("throughput_vs_experts", f"Tokens/s per device vs experts (error bars: {CI} CI of the median)",
         throughput_vs_experts),
    Plot("speedup", f"Speedup over the baseline (whiskers: {CI} CI of the ratio)", speedup),
    Plot("tflops_mfu", "Model TFLOP/s and MFU per device", tflops_mfu),
    Plot("memory", "Peak memory per point", memory),
    Plot("precision", "Precision comparison: speed, memory, final loss", precision),
    Plot("top_k", f"Effect of top-k (error bars: {CI} CI of the median tokens/s)", top_k),
    Plot("step_times", "Step-time distributions", step_times),
    Plot("time_breakdown", "Where each step's time goes: every point beside its baseline", plot_breakdown),
    Plot("comm_bytes", "Communication per step by mesh axis", comm_bytes),
    Plot("routing", "Load imbalance and dropped routes", routing),
]


def render_all(t: pd.DataFrame, caption: str) -> list[tuple[Plot, Figure | str]]:
    """Draw every plot in the report style; figures get ``caption`` printed along the bottom."""
    out = []
    with plt.rc_context(STYLE):
        for plot in PLOTS:
            fig = plot.draw(t)
            if isinstance(fig, Figure):
                fig.suptitle(plot.title)
                fig.tight_layout(rect=(0, 0.05, 1, 1))
                fig.text(0.01, 0.01, caption, fontsize=7, color="0.35", ha="left", va="bottom")
            out.append((plot, fig))
    return out
