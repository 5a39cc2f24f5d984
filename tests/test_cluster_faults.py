"""Scheduler faults on the two-node cluster (scripts/slurm-local.sh): a node taken down under
a running multi-node point fails that point (with its Slurm state and log tail) and nothing
else, leaves no rank running, and ``--rerun-failed`` resubmits only that point; cancelling
the resubmitted job records nothing. Skipped, with the reason, without two idle
nodes."""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from cluster_helpers import NODES, TWO_NODES, needs_two_nodes

from moebench.sweep.runner import run_suite, status_table
from moebench.sweep.slurm import idle_nodes
from moebench.sweep.store import Store
from moebench.sweep.suite import parse_suite

pytestmark = [pytest.mark.slow, needs_two_nodes]
SLURM = TWO_NODES


def _wait(what: str, done: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}")
        time.sleep(1.0)


def _in_background(**kwargs) -> threading.Thread:
    thread = threading.Thread(target=run_suite, kwargs={"progress": False, "echo": lambda line: None,
                                                        "slurm": SLURM, **kwargs}, daemon=True)
    thread.start()
    return thread


def _records(store: Path) -> list[dict]:
    return Store(store).read_records()[0] if (store / "records.jsonl").exists() else []


def _task_processes(job_id: str, task: str) -> list[int]:
    """Processes of one array task, wherever they run on this host (the nodes share it)."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            env = environ.read_bytes().split(b"\0")
        except OSError:
            continue
        if f"SLURM_ARRAY_JOB_ID={job_id}".encode() in env and f"SLURM_ARRAY_TASK_ID={task}".encode() in env:
            found.append(int(environ.parent.name))
    return found


def _scontrol(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=30)


def test_node_down_fails_only_its_point_and_rerun_resubmits_only_it(tmp_path):
    # one rank per node; p001 trains long enough to be running when its second node goes down
    suite = parse_suite({"name": "faults", "timeout": 300, "grid": {"train.steps": [3, 5000]}, "base": {
        "preset": "tiny", "nproc": 2, "set": {"parallel.dp": 2, "train.warmup_steps": 1,
                                              "train.profile_steps": 0, "train.device": "cpu"}}})
    store = tmp_path / "store"
    victim = NODES[1]
    sweep = _in_background(suite=suite, out=store)
    try:
        _wait("p000's record and p001's first steps",
              lambda: any(r["point_id"] == "p000" for r in _records(store))
              and "step " in (store / "logs" / "p001.log").read_text(errors="replace")
              if (store / "logs" / "p001.log").exists() else False, 240)
        job_id = Store(store).read_meta()["slurm"]["jobs"][0]["job_id"]
        assert _scontrol("update", f"nodename={victim}", "state=down", "reason=moebench-test").returncode == 0
        sweep.join(timeout=180)
        assert not sweep.is_alive(), "the sweep did not finish after the node went down"
        _wait("p001's ranks to end", lambda: not _task_processes(job_id, "1"), 60)
    finally:  # ReturnToService=2 usually brings it back by itself; then resume is refused, harmlessly
        _scontrol("update", f"nodename={victim}", "state=resume")
    records = {r["point_id"]: r for r in _records(store)}
    assert records["p000"]["status"] == "ok"
    failed = records["p001"]
    assert failed["status"] == "failed" and failed["slurm_state"] == "NODE_FAIL", failed["error"]
    assert failed["error"] == f"Slurm task {job_id}_1 ended NODE_FAIL without a record"
    assert "step " in failed["log_tail"]

    # --rerun-failed submits p001 alone; scancel of that job records nothing, the store stays as it was
    _wait(f"{victim} to be idle again", lambda: victim in (idle_nodes() or []), 60)
    rerun = _in_background(suite=suite, out=store, rerun_failed=True)
    _wait("the resubmitted job", lambda: len(Store(store).read_meta()["slurm"]["jobs"]) == 2, 60)
    script = (store / "slurm" / "sweep.sbatch").read_text()
    assert "POINTS=(p001)" in script and "#SBATCH --array=0-0" in script.splitlines()
    second = Store(store).read_meta()["slurm"]["jobs"][1]["job_id"]
    subprocess.run(["scancel", second], check=True, timeout=30)
    rerun.join(timeout=120)
    assert not rerun.is_alive()
    assert [(r["point_id"], r["status"]) for r in _records(store)] == [("p000", "ok"), ("p001", "failed")]
    assert "p001 failed" in status_table(store)
