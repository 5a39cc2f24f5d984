"""Run one point and turn its end into a store record.

The point runs as ``python -m moebench.cli train ... --json``, an isolated process tree
(:func:`moebench.launch.tree.run_process`: its own session, stopped as a whole on timeout or
interrupt). The last stdout line is the run record; everything the process prints goes to the
point's log.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from moebench.launch.failure import (
    OOM_PATTERN,
    RANK_LOGS_ENV,
    error_line,
    rank_tails,
    read_failure,
    read_tail,
)
from moebench.launch.procs import SAFE_PATH_ENV
from moebench.launch.tree import Outcome, run_process
from moebench.metrics import CPU_PEAK_FILE_ENV, TRACE_DIR_ENV
from moebench.record import SCHEMA_VERSION, layout_of, settled_status
from moebench.results.store import Store, now_iso
from moebench.results.store_record import Share, StoreRecord
from moebench.sweep.suite import Point

LOG_TAIL_CHARS = 4000
# Every local point's processes carry this (the store's path) in their environment: a later run of
# the store finds any that outlived their sweep (moebench.sweep.runner.stop_leftovers).
STORE_MARKER_ENV = "MOEBENCH_SWEEP_STORE"


def parse_record(line: str | None) -> dict[str, Any] | None:
    if not line:
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) and "status" in record else None


def classify(
    outcome: Outcome, record: dict[str, Any] | None, log_tail: str, timeout_s: float,
    failure: dict[str, Any] | None = None,
) -> tuple[str, str | None]:
    """(status, one-line error) of a finished point. ``failure``: the leader's word on which rank
    failed first and why (:func:`moebench.launch.failure.read_failure`), for multi-rank points."""
    if outcome.timed_out:
        clock = outcome.clock
        seen = f", {clock.describe()}" if clock is not None else ""
        unit = clock.unit if clock is not None else "s of a fair share of the machine"
        return "timeout", (f"exceeded its time limit of {timeout_s:g} {unit}{seen} "
                           f"(the limit: the suite's `timeout` key, or --timeout)")
    if record is not None and (outcome.returncode == 0 or outcome.interrupted):
        # interrupted: the run had finished and printed its record, only the exit was cut short
        return settled_status(str(record["status"]), record, record.get("error"))
    if record is not None and record.get("status") not in (None, "ok"):
        return str(record["status"]), record.get("error")
    if failure is not None:
        return ("oom" if failure.get("oom") else "failed"), failure["error"]
    if OOM_PATTERN.search(log_tail):
        return "oom", error_line(log_tail, OOM_PATTERN) or "out of memory"
    if outcome.returncode == -signal.SIGKILL:
        return "oom", "killed by SIGKILL from outside the sweep (most likely the kernel OOM killer)"
    rc = outcome.returncode
    why = f"exit code {rc}" if rc is not None and rc >= 0 else f"killed by signal {-(rc or 0)}"
    if record is None and rc == 0:
        why = "exited 0 without a JSON run record on its last stdout line"
    detail = error_line(log_tail)
    return "failed", f"{why}: {detail}" if detail else why


def point_record(point: Point, status: str, error: str | None, run_record: dict[str, Any] | None = None,
                 log_tail: str = "", wall_s: float | None = None,
                 rank_tails: dict[str, str] | None = None, outcome: Outcome | None = None,
                 limit_s: float | None = None) -> dict[str, Any]:
    """The store line of a point (:class:`moebench.results.store_record.StoreRecord`): the run record
    (or what the config alone tells) + point fields.

    With the ``outcome`` of its process: the time limit it ran under and the machine's load while it ran
    (:class:`moebench.launch.share.ShareClock`), so a slow or timed-out run says whether the machine was busy."""
    cfg = point.config
    from_config: dict[str, Any] = {}
    if cfg is not None:
        from_config = {"config": cfg.to_dict(), "config_hash": cfg.hash(), "world_size": point.nproc,
                       "layout": layout_of(cfg.parallel), **cfg.cost_summary()}
    clock = outcome.clock if outcome is not None else None
    share = None if clock is None else Share(time_limit_s=limit_s, point_share_s=round(clock.elapsed, 3),
                                             cores=clock.n_cores, load_start=clock.load_start,
                                             load_mean=clock.load_mean)
    return StoreRecord(
        run=dict(run_record or {"schema_version": SCHEMA_VERSION, "preset": point.preset}), from_config=from_config,
        point_id=point.point_id, key=point.key, repeat=point.repeat, repeats=point.repeats, point=point.values,
        nproc=point.nproc, status=status, error=error, finished_at=now_iso(), point_wall_s=wall_s,
        hostname=socket.gethostname(), share=share, log_tail=log_tail if status != "ok" else None,
        rank_tails=rank_tails if status != "ok" and rank_tails else None,
    ).to_dict()


def train_argv(point: Point) -> list[str]:
    return [sys.executable, "-m", "moebench.cli", "train", *point.train_args()]


def point_env(store: Store) -> dict[str, str]:
    """What every point of a store runs with: one CPU peak per sweep run, so MFU compares across points;
    the current directory off the import path (``SAFE_PATH_ENV``)."""
    return {CPU_PEAK_FILE_ENV: str(store.path / "cpu_peak"), **SAFE_PATH_ENV}


def rank_log_dir(log_path: Path) -> Path:
    """Where a point's ranks leave their logs and the leader its failure summary: ``logs/<point>.ranks/``."""
    return log_path.with_suffix(".ranks")


def store_relative(files: list[str], log_path: Path) -> list[str]:
    """The trainer's trace paths relative to the store folder (``logs/<point>.ranks/rank<N>.trace.json.gz``),
    so that they survive moving the store; a path outside it stays as it is."""
    root = log_path.parent.parent.absolute()
    out = []
    for f in files:
        path = Path(f)
        out.append(path.relative_to(root).as_posix() if path.is_relative_to(root) else f)
    return out


def run_point(point: Point, log_path: Path, env: dict[str, str] | None = None,
              launcher: Callable[[Point], list[str]] | None = None,
              stop: threading.Event | None = None, limit_s: float | None = None,
              fair_share: bool = True) -> dict[str, Any] | None:
    """Run one valid point to completion (or timeout) and return its store record.

    ``limit_s`` (fair-share seconds, default the point's ``timeout_s``) is its time limit: see
    :func:`time_limit` for the one a sweep gives a run; ``fair_share=False`` counts it in wall seconds
    (a Slurm task, whose allocation is its own and whose ``--time`` is a wall limit).

    ``launcher`` maps a point to its command line (default: ``moebench train``); tests swap in
    a scripted trainer. ``stop`` set (the sweep was interrupted) stops the point; it returns None
    then, unless the run had already printed its record.
    """
    if not point.valid:
        return point_record(point, "invalid", point.error)
    ranks = rank_log_dir(log_path)
    shutil.rmtree(ranks, ignore_errors=True)  # an earlier attempt's failure is not this one's
    run_env = {**os.environ, "PYTHONUNBUFFERED": "1", RANK_LOGS_ENV: str(ranks), TRACE_DIR_ENV: str(ranks),
               **(env or {})}
    argv = (launcher or train_argv)(point)
    try:
        limit_s = point.timeout_s if limit_s is None else limit_s
        outcome = run_process(argv, log_path, limit_s, env=run_env, stop=stop, fair_share=fair_share)
    except OSError as exc:
        # the command could not start (no python, a full disk for its log): the machine's fault, not
        # the point's; the sweep goes on, and --resume runs the point again
        return point_record(point, "env_failed", f"could not start {argv[0]}: {exc}")
    record = parse_record(outcome.last_stdout_line)
    if outcome.interrupted and record is None:
        return None
    if record is not None and record.get("trace_files"):
        record["trace_files"] = store_relative(record["trace_files"], log_path)
    tail = read_tail(log_path, LOG_TAIL_CHARS)
    status, error = classify(outcome, record, tail, limit_s, read_failure(ranks))
    return point_record(point, status, error, record, tail, outcome.wall_s, rank_tails(ranks), outcome, limit_s)


# A run may take this many times the longest finished run of its point (in fair-share seconds)
# before it is stopped, where that is longer than the suite's timeout: the repeats of one point do
# the same work, so three times the slowest of them is a hang, not a slow machine.
REPEAT_MARGIN = 3.0


def time_limit(point: Point, earlier: list[dict[str, Any]]) -> float:
    """A run's time limit in fair-share seconds: the suite's ``timeout`` (``point.timeout_s``), or
    :data:`REPEAT_MARGIN` x the longest of ``earlier`` records of the same point that finished ok."""
    done = [r.get("point_share_s") for r in earlier if r.get("status") == "ok"]
    done = [float(s) for s in done if isinstance(s, (int, float)) and not isinstance(s, bool) and s > 0]
    return max([point.timeout_s, *(REPEAT_MARGIN * s for s in done)])


T = TypeVar("T")


def with_one_retry(items: Sequence[T], run_one: Callable[[T, tuple[int, int] | None], dict[str, Any] | None],
                   announce: Callable[[list[T]], None]) -> None:
    """Run every item in order, then once more each whose run timed out, after ``announce`` says which: a
    burst of load must not cost a point its run. ``run_one(item, retry)`` runs and records one item and returns
    its record (None: stopped before it finished); ``retry`` is None in the first pass, ``(j, n)`` for the
    j-th of n runs tried again. The loop of ``moebench run`` and of ``check --against``."""
    timed_out = []
    for item in items:
        record = run_one(item, None)
        if record is not None and record.get("status") == "timeout":
            timed_out.append(item)
    if timed_out:
        announce(timed_out)
        for j, item in enumerate(timed_out, 1):
            run_one(item, (j, len(timed_out)))
