"""Who a comparison is between, in words built from what differs between a point and its baseline.

A layout suite reads ``ddp ep8 vs fsdp at num_experts=64``, a top-k suite ``top_k=1 vs top_k=2``, a
precision suite ``fp32 vs bf16``: the sides are named by the axes (and layout) they differ in, the
axes they share follow ``at`` (the layout too, where the table holds several: ``fp32 vs bf16 at
ddp ep8``). With several suites loaded the subject starts with its suite, with several runs of one
suite with its run (the prefix the points' labels carry, ``table.tidy``).
"""

from __future__ import annotations

import pandas as pd

from moebench.results.table import VARIANT_AXES, axis_name, is_missing, norm_value

# Axes whose values name themselves: ``fp32 vs bf16`` rather than ``precision=fp32 vs precision=bf16``.
_BARE = ("precision",)


def _shown(col: str, value: str) -> str:
    name = axis_name(col)
    return value if name in _BARE else f"{name}={value}"


def _value(row: pd.Series, col: str) -> str:
    """The row's value of the axis ``col``; a point that does not sweep it (a baseline outside the grid)
    has the value it ran with: the record's resolved ``precision``, else its config's."""
    value = norm_value(row.get(col))
    if value != "none":
        return value
    if axis_name(col) == "precision":
        return norm_value(row.get("precision"))
    return norm_value(row.get(f"config.{col.removeprefix('point.')}"))


def subject_parts(r: pd.Series, base: pd.Series, layouts: bool = False) -> tuple[str, str]:
    """(``own vs baseline``, the axes both share) for a point and its baseline row; with ``layouts`` (the
    table holds several) a layout both sides share is the first of those axes (``fp32 vs bf16 at ddp ep8``)."""
    own: list[str] = []
    theirs: list[str] = []
    shared: list[str] = []
    if r["variant"] != base["variant"]:
        own.append(str(r["variant"]))
        theirs.append(str(base["variant"]))
    elif layouts:
        shared.append(str(r["variant"]))
    for col in sorted(c for c in r.index if c.startswith("point.") and c not in VARIANT_AXES):
        mine, other = _value(r, col), _value(base, col)
        if mine == other:
            shared += [f"{axis_name(col)}={mine}"] if mine != "none" and norm_value(r[col]) != "none" else []
        elif "none" not in (mine, other):  # a field neither side knows names neither
            own.append(_shown(col, mine))
            theirs.append(_shown(col, other))
    if not own:  # the same axes and layout (a baseline from another run): the layouts name the sides
        own, theirs = [str(r["variant"])], [str(base["variant"])]
    return f"{' '.join(own)} vs {' '.join(theirs)}", ", ".join(shared)


def prefixed(r: pd.Series, text: str) -> str:
    """``text`` after the row's suite / run prefix, as its label has it."""
    prefix = r.get("prefix")
    return f"{prefix}: {text}" if isinstance(prefix, str) and prefix else text


def add_subjects(t: pd.DataFrame) -> None:
    """``subject`` and ``subject_at`` for each point paired with another (empty otherwise), and
    ``baseline_shown``, the baseline cell: the baseline point's label (``smoke: fsdp, num_experts=8``)."""
    subjects, ats, shown = [], [], []
    layouts = t["variant"].nunique() > 1
    for i, r in t.iterrows():
        b = r.get("baseline_row")
        if is_missing(b):
            subjects.append("")
            ats.append("")
            shown.append("")
            continue
        base = t.loc[b]
        subject, at = subject_parts(r, base, layouts) if b != i else ("", "")
        subjects.append(prefixed(r, subject) if subject else "")
        ats.append(at)
        shown.append(str(base["label"]))  # which point it is, as its own row reads (prefix included)
    t["subject"], t["subject_at"], t["baseline_shown"] = subjects, ats, shown
