"""The report's "Claims" section: the verdicts ``moebench claim`` recorded in the stores (their claims.json).

The report does not judge claims itself (``moebench.claim`` sits above the report and uses its
statistics); it shows what was judged, at the top, one row per claim and store.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from moebench.errors import StoreError
from moebench.report.markdown import md_cell, md_table
from moebench.results.claims_file import read_claims

HEADERS = ["claim", "verdict", "measured", "published", "differs from the published setup"]
INTRO = ("Published claims judged on these results by `moebench claim` (docs/claims.md): a claim holds when the "
         "95% interval of every comparison lies on its holding side, does not hold when one lies wholly on the "
         "other side, and is inconclusive otherwise; a memory ratio or a count (host syncs), one value per point, "
         "holds or not by its value.")


def claim_rows(stores: Sequence[Path], warnings: list[str]) -> list[list[str]]:
    """One row per recorded verdict; an unreadable claims.json is a warning, not a failed report."""
    rows = []
    for store in stores:
        try:
            verdicts = read_claims(store)
        except StoreError as exc:
            warnings.append(str(exc))
            continue
        rows += [_row(v) for v in verdicts]
    return rows


def _text(v: Any) -> str:
    return "" if v is None else str(v)


def _row(v: dict[str, Any]) -> list[str]:
    conditions = v.get("conditions") if isinstance(v.get("conditions"), list) else []
    carried = v.get("carried") if isinstance(v.get("carried"), dict) else {}
    published = _text(v.get("published")) + (f"; {_text(carried['text'])}" if carried.get("text") else "")
    return [f"{_text(v.get('name'))}: {_text(v.get('statement'))}", _text(v.get("verdict")),
            f"{_text(v.get('measured'))} (holds when {_text(v.get('holds'))})", published,
            "; ".join(map(_text, conditions))]


def claims_html(rows: list[list[str]], heading: str) -> list[str]:
    """The section under ``heading`` (the page's ``<h2>``, which also enters its contents): every cell
    wraps (``words``), as the verdicts' sentences are long; the intro's command in ``<code>``."""
    if not rows:
        return []
    e = html.escape
    head = "".join(f"<th>{e(h)}</th>" for h in HEADERS)
    body = "".join("<tr>" + "".join(f"<td class=\"words\">{e(c)}</td>" for c in row) + "</tr>" for row in rows)
    intro = e(INTRO).replace("`moebench claim`", "<code>moebench claim</code>")
    return [f"<section class=\"claims\">{heading}", f"<p>{intro}</p>",
            f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></section>"]


def claims_md(rows: list[list[str]]) -> list[str]:
    if not rows:
        return []
    return ["### Claims", "", md_cell(INTRO), "", md_table(HEADERS, rows), ""]
