"""Render the paired table and figures as a self-contained HTML page and as Markdown.

Every string that comes from results (config values, errors, log tails, host names) goes
through :func:`html.escape` in HTML and :func:`~moebench.report.markdown.md_cell` in Markdown (which also escapes
HTML, since pull-request comments render it).
"""

from __future__ import annotations

import base64
import html
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd

from moebench.record import METRICS, format_value
from moebench.report.breakdown import BREAKDOWN_INTRO, breakdown_table, explanations
from moebench.report.claims import claims_html, claims_md
from moebench.report.completeness import RunStatus
from moebench.report.details import (
    PENDING_HEADERS,
    PENDING_INTRO,
    configs_html,
    log_html,
    overlap_text,
    pending_rows,
    points_heading,
    reproduce_command,
    run_notes,
    toc_html,
)
from moebench.report.device import device_class, device_classes, machine_of, mfu_header
from moebench.report.headline import Line, emulated_side, headline, row_ratio, throttled_side
from moebench.report.html_table import WRAPPED, html_table
from moebench.report.markdown import md_cell, md_table
from moebench.report.planned import HEADERS as PLAN_HEADERS
from moebench.report.runs import HEADERS as DELTA_HEADERS
from moebench.report.runs import INTRO as DELTA_INTRO
from moebench.report.runs import Delta, delta_lines
from moebench.report.trace import OVERLAP_HEADERS, PointTraces, overlap_rows
from moebench.report.why import pair_whys, why_html, why_md
from moebench.results.stats import CONFIDENCE, PRACTICAL_CHANGE
from moebench.results.table import is_missing, norm_value, run_name


def fmt(value: Any, kind: str = "") -> str:
    """Human formatting for one table cell (``kind``: a metric's format, see :data:`moebench.record.FmtKind`,
    or ``flag``); empty for missing values."""
    if is_missing(value):
        return ""
    if kind == "flag":
        return "throttled" if value is True else ""
    if kind:
        return format_value(value, kind)
    return norm_value(value)


def _metrics(*names: str) -> list[tuple[str, str, str]]:
    return [(METRICS[n].header, n, METRICS[n].fmt) for n in names]


# (header, column, kind) of the main comparison table, in reading order: the point, its answer (speedup
# with interval and verdict), the throughput and the two checks on it (dropped routes, step noise), then
# the point's fields and the remaining metrics as their spec shows them.
COLUMNS = [
    ("point", "label", ""), *_metrics("speedup", "tokens_per_s_per_device", "dropped_fraction", "step_time_cv"),
    ("status", "status", ""), ("world", "world_size", "ranks"), ("nodes", "num_nodes", "int"),
    ("experts", "num_experts", "int"), ("top-k", "top_k", "int"), ("precision", "precision_shown", ""),
    # repeats: how many ok runs stand behind the point, and how much their throughput differs (CV)
    ("runs", "runs", "int"), ("failed runs", "failed_runs", ""), ("run spread", "run_spread", "pct"),
    *_metrics("step_time_median_s", "tflops_per_device", "mfu", "useful_mfu", "peak_mem_bytes", "comm_bytes_total",
              "loss_last", "loss_delta"),
    ("baseline", "baseline_shown", ""), *_metrics("mem_ratio", "comm_ratio"),
    ("clocks", "throttled", "flag"),
]
# Always shown, even when constant: the point's name and its answer.
_KEPT = ("label", "speedup", "tokens_per_s_per_device")
# Constant point fields: said once above the table ("all points: ...") instead of in a column.
_STATED = ("status", "world_size", "num_nodes", "num_experts", "top_k", "precision_shown", "runs")


RUN_COLUMN = ("run", "run", "")


def drops_routes(t: pd.DataFrame) -> bool:
    """Whether any point dropped routes over capacity: then MFU overstates its work (see :data:`USEFUL_MFU_NOTE`)."""
    return "dropped_fraction" in t.columns and bool((pd.to_numeric(t["dropped_fraction"], errors="coerce") > 0).any())


# Said above the points table when its useful-MFU column shows.
USEFUL_MFU_NOTE = ("useful MFU counts the FLOPs of the routes kept under capacity only; MFU counts every route, "
                   "dropped ones too, so a point that dropped routes reads more efficient there than it was.")


def _cells(t: pd.DataFrame, col: str, kind: str) -> list[str]:
    if col == "useful_mfu" and not drops_routes(t):  # equal to MFU where no route was dropped: no column
        return [""] * len(t)
    return [speedup_cell(r) if col == "speedup" else fmt(r.get(col), kind) for _, r in t.iterrows()]


def columns(t: pd.DataFrame) -> list[tuple[str, str, str]]:
    """The columns of :data:`COLUMNS` the table shows: a run column after the point when several runs of a
    suite are loaded; no column that is empty for every point (``clocks`` on CPU, ratios without a baseline),
    and none of the point fields that are the same for every point (:func:`constant_fields` says them once)."""
    stated = {col for _, col, _ in constant_fields(t)}
    shown = [c for c in COLUMNS if c[1] in _KEPT or (c[1] not in stated and any(_cells(t, c[1], c[2])))]
    shown = [(mfu_header(t, c[1]), *c[1:]) if c[1] in ("mfu", "useful_mfu") else c for c in shown]
    return [shown[0], RUN_COLUMN, *shown[1:]] if t.attrs.get("multi_run") else shown


def constant_fields(t: pd.DataFrame) -> list[tuple[str, str, str]]:
    """(header, column, value) of each point field of :data:`_STATED` that is one value for every point of a
    table of two or more that recorded it (a point that crashed before resolving its world size has none):
    the table leaves its column out and the line above it says it."""
    if len(t) < 2:
        return []
    out = []
    for header, col, kind in COLUMNS:
        if col in _STATED:
            values = set(_cells(t, col, kind)) - {""}
            if len(values) == 1:
                out.append((header, col, values.pop()))
    return out


def constant_text(t: pd.DataFrame) -> str:
    """``Every point: world 4, top-k 2, precision fp32.`` (empty when nothing is constant)."""
    fields = constant_fields(t)
    return ("Every point: " + ", ".join(f"{h} {v}" for h, _, v in fields) + ".") if fields else ""


def speedup_cell(r: pd.Series) -> str:
    """``1.47x [1.31, 1.62] faster``, and a warning sign when the two sides did unequal work, a side
    throttled or ran emulated, or the noise hides the change."""
    if is_missing(r.get("speedup")):
        return ""
    if r.get("baseline_point_id") == r.get("point_id"):
        return fmt(r["speedup"], METRICS["speedup"].fmt)
    ratio = row_ratio(r)
    flags = ["⚠ unequal drops"] if r.get("drops_differ") else []
    flags += [f"⚠ {side}" for side in (throttled_side(r), emulated_side(r)) if side]
    # one run a side says "no verdict" in its text already
    flags += ["⚠ inconclusive"] if r.get("inconclusive") and ratio.why is None else []
    flags += ["⚠ diverges"] if r.get("diverges") else []
    return " ".join([ratio.text(), *flags])


def table_rows(t: pd.DataFrame) -> list[list[str]]:
    cells = [_cells(t, col, kind) for _, col, kind in columns(t)]
    return [list(row) for row in zip(*cells, strict=True)] if cells and len(t) else []


def headline_intro(t: pd.DataFrame, device: str = "") -> str:
    """What the answer compares, on ``device`` (the loaded runs' device phrases, :mod:`moebench.report.device`)."""
    return ((f"{device}. " if device else "")
            + f"Tokens/s per device of each point over its baseline ({t.attrs.get('baseline', '')}; same model, "
            f"precision, world size and device), {100 * CONFIDENCE:g}% bootstrap confidence interval of the ratio "
            f"of median step times. Within noise: the interval includes 1.0 or the change is under "
            f"{100 * PRACTICAL_CHANGE:g}%.")


def failed_rows(t: pd.DataFrame) -> pd.DataFrame:
    return t[t["status"] != "ok"]


def traces_md(t: pd.DataFrame, traces: Sequence[PointTraces | None]) -> list[str]:
    """The Markdown report's "Traces" section: per traced point, the overlap sentence and table, and
    its timeline; nothing when no point was traced."""
    lines: list[str] = []
    for (_, row), found in zip(t.iterrows(), traces, strict=False):
        if found is None or not found.overlaps:
            continue
        lines += [f"#### {md_cell(norm_value(row['label']))}", "", md_cell(overlap_text(row, found.overlaps)), "",
                  md_table(OVERLAP_HEADERS, overlap_rows(found.overlaps)), ""]
        lines += [f"![trace timeline of {md_cell(norm_value(row['label']))}]({found.timeline})", ""] \
            if found.timeline else []
    return ["", "### Traces", "", *lines] if lines else []


CSS = """
body{font-family:system-ui,sans-serif;margin:2em;color:#222;max-width:1400px}
table{border-collapse:collapse;font-size:12px;margin:1em 0}
th,td{border:1px solid #ccc;padding:3px;text-align:right;vertical-align:top;white-space:nowrap}
td:first-child{white-space:normal;min-width:10em} .scroll{overflow-x:auto}
th{white-space:normal} td.verdict{white-space:normal;min-width:9em} td.words{white-space:normal;min-width:6em}
th{background:#f3f3f3} td:first-child,th:first-child{text-align:left}
section.claims td,section.claims th{text-align:left}
tr.failed td{background:#fde8e8}
figure{margin:1.5em 0} figure img{max-width:100%;height:auto}
pre{background:#f7f7f7;padding:6px;white-space:pre-wrap;font-size:11px;text-align:left;max-width:900px}
.note{color:#8a5a00}
.caption{font-size:13px;color:#444;max-width:1100px;margin:0.8em 0 0}
.why{display:flex;flex-wrap:wrap;column-gap:2em;align-items:flex-start} details.pair{margin:1em 0}
.headline{border:2px solid #446;border-radius:6px;padding:0.6em 1.2em;margin:1em 0 1.5em;background:#f8f9fc}
.headline h2{margin:0.2em 0 0.3em} .headline p{font-size:13px;color:#555;margin:0.2em 0}
.headline ul.answer{font-size:20px;line-height:1.5;padding-left:1em}
.headline ul.answer li{margin:0.3em 0} .headline details li{font-size:14px} .headline ul.why{font-size:14px}
.v-faster{color:#106b21;font-weight:bold} .v-slower{color:#a31515;font-weight:bold}
.v-within-noise,.v-mixed{color:#555;font-weight:bold} .v-diverges{color:#a31515;font-weight:bold}
.v-unequal-work{color:#b36b00;font-weight:bold} .v-qualified{color:#b36b00;font-weight:bold}
.flag{color:#8a5a00;font-size:0.75em;display:block}
.detail{color:#555;font-size:0.7em;display:block}
.toc{font-size:13px} .toc ul{max-width:900px} .toc li.sub{margin-left:1.5em;list-style:circle}
details pre{max-height:30em;overflow:auto}
"""


def load_text(meta: dict[str, Any], t: pd.DataFrame) -> str:
    """``; load 1.2 to 9.8 while its runs ran (1-minute average, 2 cores)``: how busy the machine was (empty for
    records from before loads were kept)."""
    if "load_mean" not in t.columns:
        return ""
    rows = t[t["run_id"].map(norm_value) == norm_value(meta.get("run_id"))] if "run_id" in t.columns else t
    loads = pd.to_numeric(rows["load_mean"], errors="coerce").dropna()
    if loads.empty:
        return ""
    cores = pd.to_numeric(rows.get("cores", pd.Series(dtype=float)), errors="coerce").dropna()
    span = f"{loads.min():.1f}" if round(loads.min(), 1) == round(loads.max(), 1) else \
        f"{loads.min():.1f} to {loads.max():.1f}"
    on = f", {int(cores.max())} cores" if len(cores) else ""
    return f"; load {span} while its runs ran (1-minute average{on})"


def run_info(metas: list[dict[str, Any]], t: pd.DataFrame) -> list[tuple[str, str]]:
    """(label, value) lines describing each loaded run, its device phrase first (:mod:`moebench.report.device`)."""
    out = []
    for m in metas:
        git = m.get("git") or {}
        host = m.get("host") or {}
        hw = machine_of(m)
        versions = ", ".join(f"{k} {v}" for k, v in sorted((m.get("versions") or {}).items()) if v)
        commit = f"{git.get('commit', '')}{' (dirty)' if git.get('dirty') else ''}"
        out.append((run_name(m.get("suite"), m.get("run_id")),
                    f"{device_class(m, t)}; created {m.get('created_at')}; commit {commit}; "
                    f"host {host.get('hostname')} ({hw}){load_text(m, t)}; {versions}"))
    return out


Plan = tuple[list[list[str]], list[str]]  # planned-vs-measured rows and notes (moebench.report.planned)
PLAN_INTRO = ("The planner's roofline and memory model for each GPU point, next to the measurement "
              "(ratio = measured / planned).")


def _html_line(line: Line) -> str:
    e = html.escape
    flags = "".join(f"<span class=\"flag\">⚠ {e(f)}</span>" for f in line.flags)
    detail = f"<span class=\"detail\">{e(line.detail)}</span>" if line.detail else ""
    return (f"<li><b>{e(line.subject)}</b>: <span class=\"v-{line.verdict.replace(' ', '-')}\">{e(line.answer)}"
            f"</span>{detail}{flags}</li>")


def headline_html(t: pd.DataFrame, extra: Sequence[Line] = (), device: str = "") -> str:
    """The answer box: one line per layout pair (and run pair), then every comparison, folded."""
    lines, details = headline(t)
    lines = [*lines, *extra]
    if not lines:
        return ""
    e = html.escape
    parts = ["<section class=\"headline\"><h2>Answer</h2>", f"<p>{e(headline_intro(t, device))}</p>",
             "<ul class=\"answer\">", *map(_html_line, lines), "</ul>"]
    why = explanations(t)
    if why:  # where the time goes: the phases that make each speedup
        parts += ["<p><b>Why</b> (measured time breakdown):</p><ul class=\"why\">",
                  *(f"<li>{e(text)}</li>" for text in why), "</ul>"]
    if len(details) > len(lines):
        parts += [f"<details><summary>every comparison ({len(details)})</summary><ul>", *map(_html_line, details),
                  "</ul></details>"]
    parts.append("</section>")
    return "\n".join(parts)


def headline_md(t: pd.DataFrame, extra: Sequence[Line] = (), device: str = "") -> list[str]:
    lines, details = headline(t)
    lines = [*lines, *extra]
    if not lines:
        return []
    out = ["### Answer", "", md_cell(headline_intro(t, device)), ""]
    out += [f"- **{md_cell(x.subject)}**: {md_cell(x.answer)}" + (f" ({md_cell(x.detail)})" if x.detail else "")
            + "".join(f" ⚠ {md_cell(f)}" for f in x.flags) for x in lines]
    why = explanations(t)
    if why:
        out += ["", "**Why** (measured time breakdown):", "", *(f"- {md_cell(text)}" for text in why)]
    if len(details) > len(lines):
        out += ["", f"<details><summary>every comparison ({len(details)})</summary>", ""]
        out += [f"- {md_cell(x.text())}" for x in details]
        out += ["", "</details>"]
    return [*out, ""]


@dataclass(frozen=True)
class ReportPage:
    """What one report shows, for both renderers.

    ``table`` has one row per point (:mod:`moebench.results.table`), ``metas`` each loaded store's meta.json;
    ``figures`` holds (title, name, SVG bytes), ``notes`` says which plots were skipped and why, ``caption``
    is the figures' device and commit line; ``plan`` is the planned-vs-measured rows and notes; ``deltas``
    compares matching points of several runs of a suite (:mod:`moebench.report.runs`); ``runs`` says what
    each store still lacks (:mod:`moebench.report.completeness`); ``logs`` is each row's logs and trace files,
    (name, path relative to the report) with the point's own log first (HTML only: Markdown links none);
    ``traces`` each row's trace figures per rank and timeline (:mod:`moebench.report.trace`), None where it
    has no trace; ``claims`` the verdicts ``moebench claim`` recorded in the stores (:mod:`moebench.report.claims`);
    ``reproduce`` a ``moebench run`` per store and the ``moebench report`` of this page.
    """

    title: str
    table: pd.DataFrame
    metas: list[dict[str, Any]]
    figures: list[tuple[str, str, bytes]]
    notes: list[str]
    warnings: list[str]
    caption: str
    plan: Plan = ([], [])
    deltas: Sequence[Delta] = ()
    runs: Sequence[RunStatus] = ()
    logs: Sequence[Sequence[tuple[str, str]]] | None = None
    traces: Sequence[PointTraces | None] | None = None
    claims: list[list[str]] | None = None
    reproduce: Sequence[str] = ()  # the commands that make the stores and this page again (moebench.report.reproduce)

    def point_logs(self) -> list[Sequence[tuple[str, str]]]:
        return list(self.logs) if self.logs is not None else [[] for _ in range(len(self.table))]

    def metas_by_run(self) -> dict[str, dict[str, Any]]:
        return {norm_value(m.get("run_id")): m for m in self.metas}


REPRODUCE_INTRO = "from the folder they ran in, at each run's commit, each store made afresh"


class Toc:
    """The HTML page's contents, filled while its sections render: (anchor, title, depth) per entry."""

    def __init__(self) -> None:
        self.entries: list[tuple[str, str, int]] = []

    def h2(self, anchor: str, text: str) -> str:
        self.entries.append((anchor, text, 0))
        return f"<h2 id=\"{anchor}\">{html.escape(text)}</h2>"


@dataclass(frozen=True)
class Section:
    """One part of the report in both formats: ``html`` gives its page parts (joined by newlines, headings
    added to the contents), ``md`` its Markdown lines; an empty list leaves the section out."""

    name: str
    html: Callable[[ReportPage, Toc], list[str]]
    md: Callable[[ReportPage], list[str]]


def _claims_html(page: ReportPage, toc: Toc) -> list[str]:
    return claims_html(page.claims or [], toc.h2("claims", "Claims")) if page.claims else []


def _claims_md(page: ReportPage) -> list[str]:
    return claims_md(page.claims or [])


def _answer_html(page: ReportPage, toc: Toc) -> list[str]:
    return [headline_html(page.table, delta_lines(page.deltas), device_classes(page.metas, page.table))]


def _answer_md(page: ReportPage) -> list[str]:
    return headline_md(page.table, delta_lines(page.deltas), device_classes(page.metas, page.table))


def _runs_html(page: ReportPage, toc: Toc) -> list[str]:
    e = html.escape
    parts = [toc.h2("runs", "Runs"), "<ul>"]
    parts += [f"<li><b>{e(k)}</b>: {e(v)}</li>" for k, v in run_info(page.metas, page.table)]
    parts += [f"<li><b>{e(k)}</b>: {e(v)}</li>" for k, v in run_notes(page.runs)]
    if page.reproduce:  # one command a line, in the order they run
        parts.append(f"<li><b>reproduce</b> ({e(REPRODUCE_INTRO)}):<ul>"
                     + "".join(f"<li><code>{e(c)}</code></li>" for c in page.reproduce) + "</ul></li>")
    parts.append("</ul>")
    return parts + [f"<p class=\"note\">warning: {e(w)}</p>" for w in page.warnings]


def _runs_md(page: ReportPage) -> list[str]:
    lines = [f"- **{md_cell(k)}**: {md_cell(v)}" for k, v in [*run_info(page.metas, page.table), *run_notes(page.runs)]]
    if page.reproduce:
        lines += [f"- **reproduce** ({md_cell(REPRODUCE_INTRO)}):", *(f"  - `{md_cell(c)}`" for c in page.reproduce)]
    return lines + [f"- warning: {md_cell(w)}" for w in page.warnings]


def _useful_mfu_shown(t: pd.DataFrame) -> bool:
    return any(col == "useful_mfu" for _, col, _ in columns(t))


def _points_html(page: ReportPage, toc: Toc) -> list[str]:
    t = page.table
    parts = [toc.h2("points", points_heading(t, page.runs)),
             "<p>Speedup, memory and comm ratios are against the baseline point: same model, precision, "
             "world size and device; the baseline layout is the suite's <code>baseline</code> selector.</p>"]
    if constant_text(t):
        parts.append(f"<p>{html.escape(constant_text(t))}</p>")
    if _useful_mfu_shown(t):
        parts.append(f"<p>{html.escape(USEFUL_MFU_NOTE)}</p>")
    return [*parts, html_table([h for h, _, _ in columns(t)], table_rows(t), failed=list(t["status"] != "ok"),
                                wrapped=WRAPPED)]


def _points_md(page: ReportPage) -> list[str]:
    t = page.table
    lines = ["", f"### {md_cell(points_heading(t, page.runs))}", ""]
    lines += [md_cell(constant_text(t)), ""] if constant_text(t) else []
    lines += [md_cell(USEFUL_MFU_NOTE), ""] if _useful_mfu_shown(t) else []
    return [*lines, md_table([h for h, _, _ in columns(t)], table_rows(t)), ""]


def _pending_html(page: ReportPage, toc: Toc) -> list[str]:
    if not pending_rows(page.runs):
        return []
    return [toc.h2("pending", "Pending points"), f"<p>{html.escape(PENDING_INTRO)}</p>",
            html_table(PENDING_HEADERS, pending_rows(page.runs))]


def _pending_md(page: ReportPage) -> list[str]:
    if not pending_rows(page.runs):
        return []
    return ["### Pending points", "", md_cell(PENDING_INTRO), "", md_table(PENDING_HEADERS, pending_rows(page.runs)),
            ""]


def _deltas_html(page: ReportPage, toc: Toc) -> list[str]:
    if not page.deltas:
        return []
    return [toc.h2("run-vs-run", "Run vs run"), f"<p>{html.escape(DELTA_INTRO)}</p>",
            html_table(DELTA_HEADERS, [d.row() for d in page.deltas])]


def _deltas_md(page: ReportPage) -> list[str]:
    if not page.deltas:
        return []
    return ["### Run vs run", "", md_cell(DELTA_INTRO), "", md_table(DELTA_HEADERS, [d.row() for d in page.deltas]),
            ""]


def _failed_html(page: ReportPage, toc: Toc) -> list[str]:
    e = html.escape
    t = page.table
    failed = failed_rows(t)
    if failed.empty:
        return []
    links = [point_logs[0][1] if point_logs else None for point_logs in page.point_logs()]
    parts = [toc.h2("failed", "Failed points")]
    for i, r in failed.iterrows():
        parts.append(f"<h3>{e(norm_value(r['label']))}: {e(norm_value(r['status']))}"
                     f"{log_html(links[t.index.get_loc(i)])}</h3>")
        parts.append(f"<p>{e(norm_value(r.get('error')))}</p>")
        if isinstance(r.get("log_tail"), str) and r["log_tail"]:
            parts.append(f"<pre>{e(r['log_tail'])}</pre>")
    return parts


def _failed_md(page: ReportPage) -> list[str]:
    failed = failed_rows(page.table)
    if failed.empty:
        return []
    rows = [[norm_value(r["label"]), norm_value(r["status"]), norm_value(r.get("error"))]
            for _, r in failed.iterrows()]
    return ["### Failed points", "", md_table(["point", "status", "error"], rows), ""]


def _breakdown_html(page: ReportPage, toc: Toc) -> list[str]:
    headers, rows = breakdown_table(page.table)
    if not rows:
        return []
    return [toc.h2("breakdown", "Time breakdown"), f"<p>{html.escape(BREAKDOWN_INTRO)}</p>",
            html_table(headers, rows)]


def _breakdown_md(page: ReportPage) -> list[str]:
    headers, rows = breakdown_table(page.table)
    if not rows:
        return []
    return ["### Time breakdown", "", md_cell(BREAKDOWN_INTRO), "", md_table(headers, rows), ""]


def _why_html(page: ReportPage, toc: Toc) -> list[str]:
    whys = pair_whys(page.table)
    return why_html(whys, toc.h2("why", "Why each pair differs")) if whys else []


def _why_md(page: ReportPage) -> list[str]:
    return why_md(pair_whys(page.table))


def _planned_html(page: ReportPage, toc: Toc) -> list[str]:
    plan_table, plan_notes = page.plan
    if not (plan_table or plan_notes):
        return []
    parts = [f"{toc.h2('planned', 'Planned vs measured')}<p>{html.escape(PLAN_INTRO)}</p>",
             html_table(PLAN_HEADERS, plan_table) if plan_table else ""]
    return parts + [f"<p class=\"note\">{html.escape(n)}</p>" for n in plan_notes]


def _planned_md(page: ReportPage) -> list[str]:
    plan_table, plan_notes = page.plan
    lines = ["### Planned vs measured", "", md_cell(PLAN_INTRO), "", md_table(PLAN_HEADERS, plan_table), ""] \
        if plan_table else []
    return lines + [f"- {md_cell(n)}" for n in plan_notes]


def _plots_html(page: ReportPage, toc: Toc) -> list[str]:
    e = html.escape
    parts = [toc.h2("plots", "Plots")]
    for fig_title, name, svg in page.figures:
        data = base64.b64encode(svg).decode("ascii")
        toc.entries.append((name, fig_title, 1))
        # The figure carries its title and caption itself (so does its file under plots/): no figcaption.
        parts.append(f"<figure id=\"{e(name)}\"><img alt=\"{e(fig_title)}. {e(page.caption)}\" "
                     f"src=\"data:image/svg+xml;base64,{data}\"></figure>")
    if page.notes:
        parts.append("<h3>Plots not drawn</h3><ul>" + "".join(f"<li>{e(n)}</li>" for n in page.notes) + "</ul>")
    return parts


def _plots_md(page: ReportPage) -> list[str]:
    lines = ["### Plots", ""] if page.figures else []
    lines += [f"![{md_cell(fig_title)}](plots/{name}.svg)" for fig_title, name, _ in page.figures]
    return lines + (["", "Plots not drawn: " + "; ".join(md_cell(n) for n in page.notes)] if page.notes else [])


def _points_detail_html(page: ReportPage, toc: Toc) -> list[str]:
    """Each point folded: its config, logs and traces (:func:`moebench.report.details.configs_html`)."""
    machines = {norm_value(m.get("run_id")): f"{(m.get('host') or {}).get('hostname')} ({machine_of(m)})"
                for m in page.metas}
    return [toc.h2("configs", "Point configs and logs"),
            configs_html(page.table, page.point_logs(), machines, page.traces, page.metas_by_run())]


def _points_detail_md(page: ReportPage) -> list[str]:
    """The traced points' overlap, then the command that reruns each point, from the repository root at the
    run's commit (Markdown has no folding, so no configs or logs)."""
    lines = traces_md(page.table, page.traces or ())
    lines += ["", "### Reproduce", ""]
    metas = page.metas_by_run()
    commands = [reproduce_command(r, metas.get(norm_value(r.get("run_id")))) for _, r in page.table.iterrows()]
    return lines + [f"- {md_cell(label)}: `{md_cell(command)}`"
                    for label, command in zip(page.table["label"], commands, strict=True)]


# The report's sections in reading order, walked by both renderers: the recorded claim verdicts and the
# answer first, then what was run, the points, what is missing or failed, why (breakdown, plan), the plots,
# and each point's details.
SECTIONS = (
    Section("claims", _claims_html, _claims_md),
    Section("answer", _answer_html, _answer_md),
    Section("runs", _runs_html, _runs_md),
    Section("points", _points_html, _points_md),
    Section("pending", _pending_html, _pending_md),
    Section("run-vs-run", _deltas_html, _deltas_md),
    Section("failed", _failed_html, _failed_md),
    Section("breakdown", _breakdown_html, _breakdown_md),
    Section("why", _why_html, _why_md),
    Section("planned", _planned_html, _planned_md),
    Section("plots", _plots_html, _plots_md),
    Section("point-details", _points_detail_html, _points_detail_md),
)


def render_html(page: ReportPage) -> str:
    """The self-contained HTML report: a contents list, then every section of :data:`SECTIONS`."""
    e = html.escape
    toc = Toc()
    parts = [part for section in SECTIONS for part in section.html(page, toc)]
    head = [f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>{e(page.title)}</title>",
            f"<style>{CSS}</style></head><body>", f"<h1>{e(page.title)}</h1>"]
    return "\n".join([*head, toc_html(toc.entries), *parts, "</body></html>"])


def render_md(page: ReportPage) -> str:
    """The Markdown report (for pull-request comments): every section of :data:`SECTIONS`."""
    lines = [f"## {md_cell(page.title)}", ""]
    lines += [line for section in SECTIONS for line in section.md(page)]
    return "\n".join(lines) + "\n"
