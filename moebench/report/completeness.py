"""How complete each loaded run is: points planned but not recorded, whether the sweep still runs,
how long it ran, and where each point's log is.

A store's ``points.json`` lists every planned point (:func:`moebench.sweep.status.suite_statuses`);
a planned point without a record is *pending*, or *running* while a sweep holds the store's lock.
Stores written before ``points.json`` existed have no pending list: their records are all there is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import pandas as pd

from moebench.errors import StoreError
from moebench.results import reader
from moebench.results.store import Store
from moebench.results.table import norm_value
from moebench.sweep.status import POINTS_FILE, suite_statuses


@dataclass
class RunStatus:
    """One loaded store: its description, points without a record and how long the sweep ran."""

    store: Path
    suite: str
    description: str
    pending: list[tuple[str, str]] = field(default_factory=list)  # (point id, axis values)
    running: bool = False
    duration_s: float | None = None  # created_at to the last record's finished_at

    @property
    def state(self) -> str:
        return "running" if self.running else "pending"


def _time(value: Any) -> datetime | None:
    with contextlib.suppress(TypeError, ValueError):
        return datetime.fromisoformat(str(value))
    return None


def duration_text(seconds: float | None) -> str:
    if seconds is None:
        return ""
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m" if hours else f"{minutes}m {secs:02d}s"


def run_statuses(stores: Sequence[Path], metas: Sequence[dict[str, Any]], runs: pd.DataFrame,
                 problems: list[str] | None = None) -> list[RunStatus]:
    """One :class:`RunStatus` per store, in the order ``stores`` lists them (as ``metas`` does); a
    damaged points.json or pending/ file is a line in ``problems``. ``runs`` has a row per run, every
    repeat of a point included: a sweep lasts until the last of them finished."""
    out = []
    for store, meta in zip(stores, metas, strict=True):
        status = RunStatus(store, norm_value(meta.get("suite")), str(meta.get("description") or ""))
        try:
            status.pending = [(p.point_id, ", ".join(f"{k}={norm_value(v)}" for k, v in p.values.items()))
                              for p, record in suite_statuses(store, problems) if record is None]
        except StoreError as exc:  # no points.json: a store from before it, nothing more known
            if reader.exists(store / POINTS_FILE) and problems is not None:
                problems.append(f"{exc} (pending points not listed)")
        status.running = Store(store).sweep_running()
        rows = runs[runs["run_id"] == meta.get("run_id")] if "run_id" in runs.columns else runs.iloc[0:0]
        start = _time(meta.get("created_at"))
        ends = [e for e in map(_time, rows.get("finished_at", pd.Series(dtype=object))) if e is not None]
        if start is not None and ends:
            status.duration_s = (max(ends) - start).total_seconds()
        out.append(status)
    return out
