"""``build_report``: results stores in, ``report.html`` + ``report.md`` + CSV + SVG plots out."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from moebench.errors import ConfigError, StoreError
from moebench.report.claims import claim_rows
from moebench.report.completeness import run_statuses
from moebench.report.device import device_classes, machine_of
from moebench.report.headline import inconclusive_warnings
from moebench.report.planned import gpu_points, plan_rows
from moebench.report.reproduce import report_command, run_command
from moebench.report.runs import environment_notes, run_deltas
from moebench.report.trace import PointTraces, overlap, read_traces
from moebench.results import reader
from moebench.results.load import find_stores
from moebench.results.pairing import pair_with_baseline
from moebench.results.table import csv_table, emulation_warnings, load_tables, run_order

PathArg = str | os.PathLike


def per_repeat(repeats: pd.DataFrame, points: pd.DataFrame) -> pd.DataFrame:
    """The per-repeat table with each point's comparison columns (speedup, baseline, runs ...) on every repeat."""
    key = ["run_id", "point_id"]
    extra = [c for c in points.columns if c not in repeats.columns or c in ("runs", "run_spread")]
    shared = [c for c in extra if c not in key]
    left = repeats.drop(columns=[c for c in shared if c in repeats.columns])
    right = points[key + shared].astype({"run_id": object})
    out = left.astype({"run_id": object}).merge(right, on=key, how="left", sort=False)
    out.attrs = dict(points.attrs)
    return out


def machine_warnings(metas: Sequence[dict[str, Any]], what: str = "the loaded runs") -> list[str]:
    hosts = {((m.get("host") or {}).get("hostname"), machine_of(m)) for m in metas}
    if len(hosts) <= 1:
        return []
    listing = "; ".join(f"{h} ({hw})" for h, hw in sorted(hosts, key=str))
    return [f"{what} come from different machines: {listing}; absolute numbers are not comparable"]


def no_ok_warnings(table: pd.DataFrame) -> list[str]:
    """A store where no point finished ok still gets its report: it says so, and why each point failed."""
    if (table["status"] == "ok").any():
        return []
    counts = table["status"].map(str).value_counts()
    listing = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
    return [f"no point finished ok ({listing}): the report's 'Failed points' section says why each failed"]


def caption_for(metas: Sequence[dict[str, Any]], t: pd.DataFrame) -> str:
    """Every figure's caption: the device phrase of each loaded run (:mod:`moebench.report.device`),
    the commits and the suites."""
    commits = sorted({str((m.get("git") or {}).get("commit") or "unknown")[:10]
                      + ("+dirty" if (m.get("git") or {}).get("dirty") else "") for m in metas})
    suites = sorted({str(m.get("suite")) for m in metas})
    return f"device: {device_classes(metas, t)} | commit: {', '.join(commits)} | suite: {', '.join(suites)}"


def build_report(stores: PathArg | Sequence[PathArg], out_dir: PathArg, title: str | None = None,
                 warn: Callable[[str], None] | None = None) -> Path:
    """Write ``report.html``, ``report.md``, ``results.csv`` and ``plots/*.svg`` to ``out_dir``.

    ``stores`` are store folders, ``records.jsonl`` files or folders of stores. Unreadable
    lines (a sweep still running, a crash) are skipped and listed as warnings in the report,
    and passed to ``warn`` (the CLI prints them, so a skipped line is not only in the HTML).
    Returns the path of ``report.html``. The report is written into a fresh folder beside
    ``out_dir`` and renamed into place (replacing an earlier report whole).
    """
    if not os.fspath(out_dir).strip():
        raise ConfigError("-o '': an empty path names no folder (it would be the current one); name the report folder")
    paths = [stores] if isinstance(stores, (str, os.PathLike)) else list(stores)
    repeats, metas, warnings = load_tables(paths, strict=False)  # one row per run (point and repeat)
    found = [s for p in paths for s in find_stores(p)]  # one per meta, in the same order
    # the order tidy() gives the rows: suites by name, a suite's runs by their start (the Runs lines, captions)
    order = sorted(range(len(metas)), key=lambda i: run_order(metas[i]))
    metas = [metas[i] for i in order]
    found = [found[i] for i in order] if len(found) == len(metas) else found
    table = pair_with_baseline(repeats, metas)  # one row per point, its repeats folded
    warnings = (warnings + no_ok_warnings(table) + machine_warnings(metas) + emulation_warnings(table)
                + inconclusive_warnings(table) + environment_notes(table, metas))
    for warning in warnings if warn is not None else []:
        warn(warning)
    reproduce = [*(run_command(m, store) for m, store in zip(metas, found, strict=True)),
                 report_command(paths, out_dir, title)] if len(found) == len(metas) else []
    title = title or "moebench report: " + ", ".join(sorted({str(m.get("suite")) for m in metas}))
    caption = caption_for(metas, table)
    out = Path(out_dir)
    tmp = _fresh_folder(out)
    try:
        _write_report(tmp, out, found, repeats, table, metas, warnings, title, caption, warn, reproduce)
        _replace_folder(tmp, out)
    except OSError as exc:
        raise ConfigError(f"report folder {out}: cannot write the report ({exc.strerror or exc})") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out / "report.html"


REPORT_FILE = "report.html"


def _fresh_folder(out: Path) -> Path:
    """A new empty folder beside ``out`` to write the report in. ``out`` itself must be absent, empty
    or an earlier report (its report.html): a report never mixes with other files, nor deletes them."""
    try:
        if out.exists() or out.is_symlink():
            if not out.is_dir():
                raise ConfigError(f"report folder {out}: not a folder")
            entries = sorted(os.listdir(out))
            if entries and REPORT_FILE not in entries:
                shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
                raise ConfigError(f"report folder {out}: not empty and not an earlier report (it holds {shown}); "
                                  "choose another -o")
        out.mkdir(parents=True, exist_ok=True)  # the parents it needs; itself, empty, is replaced whole
        return _new_folder(out, "tmp")
    except OSError as exc:
        raise ConfigError(f"report folder {out}: cannot create it ({exc.strerror}: {exc.filename})") from None


def _replace_folder(tmp: Path, out: Path) -> None:
    """Put the finished report in place: an earlier one is renamed away first and removed after, so
    none of its plots stay, and two reports into one folder each land whole (the last one wins)."""
    old = _new_folder(out, "old")
    try:
        with contextlib.suppress(FileNotFoundError):  # a concurrent report moved it already
            os.rename(out, old / "report")
        os.rename(tmp, out)
    finally:
        shutil.rmtree(old, ignore_errors=True)


def _new_folder(out: Path, kind: str) -> Path:
    """An empty folder beside ``out`` (mode from the umask, as ``out``'s own would be)."""
    folder = out.absolute().parent / f".{out.name}.{kind}-{os.getpid()}-{secrets.token_hex(3)}"
    folder.mkdir()
    return folder


def _write_report(tmp: Path, out: Path, stores: list[Path], repeats: pd.DataFrame, table: pd.DataFrame,
                  metas: list[dict[str, Any]], warnings: list[str], title: str, caption: str,
                  warn: Callable[[str], None] | None, reproduce: list[str]) -> None:
    """Every file of the report into ``tmp`` (``repeats``: one row per run, ``table``: one per point);
    links to the points' logs are relative to ``out``."""
    # matplotlib loads only to draw: `moebench check` reads stores through load_tables without it
    from moebench.report.figure import svg_bytes
    from moebench.report.history import history_plots
    from moebench.report.plots import render_all
    from moebench.report.render import ReportPage, render_html, render_md
    from moebench.report.trace_timeline import timeline_figure

    (tmp / "plots").mkdir()
    figures: list[tuple[str, str, bytes]] = []
    notes: list[str] = []
    any_gpu = not gpu_points(table).empty
    for plot, fig in render_all(table, caption, history_plots(metas)):
        if isinstance(fig, str):
            if any_gpu or not plot.gpu_only:  # a CPU report does not list what only GPUs draw
                notes.append(f"{plot.title}: {fig}")
            continue
        svg = svg_bytes(fig)
        (tmp / "plots" / f"{plot.name}.svg").write_bytes(svg)
        figures.append((plot.title, plot.name, svg))
    plan = plan_rows(table)
    deltas = run_deltas(table, metas)
    csv_table(per_repeat(repeats, table)).to_csv(tmp / "results.csv", index=False)
    problems: list[str] = []
    runs = run_statuses(stores, metas, repeats, problems)
    for warning in problems if warn is not None else []:
        warn(warning)
    warnings += problems
    claims = claim_rows(stores, warnings)  # the verdicts `moebench claim` recorded in the stores
    logs = copy_logs(table, tmp)
    trace_problems: list[str] = []
    traces = copy_traces(table, tmp, trace_problems)
    for warning in trace_problems if warn is not None else []:
        warn(warning)
    warnings += trace_problems
    point_traces: list[PointTraces | None] = []
    for k, (label, found) in enumerate(zip(table["label"], traces, strict=True)):
        ranks = read_traces([tmp / rel for _, rel in found], warnings)
        if ranks is None:
            point_traces.append(None)
            continue
        fig = timeline_figure(ranks, f"{label}: trace of the profiled step")
        timeline = None
        if fig is not None:
            timeline = f"plots/trace-{k}.svg"
            (tmp / timeline).write_bytes(svg_bytes(fig))
        point_traces.append(PointTraces([overlap(events) for events in ranks], timeline))
    page = ReportPage(title, table, metas, figures, notes, warnings, caption, plan, deltas, runs,
                      [a + b for a, b in zip(logs, traces, strict=True)], point_traces, claims, reproduce)
    (tmp / "report.md").write_text(render_md(page))
    (tmp / REPORT_FILE).write_text(render_html(page))


def copy_logs(t: pd.DataFrame, tmp: Path) -> list[list[tuple[str, str]]]:
    """Per row, the logs its point left that exist: the point's log (``logs/<point>.log``) and each rank's
    (``logs/<point>.ranks/rank<N>.log``), copied to ``logs/<run-id>/`` in the report folder so that the
    links survive copying the folder. Returns (name, path relative to the report) per log."""
    out = []
    for store, run_id, point_id in zip(t.get("store", pd.Series([None] * len(t))), t.get("run_id", t["point_id"]),
                                       t["point_id"], strict=True):
        found: list[tuple[str, str]] = []
        if store is not None:
            logs = Path(str(store)) / "logs"
            ranks = sorted((logs / f"{point_id}.ranks").glob("rank*.log"),
                           key=lambda p: int("".join(ch for ch in p.stem if ch.isdigit()) or 0))
            for name, src in [("log", logs / f"{point_id}.log"), *((p.stem, p) for p in ranks)]:
                if src.is_file():
                    rel = Path("logs") / str(run_id) / (src.name if name == "log" else f"{point_id}.{src.name}")
                    (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(src, tmp / rel)
                    found.append((name, rel.as_posix()))
        out.append(found)
    return out


def copy_traces(t: pd.DataFrame, tmp: Path, problems: list[str]) -> list[list[tuple[str, str]]]:
    """Per row, the Chrome traces its record names (``trace_files``, relative to its store:
    ``logs/<point>.ranks/rank<N>.trace.json.gz``) that exist, copied beside its logs as
    ``logs/<run-id>/<point>.rank<N>.trace.json.gz``. Returns ``("rank<N> trace", path relative to
    the report)`` per trace, in rank order. A trace that is there but no regular file (a FIFO, a
    link to a device: copying either would block or never end) is left out with a line in ``problems``."""
    out = []
    stores = t.get("store", pd.Series([None] * len(t)))
    files = t.get("trace_files", pd.Series([None] * len(t)))
    for store, run_id, point_id, traces in zip(stores, t.get("run_id", t["point_id"]), t["point_id"], files,
                                               strict=True):
        found: list[tuple[str, str]] = []
        for rank, name in enumerate(traces if store is not None and isinstance(traces, list) else []):
            src = Path(str(store)) / str(name)
            try:
                regular = reader.regular_file(src) is not None
            except StoreError as exc:
                problems.append(f"{exc} (the trace of {point_id}, left out of the report)")
                continue
            if regular:
                rel = Path("logs") / str(run_id) / f"{point_id}.{src.name}"
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, tmp / rel)
                found.append((f"rank{rank} trace", rel.as_posix()))
        out.append(found)
    return out
