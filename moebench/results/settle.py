"""Records as every reader takes them: which run of which point a record is, an ok record with a
NaN loss read as diverged, and a warning where the file says something no sweep writes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moebench.record import settled_status


def run_key(record: dict[str, Any]) -> tuple[str, int]:
    """Which run of which point a record is: its point key and repeat (0 in a store written before
    repeats, whose records have no ``repeat``)."""
    return record["key"], int(record.get("repeat") or 0)


def settle_records(records: list[dict[str, Any]], path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Records as every reader takes them, and a warning for each that the file does not say as
    it is read: an ok record with a NaN loss (read as diverged), an ok point recorded not ok later."""
    warnings: list[str] = []
    settled = [_settle(r, path, warnings) for r in records]
    return settled, warnings + _superseded_ok(settled, path)


def _superseded_ok(records: list[dict[str, Any]], path: Path) -> list[str]:
    """A run (point and repeat) that was ok and has a later record that is not: no sweep reruns an
    ok run, so the store was edited or merged by hand; the later record is shown, and this says so."""
    ok: set[tuple[str, int]] = set()
    out = []
    for r in records:
        run = run_key(r)
        if r["status"] == "ok":
            ok.add(run)
        elif run in ok:
            repeat = f" (repeat {run[1]})" if run[1] else ""
            out.append(f"{path}: {r.get('point_id', r['key'])}{repeat} has a {r['status']} record after an ok one "
                       "(no sweep reruns an ok run): the later one is shown")
            ok.discard(run)
    return out


def _settle(record: dict[str, Any], path: Path, warnings: list[str]) -> dict[str, Any]:
    """An ``ok`` record whose loss is NaN, infinite or missing (written before such runs were
    ``diverged``, or edited) is read as ``diverged``, with a warning, so no reader counts it ok."""
    status, why = settled_status(record["status"], record, record.get("error"))
    if status == record["status"]:
        return record
    warnings.append(f"{path}: {record.get('point_id', record['key'])} is recorded ok but its {why}: read as diverged")
    return {**record, "status": status, "error": why}

