"""Markdown cells and tables for the report and the gate's ``--format md``: every string that comes from
results is escaped (HTML too, since pull-request comments render it)."""

from __future__ import annotations

import html
from typing import Any


def md_cell(value: Any) -> str:
    text = html.escape(str(value), quote=False).replace("|", "\\|").replace("\n", " ").replace("`", "'")
    return text.strip()


def md_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(md_cell(h) for h in headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(md_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
