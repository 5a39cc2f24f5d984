"""What the two-node Slurm tests share: the idle nodes found at import, the skip when there are
fewer than two (scripts/slurm-local.sh starts them on this host), the sweep options, and ways
to watch a store and the cluster while a sweep runs."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from moebench.results.store import Store
from moebench.sweep.slurm import SlurmOptions, idle_nodes

NODES = idle_nodes()
needs_two_nodes = pytest.mark.skipif(
    NODES is None or len(NODES) < 2,
    reason=f"needs a Slurm cluster with 2 idle nodes (scripts/slurm-local.sh starts one); found {NODES}")
TWO_NODES = SlurmOptions(nodes=2, poll_s=1.0, cpus_per_task=1, time="10")


def wait_for(what: str, done: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}")
        time.sleep(0.5)


def records(store: Path) -> list[dict]:
    return Store(store).read_records()[0] if (store / "records.jsonl").exists() else []


def job_ids(store: Path) -> list[str]:
    """The Slurm jobs a store has submitted, oldest first (none while the store is being made)."""
    if not (store / "meta.json").exists():
        return []
    return [job["job_id"] for job in (Store(store).read_meta().get("slurm") or {}).get("jobs", [])]


def log_has(store: Path, point_id: str, text: str) -> bool:
    log = store / "logs" / f"{point_id}.log"
    return log.exists() and text in log.read_text(errors="replace")


def task_processes(job_id: str, task: str | None = None) -> list[int]:
    """Processes of a job's array tasks (one task, or all), wherever they run on this host (the nodes share it)."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            env = environ.read_bytes().split(b"\0")
        except OSError:
            continue
        if f"SLURM_ARRAY_JOB_ID={job_id}".encode() in env and (
                task is None or f"SLURM_ARRAY_TASK_ID={task}".encode() in env):
            found.append(int(environ.parent.name))
    return found


def scontrol(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=30)
