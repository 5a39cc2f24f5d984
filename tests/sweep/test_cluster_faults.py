"""Scheduler faults on the two-node cluster (scripts/slurm-local.sh): a node set down under a
running multi-node point fails that point (with its Slurm state and log tail) and nothing
else and leaves no rank running; ``--rerun-failed`` resubmits only that point, and a killed
slurmd under it fails it the same way. Skipped, with the reason, without two idle nodes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
from pathlib import Path

import pytest
from cluster_helpers import (
    NODES,
    TWO_NODES,
    job_ids,
    log_has,
    needs_two_nodes,
    records,
    scontrol,
    task_processes,
    wait_for,
)

from moebench.sweep.runner import SweepOptions, run_suite
from moebench.sweep.slurm import idle_nodes
from moebench.sweep.status import status_table
from moebench.sweep.suite import parse_suite

pytestmark = [pytest.mark.slow, pytest.mark.cluster, needs_two_nodes]
SLURM = TWO_NODES


def _in_background(suite, out, **kwargs) -> threading.Thread:
    options = SweepOptions(progress=False, echo=lambda line: None, slurm=SLURM, **kwargs)
    thread = threading.Thread(target=run_suite, args=(suite, out, options), daemon=True)
    thread.start()
    return thread


def test_node_down_fails_only_its_point_and_rerun_resubmits_only_it(tmp_path):
    # one rank per node; p001 trains long enough to be running when its second node goes down
    suite = parse_suite({"name": "faults", "timeout": 300, "grid": {"train.steps": [3, 5000]}, "base": {
        "preset": "tiny", "nproc": 2, "set": {"parallel.dp": 2, "train.warmup_steps": 1,
                                              "train.profile_steps": 0, "train.device": "cpu"}}})
    store = tmp_path / "store"
    victim = NODES[1]
    sweep = _in_background(suite=suite, out=store)
    try:
        wait_for("p000's record and p001's first steps",
              lambda: any(r["point_id"] == "p000" for r in records(store)) and log_has(store, "p001", "step "), 240)
        job_id, = job_ids(store)
        assert scontrol("update", f"nodename={victim}", "state=down", "reason=moebench-test").returncode == 0
        sweep.join(timeout=180)
        assert not sweep.is_alive(), "the sweep did not finish after the node went down"
        wait_for("p001's ranks to end", lambda: not task_processes(job_id, "1"), 60)
    finally:  # ReturnToService=2 usually brings it back by itself; then resume is refused, harmlessly
        scontrol("update", f"nodename={victim}", "state=resume")
    recorded = {r["point_id"]: r for r in records(store)}
    assert recorded["p000"]["status"] == "ok"
    failed = recorded["p001"]
    assert failed["status"] == "failed" and failed["slurm_state"] == "NODE_FAIL", failed["error"]
    assert failed["error"] == f"Slurm task {job_id}_1 ended NODE_FAIL without a record"
    assert "step " in failed["log_tail"]

    # --rerun-failed submits p001 alone; this time the victim's slurmd is killed under it
    wait_for(f"{victim} to be idle again", lambda: victim in (idle_nodes() or []), 60)
    rerun = _in_background(suite=suite, out=store, rerun_failed=True)
    try:
        wait_for("the resubmitted p001's steps", lambda: _attempt_steps(store, 1) > 0, 240)
        script = (store / "slurm" / "sweep.sbatch").read_text()
        assert "POINTS=(p001)" in script and "#SBATCH --array=0-0" in script.splitlines()
        second = job_ids(store)[1]
        os.kill(int(Path(f"/run/slurmd-{victim}.pid").read_text()), signal.SIGKILL)
        rerun.join(timeout=180)  # slurmctld sets the node down SlurmdTimeout (30 s) after its last answer
        assert not rerun.is_alive(), "the sweep did not finish after the node's slurmd was killed"
        wait_for("p001's ranks to end", lambda: not task_processes(second), 60)
    finally:
        _restart_slurmd(victim)
    lines = records(store)
    assert [(r["point_id"], r["status"]) for r in lines] == [("p000", "ok"), ("p001", "failed"), ("p001", "failed")]
    assert lines[-1]["slurm_state"] == "NODE_FAIL" and lines[-1]["slurm_job_id"] == second
    assert "p001 failed" in status_table(store)
    wait_for(f"{victim} to be idle again", lambda: victim in (idle_nodes() or []), 60)


def _attempt_steps(store, attempt: int) -> int:
    """Step lines that p001's ``attempt``-th run (0: the first) wrote to its log, which each run appends to."""
    log = store / "logs" / "p001.log"
    runs = log.read_text(errors="replace").split("$ srun")[1:] if log.exists() else []
    return runs[attempt].count("step ") if len(runs) > attempt else 0


def _restart_slurmd(node: str) -> None:
    pid_file = Path(f"/run/slurmd-{node}.pid")
    try:
        os.kill(int(pid_file.read_text()), 0)
    except (OSError, ValueError):  # dead, as the test left it: start it as scripts/slurm-local.sh does
        subprocess.run(["slurmd", "-N", node], stdin=subprocess.DEVNULL, capture_output=True, timeout=30)


def _rank_launcher_on_second_node(job_id: str) -> list[int]:
    """The torchrun that srun started on the allocation's second node (SLURM_NODEID=1) for ``job_id``."""
    found = []
    for pid in task_processes(job_id):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"SLURM_NODEID=1" in env and b"torch.distributed.run" in argv:
            found.append(pid)
    return found


def test_rank_that_never_joins_the_rendezvous_times_the_point_out(tmp_path):
    """The second node's torchrun is frozen before it joins: the first node's waits in the c10d
    rendezvous until the point's timeout, then the point is recorded timeout, the sweep ends and
    no process of the task is left on either node."""
    suite = parse_suite({"name": "rdzv", "timeout": 60, "base": {"preset": "tiny", "nproc": 2, "set": {
        "parallel.dp": 2, "train.steps": 3, "train.warmup_steps": 1, "train.profile_steps": 0,
        "train.device": "cpu"}}})
    store = tmp_path / "store"
    sweep = _in_background(suite=suite, out=store)
    frozen: list[int] = []
    try:
        wait_for("the first job", lambda: job_ids(store) != [], 60)
        job_id, = job_ids(store)

        def freeze() -> bool:
            frozen[:] = _rank_launcher_on_second_node(job_id)
            for pid in frozen:
                os.kill(pid, signal.SIGSTOP)
            return bool(frozen)

        wait_for("the second node's torchrun", freeze, 60)
        sweep.join(timeout=180)
        assert not sweep.is_alive(), "the sweep hung on a rendezvous that never completes"
        wait_for("the task's processes on both nodes to end", lambda: not task_processes(job_id), 90)
    finally:
        for pid in frozen:  # the frozen torchrun is killed when its job ends; a failed test must not leave it
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    record, = records(store)
    assert record["status"] == "timeout", record
    assert record["error"].startswith("exceeded its time limit of 60 s of wall time"), record  # a Slurm task's
    assert record["slurm_job_id"] == job_id and "killed after its time limit of 60 s of wall time" in record["log_tail"]
