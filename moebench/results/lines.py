"""One line of records.jsonl: a point record at the current schema version, or what is wrong with the
line (cut short by a crash, zero-filled, corrupt, not a record, a field of the wrong type). Every store
line is read here: records.jsonl, side files, Slurm's pending records."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from moebench.errors import StoreError
from moebench.results import reader
from moebench.results.migrate import upgrade

# Record fields that readers flatten or index into, and their JSON type (null is allowed for each).
RECORD_TYPES: dict[str, tuple[type | tuple[type, ...], str]] = {
    "config": (dict, "object"), "point": (dict, "object"), "layout": (dict, "object"),
    "comm_bytes_per_step": (dict, "object"), "memory_parts_bytes": (dict, "object"),
    "point_id": (str, "string"), "nproc": (int, "integer"),
}
# A point id names files (logs/<id>.log, pending/<id>-...json): a name, never a path.
POINT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+=-]{0,127}")


def parse_store_line(raw: bytes) -> tuple[Any, str | None]:
    """One line of records.jsonl: (record, None), the record upgraded to the current schema
    (:func:`moebench.results.migrate.upgrade`), or (None, what is wrong with it). A record newer than
    this moebench raises :class:`moebench.results.migrate.NewerRecord`: it is not damage."""
    body = raw.rstrip(b"\n")
    if body and not body.strip(b"\x00"):  # a file extended by a crash or a full disk, never written
        return None, f"zero-filled line ({len(body)} NUL bytes where no record was written)"
    try:
        record = reader.parse_json(raw)
    except reader.TooDeep as exc:
        return None, f"corrupt line ({exc})"
    except ValueError as exc:
        return None, f"{'truncated' if _cut_short(raw) else 'corrupt'} line ({exc})"
    if not isinstance(record, dict) or "key" not in record or "status" not in record:
        return None, "line is not a point record (needs 'key' and 'status')"
    for name in ("key", "status"):
        if not isinstance(record[name], str) or not record[name]:
            return None, f"field {name!r} must be a non-empty string, got {repr(record[name])[:60]}"
    for name, (kind, json_name) in RECORD_TYPES.items():
        value = record.get(name)
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
            return None, f"field {name!r} must be a JSON {json_name}, got {repr(value)[:60]}"
    point_id = record.get("point_id")
    if point_id is not None and (not POINT_ID.fullmatch(point_id) or ".." in point_id):
        return None, f"field 'point_id' must be a name (letters, digits, . _ + = -), got {point_id[:60]!r}"
    try:
        return upgrade(record), None
    except ValueError as exc:
        return None, str(exc)


# Text that finishes whatever token a cut line stops in: a string (plain, after a backslash, inside
# a \uXXXX escape), a number (after "-", "." or "e") or a literal (true, false, null).
_LITERAL_TAILS = dict.fromkeys(word[i:] for word in ("true", "false", "null") for i in range(1, len(word)))
_COMPLETIONS = ("", '"', 'n"', '0000"', "0", *_LITERAL_TAILS)


def _cut_short(raw: bytes) -> bool:
    """Whether a line that does not parse is the beginning of one that would.

    A line without its newline was cut (``append_line`` writes line and newline at once). One
    with it may have been cut too: the writer that resumes a store ends a partial line. It was
    cut when the parser only fails for lack of text: some completion carries it past the end.
    """
    if not raw.endswith(b"\n"):
        return True
    try:
        text = raw.decode().rstrip()
    except UnicodeDecodeError:
        return False  # records are ASCII (to_json_line escapes the rest): a cut cannot make this
    for completion in _COMPLETIONS:
        try:
            json.loads(text + completion)
        except json.JSONDecodeError as exc:
            if exc.pos >= len(text):
                return True
        except RecursionError:  # nested past what the parser takes: refused for that, cut or not
            return False
        else:
            return True
    return False


def read_record_file(path: Path) -> tuple[Any, str | None] | None:
    """A side file's record (a Slurm task's pending record, one kept when records.jsonl could not take it) as
    :func:`parse_store_line` gives it, or (None, why) when it cannot be read; None when it is gone (merged
    meanwhile by another reader)."""
    try:
        return parse_store_line(reader.read_bytes(path))
    except FileNotFoundError:
        return None
    except StoreError as exc:
        return None, str(exc)
