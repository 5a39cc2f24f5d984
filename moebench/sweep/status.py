"""A store's planned runs and their state: the sweep's plan (``points.json``), each planned run with its latest
record, and the ``moebench status`` table."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from moebench.errors import StoreError
from moebench.record import METRICS
from moebench.results import reader
from moebench.results.settle import run_key
from moebench.results.store import Store, commit_label
from moebench.sweep.progress import describe, metric_parts
from moebench.sweep.slurm import pending_records
from moebench.sweep.suite import Point, runs

POINTS_FILE = "points.json"
# What every planned point in points.json needs (see Point.to_dict); nproc may be null.
PLAN_FIELDS: dict[str, type | tuple[type, ...]] = {
    "point_id": str, "key": str, "values": dict, "preset": str, "overrides": dict,
    "nproc": (int, type(None)), "timeout_s": (int, float), "error": (str, type(None)),
}


def read_plan(store: Store) -> list[dict[str, Any]]:
    """The planned points of a store (``points.json``), one dict per point."""
    path = store.path / POINTS_FILE
    try:
        data = reader.read_json(path)
    except FileNotFoundError:
        raise StoreError(f"{store.path}: no {POINTS_FILE}; was this store written by moebench run?") from None
    plan = data.get("points") if isinstance(data, dict) else None
    if not isinstance(plan, list) or not all(isinstance(d, dict) and "point_id" in d and "key" in d for d in plan):
        raise StoreError(f"{path}: points: expected a list of points with point_id and key")
    for i, data in enumerate(plan):
        for name, kind in PLAN_FIELDS.items():
            if not isinstance(data.get(name), kind):
                got = repr(data[name])[:60] if name in data else "nothing"
                raise StoreError(f"{path}: points[{i}].{name}: missing or of the wrong type (got {got})")
        if not re.fullmatch(r"p\d+", data["point_id"]):
            raise StoreError(f"{path}: points[{i}].point_id: expected p000, p001, ..., got {data['point_id']!r}")
    return plan


def suite_statuses(store_path: str | Path, problems: list[str] | None = None
                   ) -> list[tuple[Point, dict[str, Any] | None]]:
    """Each planned run of a store (a point at a repeat, round-robin order) with its latest record
    (None: not finished yet). The runs are the store's ``repeats`` of every point, and any repeat
    recorded beyond them; a file in pending/ that is no record is a line in ``problems``."""
    store = Store(store_path)
    plan = read_plan(store)
    latest = store.latest_by_run()
    # finished Slurm tasks not merged yet are newer than any line of records.jsonl
    latest.update({run_key(r): r for r in pending_records(store, problems)})
    latest.update({run_key(r): r for _, r in store.unsaved_records()})
    repeats = max([int(store.read_meta().get("repeats") or 1), *(r + 1 for _, r in latest)])
    points = [Point.from_dict(data, resolve=False) for data in plan]
    keys = {data["point_id"]: data["key"] for data in plan}  # as planned (unresolved points hash otherwise)
    return [(run, latest.get((keys[run.point_id], run.repeat))) for run in runs(points, repeats)]


def _status_header(store: Store, sweeping: bool, counts: dict[str, int]) -> str:
    """``suite smoke, run 20261206-051711-ab12, commit 0d579b9, started 2026-12-06 05:17 UTC:`` and whether a
    sweep holds the store now, was cut short (runs ``interrupted``), or left runs pending."""
    meta = store.read_meta()
    created = str(meta.get("created_at") or "")
    # created_at is ISO 8601 in UTC (now_iso); the minute is enough to tell runs apart
    started = f"{created[:10]} {created[11:16]} UTC" if len(created) >= 16 else "at an unknown time"
    if sweeping:
        state = "a sweep holds the store now"
    elif counts.get("interrupted"):
        state = f"interrupted (no sweep holds the store; {_runs(counts['interrupted'])} cut short)"
    elif counts.get("pending"):
        state = f"no sweep holds the store; {_runs(counts['pending'])} not started"
    else:
        state = "no sweep holds the store; every planned run has a record"
    return (f"suite {meta.get('suite') or 'unknown'}, run {meta.get('run_id') or store.path.name}, "
            f"commit {commit_label(meta)}, started {started}: {state}")


def _runs(n: int) -> str:
    return f"{n} run" if n == 1 else f"{n} runs"


def failed_points(store_path: str | Path) -> list[str]:
    """Run ids (``p001``, ``p001.r2``) whose latest record is not ``ok`` (or that have no record)."""
    return [p.run_id for p, rec in suite_statuses(store_path) if rec is None or rec.get("status") != "ok"]


def invalid_points(store_path: str | Path) -> dict[str, str]:
    """Point id -> reason, for points whose latest record is ``invalid``: their config cannot run, so
    ``--rerun-failed`` records them invalid again; only a changed suite fixes them."""
    return {p.point_id: str(rec.get("error") or "no reason recorded")
            for p, rec in suite_statuses(store_path) if rec is not None and rec.get("status") == "invalid"}


def status_table(store_path: str | Path, live: dict[str, str] | None = None) -> str:
    """A header, then one line per planned run (point and repeat): id, state, axes, tokens/s per device,
    peak memory; then the counts of runs per state (and of points, with repeats).

    A run without a record is ``running`` (the newest log while a sweep holds the store's lock),
    ``interrupted`` (a log, but no sweep holds the lock: the sweep that started it was stopped),
    ``pending`` otherwise, or the Slurm state ``live`` gives it."""
    counts: dict[str, int] = {}
    statuses = suite_statuses(store_path)
    repeats = max(p.repeats for p, _ in statuses) if statuses else 1
    width = 5 if repeats == 1 else 9  # p000, or p000.r12
    lines = [f"{'run':<{width}}{'state':<11} axes, then {METRICS['tokens_per_s_per_device'].header}, peak, error"]
    store = Store(store_path)
    started = {p.run_id: store.log_path(p.run_id) for p, rec in statuses if not rec}
    started = {run: log.stat().st_mtime for run, log in started.items() if log.is_file()}
    # a run with a log and no record: the sweep's newest while a sweep holds the lock, else cut short
    sweeping = store.sweep_running()
    running = max(started, key=started.get) if started and sweeping else None
    for point, rec in statuses:
        state = rec["status"] if rec else (live or {}).get(point.run_id) or (
            "running" if point.run_id == running else "pending" if running or point.run_id not in started
            else "interrupted")
        counts[state] = counts.get(state, 0) + 1
        extra = "".join(f"  {part}" for part in metric_parts(rec)) if rec else ""
        if rec and state != "ok" and rec.get("error"):
            extra += f"  | {str(rec['error'])[:120]}"
        lines.append(f"{point.run_id:<{width}}{state:<11} {describe(point.values)}{extra}")
    lines.insert(0, _status_header(store, sweeping, counts))
    summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    if repeats > 1:
        n_points = len({p.point_id for p, _ in statuses})
        summary += f" (runs: {n_points} points x {repeats} repeats)"
    lines.append(summary)
    return "\n".join(lines)
