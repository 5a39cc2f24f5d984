"""A store is bound to its suite: a continued store's plan must be the suite's points.

``moebench run SUITE --out STORE --resume`` (or ``--rerun-failed``) compares the suite's points
with the plan the store holds (``points.json``), point by point through their keys (resolved
config, rank count, code version). A point the store has that the suite lacks (a changed config,
a removed axis value) is refused, naming the first such point and the first field that differs;
points the suite has that the store lacks are refused too unless ``--extend`` asks for them: they
are appended after the store's own, whose ids, values and records stay as they are.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import moebench
from moebench.config import Config
from moebench.errors import ConfigError, StoreError
from moebench.presets import load_config
from moebench.sweep.progress import describe
from moebench.sweep.suite import Point


def bind_plan(plan: list[dict[str, Any]], points: list[Point], extend: bool, where: str,
              store_version: str | None = None) -> list[Point]:
    """The points to continue a store with: its planned points (as planned, with the suite's timeout),
    then, with ``extend``, the suite's new points.

    ``plan`` is the store's ``points.json``, ``where`` names it in errors and ``store_version``
    is the moebench version the store was made by (``meta.json``), named when only it changed.
    """
    by_key: dict[str, Point] = {}
    for point in points:
        if not point.duplicate_of:
            by_key.setdefault(point.key, point)
    first_id: dict[str, str] = {}
    bound: list[Point] = []
    for i, old in enumerate(plan):
        point = by_key.get(old["key"])
        if point is None:
            raise StoreError(_changed(where, old, points, store_version, extend))
        twin = first_id.setdefault(old["key"], old["point_id"])
        duplicate = twin if twin != old["point_id"] else None
        # as planned but for the timeout, which says how the point runs, not what it measures
        bound.append(dataclasses.replace(
            point, index=i, values=old["values"], preset=old["preset"], overrides=old["overrides"],
            duplicate_of=duplicate, error=f"same resolved config as {duplicate}" if duplicate else point.error))
    new = [p for p in points if p.key not in first_id]
    if new and not extend:
        listed = "; ".join(f"{p.point_id} {describe(p.values)}" for p in new[:3]) + ("; ..." if len(new) > 3 else "")
        raise StoreError(f"{where}: the suite has {len(new)} point(s) this store does not plan ({listed}); "
                         "pass --extend to add them (the recorded points stay as they are), or start a new store")
    ids: dict[str, str] = {}  # the suite's id of a new point -> its id in the store
    for point in new:
        index = len(bound)
        ids[point.point_id] = f"p{index:03d}"
        bound.append(dataclasses.replace(point, index=index, duplicate_of=ids.get(point.duplicate_of or "")))
    return bound


def _changed(where: str, old: dict[str, Any], points: list[Point], store_version: str | None, extend: bool) -> str:
    """Why the store's point ``old`` is not among the suite's points, in one line."""
    same_id = next((p for p in points if p.point_id == old["point_id"]), None)
    if same_id is None:
        what = f"{old['point_id']} ({describe(old['values'])}) is not in the suite any more"
    else:
        what = f"{old['point_id']} ({describe(old['values'])}) changed: {first_difference(old, same_id, store_version)}"
    keep = ("--extend only adds points: the recorded ones must stay in the suite unchanged" if extend
            else "a store holds one suite")
    return f"{where}: the suite changed since this store was made: {what}; {keep}; start a new store (another --out)"


def first_difference(old: dict[str, Any], new: Point, store_version: str | None) -> str:
    """The first thing that differs between a planned point and the suite's point of the same id:
    its rank count, a config field (``moe.top_k 2 -> 4``), the preset or overrides of a point
    whose config does not resolve, or the moebench version that made the key."""
    if old["nproc"] != new.nproc:
        return f"nproc {old['nproc']} -> {new.nproc}"
    old_cfg = _resolved(old)
    if old_cfg is not None and new.config is not None:
        before, after = _fields(old_cfg), _fields(new.config)
        for name in [*before, *(k for k in after if k not in before)]:
            if before.get(name) != after.get(name):
                return f"{name} {before.get(name)!r} -> {after.get(name)!r}"
    if old["preset"] != new.preset:
        return f"preset {old['preset']!r} -> {new.preset!r}"
    before, after = old["overrides"], new.overrides
    for name in [*before, *(k for k in after if k not in before)]:
        if before.get(name) != after.get(name):
            return f"{name} {before.get(name)!r} -> {after.get(name)!r}"
    if old["values"] != new.values:
        return f"axis values {describe(old['values'])} -> {describe(new.values)}"
    return f"the same config under another moebench version ({store_version or 'unknown'} -> {moebench.__version__})"


def _fields(cfg: Config) -> dict[str, Any]:
    """``{section.field: value}``, the names ``--set`` and suites use (and ``preset``)."""
    out: dict[str, Any] = {}
    for section, fields in cfg.to_dict().items():
        out.update({f"{section}.{k}": v for k, v in fields.items()} if isinstance(fields, dict) else {section: fields})
    return out


def _resolved(entry: dict[str, Any]) -> Config | None:
    if entry.get("error") is not None:
        return None
    try:
        return load_config(entry["preset"], dict(entry["overrides"]))
    except ConfigError:
        return None

