"""Print a gate result as text, Markdown (pull-request comment) or JSON."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from moebench.record import finite, format_value, metric_kind
from moebench.report.gate.check import Comparison, MetricResult
from moebench.report.gate.ratio import RatioResult
from moebench.report.render import md_cell, md_table


def _metric_cell(m: MetricResult) -> str:
    if m.change is None:
        return "n/a"
    ci = f" [{100 * (m.ci_low - 1):+.1f}%, {100 * (m.ci_high - 1):+.1f}%]" if m.ci_low is not None else ""
    mark = {"regressed": " REGRESSED", "improved": " improved"}.get(m.verdict, "")
    noise = " (noise)" if m.note == "beyond threshold but within noise" else ""
    return f"{100 * m.change:+.1f}%{ci}{mark}{noise}"


def _comparison_rows(c: Comparison) -> tuple[list[str], list[list[str]]]:
    headers = ["point", "result", *[str(r) for r in c.rules], "note"]
    rows = []
    for p in c.points:
        status = p.category
        if p.category == "failed":
            was = f"was {p.baseline_status}" if p.baseline_status else "new point"
            status = f"failed ({p.current_status}; {was})"
        cells = [_metric_cell(m) for m in p.metrics] or [""] * len(c.rules)
        rows.append([p.label, status, *cells, p.note])
    return headers, rows


def _ratio_rows(r: RatioResult) -> tuple[list[str], list[list[str]]]:
    headers = ["numerator", "denominator", r.spec.metric, "ratio", f"{r.spec.op} {r.spec.value:g}"]
    rows = []
    for p in r.pairs:
        both = p.num_value is not None and p.den_value is not None
        kind = metric_kind(r.spec.metric)
        vals = f"{format_value(p.num_value, kind)} / {format_value(p.den_value, kind)}" if both else ""
        rows.append([p.num_label, p.den_label, vals, f"{p.ratio:.3f}" if p.ratio is not None else "n/a",
                     f"pass {p.note}".strip() if p.passed else f"FAIL {p.note}".strip()])
    return headers, rows


def _text_table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows, strict=True)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    return "\n".join(lines)


def summary(c: Comparison | None, ratios: list[RatioResult], exit_code: int) -> str:
    parts = []
    if c is not None:
        parts.append(", ".join(f"{n} {k}" for k, n in c.counts().items()))
    if ratios:
        parts.append(f"ratios: {sum(r.passed for r in ratios)} of {len(ratios)} hold")
    verdict = "PASS" if exit_code == 0 else "FAIL"
    return f"{verdict}: " + "; ".join(parts)


def to_text(c: Comparison | None, ratios: list[RatioResult], warnings: list[str], exit_code: int) -> str:
    out = [f"warning: {w}" for w in warnings]
    if c is not None:
        out += [_text_table(*_comparison_rows(c)), ""]
    for r in ratios:
        out += [f"ratio {r.spec.text}", _text_table(*_ratio_rows(r))]
        out += [f"  no partner for: {', '.join(r.unmatched)}"] if r.unmatched else []
        out.append("")
    out.append(summary(c, ratios, exit_code))
    return "\n".join(out)


def to_md(c: Comparison | None, ratios: list[RatioResult], warnings: list[str], exit_code: int) -> str:
    out = [f"**moebench check: {summary(c, ratios, exit_code)}**", ""]
    out += [f"> warning: {md_cell(w)}\n" for w in warnings]
    if c is not None:
        out += [md_table(*_comparison_rows(c)), ""]
    for r in ratios:
        out += [f"ratio `{r.spec.text}`", "", md_table(*_ratio_rows(r)), ""]
        out += [f"no partner for: {md_cell(', '.join(r.unmatched))}", ""] if r.unmatched else []
    return "\n".join(out)


def to_json(c: Comparison | None, ratios: list[RatioResult], warnings: list[str], exit_code: int) -> str:
    data: dict[str, Any] = {"exit_code": exit_code, "passed": exit_code == 0, "warnings": warnings}
    if c is not None:
        data["rules"] = [str(r) for r in c.rules]
        data["alpha"] = c.alpha
        data["counts"] = c.counts()
        data["points"] = [{**asdict(p), "fails_gate": p.fails_gate} for p in c.points]
    data["ratios"] = [{"spec": r.spec.text, "passed": r.passed, "pairs": [asdict(p) for p in r.pairs],
                       "unmatched": r.unmatched} for r in ratios]
    return json.dumps(finite(data), indent=2, allow_nan=False)


FORMATS = {"text": to_text, "md": to_md, "json": to_json}
