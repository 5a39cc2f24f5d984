"""Who a comparison is between, in words built from what differs between a point and its baseline.

A layout suite reads ``ddp ep8 vs fsdp at num_experts=64``, a top-k suite ``top_k=1 vs top_k=2``, a
precision suite ``fp32 vs bf16``: the sides are named by the axes (and layout) they differ in, the
axes they share follow ``at``. With several suites loaded the subject starts with its suite, with
several runs of one suite with its run (the prefix the points' labels carry, ``table.tidy``).
"""

from __future__ import annotations

import pandas as pd

from moebench.report.table import VARIANT_AXES, axis_name, is_missing, norm_value

# Axes whose values name themselves: ``fp32 vs bf16`` rather than ``precision=fp32 vs precision=bf16``.
_BARE = ("precision",)


def _shown(col: str, value: object) -> str:
    name = axis_name(col)
    return norm_value(value) if name in _BARE else f"{name}={norm_value(value)}"


def subject_parts(r: pd.Series, base: pd.Series) -> tuple[str, str]:
    """(``own vs baseline``, the axes both share) for a point and its baseline row."""
    own: list[str] = []
    theirs: list[str] = []
    shared: list[str] = []
    if r["variant"] != base["variant"]:
        own.append(str(r["variant"]))
        theirs.append(str(base["variant"]))
    for col in sorted(c for c in r.index if c.startswith("point.") and c not in VARIANT_AXES):
        mine, other = norm_value(r[col]), norm_value(base.get(col))
        if mine == other:
            shared += [f"{axis_name(col)}={mine}"] if mine != "none" else []
        elif "none" not in (mine, other):  # an axis only one side has (another suite's) names neither
            own.append(_shown(col, r[col]))
            theirs.append(_shown(col, base[col]))
    if not own:  # the same axes and layout (a baseline from another run): the layouts name the sides
        own, theirs = [str(r["variant"])], [str(base["variant"])]
    return f"{' '.join(own)} vs {' '.join(theirs)}", ", ".join(shared)


def prefixed(r: pd.Series, text: str) -> str:
    """``text`` after the row's suite / run prefix, as its label has it."""
    prefix = r.get("prefix")
    return f"{prefix}: {text}" if isinstance(prefix, str) and prefix else text


def add_subjects(t: pd.DataFrame) -> None:
    """``subject`` and ``subject_at`` for each point paired with another (empty otherwise), and
    ``baseline_shown``, the baseline cell: its point id after its suite / run prefix."""
    subjects, ats, shown = [], [], []
    for i, r in t.iterrows():
        b = r.get("baseline_row")
        if is_missing(b):
            subjects.append("")
            ats.append("")
            shown.append("")
            continue
        base = t.loc[b]
        subject, at = subject_parts(r, base) if b != i else ("", "")
        subjects.append(prefixed(r, subject) if subject else "")
        ats.append(at)
        shown.append(prefixed(base, str(base["point_id"])))
    t["subject"], t["subject_at"], t["baseline_shown"] = subjects, ats, shown
