"""The answer at the top of a report: each layout against its baseline, with noise and caveats.

One line per (run, layout, baseline layout): a single compared point gives its ratio, 95%
interval and verdict; several give the range (slowest and fastest point, each with its
interval) and how many points came out faster, slower or within noise. Every compared point
also gets its own line for the collapsible full list.

What makes a ratio something other than the layouts' speed qualifies its verdict, in amber: unequal
work (different shares of dropped routes), a throttled side (NVML saw its GPU clocks throttle) and
an emulated side (fp8/mxfp8 GEMMs run as quantize -> dequantize -> bf16). Emulated points stay out of
a group's speed range and tally, which says how many it left out. Ratios, intervals and verdicts come
from :mod:`moebench.results.stats` through the paired table (``speedup_*`` columns).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from moebench.results.pairing import LOSS_SIGMAS
from moebench.results.stats import VERDICTS, Ratio, runs_text
from moebench.results.table import is_missing, is_set, norm_value, share_text


@dataclass
class Line:
    """One headline line: ``subject`` (who vs whom), ``answer`` (numbers and verdict), caveats."""

    subject: str
    answer: str
    # faster | slower | within noise | diverges | mixed | unequal work | qualified (throttled or emulated
    # side): the line's colour
    verdict: str
    flags: list[str] = field(default_factory=list)
    detail: str = ""  # the numbers behind a range, in smaller print

    def text(self) -> str:
        detail = f" ({self.detail})" if self.detail else ""
        return f"{self.subject}: {self.answer}{detail}" + "".join(f"; ⚠ {f}" for f in self.flags)


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def row_ratio(r: pd.Series) -> Ratio:
    low, high = (None, None) if is_missing(r["speedup_low"]) else (r["speedup_low"], r["speedup_high"])
    runs = (int(r["runs"]), 1 if is_missing(r["baseline_runs"]) else int(r["baseline_runs"]))
    unsteady = r.get("speedup_unsteady")
    return Ratio(float(r["speedup"]), low, high, runs=runs, unsteady=None if is_missing(unsteady) else str(unsteady))


def drop_flag(r: pd.Series) -> str:
    return (f"unequal work: drops {_pct(r['dropped_fraction'])} of routes vs "
            f"{_pct(r['baseline_dropped_fraction'])} for the baseline")


def unequal_work(r: pd.Series) -> str:
    """``unequal work: drops 10.9% vs 0%``: what a verdict between unequal sides carries."""
    return f"unequal work: drops {share_text(r['dropped_fraction'])} vs {share_text(r['baseline_dropped_fraction'])}"


def _side(own: bool, base: bool, what: str) -> str | None:
    """``throttled`` / ``baseline throttled`` / ``both sides throttled`` (None: neither)."""
    return f"both sides {what}" if own and base else what if own else f"baseline {what}" if base else None


def throttled_side(r: pd.Series) -> str | None:
    """Which side of the comparison ran with throttled GPU clocks, or None."""
    return _side(is_set(r.get("throttled")), is_set(r.get("baseline_throttled")), "throttled")


def emulated_side(r: pd.Series) -> str | None:
    """``emulated fp8``, ``baseline emulated mxfp8``...: which side ran its quantized GEMMs emulated, or None."""
    own, base = r.get("precision_impl") == "emulated", r.get("baseline_precision_impl") == "emulated"
    mode = norm_value(r.get("precision") if own else r.get("baseline_precision"))
    return _side(own, base, f"emulated {mode}")


def qualifiers(r: pd.Series) -> list[str]:
    """What a faster or slower verdict carries in parentheses: unequal work, a throttled or emulated side."""
    out = [unequal_work(r)] if r["drops_differ"] else []
    return out + [q for q in (throttled_side(r), emulated_side(r)) if q]


def line_verdict(r: pd.Series) -> str:
    """The line's colour: a faster or slower verdict between sides that dropped different shares of
    routes is ``unequal work`` (amber), one with a throttled or emulated side ``qualified`` (amber):
    never plain faster or slower."""
    verdict = verdict_of(r)
    if verdict not in ("faster", "slower"):
        return verdict
    return "unequal work" if r["drops_differ"] else "qualified" if qualifiers(r) else verdict


def throttle_flag(r: pd.Series) -> str:
    side = throttled_side(r)
    effect = {"baseline throttled": ": the ratio overstates the speedup", "throttled": ": the ratio understates it"}
    return f"{side}: NVML saw the GPU clocks throttle in the timed window{effect.get(str(side), '')}"


def emulated_flag(r: pd.Series) -> str:
    return f"{emulated_side(r)}: quantize -> dequantize -> bf16 GEMMs, not the format's speed"


def noise_flag(r: pd.Series, base_cv: float) -> str:
    ratio = row_ratio(r)
    if ratio.why is not None:
        return f"inconclusive: {ratio.why}"
    spread = ""
    if not is_missing(r.get("run_spread")) and not is_missing(r.get("baseline_run_spread")):
        spread = f", run spread {_pct(r['run_spread'])} vs {_pct(r['baseline_run_spread'])}"
    return (f"inconclusive: step times too noisy (step CV {_pct(r['step_time_cv'])} vs "
            f"{_pct(base_cv)} for the baseline{spread})")


def loss_flag(r: pd.Series) -> str:
    window = r.get("baseline_loss_window")
    steps = f"the last {int(window)} steps" if not is_missing(window) else "the last step"
    return (f"diverges: mean loss over {steps} {100 * r['loss_delta']:+.1f}% vs the baseline's (tolerance "
            f"{100 * r['loss_tolerance']:.1f}%: {LOSS_SIGMAS:g} standard errors from the baseline's step-to-step "
            "spread), so its speed is not a like-for-like result")


def verdict_of(r: pd.Series) -> str:
    """The comparison's verdict: ``diverges`` when the loss rose beyond its tolerance, else the speed's."""
    return "diverges" if r["diverges"] else str(r["speedup_verdict"])


def compared(t: pd.DataFrame) -> pd.DataFrame:
    """Ok points paired with a baseline other than themselves."""
    return t[(t["status"] == "ok") & t["speedup"].notna() & (t["baseline_point_id"] != t["point_id"])]


def point_line(r: pd.Series) -> Line:
    where = f" at {r['subject_at']}" if r["subject_at"] else ""
    ratio = row_ratio(r)
    verdict = line_verdict(r)
    qualified = verdict in ("unequal work", "qualified")
    # a qualified verdict says why in its answer; any other verdict carries the flags
    flags = [] if qualified else [f(r) for f, on in ((drop_flag, r["drops_differ"]), (throttle_flag, throttled_side(r)),
                                                     (emulated_flag, emulated_side(r))) if on]
    # a comparison without a verdict says why in its answer already
    flags += [noise_flag(r, r["baseline_step_time_cv"])] if r["inconclusive"] and ratio.why is None else []
    flags += [loss_flag(r)] if r["diverges"] else []
    said = f"{verdict_of(r)} ({'; '.join(qualifiers(r))})" if qualified else verdict_of(r)
    answer = f"{ratio.value:.2f}x {ratio.ci_text()} {said} ({runs_text(ratio.runs)})"
    if ratio.why is not None and not r["diverges"]:
        answer = ratio.text()
    return Line(f"{r['subject']}{where}", answer, verdict, flags)


def _group_runs(g: pd.DataFrame) -> str:
    """How many runs stand behind a group's verdicts: ``3 runs each``, or a range when points differ."""
    texts = sorted({runs_text(row_ratio(r).runs) for _, r in g.iterrows()})
    return texts[0] if len(texts) == 1 else "runs: " + ", ".join(texts)


def _at(r: pd.Series) -> str:
    """``num_experts=64``, with what qualifies the point's ratio: ``num_experts=64 (baseline throttled)``."""
    quals = [q for q in (throttled_side(r), emulated_side(r)) if q]
    return f"{r['subject_at'] or r['label']}" + (f" ({'; '.join(quals)})" if quals else "")


def group_line(g: pd.DataFrame) -> Line:
    """The range over a layout pair's points; emulated ones are left out of it (unless all are) and counted."""
    emulated = g.apply(emulated_side, axis=1).notna()
    left_out = g[emulated] if not emulated.all() else g.iloc[:0]
    g = g[~emulated] if not emulated.all() else g
    line = _range_line(g)
    if len(left_out):
        modes = "/".join(sorted({norm_value(p) for p in left_out["precision"]}))
        line.flags.insert(0, f"{len(left_out)} emulated {modes} point(s) left out of the range and tally "
                             "(not the format's speed)")
    return line


def _range_line(g: pd.DataFrame) -> Line:
    first = g.iloc[0]
    subject = first["subject"]
    if len(g) == 1:
        return point_line(first)
    lo, hi = g.loc[g["speedup"].idxmin()], g.loc[g["speedup"].idxmax()]
    counts = g.apply(verdict_of, axis=1).value_counts()
    tally = ", ".join(f"{counts[v]} {v}" for v in (*VERDICTS, "diverges") if v in counts)
    runs = _group_runs(g)
    answer = f"{lo['speedup']:.2f}x to {hi['speedup']:.2f}x over {len(g)} points, {runs}: {tally}"
    detail = (f"lowest {row_ratio(lo).value:.2f}x {row_ratio(lo).ci_text()} at {_at(lo)}, "
              f"highest {row_ratio(hi).value:.2f}x {row_ratio(hi).ci_text()} at {_at(hi)}")
    verdict = counts.index[0] if len(counts) == 1 else "mixed"
    colours = set(g.apply(line_verdict, axis=1))
    if verdict != "diverges" and colours & {"unequal work", "qualified"}:
        # amber: some of its faster or slower points did unequal work or had a throttled or emulated side
        verdict = "unequal work" if "unequal work" in colours else "qualified"
    flags = []
    if g["drops_differ"].any():
        flags.append(f"{int(g['drops_differ'].sum())} point(s) drop a different share of routes than the "
                     "baseline (unequal work)")
    throttled = g.apply(throttled_side, axis=1).dropna()
    if len(throttled):
        flags.append(f"{len(throttled)} point(s) with a throttled side (" + ", ".join(
            f"{n} {side}" for side, n in throttled.value_counts().sort_index().items()) + ")")
    if g["inconclusive"].any():
        whys = {row_ratio(r).why or "step times too noisy" for _, r in g[g["inconclusive"]].iterrows()}
        why = "; ".join(sorted(whys))
        flags.append(f"{int(g['inconclusive'].sum())} point(s) inconclusive: {why}")
    if g["diverges"].any():
        flags.append(f"{int(g['diverges'].sum())} point(s) diverge: mean loss over the last steps above the "
                     f"baseline's by more than {LOSS_SIGMAS:g} standard errors of its step-to-step spread")
    return Line(subject, answer, verdict, flags, detail)


def headline(t: pd.DataFrame) -> tuple[list[Line], list[Line]]:
    """(one line per run and subject, one line per compared point), fastest first; a subject names what
    differs between a point and its baseline (:mod:`moebench.results.subject`)."""
    ok = compared(t)
    if ok.empty:
        return [], []
    groups = [g for _, g in ok.groupby(["run", "subject"], sort=False)]
    groups.sort(key=lambda g: (norm_value(g["run_id"].iloc[0]), -g["speedup"].median()))  # oldest run first
    details = [point_line(r) for g in groups for _, r in g.sort_values("speedup").iterrows()]
    return [group_line(g) for g in groups], details


def inconclusive_warnings(t: pd.DataFrame) -> list[str]:
    """One warning per comparison whose noise hides a change big enough to matter."""
    ok = compared(t)
    # a single run says "no verdict" in its answer line already: no warning per comparison
    return [f"{r['label']}: {row_ratio(r).text()} against {r['baseline_label']}; "
            f"{noise_flag(r, r['baseline_step_time_cv'])}, so neither faster nor slower can be claimed"
            for _, r in ok[ok["inconclusive"]].iterrows() if row_ratio(r).why is None]
