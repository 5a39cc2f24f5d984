"""Why each pair differs, verdict or not: per compared point (a point against its baseline), three tables.

- **phases**: ms per step of every phase on both sides and their difference, largest first, and below them
  how well the breakdown describes the timed step (the phases' sum against the timed median, per side, and
  the phases' difference against the timed one);
- **work per rank**: the experts a rank holds, the expert rows (routes) it computes and their GEMM FLOPs per
  step, and the FLOP rate its ``experts`` phase achieved. An EP rank holds ``num_experts / ep`` experts and
  computes the rows its EP group routes to them: 1/ep of the group's rows, the tokens of ep ranks; with
  balanced routing that is as many rows as a rank without EP computes for its own tokens;
- **communication per mesh axis**: bytes per step each rank moved on the axis, the time of the phases that
  move them (:data:`AXIS_PHASES`) and the achieved bandwidth, bytes / that time. The time is the collectives'
  own (``comm_breakdown_s``) where the record has it; else the whole phases' time, which holds compute too,
  so the bandwidth is a lower bound (shown as ``≥ ...``).

The answer's Why line (:func:`moebench.report.breakdown.explanations`) stays reserved for conclusive
verdicts; these tables are figures for every pair, and a difference within the noise is no finding.
"""

from __future__ import annotations

import html
from dataclasses import dataclass

import pandas as pd

from moebench.config import Config
from moebench.errors import MoebenchError
from moebench.record import PHASES, format_value
from moebench.report.breakdown import COLUMN, phases_of, representative, timed_breakdown
from moebench.report.headline import row_ratio
from moebench.report.html_table import html_table
from moebench.report.markdown import md_cell, md_table
from moebench.report.planned import config_dict
from moebench.results.table import is_missing, norm_value

# Which phases move each mesh axis's bytes (the phase clock's regions, moebench.record.PHASES): the EP token
# all-to-all in dispatch and combine; data-parallel gradients and FSDP / sharded-optimizer gathers; the
# pipeline's p2p transfers inside the bubble. Axes that share phases share one time: one row for both.
AXIS_PHASES = {"ep": ("dispatch", "combine"), "dp": ("grad_reduce", "param_gather"),
               "edp": ("grad_reduce", "param_gather"), "pp": ("pipeline_bubble",)}
COMM_COLUMN = "comm_breakdown_s.{}"

INTRO = ("Every compared point against its baseline, verdict or not (the answer's Why line is kept for conclusive "
         "verdicts): where the step's time goes, what each rank computes, what each mesh axis moved and how fast. "
         "These are measurements of one run a side, not findings: a difference within the step-time noise "
         "explains nothing.")
PHASE_CAPTION = ("ms per step by phase (the median timed step's; older records: the mean rank's), largest "
                 "difference first; difference = point - "
                 "baseline (negative: the point spends less). Below: the phases' sum against the timed median "
                 "step, which the speedup is measured on, and the share of it (and of the timed "
                 "difference) the phases account for.")
WORK_CAPTION = ("per rank and step. An EP rank computes rows for num_experts / ep experts (without EP: every expert, "
                "FSDP gathering them): the rows its EP group routes to them, 1/ep of the group's rows (the tokens of "
                "ep ranks), as many as a rank without EP computes for its own tokens when routing is balanced. "
                "FLOPs: 6 x 3 x d_model x expert_hidden per row (forward and backward of the SwiGLU expert).")
COMM_CAPTION = ("per rank and step: bytes the rank moved on the axis, the time of the phases that move them "
                "(ep: dispatch + combine; dp/edp: grad_reduce + param_gather; pp: pipeline_bubble) and bytes / "
                "time. Time: the collectives' own where the record has them (comm_breakdown_s); otherwise the "
                "whole phases, compute included, so the bandwidth is at least the figure (≥).")


@dataclass(frozen=True)
class Table:
    name: str  # one of TABLES: the section's intro says once what each shows
    headers: list[str]
    rows: list[list[str]]


# (name, what it shows) of each table of a pair, in the order a pair shows them
TABLES = (("phases", PHASE_CAPTION), ("work per rank", WORK_CAPTION), ("communication per mesh axis", COMM_CAPTION))


@dataclass(frozen=True)
class PairWhy:
    """One compared point: its title (point vs baseline), its speedup as the points table says it, what its
    breakdown is where it is not the timed steps' phase clock, and its tables."""

    title: str
    speedup: str
    note: str
    tables: list[Table]


def _ms(seconds: float | None) -> str:
    return "" if seconds is None else format_value(seconds, "ms")


def _signed_ms(seconds: float) -> str:
    text = format_value(seconds, "ms")
    return f"+{text}" if seconds > 0 and not text.startswith("+") else text


def _number(row: pd.Series, column: str) -> float | None:
    value = row.get(column)
    return None if is_missing(value) else float(value)


def _names(row: pd.Series, base: pd.Series) -> tuple[str, str]:
    """Column names of the two sides: their layouts, or ``point`` / ``baseline`` where the layouts agree."""
    mine, theirs = norm_value(row.get("variant")), norm_value(base.get("variant"))
    return (mine, theirs) if mine != theirs else ("point", "baseline")


def _pct(part: float | None, whole: float | None) -> str:
    return "" if part is None or not whole else format_value(part / whole, "pct")


def phase_table(row: pd.Series, base: pd.Series) -> Table | None:
    """The phase difference table (None when a side has no breakdown)."""
    mine, theirs = phases_of(row), phases_of(base)
    if mine is None or theirs is None:
        return None
    me, them = _names(row, base)
    used = [p for p in PHASES if mine[p] or theirs[p]]
    used.sort(key=lambda p: -abs(mine[p] - theirs[p]))
    rows = [[p, _ms(theirs[p]), _ms(mine[p]), _signed_ms(mine[p] - theirs[p])] for p in used]
    sums = sum(mine.values()), sum(theirs.values())
    timed = _number(row, "step_time_median_s"), _number(base, "step_time_median_s")
    rows.append(["sum of phases", _ms(sums[1]), _ms(sums[0]), _signed_ms(sums[0] - sums[1])])
    if timed[0] is not None and timed[1] is not None:
        rows.append(["timed step (median)", _ms(timed[1]), _ms(timed[0]), _signed_ms(timed[0] - timed[1])])
        rows.append(["phases' share of the timed step", _pct(sums[1], timed[1]), _pct(sums[0], timed[0]),
                     _pct(sums[0] - sums[1], timed[0] - timed[1])])
    return Table("phases", ["phase", f"{them} ms", f"{me} ms", "difference ms"], rows)


def source_note(row: pd.Series, base: pd.Series) -> str:
    """``breakdown of fsdp, ddp ep2: taken in profiled steps ...`` (empty when both are the timed steps')."""
    me, them = _names(row, base)
    sides = [(name, _source(side)) for name, side in ((them, base), (me, row)) if _source(side)]
    if len({what for _, what in sides}) == 1:
        return f"breakdown of {', '.join(name for name, _ in sides)}: {sides[0][1]}"
    return "; ".join(f"breakdown of {name}: {what}" for name, what in sides)


def _source(row: pd.Series) -> str:
    """What a side's breakdown is, when it is not simply the timed steps' phase clock."""
    if timed_breakdown(row):
        return ""
    where = "taken in profiled steps after the timed ones (an older record)"
    return where if representative(row) else where + ", which do not describe the timed step"


def _config(row: pd.Series) -> Config | None:
    try:
        return Config.from_dict(config_dict(row))
    except (MoebenchError, TypeError, ValueError):
        return None  # a record whose config this version cannot read: no work figures


def _work(row: pd.Series) -> dict[str, float] | None:
    """Per rank and step: experts held, expert rows computed, their FLOPs and the experts phase's rate."""
    cfg = _config(row)
    tokens, world, steps = (_number(row, c) for c in ("tokens_per_step", "world_size", "timed_steps"))
    if cfg is None or tokens is None or not world:
        return None
    n_moe = cfg.model.n_layers - cfg.model.n_dense_layers
    if n_moe <= 0:
        return None
    dropped = (_number(row, "dropped_tokens") or 0.0) / steps if steps else 0.0
    rows = (tokens * cfg.moe.top_k * n_moe - dropped) / world
    flops = 6 * cfg.expert_params() * rows
    out = {"experts": cfg.moe.num_experts / (_number(row, "ep") or 1), "rows": rows, "flops": flops}
    experts_s = _number(row, COLUMN.format("experts"))
    if experts_s:
        out["experts_s"] = experts_s
        out["rate"] = flops / experts_s
    return out


WORK_ROWS = (("experts it computes rows for", "experts", "int"), ("expert rows (routes) computed", "rows", "int"),
             ("expert GEMM FLOPs", "flops", "count"), ("experts phase ms", "experts_s", "ms"),
             ("achieved expert FLOP/s", "rate", "tflops"))


def work_table(row: pd.Series, base: pd.Series) -> Table | None:
    """The work-per-rank table (None when neither side's config can be read)."""
    mine, theirs = _work(row), _work(base)
    if mine is None and theirs is None:
        return None
    me, them = _names(row, base)

    def cell(work: dict[str, float] | None, key: str, kind: str) -> str:
        if work is None or key not in work:
            return ""
        return format_value(work[key] / 1e12 if kind == "tflops" else work[key], kind)

    rows = [[name, cell(theirs, key, kind), cell(mine, key, kind)] for name, key, kind in WORK_ROWS]
    return Table("work per rank", ["per rank, per step", them, me], rows)


def _axis_groups(row: pd.Series, base: pd.Series) -> list[list[str]]:
    """The axes either side moved bytes on, axes that share phases together, in AXIS_PHASES order."""
    moved = [a for a in AXIS_PHASES if any((_number(r, f"comm_{a}_bytes") or 0) > 0 for r in (row, base))]
    groups: dict[tuple[str, ...], list[str]] = {}
    for axis in moved:
        groups.setdefault(AXIS_PHASES[axis], []).append(axis)
    return list(groups.values())


def _comm_time(row: pd.Series, phases: tuple[str, ...]) -> tuple[float | None, bool]:
    """(seconds per step the axis's phases spent, whether that is the collectives' own time)."""
    own = [_number(row, COMM_COLUMN.format(p)) for p in phases]
    if any(v is not None for v in own):
        return sum(v or 0.0 for v in own), True
    whole = [_number(row, COLUMN.format(p)) for p in phases]
    return (sum(v or 0.0 for v in whole), False) if any(v is not None for v in whole) else (None, False)


def _side_cells(row: pd.Series, axes: list[str]) -> list[str]:
    # an ok side without an axis moved nothing on it (a layout without EP has no ep bytes)
    nbytes = sum(_number(row, f"comm_{a}_bytes") or 0.0 for a in axes)
    seconds, own = _comm_time(row, AXIS_PHASES[axes[0]])
    rate = ""
    if nbytes and seconds:
        rate = ("" if own else "≥ ") + format_value(nbytes / seconds, "bytes") + "/s"
    return [format_value(nbytes, "bytes"), _ms(seconds), rate]


def comm_table(row: pd.Series, base: pd.Series) -> Table | None:
    """The bytes-and-bandwidth table per mesh axis (None when neither side communicated)."""
    groups = _axis_groups(row, base)
    if not groups:
        return None
    me, them = _names(row, base)
    headers = ["mesh axis", "phases", f"{them} bytes", f"{them} ms", f"{them} bandwidth",
               f"{me} bytes", f"{me} ms", f"{me} bandwidth"]
    rows = [[" + ".join(axes), " + ".join(AXIS_PHASES[axes[0]]), *_side_cells(base, axes), *_side_cells(row, axes)]
            for axes in groups]
    return Table("communication per mesh axis", headers, rows)


def pairs(t: pd.DataFrame) -> list[tuple[int, int]]:
    """(row, baseline row) of every ok point compared with an ok baseline other than itself, in table order."""
    out = []
    for i, j in t.get("baseline_row", pd.Series(dtype=object)).items():
        if is_missing(j) or j == i or j not in t.index:
            continue
        if t.at[i, "status"] == "ok" and t.at[j, "status"] == "ok" and not is_missing(t.at[i, "speedup"]):
            out.append((i, j))
    return out


def pair_whys(t: pd.DataFrame) -> list[PairWhy]:
    """Every compared pair's tables (:func:`pairs`); a pair without any table is left out."""
    out = []
    for i, j in pairs(t):
        row, base = t.loc[i], t.loc[j]
        tables = [x for x in (phase_table(row, base), work_table(row, base), comm_table(row, base)) if x]
        if tables:
            out.append(PairWhy(f"{norm_value(row['label'])} vs {norm_value(base['label'])}",
                               row_ratio(row).text(), source_note(row, base), tables))
    return out


OPEN_UP_TO = 4  # pairs shown unfolded; beyond this each is folded under its title


def why_html(whys: list[PairWhy], heading: str) -> list[str]:
    """The section's HTML parts under ``heading`` (empty without pairs)."""
    if not whys:
        return []
    e = html.escape
    parts = [heading, f"<p>{e(INTRO)}</p>",
             "<ul class=\"caption\">" + "".join(f"<li><b>{e(name)}</b>: {e(text)}</li>" for name, text in TABLES)
             + "</ul>"]
    unfolded = " open" if len(whys) <= OPEN_UP_TO else ""
    for why in whys:
        parts.append(f"<details class=\"pair\"{unfolded}><summary><b>{e(why.title)}</b>: {e(why.speedup)}</summary>")
        parts += [f"<p class=\"caption\">{e(why.note)}</p>"] if why.note else []
        parts.append("<div class=\"why\">" + "".join(
            f"<div><p class=\"caption\"><b>{e(table.name)}</b></p>{html_table(table.headers, table.rows)}</div>"
            for table in why.tables) + "</div>")
        parts.append("</details>")
    return parts


def why_md(whys: list[PairWhy]) -> list[str]:
    """The section's Markdown lines (empty without pairs)."""
    if not whys:
        return []
    lines = ["### Why each pair differs", "", md_cell(INTRO), ""]
    lines += [f"- **{md_cell(name)}**: {md_cell(text)}" for name, text in TABLES] + [""]
    for why in whys:
        lines += [f"#### {md_cell(why.title)}", "", f"speedup: {md_cell(why.speedup)}", ""]
        lines += [md_cell(why.note), ""] if why.note else []
        for table in why.tables:
            lines += [f"**{md_cell(table.name)}**", "", md_table(table.headers, table.rows), ""]
    return lines
