"""An HTML table of the report: wide tables scroll sideways, headers break at spaces and slashes, and
columns of words wrap (:data:`WRAPPED`) while numbers never break. Every cell is escaped."""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence

# Points-table columns of words and their cells' class: a verdict and its warnings (``verdict``), a baseline
# with its suite (``words``) wrap, so that the table fits a 1400 px page; numbers never break.
WRAPPED = {"speedup": "verdict", "baseline": "words"}
NB_HYPHEN = "\u2011"  # a header breaks at its spaces and slashes only: top-k stays whole


def _breakable(text: str) -> str:
    """A label may also break after ``_`` and ``=`` (``num_<wbr>experts=<wbr>32``): a baseline cell is
    then as narrow as its shortest parts, not its longest ``axis=value``, so the table fits the page."""
    return text.replace("_", "_<wbr>").replace("=", "=<wbr>")


def html_table(headers: list[str], rows: list[list[str]], failed: Sequence[bool] = (),
               wrapped: Mapping[str, str] | None = None) -> str:
    """The table of ``rows`` under ``headers``; a ``failed`` row is shaded, a column named in ``wrapped`` gets
    that cell class."""
    e = html.escape
    # wide tables scroll sideways instead of breaking every number over two lines
    # a header may break after a slash (tokens/s/ dev): no column is wider than its numbers for its header
    out = ["<div class=\"scroll\"><table><thead><tr>"
           + "".join(f"<th>{e(h).replace('/', '/<wbr>').replace('-', NB_HYPHEN)}</th>" for h in headers)
           + "</tr></thead><tbody>"]
    failed = list(failed) or [False] * len(rows)
    classes = [(wrapped or {}).get(h) for h in headers]
    opens = [f'<td class="{c}">' if c else "<td>" for c in classes]
    for row, bad in zip(rows, failed, strict=True):
        tr = '<tr class="failed">' if bad else "<tr>"
        out.append(tr + "".join(f"{td}{_breakable(e(c)) if k == 'words' else e(c)}</td>"
                                for td, k, c in zip(opens, classes, row, strict=True)) + "</tr>")
    out.append("</tbody></table></div>")
    return "\n".join(out)
