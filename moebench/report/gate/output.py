"""Print a gate result as text, Markdown (pull-request comment) or JSON."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import pandas as pd

from moebench.record import finite, format_value, metric_kind
from moebench.report.device import machine_of
from moebench.report.gate.check import Comparison, MetricResult
from moebench.report.gate.ratio import RatioResult
from moebench.report.markdown import md_cell, md_table
from moebench.report.render import load_text


def _values(m: MetricResult) -> str:
    """``40,960 -> 47,537 tok/s``: the baseline's and the current value beside the change."""
    kind = metric_kind(m.metric)
    return f"{format_value(m.baseline, kind)} -> {format_value(m.current, kind)}"


def _metric_cell(m: MetricResult) -> str:
    if m.change is None:
        return "n/a"
    ci = f" [{100 * (m.ci_low - 1):+.1f}%, {100 * (m.ci_high - 1):+.1f}%]" if m.ci_low is not None else ""
    mark = {"regressed": " REGRESSED", "improved": " improved", "inconclusive": " INCONCLUSIVE",
            "no verdict": " no verdict"}.get(m.verdict, "")
    why = ""
    if m.verdict == "inconclusive" and m.detectable is not None:
        why = f" (could detect ±{100 * m.detectable:.1f}%)"
    elif m.verdict == "no verdict":
        why = f" ({m.note.removesuffix(', no verdict')})"
    return f"{100 * m.change:+.1f}%{ci}{mark}{why} ({_values(m)})"


def _pooled_lines(c: Comparison) -> list[str]:
    """``pooled tokens_per_s over 4 points: -23.1% [-27.0%, -19.0%] regressed (4 of 4 moved down)``."""
    out = []
    for p in c.pooled:
        r = p.ratio
        way = "up" if r.value >= 1 else "down"
        out.append(f"pooled {p.metric} over {p.points} points: {100 * (r.value - 1):+.1f}% "
                   f"[{100 * (r.low - 1):+.1f}%, {100 * (r.high - 1):+.1f}%] {p.verdict} "
                   f"({p.same_direction} of {p.points} moved {way})")
    return out


def _missing_lines(c: Comparison) -> list[str]:
    return [f"missing: {p.label} is in BASELINE but not in CURRENT (fails the gate; --allow-missing to accept)"
            for p in c.missing]


def _comparison_rows(c: Comparison) -> tuple[list[str], list[list[str]]]:
    headers = ["point", "result", *[str(r) for r in c.rules], "note"]
    rows = []
    for p in c.points:
        status = p.category
        if p.category == "failed":
            was = f"was {p.baseline_status}" if p.baseline_status else "new point"
            status = f"failed ({p.current_status}; {was})"
        cells = [_metric_cell(m) for m in p.metrics] or [""] * len(c.rules)
        work = "work: " + "; ".join(w.text() + (" REGRESSED" if w.regressed else "") for w in p.work) if p.work else ""
        note = "; ".join(x for x in (p.note, work, f"error: {p.error}" if p.error else "") if x)
        rows.append([p.label, status, *cells, note])
    return headers, rows


def _ratio_rows(r: RatioResult) -> tuple[list[str], list[list[str]]]:
    if not r.spec.den:  # a bound on each point's own value
        kind = metric_kind(r.spec.metric)
        headers = ["point", r.spec.metric, f"{r.spec.op} {format_value(r.spec.value, kind)}"]
        return headers, [[p.num_label, format_value(p.num_value, kind) if p.num_value is not None else "n/a",
                          f"{'pass' if p.passed else 'FAIL'} {p.note}".strip()] for p in r.pairs]
    headers = ["numerator", "denominator", r.spec.metric, "ratio", f"{r.spec.op} {r.spec.value:g}"]
    rows = []
    for p in r.pairs:
        both = p.num_value is not None and p.den_value is not None
        kind = metric_kind(r.spec.metric)
        vals = f"{format_value(p.num_value, kind)} / {format_value(p.den_value, kind)}" if both else ""
        outcome = {"pass": "pass", "fail": "FAIL", "inconclusive": "inconclusive", "unequal work": "REFUSED"}[p.outcome]
        rows.append([p.num_label, p.den_label, vals, f"{p.ratio:.3f}" if p.ratio is not None else "n/a",
                     f"{outcome} {p.note}".strip()])
    return headers, rows


def _text_table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows, strict=True)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    return "\n".join(lines)


def run_header(base_metas: Sequence[dict[str, Any]], cur_metas: Sequence[dict[str, Any]],
               tables: Sequence[pd.DataFrame | None] = (None, None)) -> list[str]:
    """``BASELINE: run 20261128-110000-c3d4, commit 0d579b9, host ci-runner-3 (CPU: ...); load 0.9 to 4.2 ...``,
    one line a side (CURRENT alone for a --ratio gate on one store): what the gate compared, and how busy the
    machine was while it ran (from ``tables``, the sides' tidy tables, where given)."""
    def side(name: str, metas: Sequence[dict[str, Any]], t: pd.DataFrame | None) -> str:
        runs = ", ".join(str(m.get("run_id")) for m in metas) or "none"
        commits = ", ".join(sorted({str((m.get("git") or {}).get("commit") or "unknown")[:7]
                                    + ("+dirty" if (m.get("git") or {}).get("dirty") else "") for m in metas}))
        hosts = ", ".join(sorted({f"{(m.get('host') or {}).get('hostname')} ({machine_of(m)})" for m in metas}))
        load = "".join(load_text(m, t) for m in metas) if t is not None else ""
        return f"{name}: run {runs}; commit {commits or 'unknown'}; host {hosts or 'unknown'}{load}"

    return ([side("BASELINE", base_metas, tables[0])] if base_metas else []) + [side("CURRENT", cur_metas, tables[1])]


def _unrecorded_lines(unrecorded: Sequence[str], allow_missing: bool) -> list[str]:
    if not unrecorded:
        return []
    verdict = "listed only: --allow-missing" if allow_missing else "fails the gate; --allow-missing to accept"
    return [f"missing: {len(unrecorded)} planned run(s) of CURRENT have no record: {', '.join(unrecorded)} ({verdict})"]


def summary(c: Comparison | None, ratios: list[RatioResult], exit_code: int, unrecorded: Sequence[str] = ()) -> str:
    parts = [f"{len(unrecorded)} planned run(s) missing"] if unrecorded else []
    if c is not None:
        parts.append(", ".join(f"{n} {k}" for k, n in c.counts().items()))
        parts += [f"pooled {p.metric}: {p.verdict}" for p in c.pooled]
    if ratios:
        outcomes = [p.outcome for r in ratios for p in r.pairs]
        words = (("pass", "hold"), ("inconclusive", "inconclusive"), ("fail", "fail"), ("unequal work", "refused"))
        counts = ", ".join(f"{outcomes.count(o)} {w}" for o, w in words if outcomes.count(o)) or "no pairs"
        parts.append(f"ratios: {sum(not r.passed for r in ratios)} of {len(ratios)} fail; pairs: {counts}")
    verdict = "PASS" if exit_code == 0 else "FAIL"
    return f"{verdict}: " + "; ".join(parts)


def to_text(c: Comparison | None, ratios: list[RatioResult], warnings: list[str], exit_code: int,
            header: Sequence[str] = (), unrecorded: Sequence[str] = (), allow_missing: bool = False) -> str:
    """``unrecorded``: CURRENT's planned runs without a record (one store with --ratio)."""
    out = [*header, *([""] if header else []), *(f"warning: {w}" for w in warnings)]
    if c is not None:
        out += [_text_table(*_comparison_rows(c)), *_pooled_lines(c), *_missing_lines(c), ""]
    for r in ratios:
        out += [f"ratio {r.spec.text}", _text_table(*_ratio_rows(r))]
        out += [f"  no partner for: {', '.join(r.unmatched)}"] if r.unmatched else []
        out.append("")
    out += _unrecorded_lines(unrecorded, allow_missing)
    out.append(summary(c, ratios, exit_code, unrecorded))
    return "\n".join(out)


def to_md(c: Comparison | None, ratios: list[RatioResult], warnings: list[str], exit_code: int,
          header: Sequence[str] = (), unrecorded: Sequence[str] = (), allow_missing: bool = False) -> str:
    """``unrecorded``: CURRENT's planned runs without a record (one store with --ratio)."""
    out = [f"**moebench check: {summary(c, ratios, exit_code, unrecorded)}**", ""]
    out += [*(f"- {md_cell(h)}" for h in header), *([""] if header else [])]
    out += [f"> warning: {md_cell(w)}\n" for w in warnings]
    if c is not None:
        out += [md_table(*_comparison_rows(c)), ""]
        out += [f"- {md_cell(line)}" for line in [*_pooled_lines(c), *_missing_lines(c)]]
        out += [""] if c.pooled or c.missing else []
    for r in ratios:
        out += [f"ratio `{r.spec.text}`", "", md_table(*_ratio_rows(r)), ""]
        out += [f"no partner for: {md_cell(', '.join(r.unmatched))}", ""] if r.unmatched else []
    out += [f"- {md_cell(line)}" for line in _unrecorded_lines(unrecorded, allow_missing)]
    return "\n".join(out)


def to_json(c: Comparison | None, ratios: list[RatioResult], warnings: list[str], exit_code: int,
            header: Sequence[str] = (), unrecorded: Sequence[str] = (), allow_missing: bool = False) -> str:
    """``unrecorded``: CURRENT's planned runs without a record (one store with --ratio)."""
    data: dict[str, Any] = {"exit_code": exit_code, "passed": exit_code == 0, "warnings": warnings,
                            "compared": list(header)}
    if c is not None:
        data["rules"] = [str(r) for r in c.rules]
        data["alpha"] = c.alpha
        data["counts"] = c.counts()
        data["points"] = [{**asdict(p), "fails_gate": p.fails_gate} for p in c.points]
        data["pooled"] = [{"metric": p.metric, "points": p.points, "ratio": p.ratio.value, "ci_low": p.ratio.low,
                           "ci_high": p.ratio.high, "verdict": p.verdict, "same_direction": p.same_direction}
                          for p in c.pooled]
        data["missing"] = [p.label for p in c.missing]
        data["inconclusive"] = c.inconclusive
    data["ratios"] = [{"spec": r.spec.text, "passed": r.passed, "inconclusive": r.inconclusive,
                       "pairs": [{**asdict(p), "outcome": p.outcome} for p in r.pairs],
                       "unmatched": r.unmatched} for r in ratios]
    if c is None:
        data["missing"] = list(unrecorded)
    return json.dumps(finite(data), indent=2, allow_nan=False)


FORMATS = {"text": to_text, "md": to_md, "json": to_json}
