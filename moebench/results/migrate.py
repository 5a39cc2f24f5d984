"""Old records read as current ones: one upgrade step per schema version, applied where every store
line is parsed (:func:`moebench.results.lines.parse_store_line`), so no reader sees two shapes.

``schema_version`` (:data:`moebench.record.SCHEMA_VERSION`) goes up when a field's meaning changes,
or when readers need a field that older records cannot have. Each step ``_to_<n>`` takes a record
of version ``n - 1`` and returns it at version ``n``; :func:`upgrade` runs the steps in order. A
record without ``schema_version`` (point records written before every line carried one) is version
1. A record newer than this moebench is refused: reading it as an older shape would misread it.
docs/results-store.md says what each version changed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from moebench.errors import StoreError
from moebench.record import SCHEMA_VERSION


class NewerRecord(StoreError):
    """A record written by a newer moebench than this one (its ``schema_version`` is past ours)."""


# Version 2 (the time limits of 786df9b and the work counts of bd58902): a ``timeout`` is a run past
# its limit in fair-share seconds, and the record says that limit and the load it ran under; every
# run counts its first step's work. A version 1 record has none of these: its limit was wall seconds
# and is not recorded, its load was not read, its work not counted. They read as None ("not
# recorded"), as does an adaptive warm-up's drift in records written before it.
V2_FIELDS = ("time_limit_s", "point_share_s", "cores", "load_start", "load_mean", "work_per_step",
             "window_drift", "window_drifting")


def _to_2(record: dict[str, Any]) -> dict[str, Any]:
    return {**record, **{name: None for name in V2_FIELDS if name not in record}, "schema_version": 2}


# Step to version n is _STEPS[n]; a new version adds its step here and bumps SCHEMA_VERSION.
_STEPS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {2: _to_2}


def record_version(record: dict[str, Any]) -> int:
    """The record's ``schema_version`` (1 where it has none); ValueError when it is not a positive integer."""
    version = record.get("schema_version", 1)
    if version is None:
        return 1
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ValueError(f"field 'schema_version' must be a positive integer, got {repr(version)[:60]}")
    return version


def upgrade(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` at :data:`SCHEMA_VERSION`: each step from its version on applied in order (a new dict
    where any step ran; the record itself when it is current). :class:`NewerRecord` when it is newer."""
    version = record_version(record)
    if version > SCHEMA_VERSION:
        raise NewerRecord(f"record schema_version {version} is newer than this moebench reads "
                          f"({SCHEMA_VERSION}): read it with the moebench that wrote it, or a later one")
    for step in range(version + 1, SCHEMA_VERSION + 1):
        record = _STEPS[step](record)
    return record
