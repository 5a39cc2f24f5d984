"""The work gate: a step's exact work counts (the record's ``work_per_step``, :mod:`moebench.metrics.work`)
compared between a BASELINE and a CURRENT point.

The counts are the same in every run of the same code and config, whatever the load, so they are
compared exactly, with no interval: a change is the code's. What fails the gate:

- any new host sync, or any new collective call on any mesh axis (each costs a round trip that
  no speed-up of the math buys back, and a sync-free path stops being one with the first);
- any new ATen operator (an extra copy or cast is one op a layer: a fraction of a percent of a
  step's ops, so no relative threshold could see it);
- collective bytes on an axis beyond :data:`BYTES_THRESHOLD` more (a wider buffer, a larger dtype).

Fewer of anything is reported as an improvement. A point whose own runs counted different work
(a nondeterministic path) is reported, not judged.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np

from moebench.results.table import WORK_PREFIX as PREFIX
from moebench.results.table import is_set

# Bytes may grow this much before the gate fails: padding of the row-wise dispatcher's blocks can move a
# count by a few rows when a change shifts routing by one token, far below any real widening (+12.5% for
# one extra byte a bf16 element pair, +100% for fp32 instead of bf16).
BYTES_THRESHOLD = 0.01
_NAMES = {"aten_ops": "ATen ops", "host_syncs": "host syncs"}


@dataclass
class WorkChange:
    """One count that differs between BASELINE and CURRENT."""

    what: str  # ``host syncs``, ``ep collective calls``, ``ep collective bytes``
    baseline: float
    current: float
    regressed: bool

    def text(self) -> str:
        """``host syncs 0 -> 1 a step`` or ``ep collective bytes +12.5%``."""
        if self.what.endswith("bytes") and self.baseline:
            return f"{self.what} {100 * (self.current / self.baseline - 1):+.1f}%"
        return f"{self.what} {self.baseline:,.0f} -> {self.current:,.0f} a step"


def work_of(row: Any) -> dict[str, float]:
    """A point's counts from its (flattened) ``work_per_step`` columns: ``{"aten_ops": n, "collective_calls.ep":
    n, ...}``; empty when its record has none (an older store, a compiled run)."""
    out = {}
    for name, value in row.items():
        if isinstance(name, str) and name.startswith(PREFIX) and isinstance(value, numbers.Real) \
                and not isinstance(value, (bool, np.bool_)) and math.isfinite(value):
            out[name.removeprefix(PREFIX)] = float(value)
    return out


def _what(key: str) -> str:
    kind, _, axis = key.partition(".")
    return _NAMES.get(kind) or f"{axis} {kind.replace('_', ' ')}"


def _regressed(key: str, base: float, cur: float) -> bool:
    if key.startswith("collective_bytes"):
        return cur > base * (1 + BYTES_THRESHOLD)
    return cur > base


def compare_work(base: Any, cur: Any) -> list[WorkChange]:
    """Every count that differs between the two points (a count only one side has counts from 0); none when a
    side has no counts. Whether the counts can be compared at all (:func:`varies`) is the caller's question."""
    b, c = work_of(base), work_of(cur)
    if not b or not c:
        return []
    changes = []
    for key in sorted(set(b) | set(c)):
        bv, cv = b.get(key, 0.0), c.get(key, 0.0)
        if bv != cv:
            changes.append(WorkChange(_what(key), bv, cv, _regressed(key, bv, cv)))
    return changes


def varies(row: Any) -> bool:
    """Whether the runs of a point counted different work (:func:`moebench.results.table.by_point`)."""
    return is_set(row.get("work_varies"))
