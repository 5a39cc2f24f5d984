"""The report's completeness and per-point detail sections, as HTML and Markdown: how many points
ran, which are still pending, each point's resolved config and log, and the table of contents."""

from __future__ import annotations

import html
import json
from collections.abc import Sequence

import pandas as pd

from moebench.report.completeness import RunStatus, duration_text
from moebench.report.planned import config_dict
from moebench.report.table import norm_value


def points_heading(t: pd.DataFrame, runs: Sequence[RunStatus]) -> str:
    """``Points (4: 1 ok, 0 not ok, 3 pending)``: planned points count, not only recorded ones."""
    ok = int((t["status"] == "ok").sum())
    parts = [f"{ok} ok", f"{len(t) - ok} not ok"]
    for state in ("running", "pending"):
        n = sum(len(r.pending) for r in runs if r.state == state)
        parts += [f"{n} {state}"] if n else []
    total = len(t) + sum(len(r.pending) for r in runs)
    return f"Points ({total}: {', '.join(parts)})"


def run_notes(runs: Sequence[RunStatus]) -> list[tuple[str, str]]:
    """(suite, line) per run with a description or a duration."""
    out = []
    for r in runs:
        took = duration_text(r.duration_s)
        description = (r.description or "").strip().rstrip(".")  # the duration follows after "; "
        bits = [description, f"ran {took} (start to the last finished point)" if took else ""]
        if r.running:
            bits.append("the sweep is still running")
        if any(bits):
            out.append((r.suite, "; ".join(b for b in bits if b)))
    return out


def pending_rows(runs: Sequence[RunStatus]) -> list[list[str]]:
    return [[r.suite, pid, r.state, axes] for r in runs for pid, axes in r.pending]


PENDING_HEADERS = ["suite", "point", "state", "axes"]
PENDING_INTRO = "Planned in the store's points.json, no record yet: not run, or still running."


def log_html(link: str | None) -> str:
    return f" <a href=\"{html.escape(link)}\">log</a>" if link else ""


def configs_html(t: pd.DataFrame, links: Sequence[str | None]) -> str:
    """Each point's resolved config, folded, with a link to its log."""
    e = html.escape
    parts = []
    for (_, row), link in zip(t.iterrows(), links, strict=True):
        config = json.dumps(config_dict(row), indent=2, sort_keys=True, default=str)
        parts.append(f"<details><summary>{e(norm_value(row['label']))} ({e(norm_value(row['status']))})"
                     f"{log_html(link)}</summary><pre>{e(config)}</pre></details>")
    return "\n".join(parts)


def toc_html(sections: Sequence[tuple[str, str, int]]) -> str:
    """Contents: (anchor, title, depth) per entry; depth 1 (a figure under Plots) is indented."""
    e = html.escape
    items = "".join(f"<li class=\"{'sub' if depth else 'top'}\"><a href=\"#{e(anchor)}\">{e(title)}</a></li>"
                    for anchor, title, depth in sections)
    return f"<nav class=\"toc\"><b>Contents</b><ul>{items}</ul></nav>"
