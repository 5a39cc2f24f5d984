"""Slurm submission: one job-array task per point, followed until done, merged into the store.

The generated script (``<store>/slurm/sweep.sbatch``) is meant to be read: ``#SBATCH``
options, a task-index -> point table, and one ``moebench.sweep.worker`` call. Each task
runs its point exactly as a local sweep does (own process group, timeout) and drops its
record into ``<store>/pending/``; the sweep that submitted the job holds the store lock and
moves those records into ``records.jsonl`` as they arrive (any later ``moebench run`` on the
store merges what is left; ``moebench status`` shows them without moving them).

Quoting: ``#SBATCH`` lines are parsed by sbatch, not a shell, so their values are
restricted to a safe character set; every value in the script body goes through
:func:`shlex.quote`. No user-supplied value reaches a shell unquoted.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moebench.errors import ConfigError, LaunchError, StoreError
from moebench.record import to_json_line
from moebench.sweep.launch import LOG_TAIL_CHARS, point_record, read_tail
from moebench.sweep.store import Store, write_text_atomic
from moebench.sweep.suite import Point

PENDING_DIR = "pending"
SLURM_DIR = "slurm"
_SAFE = re.compile(r"[A-Za-z0-9_.,:=@%+/-]+")  # matched in full, like the two below
_EXTRA = re.compile(r"--?[A-Za-z][A-Za-z0-9-]*(=[A-Za-z0-9_.,:=@%+/-]+)?")
_TIME = re.compile(r"(\d+-)?\d+(:\d+){0,2}|INFINITE|UNLIMITED")  # the forms sbatch --time accepts
MAX_NODES = 2**32 - 3  # NO_VAL (2^32 - 2) and INFINITE (2^32 - 1) are markers
MAX_CPUS_PER_TASK = 2**16 - 3  # NO_VAL16 and INFINITE16 likewise
ACTIVE_STATES = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED"}


@dataclass
class SlurmOptions:
    partition: str | None = None
    account: str | None = None
    time: str | None = None  # Slurm time format; default: the point timeout plus 5 minutes
    nodes: int = 1
    gpus_per_node: int | None = None
    cpus_per_task: int | None = None
    extra: list[str] = field(default_factory=list)
    poll_s: float = 5.0


def _safe(option: str, value: Any) -> str:
    text = str(value)
    if not _SAFE.fullmatch(text):
        raise ConfigError(
            f"--{option} {text!r}: only letters, digits and _.,:=@%+/- are allowed in #SBATCH values"
        )
    return text


def ranks_per_node(point: Point, nodes: int) -> int:
    """How many of ``point``'s ranks each of ``nodes`` nodes runs (every node runs as many)."""
    nproc = int(point.nproc or 1)
    if nodes > nproc:
        raise ConfigError(f"--nodes {nodes}: point {point.point_id} has only {nproc} rank(s), fewer than the nodes")
    if nproc % nodes:
        raise ConfigError(f"--nodes {nodes}: point {point.point_id} has {nproc} ranks, "
                          f"which do not split evenly over {nodes} nodes")
    return nproc // nodes


def sbatch_options(opts: SlurmOptions, store: Store, suite_name: str, points: list[Point]) -> list[str]:
    """The ``#SBATCH`` option list of a job array running ``points`` (validated: no whitespace,
    quotes or shell syntax; node, CPU and GPU counts that sbatch and every task accept)."""
    if opts.nodes < 1:
        raise ConfigError(f"--nodes {opts.nodes}: must be >= 1")
    for point in points:
        ranks_per_node(point, opts.nodes)
    # Slurm's job request holds node and CPU counts in 32- and 16-bit fields whose top values mean
    # "not set"; a GPU count above what any node has is refused by the controller (see sbatch_accepts)
    for name, value, least, most in [("nodes", opts.nodes, 1, MAX_NODES),
                                     ("cpus-per-task", opts.cpus_per_task, 1, MAX_CPUS_PER_TASK),
                                     ("gpus-per-node", opts.gpus_per_node, 0, MAX_CPUS_PER_TASK)]:
        if value is not None and not least <= value <= most:
            raise ConfigError(f"--{name} {value}: must be in [{least}, {most}]")
    if opts.time is not None and not _TIME.fullmatch(str(opts.time)):
        raise ConfigError(f"--time {str(opts.time)!r}: expected a Slurm time limit: MINUTES, MINUTES:SECONDS, "
                          "HOURS:MINUTES:SECONDS, DAYS-HOURS, DAYS-HOURS:MINUTES or DAYS-HOURS:MINUTES:SECONDS")
    minutes = math.ceil(max(p.timeout_s for p in points) / 60) + 5
    lines = [
        f"--job-name={_safe('job-name', f'moebench-{suite_name}')}",
        f"--array=0-{len(points) - 1}",
        f"--output={_safe('out', store.path.resolve() / SLURM_DIR)}/task-%A_%a.out",
        f"--nodes={opts.nodes}",
        "--ntasks-per-node=1",
        # a task whose node fails ends (NODE_FAIL) and is recorded failed, for --rerun-failed;
        # requeued, it would rerun unseen, or wait forever for a node that is gone
        "--no-requeue",
        f"--time={opts.time or minutes}",
    ]
    for name, value in [("partition", opts.partition), ("account", opts.account),
                        ("gpus-per-node", opts.gpus_per_node), ("cpus-per-task", opts.cpus_per_task)]:
        if value is not None:
            lines.append(f"--{name}={_safe(name, value)}")
    for item in opts.extra:
        if not _EXTRA.fullmatch(item):
            raise ConfigError(f"--extra {item!r}: expected one sbatch option like --qos=high (no spaces or quotes)")
        lines.append(item)
    return lines


def check_options(opts: SlurmOptions, store: Store, suite_name: str, points: list[Point]) -> None:
    """Refuse what sbatch, a task or the polling loop would trip over; the sweep calls this before it
    writes anything, so a typo in an option leaves no half-made store behind."""
    if not 0 < opts.poll_s < math.inf:
        raise ConfigError(f"--poll {opts.poll_s}: must be a number of seconds > 0")
    sbatch_accepts(render_script(store, suite_name, points, opts))


def sbatch_accepts(script: str) -> None:
    """Ask sbatch whether it would take ``script`` (``--test-only``: the controller checks the counts
    against its nodes and limits, nothing is queued); a refusal is a ConfigError. Without sbatch on
    PATH the submission itself would fail, so that is refused too."""
    try:
        out = subprocess.run(["sbatch", "--test-only"], input=script, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise ConfigError("--slurm: no sbatch on PATH (is this a Slurm login node?)") from None
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LaunchError(f"sbatch --test-only failed: {exc}") from None
    if out.returncode != 0:
        why = (out.stderr.strip() or out.stdout.strip() or f"exit code {out.returncode}").splitlines()[-1]
        raise ConfigError(f"--slurm: sbatch refuses the job array: {why}")


def render_script(store: Store, suite_name: str, points: list[Point], opts: SlurmOptions) -> str:
    """A readable sbatch job-array script: task i runs ``points[i]``."""
    options = sbatch_options(opts, store, suite_name, points)
    table = "\n".join(f"#   task {i:<3} {p.point_id}  nproc={p.nproc}  {shlex.join(p.train_args())}"
                      for i, p in enumerate(points))
    ids = " ".join(shlex.quote(p.point_id) for p in points)
    worker = shlex.join([sys.executable, "-m", "moebench.sweep.worker", str(store.path.resolve())])
    return "\n".join([
        "#!/bin/bash",
        f"# moebench sweep {shlex.quote(suite_name)}: one array task per point; each task writes its record to",
        f"# {shlex.quote(str(store.path.resolve() / PENDING_DIR))}/ and the submitting sweep merges it.",
        *(f"#SBATCH {line}" for line in options),
        "#",
        "# Points:",
        table,
        "set -euo pipefail",
        f"POINTS=({ids})",
        'POINT="${POINTS[$SLURM_ARRAY_TASK_ID]}"',
        f"cd {shlex.quote(os.getcwd())}",
        f'exec {worker} "$POINT"',
        "",
    ])


def submit(script: Path) -> str:
    try:
        out = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LaunchError(f"sbatch failed: {exc}") from None
    if out.returncode != 0:
        raise LaunchError(f"sbatch rejected {script}: {out.stderr.strip() or out.stdout.strip()}")
    return out.stdout.strip().split(";")[0]


def queue_states(job_id: str) -> dict[int, str] | None:
    """Array index -> state of the job's tasks still known to squeue, finished ones included
    (``NODE_FAIL``, ``CANCELLED``...: slurmctld keeps them for MinJobAge; None if squeue failed)."""
    try:
        out = subprocess.run(["squeue", "-h", "-r", "-t", "all", "-j", job_id, "-o", "%i %T"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        # squeue forgets finished jobs: "Invalid job id specified" means nothing is left
        return {} if "Invalid job id" in out.stderr else None
    states: dict[int, str] = {}
    for line in out.stdout.splitlines():
        task, _, state = line.strip().partition(" ")
        _, _, index = task.partition("_")
        if index.isdigit():
            states[int(index)] = state
        elif index.startswith("["):  # a pending range like 123_[0-3]: expand it
            for part in index.strip("[]").split("%")[0].split(","):
                lo, _, hi = part.partition("-")
                for i in range(int(lo), int(hi or lo) + 1):
                    states[i] = state
    return states


def _pending(store: Store) -> list[tuple[Path, dict[str, Any]]]:
    """Finished task records waiting in pending/, in file-name order, with their files."""
    found = []
    folder = store.path / PENDING_DIR
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            record = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue  # written by rename, so unreadable means not ours; leave it for a human
        if isinstance(record, dict) and isinstance(record.get("key"), str) and isinstance(record.get("status"), str):
            found.append((path, record))
    return found


def pending_records(store: Store) -> list[dict[str, Any]]:
    """Finished task records not merged yet, read without touching the store (``moebench status``)."""
    return [record for _, record in _pending(store)]


def merge_pending(store: Store) -> list[dict[str, Any]]:
    """Move finished task records from pending/ into records.jsonl (caller holds the lock)."""
    merged = []
    for path, record in _pending(store):
        store.append(record)
        path.unlink()
        merged.append(record)
    return merged


def submit_and_follow(store: Store, points: list[Point], opts: SlurmOptions, progress: Any) -> None:
    """Submit ``points`` as one job array, then merge records as tasks finish."""
    if not points:
        return
    (store.path / SLURM_DIR).mkdir(parents=True, exist_ok=True)
    (store.path / PENDING_DIR).mkdir(parents=True, exist_ok=True)
    suite = store.read_meta()["suite"]
    script = store.path / SLURM_DIR / "sweep.sbatch"
    script.write_text(render_script(store, suite, points, opts))
    job_id = submit(script)
    store.update_meta(slurm={"job_id": job_id, "script": str(script),
                             "tasks": {str(i): p.point_id for i, p in enumerate(points)}})
    remaining = {p.point_id for p in points}

    def collect() -> None:
        for record in merge_pending(store):
            if record.get("point_id") in remaining:  # a stray record of an older job is merged, not counted
                remaining.discard(record["point_id"])
                progress.finished(record)

    def fail_unrecorded(indices: list[int], states: dict[int, str]) -> None:
        for i in indices:
            point = points[i]
            if point.point_id in remaining:
                record = _ended_without_record(store, point, job_id, i, states.get(i))
                store.append(record)
                progress.finished(record)
                remaining.discard(point.point_id)

    failures = 0
    ended_before: set[int] = set()
    try:
        while remaining:
            collect()
            if not remaining:
                break
            states = queue_states(job_id)
            if states is None:
                failures += 1
                if failures > 20:
                    raise LaunchError(f"squeue keeps failing for job {job_id}; the job may still be running")
                time.sleep(opts.poll_s)
                continue
            failures = 0
            ended = {i for i, s in states.items() if i < len(points) and s not in ACTIVE_STATES}
            if not states:  # the whole array has left squeue (after MinJobAge): no state to report
                time.sleep(1.0)
                collect()
                fail_unrecorded(list(range(len(points))), states)
                break
            # a task writes its record before it ends; one more poll lets a record written on
            # another node reach this one through a shared file system
            collect()
            fail_unrecorded(sorted(ended & ended_before), states)
            ended_before = ended
            running = sum(s == "RUNNING" for i, s in states.items() if i < len(points))
            progress.bar.set_postfix_str(f"job {job_id}: {running} running, {len(remaining)} left")
            if remaining:
                time.sleep(opts.poll_s)
    except KeyboardInterrupt:
        # a missing or hung scancel must not replace the interrupt the caller unwinds with
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
        raise


def idle_nodes() -> list[str] | None:
    """Names of the cluster's nodes that can take a job now (idle or partly used), or None
    when there is no usable Slurm (no ``sinfo``, or it fails)."""
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    up = {"idle", "mixed", "allocated"}
    return sorted({name for name, _, state in (line.partition(" ") for line in out.stdout.splitlines())
                   if state.strip() in up})


def _ended_without_record(store: Store, point: Point, job_id: str, index: int,
                          state: str | None) -> dict[str, Any]:
    """The record of a task that ended without writing one (node failure, scancel, Slurm time
    limit...): its Slurm state, and the tails of the task's Slurm output and of the point's log."""
    task = f"{job_id}_{index}"
    status = {"TIMEOUT": "timeout", "OUT_OF_MEMORY": "oom"}.get(state or "", "failed")
    half = LOG_TAIL_CHARS // 2
    tail = (read_tail(store.path / SLURM_DIR / f"task-{task}.out", half)
            + read_tail(store.log_path(point.point_id), half))
    why = f"ended {state}" if state else "left the queue"
    record = point_record(point, status, f"Slurm task {task} {why} without a record", log_tail=tail)
    record.update(slurm_job_id=job_id, slurm_task_id=str(index), slurm_state=state)
    return record


def live_states(store_path: str | Path) -> dict[str, str]:
    """Point id -> Slurm state (pending/running) for points of the store's job still queued."""
    store = Store(store_path)
    slurm = store.read_meta().get("slurm")
    if not slurm:
        return {}
    if not isinstance(slurm.get("job_id"), str) or not isinstance(slurm.get("tasks"), dict):
        raise StoreError(f"{store.meta_path}: field 'slurm' needs a job_id and a tasks mapping, got {repr(slurm)[:60]}")
    states = queue_states(slurm["job_id"]) or {}
    return {slurm["tasks"][str(i)]: s.lower() for i, s in states.items()
            if str(i) in slurm["tasks"] and s in ACTIVE_STATES}


def write_pending(store: Store, record: dict[str, Any]) -> Path:
    path = store.path / PENDING_DIR / f"{record['point_id']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, to_json_line(record) + "\n")
    return path
