"""Slurm submission: one job-array task per point, followed until done, merged into the store.

The generated script (``<store>/slurm/sweep.sbatch``) is meant to be read: ``#SBATCH``
options, a task-index -> point table, and one ``moebench.sweep.worker`` call. Each task
runs its point exactly as a local sweep does (own process group, timeout) and drops its
record into ``<store>/pending/``; the sweep that submitted the job holds the store lock and
moves those records into ``records.jsonl`` as they arrive (any later ``moebench run`` on the
store merges what is left; ``moebench status`` shows them without moving them).

Every submitted job is kept in meta.json (``slurm.jobs``: job id and, per task, the point id
and key), so a continued sweep follows the store's tasks that Slurm still has queued instead
of submitting their points again, and records are merged only when they match a task by
(job id, task id, point key), once per task: a requeued task does not record twice, and a
record of a job the store did not submit is set aside with a warning.

Quoting: ``#SBATCH`` lines are parsed by sbatch, not a shell, so their values are
restricted to a safe character set; every value in the script body goes through
:func:`shlex.quote`. No user-supplied value reaches a shell unquoted.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moebench.errors import ConfigError, LaunchError, StoreError
from moebench.record import to_json_line
from moebench.results.durable import write_text_atomic
from moebench.results.lines import read_record_file
from moebench.results.store import Store, now_iso
from moebench.sweep.launch import LOG_TAIL_CHARS, point_record, read_tail
from moebench.sweep.suite import Point

PENDING_DIR = "pending"
SLURM_DIR = "slurm"
_SAFE = re.compile(r"[A-Za-z0-9_.,:=@%+/-]+")  # matched in full, like the two below
_EXTRA = re.compile(r"--?[A-Za-z][A-Za-z0-9-]*(=[A-Za-z0-9_.,:=@%+/-]+)?")
_TIME = re.compile(r"(\d+-)?\d+(:\d+){0,2}|INFINITE|UNLIMITED")  # the forms sbatch --time accepts
MAX_NODES = 2**32 - 3  # NO_VAL (2^32 - 2) and INFINITE (2^32 - 1) are markers
MAX_CPUS_PER_TASK = 2**16 - 3  # NO_VAL16 and INFINITE16 likewise
IGNORED_DIR = "ignored"  # under pending/: records that match no task of the store, kept for a human
ACTIVE_STATES = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD",
                 "RESIZING", "SUSPENDED", "SIGNALING", "STAGE_OUT"}
# Ends that are someone stopping the task (scancel, preemption without requeue), not the point failing:
# nothing is recorded, so --resume runs the point again
NOT_RECORDED_STATES = {"CANCELLED", "PREEMPTED"}


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
    requeue: bool = False  # let Slurm requeue tasks (preemption, node failure); each still records once


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
        # by default a task whose node fails ends (NODE_FAIL) and is recorded failed, for
        # --rerun-failed, instead of waiting, requeued, for a node that may never come back
        "--requeue" if opts.requeue else "--no-requeue",
        f"--time={opts.time or minutes}",
    ]
    for name, value in [("partition", opts.partition), ("account", opts.account),
                        ("gpus-per-node", opts.gpus_per_node), ("cpus-per-task", opts.cpus_per_task)]:
        if value is not None:
            lines.append(f"--{name}={_safe(name, value)}")
    for item in opts.extra:
        if not _EXTRA.fullmatch(item):
            raise ConfigError(f"--extra {item!r}: expected one sbatch option like --qos=high (no spaces or quotes)")
        taken = _set_by_moebench(item)
        if taken is not None:
            raise ConfigError(f"--extra {item}: {taken} is set by moebench (the array, task logs, job name, nodes and "
                              "time follow the store and the run options); use --partition, --account, --time, "
                              "--nodes, --gpus-per-node or --cpus-per-task where one fits")
        lines.append(item)
    return lines


# sbatch options the script sets (or that would change what it runs): --extra may not override them.
# sbatch takes any unambiguous prefix of a long option (--arr=0-9 is --array), so prefixes count too.
_OWN_LONG = ("job-name", "array", "output", "error", "input", "nodes", "ntasks", "ntasks-per-node", "requeue",
             "no-requeue", "time", "partition", "account", "gpus-per-node", "cpus-per-task", "chdir", "wrap", "hold")
_OWN_SHORT = {"J": "job-name", "a": "array", "o": "output", "e": "error", "i": "input", "N": "nodes",
              "n": "ntasks", "t": "time", "p": "partition", "A": "account", "c": "cpus-per-task", "D": "chdir",
              "H": "hold"}


def _set_by_moebench(item: str) -> str | None:
    """The moebench-set sbatch option that ``item`` (one ``--extra``) would override, else None."""
    if item.startswith("--"):
        name = item[2:].split("=", 1)[0]
        return next((f"--{own}" for own in _OWN_LONG if own.startswith(name)), None)
    own = _OWN_SHORT.get(item[1:2])
    return f"-{item[1]} (--{own})" if own else None


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
    """A readable sbatch job-array script: task i runs ``points[i]`` (a run: a point at a repeat)."""
    options = sbatch_options(opts, store, suite_name, points)
    table = "\n".join(f"#   task {i:<3} {p.run_id}  nproc={p.nproc}  {shlex.join(p.train_args())}"
                      for i, p in enumerate(points))
    ids = " ".join(shlex.quote(p.run_id) for p in points)
    worker = shlex.join([sys.executable, "-m", "moebench.sweep.worker", str(store.path.resolve())])
    return "\n".join([
        "#!/bin/bash",
        f"# moebench sweep {shlex.quote(suite_name)}: one array task per run (point, repeat); each task writes "
        "its record to",
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
    """Submit the array held (``--hold``): none of its tasks starts before :func:`release`, which the
    sweep calls only once meta.json records the job, so no interruption leaves an array running
    that the store does not know (at worst one that is held, and never runs)."""
    try:
        out = subprocess.run(["sbatch", "--parsable", "--hold", str(script)], capture_output=True, text=True,
                             timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LaunchError(f"sbatch failed: {exc}") from None
    if out.returncode != 0:
        raise LaunchError(f"sbatch rejected {script}: {out.stderr.strip() or out.stdout.strip()}")
    return out.stdout.strip().split(";")[0]


def release(job_id: str) -> None:
    """Let a held job's tasks start (``scontrol release``); a LaunchError names the job otherwise."""
    try:
        out = subprocess.run(["scontrol", "release", job_id], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LaunchError(f"scontrol release {job_id} failed: {exc}; the job is recorded in the store, held: "
                          f"release it with `scontrol release {job_id}`") from None
    if out.returncode != 0 and "not held" not in (out.stderr + out.stdout).lower():
        raise LaunchError(f"scontrol release {job_id}: {(out.stderr.strip() or out.stdout.strip())[:200]}; the job "
                          f"is recorded in the store, held: release it with `scontrol release {job_id}`")


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


@dataclass(frozen=True)
class Task:
    """One array task a store submitted: task ``index`` of job ``job_id`` runs repeat ``repeat`` of ``point_id``."""

    job_id: str
    index: int
    point_id: str
    key: str | None  # the point's key; None in stores written before tasks kept it
    repeat: int = 0  # 0 in stores written before repeats

    @property
    def name(self) -> str:
        return f"{self.job_id}_{self.index}"

    @property
    def run_id(self) -> str:
        return self.point_id if self.repeat == 0 else f"{self.point_id}.r{self.repeat}"

    def runs(self, point: Point) -> bool:
        same = self.key == point.key if self.key is not None else self.point_id == point.point_id
        return same and self.repeat == point.repeat


def _jobs_meta(store: Store) -> list[dict[str, Any]]:
    """The jobs of meta.json's ``slurm`` field, oldest first, each ``{job_id, submitted_at, tasks}``."""
    slurm = store.read_meta().get("slurm") or {}
    jobs = slurm.get("jobs", [])
    if "job_id" in slurm and "jobs" not in slurm:  # one job, as stores written before resume followed jobs kept it
        tasks = slurm.get("tasks")
        jobs = [{"job_id": slurm["job_id"], "submitted_at": None, "tasks": {
            i: {"point_id": pid, "key": None} for i, pid in tasks.items()} if isinstance(tasks, dict) else tasks}]
    ok = (not slurm or "jobs" in slurm or "job_id" in slurm) and isinstance(jobs, list) and all(
        isinstance(job, dict) and isinstance(job.get("job_id"), str) and isinstance(job.get("tasks"), dict)
        and all(str(i).isdigit() and isinstance(t, dict) and isinstance(t.get("point_id"), str)
                and isinstance(t.get("key"), (str, type(None))) and isinstance(t.get("repeat", 0), int)
                for i, t in job["tasks"].items())
        for job in jobs)
    if not ok:
        raise StoreError(f"{store.meta_path}: field 'slurm' must list its jobs as {{jobs: [{{job_id, tasks: "
                         f"{{index: {{point_id, key}}}}}}]}}, got {repr(slurm)[:60]}")
    return jobs


def store_tasks(store: Store) -> dict[tuple[str, str], Task]:
    """Every array task the store has submitted, by (job id, task id) as its records carry them."""
    return {(job["job_id"], str(i)): Task(job["job_id"], int(i), t["point_id"], t["key"], t.get("repeat", 0))
            for job in _jobs_meta(store) for i, t in job["tasks"].items()}


def _remember_job(store: Store, job_id: str, points: list[Point], script: Path) -> list[Task]:
    """Add a submitted job to meta.json (``slurm.jobs``): a later run follows its tasks, and
    records are merged only from the tasks it lists."""
    tasks = {str(i): {"point_id": p.point_id, "key": p.key, "repeat": p.repeat} for i, p in enumerate(points)}
    jobs = [*_jobs_meta(store), {"job_id": job_id, "submitted_at": now_iso(), "tasks": tasks}]
    store.update_meta(slurm={"script": str(script), "jobs": jobs})
    return [Task(job_id, i, p.point_id, p.key, p.repeat) for i, p in enumerate(points)]


def record_task(record: dict[str, Any]) -> tuple[str, str] | None:
    """(job id, task id) of the array task that wrote or caused ``record``; None for a local one."""
    job, task = record.get("slurm_job_id"), record.get("slurm_task_id")
    return None if job is None or task is None else (str(job), str(task))


def _pending_path(store: Store, record: dict[str, Any]) -> Path:
    # one file per task: a requeued task that runs again replaces its own record, never adds one
    ids = record_task(record)
    name = f"{record['point_id']}-{ids[0]}_{ids[1]}" if ids else str(record["point_id"])
    return store.path / PENDING_DIR / f"{name}.json"


def _pending(store: Store, problems: list[str] | None = None) -> list[tuple[Path, dict[str, Any]]]:
    """Finished task records waiting in pending/, in file-name order, with their files. A file
    that is no record (written by rename, so not ours) is left for a human, with a line in
    ``problems``."""
    found = []
    folder = store.path / PENDING_DIR
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        read = read_record_file(path)
        if read is None:
            continue  # merged meanwhile
        record, problem = read
        if problem is None:
            found.append((path, record))
        elif problems is not None:
            problems.append(problem if problem.startswith(str(path)) else f"{path}: {problem}")
    return found


def _recorded_tasks(store: Store) -> set[tuple[str, str]]:
    return {ids for r in store.read_records(strict=False)[0] if (ids := record_task(r))}


def _unmatched(record: dict[str, Any], tasks: dict[tuple[str, str], Task],
               recorded: set[tuple[str, str]]) -> str | None:
    """Why a pending record must not be merged (None: it is the first record of a task this store
    submitted, for the point that task runs): records match by (job id, task id, point key)."""
    ids = record_task(record)
    task = tasks.get(ids) if ids else None
    if task is None:
        origin = f"Slurm task {ids[0]}_{ids[1]}" if ids else "no Slurm task"
        return f"a record of {origin}, which this store did not submit"
    repeat = int(record.get("repeat") or 0)
    if record.get("point_id") != task.point_id or task.key not in (None, record["key"]) or repeat != task.repeat:
        of = record.get("point_id") if repeat == 0 else f"{record.get('point_id')}.r{repeat}"
        return f"Slurm task {task.name} runs {task.run_id} (key {task.key}), but the record is of {of} " \
               f"(key {record['key']})"
    if ids in recorded:
        return f"Slurm task {task.name} is recorded already (a requeued task's second record)"
    return None


def pending_records(store: Store, problems: list[str] | None = None) -> list[dict[str, Any]]:
    """Finished task records that the next merge takes, read without touching the store (``moebench status``);
    a file in pending/ that is no record is a line in ``problems``."""
    found = _pending(store, problems)
    if not found:
        return []
    tasks, recorded = store_tasks(store), _recorded_tasks(store)
    return [record for _, record in found if _unmatched(record, tasks, recorded) is None]


def merge_pending(store: Store, warn: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Move finished task records from pending/ into records.jsonl (caller holds the lock).

    A record that does not match a task of the store (an unknown job, another point, a second
    record of one task) is moved to ``pending/ignored/`` with a line to ``warn``, not merged.
    """
    problems: list[str] = []
    found = _pending(store, problems)
    for problem in problems if warn is not None else []:
        warn(f"{problem} (left where it is, not merged)")
    if not found:
        return []
    tasks, recorded = store_tasks(store), _recorded_tasks(store)
    merged = []
    for path, record in found:
        why = _unmatched(record, tasks, recorded)
        if why is not None:
            aside = path.parent / IGNORED_DIR / path.name
            aside.parent.mkdir(exist_ok=True)
            os.replace(path, aside)
            if warn is not None:
                warn(f"{path}: {why}; not merged, moved to {aside}")
            continue
        store.append(record)
        path.unlink()
        merged.append(record)
        recorded.add((str(record["slurm_job_id"]), str(record["slurm_task_id"])))
    return merged


def task_recorded(store: Store, job_id: str, task_id: str) -> bool:
    """Whether array task ``job_id``_``task_id`` has a record, merged or pending (a requeued task
    that finished before must not run and record its point a second time)."""
    ids = (job_id, task_id)
    return any(record_task(r) == ids for r in pending_records(store)) or ids in _recorded_tasks(store)


def live_tasks(store: Store, points: list[Point]) -> dict[Task, str]:
    """The store's submitted tasks that run one of ``points`` and that Slurm still has pending or
    running, with their state: a continued sweep follows them instead of submitting them again."""
    by_job: dict[str, list[Task]] = {}
    for task in store_tasks(store).values():
        if any(task.runs(p) for p in points):
            by_job.setdefault(task.job_id, []).append(task)
    live = {}
    for job_id, tasks in by_job.items():
        states = queue_states(job_id)
        if states is None:
            raise LaunchError(f"squeue failed for job {job_id}, so whether its tasks still run is unknown; "
                              "nothing was submitted (submitting could run their points twice): try again")
        live.update({t: states[t.index] for t in tasks if states.get(t.index) in ACTIVE_STATES})
    return live


def refuse_queued(store: Store, points: list[Point]) -> None:
    """Refuse to run ``points`` here (a sweep without ``--slurm``) while tasks of the store's jobs
    still have them queued or running: each would run, and be recorded, twice. Where squeue
    cannot answer (no Slurm on this machine: a copied store) nothing of it can be queued here."""
    if not points or not _jobs_meta(store):
        return
    try:
        live = live_tasks(store, points)
    except LaunchError:
        return
    if live:
        names = " ".join(sorted(task.name for task in live))
        raise StoreError(f"{store.path}: Slurm task(s) {names} of this store still run these points; "
                         "continue with --slurm to follow them, or scancel them first")


def submit_and_follow(store: Store, points: list[Point], opts: SlurmOptions, progress: Any,
                      warn: Callable[[str], None] | None = None) -> None:
    """Run ``points`` on Slurm and merge their records as tasks finish: tasks of the store's
    earlier jobs still queued for them are followed, the other points submitted as one job array."""
    if not points:
        return
    say = warn or (lambda line: None)
    (store.path / SLURM_DIR).mkdir(parents=True, exist_ok=True)
    (store.path / PENDING_DIR).mkdir(parents=True, exist_ok=True)
    remaining: dict[tuple[str, str], tuple[Task, Point]] = {}
    for task in live_tasks(store, points):
        point = next(p for p in points if task.runs(p))
        remaining[(task.job_id, str(task.index))] = (task, point)
    if remaining:
        names = " ".join(sorted(task.name for task, _ in remaining.values()))
        say(f"following Slurm task(s) still queued from an earlier run of this store: {names} "
            "(their points are not submitted again)")
        for job_id in sorted({task.job_id for task, _ in remaining.values()}):
            # a sweep stopped between recording and releasing its job left it held; most jobs are not
            # (running tasks): scontrol's refusal of those is no error of this run
            with contextlib.suppress(LaunchError):
                release(job_id)
    followed = {(point.key, point.repeat) for _, point in remaining.values()}
    new = [p for p in points if (p.key, p.repeat) not in followed]
    if new:
        suite = store.read_meta()["suite"]
        script = store.path / SLURM_DIR / "sweep.sbatch"
        script.write_text(render_script(store, suite, new, opts))
        job_id = submit(script)  # held until the store knows it
        for task, point in zip(_remember_job(store, job_id, new, script), new, strict=True):
            remaining[(job_id, str(task.index))] = (task, point)
        release(job_id)
    _follow(store, remaining, opts, progress, warn, say)


def _follow(store: Store, remaining: dict[tuple[str, str], tuple[Task, Point]], opts: SlurmOptions,
            progress: Any, warn: Callable[[str], None] | None, say: Callable[[str], None]) -> None:
    """Poll squeue until no task of ``remaining`` is left: its record merged from pending/, or one written
    here when it ended without one (none when cancelled); an interrupt cancels the tasks still left."""

    def collect() -> None:
        for record in merge_pending(store, warn):
            ids = record_task(record)
            if ids in remaining:  # a record of a task not followed here (an older job's) is merged, not counted
                del remaining[ids]
                progress.finished(record)

    def ended_without_record(ids: tuple[str, str], state: str | None) -> None:
        task, point = remaining.pop(ids)
        if state in NOT_RECORDED_STATES:
            # stopped from outside, not failed: no record, so --resume runs the point again
            say(f"Slurm task {task.name} ({point.run_id}) ended {state} before it wrote a record: "
                "nothing recorded; --resume runs it again")
            return
        record = _ended_without_record(store, point, task.job_id, task.index, state)
        store.append(record)
        progress.finished(record)

    failures = 0
    ended_before: dict[str, set[int]] = {}
    try:
        while remaining:
            collect()
            if not remaining:
                break
            jobs = sorted({job for job, _ in remaining})
            polled = {job: queue_states(job) for job in jobs}
            if any(states is None for states in polled.values()):
                failures += 1
                if failures > 20:
                    raise LaunchError(f"squeue keeps failing for job(s) {', '.join(jobs)}; they may still be running")
                time.sleep(opts.poll_s)
                continue
            failures = 0
            # a task writes its record before it ends; one more poll lets a record written on
            # another node reach this one through a shared file system
            collect()
            running = 0
            for job, states in polled.items():
                mine = sorted(ids for ids in remaining if ids[0] == job)
                if not states:  # the whole array has left squeue (after MinJobAge): no state to report
                    time.sleep(1.0)
                    collect()
                    for ids in mine:
                        if ids in remaining:
                            ended_without_record(ids, None)
                    continue
                ended = {int(i) for _, i in mine if int(i) in states and states[int(i)] not in ACTIVE_STATES}
                for _, i in mine:
                    if int(i) in ended & ended_before.get(job, set()) and (job, i) in remaining:
                        ended_without_record((job, i), states[int(i)])
                ended_before[job] = ended
                running += sum(states.get(int(i)) == "RUNNING" for _, i in mine)
            progress.bar.set_postfix_str(f"job {','.join(jobs)}: {running} running, {len(remaining)} left")
            if remaining:
                time.sleep(opts.poll_s)
    except KeyboardInterrupt:
        # a missing or hung scancel must not replace the interrupt the caller unwinds with
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            subprocess.run(["scancel", *sorted(task.name for task, _ in remaining.values())],
                           capture_output=True, timeout=30)
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
    """The record of a task that ended without writing one (node failure, Slurm's time limit, out of
    memory...): its Slurm state, and the tails of the task's Slurm output and of the point's log."""
    task = f"{job_id}_{index}"
    status = {"TIMEOUT": "timeout", "OUT_OF_MEMORY": "oom"}.get(state or "", "failed")
    half = LOG_TAIL_CHARS // 2
    tail = (read_tail(store.path / SLURM_DIR / f"task-{task}.out", half)
            + read_tail(store.log_path(point.run_id), half))
    why = f"ended {state}" if state else "left the queue"
    record = point_record(point, status, f"Slurm task {task} {why} without a record", log_tail=tail)
    record.update(slurm_job_id=job_id, slurm_task_id=str(index), slurm_state=state)
    return record


def live_states(store_path: str | Path) -> dict[str, str]:
    """Run id (``p001``, ``p001.r2``) -> Slurm state (pending/running) for runs of the store's jobs still queued."""
    store = Store(store_path)
    live: dict[str, str] = {}
    by_job: dict[str, list[Task]] = {}
    for task in store_tasks(store).values():
        by_job.setdefault(task.job_id, []).append(task)
    for job_id, tasks in by_job.items():
        states = queue_states(job_id) or {}
        live.update({t.run_id: states[t.index].lower() for t in tasks if states.get(t.index) in ACTIVE_STATES})
    return live


def write_pending(store: Store, record: dict[str, Any]) -> Path:
    path = _pending_path(store, record)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, to_json_line(record) + "\n")
    return path
