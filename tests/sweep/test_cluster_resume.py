"""Continuing a Slurm sweep on the two-node cluster (scripts/slurm-local.sh) never runs or
records a point twice: after its follower is SIGKILLed, ``--resume --slurm`` follows the job
still queued instead of submitting a second one; a task requeued mid-run (preemption) and a
finished task requeued each leave one record; ``scancel`` of a whole array records nothing
and the next ``--resume`` finishes its point. One store, four runs of the sweep. Skipped,
with the reason, without two idle nodes."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from dataclasses import replace

import pytest
import yaml
from cluster_helpers import (
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
from moebench.sweep.slurm import ACTIVE_STATES, queue_states
from moebench.sweep.status import status_table

pytestmark = [pytest.mark.slow, pytest.mark.cluster, needs_two_nodes]
SLURM = replace(TWO_NODES, nodes=1, requeue=True)
SUITE = {"name": "resume", "timeout": 300, "grid": {"moe.num_experts": [4, 8, 16]}, "base": {
    "preset": "tiny", "set": {"train.steps": 3, "train.warmup_steps": 1, "train.profile_steps": 0,
                              "train.device": "cpu"}}}


def _requeue(task: str) -> None:
    """Requeue an array task as preemption does, and let it start again at once (Slurm would hold it
    for two minutes first)."""
    assert scontrol("requeue", task).returncode == 0
    assert scontrol("update", f"jobid={task}", "starttime=now").returncode == 0


def _resume(suite, store, warnings: list[str], **kwargs) -> threading.Thread:
    options = SweepOptions(resume=True, slurm=SLURM, progress=False, echo=lambda line: None, warn=warnings.append,
                           **kwargs)
    thread = threading.Thread(target=run_suite, args=(str(suite), store, options), daemon=True)
    thread.start()
    return thread


def test_resume_follows_queued_tasks_and_every_point_records_once(tmp_path):
    suite = tmp_path / "resume.yaml"
    suite.write_text(yaml.safe_dump(SUITE))
    store = tmp_path / "store"
    follower = subprocess.Popen(
        [sys.executable, "-m", "moebench.cli", "run", str(suite), "--out", str(store), "--only", "p000,p001",
         "--slurm", "--nodes", "1", "--requeue", "--poll", "1", "--cpus-per-task", "1", "--time", "10",
         "--no-progress"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for("the first job", lambda: job_ids(store) != [], 60)
    finally:
        follower.kill()  # SIGKILL: no scancel, the job runs on unfollowed
        follower.wait()
    first, = job_ids(store)

    # p001 is preempted (requeued) once it runs; the resumed sweep follows the job, submits nothing
    wait_for("p001 to start", lambda: log_has(store, "p001", "$ "), 120)
    _requeue(f"{first}_1")
    warnings: list[str] = []
    _resume(suite, store, warnings, point_ids={"p000", "p001"}).join(timeout=240)
    assert job_ids(store) == [first], "the resumed sweep submitted its points again"
    assert [(r["point_id"], r["slurm_job_id"], r["status"]) for r in records(store)] in (
        [("p000", first, "ok"), ("p001", first, "ok")], [("p001", first, "ok"), ("p000", first, "ok")])
    assert any(w.startswith("following Slurm task(s) still queued") for w in warnings), warnings

    # p000's task, finished and recorded, requeued: it runs again but does not train or record again
    _requeue(f"{first}_0")
    out = store / "slurm" / f"task-{first}_0.out"
    wait_for("the requeued task to end", lambda: out.exists() and "has a record already" in out.read_text()
             and (queue_states(first) or {}).get(0) not in ACTIVE_STATES, 120)

    # p002 is submitted; scancel of that whole array records nothing, and --resume finishes it
    warnings.clear()
    resumed = _resume(suite, store, warnings)
    wait_for("p002 to start", lambda: len(job_ids(store)) == 2 and log_has(store, "p002", "$ "), 120)
    cancelled = job_ids(store)[1]
    subprocess.run(["scancel", cancelled], check=True, timeout=30)
    resumed.join(timeout=120)
    assert not resumed.is_alive()
    assert [r["point_id"] for r in records(store)].count("p002") == 0
    assert any(f"Slurm task {cancelled}_0 (p002) ended CANCELLED" in w for w in warnings), warnings
    run_suite(str(suite), store, SweepOptions(resume=True, slurm=SLURM, progress=False, echo=lambda line: None))

    lines = records(store)
    assert sorted(r["point_id"] for r in lines) == ["p000", "p001", "p002"]
    assert {r["status"] for r in lines} == {"ok"}, [r.get("error") for r in lines]
    assert len({(r["slurm_job_id"], r["slurm_task_id"]) for r in lines}) == 3
    jobs = job_ids(store)
    assert jobs[:2] == [first, cancelled] and len(jobs) == 3
    assert not list((store / "pending").glob("*.json")) and not (store / "pending" / "ignored").exists()
    assert status_table(store).splitlines()[-1] == "3 ok"
    wait_for("every task's processes to end", lambda: not any(task_processes(j) for j in jobs), 60)


def test_a_sweep_stopped_between_sbatch_and_release_leaves_a_held_job_the_next_run_releases(tmp_path, monkeypatch):
    """On the real cluster: the array is submitted held and released only after meta.json records
    it, so a sweep stopped in that window leaves a job that Slurm holds (it cannot run unseen) and
    the store knows; the next ``--resume --slurm`` follows that job, releases it and submits
    nothing, and every point records once."""
    import moebench.sweep.slurm as slurm

    suite = tmp_path / "held.yaml"
    suite.write_text(yaml.safe_dump({**SUITE, "grid": {"moe.num_experts": [4, 8]}}))
    store = tmp_path / "store"

    def stopped(job_id: str) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(slurm, "release", stopped)
    with pytest.raises(KeyboardInterrupt):
        run_suite(str(suite), store, SweepOptions(slurm=SLURM, progress=False, echo=lambda line: None))
    held, = job_ids(store)
    try:
        time.sleep(3)  # long enough for the scheduler to have started a task that was not held
        states = queue_states(held)
        assert states and set(states.values()) == {"PENDING"}, states
        reasons = subprocess.run(["squeue", "-h", "-r", "-j", held, "-o", "%r"], capture_output=True, text=True,
                                 timeout=30).stdout.split()
        assert reasons and all("Held" in r for r in reasons), reasons
        assert not records(store) and not task_processes(held)
        monkeypatch.undo()
        run_suite(str(suite), store, SweepOptions(resume=True, slurm=SLURM, progress=False, echo=lambda line: None))
    finally:
        subprocess.run(["scancel", held], capture_output=True, timeout=30)  # a failed check leaves no held job
    lines = records(store)
    assert sorted(r["point_id"] for r in lines) == ["p000", "p001"], lines
    assert {r["status"] for r in lines} == {"ok"} and {r["slurm_job_id"] for r in lines} == {held}
    assert job_ids(store) == [held], "the resumed sweep submitted its points again"
