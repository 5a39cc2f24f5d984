"""Run vs run: when several runs of one suite are loaded, each later run against the first.

Points are matched as ``moebench check`` matches them (:func:`moebench.report.gate.check.match_points`:
by resolved config, then by point id) and compared on tokens/s per device with the same
ratio, interval and verdict as everywhere else (:mod:`moebench.results.stats`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd

from moebench.report.gate.check import environment_warnings, match_points
from moebench.report.headline import Line
from moebench.results.stats import VERDICTS, Ratio, metric_ratio, runs_text
from moebench.results.table import norm_value, run_tag

HEADERS = ["point", "run B", "vs run A", "tokens/s/dev A", "tokens/s/dev B", "B / A", "verdict", "note"]


@dataclass
class Delta:
    point: str  # layout and axes, without the run
    run_b: str
    run_a: str
    value_a: float | None
    value_b: float | None
    ratio: Ratio | None
    note: str = ""

    def row(self) -> list[str]:
        def num(v: float | None) -> str:
            return "" if v is None or v != v else f"{v:,.0f}"

        shown = f"{self.ratio.value:.2f}x {self.ratio.ci_text()}" if self.ratio else ""
        verdict = self.ratio.verdict if self.ratio else ""
        return [self.point, self.run_b, self.run_a, num(self.value_a), num(self.value_b), shown, verdict, self.note]


def run_order(metas: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The runs of each suite that has several, oldest first."""
    by_suite: dict[str, list[dict[str, Any]]] = {}
    for m in metas:
        by_suite.setdefault(norm_value(m.get("suite")), []).append(m)
    return {s: sorted(ms, key=lambda m: (str(m.get("created_at")), str(m.get("run_id"))))
            for s, ms in by_suite.items() if len(ms) > 1}


def _point(row: pd.Series) -> str:
    return ", ".join(p for p in (row["variant"], row["axes"]) if p)


def run_deltas(t: pd.DataFrame, metas: Sequence[dict[str, Any]]) -> list[Delta]:
    """One delta per point present in a later run and in the first run of its suite."""
    out = []
    for first, later, base, cur in _later_runs(t, metas):
        for bi, ci, how in match_points(base, cur):
            if bi is None or ci is None:
                continue
            b, c = base.loc[bi], cur.loc[ci]
            note = "matched by point id (config differs)" if how == "point id" else ""
            ok = b["status"] == "ok" and c["status"] == "ok"
            if not ok:
                note = f"A {b['status']}, B {c['status']}"
            ratio = metric_ratio(c, b) if ok else None
            out.append(Delta(_point(c), run_tag(later), run_tag(first), b["tokens_per_s_per_device"],
                             c["tokens_per_s_per_device"], ratio, note))
    return out


def environment_notes(t: pd.DataFrame, metas: Sequence[dict[str, Any]]) -> list[str]:
    """Per later run of a suite: a warning when it and the first run differ only in their environment
    (same commit and configs) or the machine's calibrated speed moved by more than 10%."""
    out = []
    for first, later, base, cur in _later_runs(t, metas):
        out += environment_warnings(base, cur, [first], [later], (f"run {run_tag(first)}", f"run {run_tag(later)}"))
    return out


def _later_runs(t: pd.DataFrame, metas: Sequence[dict[str, Any]]
                ) -> Iterator[tuple[dict[str, Any], dict[str, Any], pd.DataFrame, pd.DataFrame]]:
    """Per later run of each suite: (first run's meta, its meta, the first run's rows, its rows)."""
    for runs in run_order(metas).values():
        first = runs[0]
        base = t[t["run_id"] == first.get("run_id")]
        for later in runs[1:]:
            yield first, later, base, t[t["run_id"] == later.get("run_id")]


def delta_lines(deltas: Sequence[Delta]) -> list[Line]:
    """Headline lines: one per (run B, run A) pair, the range of B / A over matched points."""
    lines = []
    for key in dict.fromkeys((d.run_b, d.run_a) for d in deltas):
        rated = [d for d in deltas if (d.run_b, d.run_a) == key and d.ratio is not None]
        if not rated:
            continue
        lo, hi = min(rated, key=lambda d: d.ratio.value), max(rated, key=lambda d: d.ratio.value)
        verdicts = [d.ratio.verdict for d in rated]
        tally = ", ".join(f"{verdicts.count(v)} {v}" for v in VERDICTS if v in verdicts)
        verdict = verdicts[0] if len(set(verdicts)) == 1 else "mixed"
        subject = f"run {key[0]} vs run {key[1]}"
        if len(rated) == 1:
            lines.append(Line(subject, f"{lo.ratio.text()} at {lo.point}", verdict))
            continue
        runs = sorted({runs_text(d.ratio.runs) for d in rated})
        runs_shown = runs[0] if len(runs) == 1 else "runs: " + ", ".join(runs)
        answer = f"{lo.ratio.value:.2f}x to {hi.ratio.value:.2f}x over {len(rated)} points, {runs_shown}: {tally}"
        detail = (f"lowest {lo.ratio.value:.2f}x {lo.ratio.ci_text()} at {lo.point}, "
                  f"highest {hi.ratio.value:.2f}x {hi.ratio.ci_text()} at {hi.point}")
        lines.append(Line(subject, answer, verdict, detail=detail))
    return lines


INTRO = ("Each later run of a suite against its first run, point by point: tokens/s per device of run B over run A "
         "with the 95% confidence interval, as in the answer above.")
