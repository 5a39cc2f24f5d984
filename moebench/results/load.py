"""Finding stores under a path, and reading them into one pandas DataFrame (pandas imported on use)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, overload

from moebench.errors import StoreError
from moebench.results import reader
from moebench.results.settle import run_key, settle_records
from moebench.results.side_files import unsaved_warning
from moebench.results.store import CREATING_PREFIX, META_FILE, RECORDS_FILE, Store


def find_stores(path: str | os.PathLike[str]) -> list[Path]:
    """A store folder, a records.jsonl file, or a folder of stores (e.g. ``results/smoke``)."""
    p = Path(path)
    if not p.exists():
        raise StoreError(f"{p}: no such results store (the path does not exist)")
    if p.is_file() and p.name == RECORDS_FILE:
        return [p.parent]
    if reader.exists(p / META_FILE) or reader.exists(p / RECORDS_FILE):
        return [p]  # a damaged meta.json (a link to nothing, say) is named by whoever reads it
    if p.is_dir():
        # one entry per real store: a ``latest`` symlink and its target are the same store
        found: dict[Path, Path] = {}
        for meta in sorted(_metas_under(p), key=lambda m: (m.parent.is_symlink(), str(m))):
            found.setdefault(meta.parent.resolve(), meta.parent)
        if found:
            return sorted(found.values())
    raise StoreError(f"{p}: no results store here (expected {META_FILE} and {RECORDS_FILE})")


def _metas_under(folder: Path) -> list[Path]:
    """Every store's meta.json below ``folder``, symlinked folders not followed. A folder that vanishes
    or cannot be listed while walking (``/proc`` under ``report /``) is passed over, as are stores
    still being made (or a crashed creator's leftovers)."""
    metas = []
    for root, dirs, files in os.walk(folder):  # os.walk skips what it cannot list
        dirs[:] = [d for d in dirs if not d.startswith(CREATING_PREFIX)]
        if META_FILE in files:
            metas.append(Path(root) / META_FILE)
    return metas


PathArg = str | os.PathLike  # a store folder, a records.jsonl, or a folder of stores
Meta = dict[str, Any] | list[dict[str, Any]]


@overload
def load_results(
    paths: PathArg | Sequence[PathArg], strict: Literal[True] = ..., latest_only: bool = ...
) -> tuple[Any, Meta]: ...


@overload
def load_results(
    paths: PathArg | Sequence[PathArg], strict: Literal[False], latest_only: bool = ...
) -> tuple[Any, Meta, list[str]]: ...


def load_results(paths: PathArg | Sequence[PathArg], strict: bool = True, latest_only: bool = True):
    """Read one or more stores into a pandas DataFrame, one row per run (point and repeat).

    Returns ``(df, meta)`` with ``strict=True`` (an unreadable line raises StoreError naming
    file and line); ``(df, meta, warnings)`` with ``strict=False`` (unreadable lines are
    skipped and described in ``warnings``). ``meta`` is a dict for a single store and a list
    of dicts when several stores are read. Nested fields are flattened with dots
    (``config.moe.num_experts``, ``layout.strategy``, ``point.moe.num_experts``,
    ``comm_bytes_per_step.ep``); list fields (``step_times_s``, ``losses``) stay lists.
    Columns ``store`` and ``run_id`` say where each row came from; rows are in point order
    within each store, then repeat order (``repeat``: 0 in stores written before repeats). With
    ``latest_only`` a run (point and repeat) that was rerun appears once, with its last record.
    """
    import pandas as pd

    single = isinstance(paths, (str, os.PathLike))
    stores = [s for p in ([paths] if single else paths) for s in find_stores(p)]
    metas: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    warnings: list[str] = []
    for path in stores:
        store = Store(path)
        meta = store.read_meta()
        metas.append(meta)
        records, bad = store.read_records(strict=strict)
        warnings.extend(bad)
        unreadable: list[str] = []
        unsaved = store.unsaved_records(unreadable)
        warnings += unreadable  # even with strict: a side file is not yet the store's (status, report alike)
        if unsaved:
            # finished points whose append failed: theirs are the newest records of the store
            records += [r for _, r in unsaved]
            warnings.append(unsaved_warning(path, unsaved))
        records, settled = settle_records(records, path)
        warnings += settled
        if latest_only:
            records = list({run_key(r): r for r in records}.values())
        for r in records:
            rows.append({**r, "repeat": run_key(r)[1], "store": str(path), "run_id": meta.get("run_id")})
    if rows:
        # point order, not completion order (invalid points are recorded first, Slurm tasks end in any order)
        df = pd.json_normalize(rows, max_level=None)
        if "point_id" in df:
            df = df.sort_values(["store", "point_id", "repeat"], kind="stable",
                                na_position="last").reset_index(drop=True)
    else:
        df = pd.DataFrame(columns=["point_id", "key", "status"])
    df.attrs["warnings"] = warnings
    meta_out: Meta = metas[0] if single and len(metas) == 1 else metas
    if strict:
        return df, meta_out
    return df, meta_out, warnings

