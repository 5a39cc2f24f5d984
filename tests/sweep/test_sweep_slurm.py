"""Slurm: the generated sbatch script (quoting, validation) and a real submission when a
cluster is up (scripts/slurm-local.sh starts a single-node one; skipped without sbatch)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
import yaml
from report_helpers import run_cli
from sweep_helpers import tiny_suite

from moebench.errors import ConfigError
from moebench.results.load import load_results
from moebench.results.store import Store
from moebench.sweep.runner import SweepOptions, run_suite
from moebench.sweep.slurm import (
    SlurmOptions,
    idle_nodes,
    merge_pending,
    queue_states,
    render_script,
    sbatch_accepts,
    write_pending,
)
from moebench.sweep.status import status_table
from moebench.sweep.worker import multinode_argv


def _points(**set_):
    return tiny_suite("s", set=set_, grid={"moe.num_experts": [4, 8]}, timeout=120).points()


def test_script_is_readable_and_quoted(tmp_path):
    store = Store(tmp_path / "my store")  # a space in the path must survive quoting in the body
    opts = SlurmOptions(partition="gpu", account="proj-1", gpus_per_node=8, extra=["--qos=high"])
    with pytest.raises(ConfigError, match="--out"):
        render_script(store, "s", _points(), opts)  # ...but not in an #SBATCH --output line
    store = Store(tmp_path / "store")
    script = render_script(store, "s", _points(), opts)
    assert script.startswith("#!/bin/bash\n")
    for line in ["#SBATCH --array=0-1", "#SBATCH --partition=gpu", "#SBATCH --account=proj-1", "#SBATCH --time=7",
                 "#SBATCH --gpus-per-node=8", "#SBATCH --qos=high", "#SBATCH --job-name=moebench-s"]:
        assert line in script.splitlines(), line
    assert "POINTS=(p000 p001)" in script and "moebench.sweep.worker" in script
    assert "#   task 1   p001" in script
    # the body parses as bash
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


@pytest.mark.parametrize("opts, match", [
    (SlurmOptions(partition="gpu; rm -rf /"), "--partition"),
    (SlurmOptions(account="a b"), "--account"),
    (SlurmOptions(time="1:00\n#SBATCH --x"), "--time"),
    (SlurmOptions(extra=["--qos=high --mem=1"]), "--extra"),
    (SlurmOptions(extra=["$(reboot)"]), "--extra"),
    (SlurmOptions(nodes=0), "--nodes"),
    # what moebench sets itself, in any spelling sbatch takes
    (SlurmOptions(extra=["--array=0-9"]), "--extra --array=0-9: --array is set by moebench"),
    (SlurmOptions(extra=["--arr=0-9"]), "--extra --arr=0-9: --array is set by moebench"),
    (SlurmOptions(extra=["-a0-9"]), "--extra -a0-9: -a (--array) is set by moebench"),
    (SlurmOptions(extra=["--output=/etc/x"]), "--output is set by moebench"),
    (SlurmOptions(extra=["-ologs"]), "-o (--output) is set by moebench"),
    (SlurmOptions(extra=["--error=/tmp/e"]), "--error is set by moebench"),
    (SlurmOptions(extra=["--job-name=x"]), "--job-name is set by moebench"),
    (SlurmOptions(extra=["--chdir=/"]), "--chdir is set by moebench"),
    (SlurmOptions(extra=["--wrap=true"]), "--wrap is set by moebench"),
])
def test_unsafe_values_rejected(tmp_path, opts, match):
    with pytest.raises(ConfigError, match=re.escape(match)):
        render_script(Store(tmp_path / "s"), "s", _points(), opts)


def test_job_name_from_suite_is_validated(tmp_path):
    with pytest.raises(ConfigError, match="--job-name"):
        render_script(Store(tmp_path / "s"), "x'; touch /tmp/pwn", _points(), SlurmOptions())


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch, capsys):
    """``moebench run`` in-process on a suite with a valid 4-rank point and an invalid one, with sbatch
    and squeue faked: each submitted script is kept, and the job leaves the queue at once."""
    import moebench.sweep.slurm as slurm

    submitted: list[str] = []
    monkeypatch.setattr(slurm, "submit", lambda script: submitted.append(script.read_text()) or "7")
    monkeypatch.setattr(slurm, "release", lambda job_id: None)
    monkeypatch.setattr(slurm, "queue_states", lambda job_id: {})
    monkeypatch.setattr(slurm, "sbatch_accepts", lambda script: None)
    monkeypatch.setattr(slurm.time, "sleep", lambda s: None)
    suite = tmp_path / "sl.yaml"
    base = {"preset": "tiny", "set": {"parallel.dp": 4, "train.micro_batch_size": 4}}
    suite.write_text(yaml.safe_dump({"name": "sl", "base": base, "zip": {"parallel.ep": [1, 3]}}))
    return lambda *args: run_cli(["run", str(suite), "--slurm", "--no-progress", *args], monkeypatch, capsys), \
        submitted


@pytest.mark.parametrize(("options", "message"), [
    (["--nodes", "3"], "--nodes 3: point p000 has 4 ranks, which do not split evenly over 3 nodes"),
    (["--nodes", "8"], "--nodes 8: point p000 has only 4 rank(s), fewer than the nodes"),
    (["--partition", "gpu a"], "--partition 'gpu a': only letters, digits and _.,:=@%+/- are allowed"),
    (["--account", "proj\n"], "--account 'proj\\n': only letters"),
    (["--extra=--qos high"], "--extra '--qos high': expected one sbatch option like --qos=high"),
    (["--time", "1h"], "--time '1h': expected a Slurm time limit"),
    (["--cpus-per-task", "0"], "--cpus-per-task 0: must be in [1, 65533]"),
    (["--gpus-per-node", "-1"], "--gpus-per-node -1: must be in [0, 65533]"),
    (["--gpus-per-node", "100000"], "--gpus-per-node 100000: must be in [0, 65533]"),
    (["--cpus-per-task", str(2**16)], "--cpus-per-task 65536: must be in [1, 65533]"),
    (["--poll", "0"], "--poll 0.0: must be a number of seconds > 0"),
])
def test_bad_slurm_options_are_refused_before_anything_is_written(tmp_path, fake_slurm, options, message):
    run, submitted = fake_slurm
    code, _, err = run("--out", str(tmp_path / "st"), *options)
    assert code == 2 and err.startswith(f"error: {message}") and len(err.splitlines()) == 1, err
    assert not (tmp_path / "st").exists() and submitted == []
    # the same sweep with options that fit is submitted, its invalid point recorded, not sent
    code, _, err = run("--out", str(tmp_path / "ok"), "--nodes", "2", "--time", "1-00:30", "--extra=--qos=high")
    assert code == 1 and len(submitted) == 1 and "p001 invalid" in err
    for line in ["#SBATCH --nodes=2", "#SBATCH --time=1-00:30", "#SBATCH --qos=high", "#SBATCH --array=0-0"]:
        assert line in submitted[0].splitlines()


@pytest.mark.slow
def test_what_sbatch_refuses_is_refused_before_a_store_exists(tmp_path, fake_slurm, monkeypatch):
    """A GPU count no node has passes every count check but not the controller: sbatch --test-only
    asks it first (a fake sbatch here, refusing as slurmctld does)."""
    import moebench.sweep.slurm as slurm

    run, submitted = fake_slurm
    monkeypatch.setattr(slurm, "sbatch_accepts", sbatch_accepts)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text('#!/bin/sh\ncat > "$0.stdin"\n[ "$1" = --test-only ] || exit 9\n'
                                    'echo "sbatch: error: Batch job submission failed: Requested node '
                                    'configuration is not available" >&2\nexit 1\n')
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    code, _, err = run("--out", str(tmp_path / "st"), "--gpus-per-node", "4096")
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err == ("error: --slurm: sbatch refuses the job array: sbatch: error: Batch job submission failed: "
                   "Requested node configuration is not available\n")
    assert not (tmp_path / "st").exists() and submitted == []
    assert "#SBATCH --gpus-per-node=4096" in (bin_dir / "sbatch.stdin").read_text()


def test_bad_slurm_options_leave_a_continued_store_as_it_was(tmp_path, fake_slurm):
    run, submitted = fake_slurm
    store = tmp_path / "st"
    assert run("--out", str(store))[0] == 1  # p000 ends without a record (the fake job runs nothing)
    before = {p: p.read_bytes() for p in store.rglob("*") if p.is_file() and p.name != ".lock"}
    code, _, err = run("--out", str(store), "--rerun-failed", "--nodes", "3")
    assert code == 2 and err.startswith("error: --nodes 3: point p000") and len(submitted) == 1
    assert {p: p.read_bytes() for p in store.rglob("*") if p.is_file() and p.name != ".lock"} == before


def _progress(finished: list[str]):
    """A stand-in for the sweep's progress bar that lists the points it was told finished."""
    return type("P", (), {"finished": lambda self, r: finished.append(r["point_id"]),
                          "bar": type("B", (), {"set_postfix_str": lambda self, s: None})()})()


def _store_with_job(tmp_path, points, job_id="7"):
    """A store that submitted ``points`` as job ``job_id`` (meta.json's slurm.jobs)."""
    import moebench.sweep.slurm as slurm

    store = Store(tmp_path / "s")
    store.create({"suite": "s", "run_id": "r"})
    slurm._remember_job(store, job_id, points, store.path / "slurm" / "sweep.sbatch")
    return store


def _task_record(point, job_id, task_id, status="ok"):
    return {"point_id": point.point_id, "key": point.key, "status": status,
            "slurm_job_id": job_id, "slurm_task_id": task_id}


def test_pending_records_merge_once_and_only_from_the_stores_tasks(tmp_path):
    from moebench.sweep.slurm import pending_records, task_recorded

    points = _points()
    store = _store_with_job(tmp_path, points)
    write_pending(store, {**_task_record(points[0], "7", "0"), "tokens_per_s": float("nan")})
    write_pending(store, _task_record(points[0], "5", "0"))  # a job this store never submitted
    write_pending(store, _task_record(points[0], "7", "1"))  # task 1 runs p001, not p000
    assert [r["slurm_job_id"] for r in pending_records(store)] == ["7"]  # what status shows
    assert task_recorded(store, "7", "0") and not task_recorded(store, "7", "1")
    warnings: list[str] = []
    with store.locked():
        assert [r["point_id"] for r in merge_pending(store, warnings.append)] == ["p000"]
        # task 7_0 requeued after it finished: its second record is set aside, not merged
        write_pending(store, _task_record(points[0], "7", "0", status="failed"))
        assert merge_pending(store, warnings.append) == []
    assert sorted(w.split(": ", 1)[1] for w in warnings) == sorted([
        "a record of Slurm task 5_0, which this store did not submit; not merged, "
        f"moved to {store.path / 'pending' / 'ignored' / 'p000-5_0.json'}",
        f"Slurm task 7_1 runs p001 (key {points[1].key}), but the record is of p000 (key {points[0].key}); "
        f"not merged, moved to {store.path / 'pending' / 'ignored' / 'p000-7_1.json'}",
        "Slurm task 7_0 is recorded already (a requeued task's second record); not merged, "
        f"moved to {store.path / 'pending' / 'ignored' / 'p000-7_0.json'}",
    ])
    assert not list((store.path / "pending").glob("*.json")) and task_recorded(store, "7", "0")
    df, _ = load_results(store.path)
    assert df["point_id"].tolist() == ["p000"] and df["status"].tolist() == ["ok"]


def test_a_store_of_the_one_job_layout_still_merges_its_tasks_records(tmp_path):
    """meta.json's slurm field as stores kept it before every job was remembered: {job_id, tasks: {i: point id}}."""
    points = _points()
    store = Store(tmp_path / "s")
    store.create({"suite": "s", "run_id": "r", "slurm": {"job_id": "7", "script": "x", "tasks": {"0": "p000"}}})
    write_pending(store, _task_record(points[0], "7", "0"))
    write_pending(store, _task_record(points[1], "7", "1"))  # task 1 is not in that job
    with store.locked():
        assert [r["point_id"] for r in merge_pending(store)] == ["p000"]


def test_follow_merges_late_records_and_fails_tasks_without_one(tmp_path, monkeypatch):
    import moebench.sweep.slurm as slurm

    store = Store(tmp_path / "s")
    store.create({"suite": "s", "run_id": "r"})
    points = _points()

    def queue_gone(job_id):  # the array leaves the queue as its last records land
        write_pending(store, _task_record(points[0], "7", "0"))
        write_pending(store, _task_record(points[1], "6", "1"))  # an older job's record, unknown here
        return {}

    finished: list[str] = []
    monkeypatch.setattr(slurm, "submit", lambda script: "7")
    monkeypatch.setattr(slurm, "release", lambda job_id: None)
    monkeypatch.setattr(slurm, "queue_states", queue_gone)
    monkeypatch.setattr(slurm.time, "sleep", lambda s: None)
    with store.locked():
        slurm.submit_and_follow(store, points, SlurmOptions(), _progress(finished))
    assert finished == ["p000", "p001"]  # the stray record is set aside, not counted
    records, _ = store.read_records()
    assert [(r["point_id"], r["status"]) for r in records] == [("p000", "ok"), ("p001", "failed")]
    assert "Slurm task 7_1 left the queue without a record" in records[-1]["error"]
    assert [p.name for p in (store.path / "pending" / "ignored").iterdir()] == ["p001-6_1.json"]


def test_follow_records_a_task_that_ended_without_a_record_with_its_slurm_state(tmp_path, monkeypatch):
    """A node failure ends task 1 (NODE_FAIL) while task 0 runs on: task 1 is recorded failed with
    its state and log tails one poll later (its record may still be on its way), task 0 finishes."""
    import moebench.sweep.slurm as slurm

    store = Store(tmp_path / "s")
    store.create({"suite": "s", "run_id": "r"})
    points = _points()
    (store.path / "slurm").mkdir()
    (store.path / "slurm" / "task-7_1.out").write_text("srun: error: Node failure on n2\n")
    store.log_path("p001").parent.mkdir(parents=True, exist_ok=True)
    store.log_path("p001").write_text("step    5/200  loss 4.1\n")
    polls = iter([{0: "RUNNING", 1: "NODE_FAIL"}, {0: "RUNNING", 1: "NODE_FAIL"}, {0: "COMPLETED", 1: "NODE_FAIL"}])

    def queue(job_id):
        states = next(polls)
        if states[0] == "COMPLETED":
            write_pending(store, _task_record(points[0], "7", "0"))
        return states

    finished: list[str] = []
    monkeypatch.setattr(slurm, "submit", lambda script: "7")
    monkeypatch.setattr(slurm, "release", lambda job_id: None)
    monkeypatch.setattr(slurm, "queue_states", queue)
    monkeypatch.setattr(slurm.time, "sleep", lambda s: None)
    with store.locked():
        slurm.submit_and_follow(store, points, SlurmOptions(), _progress(finished))
    assert finished == ["p001", "p000"]
    records = {r["point_id"]: r for r in store.read_records()[0]}
    failed = records["p001"]
    assert failed["status"] == "failed" and failed["slurm_state"] == "NODE_FAIL"
    assert failed["error"] == "Slurm task 7_1 ended NODE_FAIL without a record"
    assert "Node failure on n2" in failed["log_tail"] and "step    5/200" in failed["log_tail"]
    assert records["p000"]["status"] == "ok"


def test_continued_sweep_follows_queued_tasks_instead_of_resubmitting(tmp_path, monkeypatch):
    """The sweep that submitted job 7 was killed: task 0 still runs, task 1 ended without a record.
    Continuing submits only p001 (job 8), follows 7_0, and a stale record of p000 from a job the
    store does not know neither counts nor ends the wait for 7_0's own."""
    import moebench.sweep.slurm as slurm

    points = _points()
    store = _store_with_job(tmp_path, points)
    submitted: list[str] = []
    polls = {"7": iter([{0: "RUNNING", 1: "FAILED"}, {0: "RUNNING"}, {0: "RUNNING"}, {0: "COMPLETED"}]),
             "8": iter([{0: "RUNNING"}, {0: "COMPLETED"}, {0: "COMPLETED"}])}

    def queue(job_id):
        states = next(polls[job_id])
        if job_id == "7" and states == {0: "RUNNING"}:
            write_pending(store, _task_record(points[0], "3", "0"))
        if states == {0: "COMPLETED"}:
            write_pending(store, _task_record(points[0] if job_id == "7" else points[1], job_id, "0"))
        return states

    finished: list[str] = []
    warnings: list[str] = []
    monkeypatch.setattr(slurm, "submit", lambda script: submitted.append(script.read_text()) or "8")
    monkeypatch.setattr(slurm, "release", lambda job_id: None)
    monkeypatch.setattr(slurm, "queue_states", queue)
    monkeypatch.setattr(slurm.time, "sleep", lambda s: None)
    with store.locked():
        slurm.submit_and_follow(store, points, SlurmOptions(), _progress(finished), warnings.append)
    assert len(submitted) == 1 and "POINTS=(p001)" in submitted[0]
    assert [job["job_id"] for job in store.read_meta()["slurm"]["jobs"]] == ["7", "8"]
    assert sorted(finished) == ["p000", "p001"]
    records = store.read_records()[0]
    assert sorted((r["point_id"], r["slurm_job_id"], r["status"]) for r in records) == [
        ("p000", "7", "ok"), ("p001", "8", "ok")]
    assert warnings[0] == ("following Slurm task(s) still queued from an earlier run of this store: 7_0 "
                           "(their points are not submitted again)")
    assert "Slurm task 3_0, which this store did not submit" in warnings[1]


def test_a_sweep_without_slurm_refuses_points_that_queued_tasks_still_run(tmp_path, monkeypatch):
    import moebench.sweep.slurm as slurm
    from moebench.errors import StoreError

    points = _points()
    store = _store_with_job(tmp_path, points)
    monkeypatch.setattr(slurm, "queue_states", lambda job_id: {0: "RUNNING", 1: "COMPLETED"})
    with pytest.raises(StoreError, match=r"Slurm task\(s\) 7_0 of this store still run these points; continue "
                                         "with --slurm to follow them, or scancel them first"):
        slurm.refuse_queued(store, points)
    slurm.refuse_queued(store, points[1:])  # 7_1 ended: p001 may run here
    monkeypatch.setattr(slurm, "queue_states", lambda job_id: None)  # no squeue on this machine
    slurm.refuse_queued(store, points)


def test_cancelled_task_is_not_recorded_so_resume_runs_it_again(tmp_path, monkeypatch):
    import moebench.sweep.slurm as slurm
    from moebench.sweep.runner import select_points

    store = Store(tmp_path / "s")
    store.create({"suite": "s", "run_id": "r"})
    points = _points()

    def queue(job_id):  # task 0 is cancelled while task 1 finishes
        if not store.records_path.exists():
            write_pending(store, _task_record(points[1], "7", "1"))
        return {0: "CANCELLED", 1: "COMPLETED"}

    finished: list[str] = []
    warnings: list[str] = []
    monkeypatch.setattr(slurm, "submit", lambda script: "7")
    monkeypatch.setattr(slurm, "release", lambda job_id: None)
    monkeypatch.setattr(slurm, "queue_states", queue)
    monkeypatch.setattr(slurm.time, "sleep", lambda s: None)
    with store.locked():
        slurm.submit_and_follow(store, points, SlurmOptions(), _progress(finished), warnings.append)
    assert finished == ["p001"] and [r["point_id"] for r in store.read_records()[0]] == ["p001"]
    assert warnings == ["Slurm task 7_0 (p000) ended CANCELLED before it wrote a record: nothing recorded; "
                        "--resume runs it again"]
    assert [p.point_id for p in select_points(points, store.latest_by_run(), True, False)] == ["p000"]


def test_requeued_task_with_a_record_does_not_run_again(tmp_path, monkeypatch, capsys):
    import moebench.sweep.worker as worker
    from moebench.results.durable import write_json_atomic
    from moebench.sweep.status import POINTS_FILE

    points = _points()
    store = _store_with_job(tmp_path, points)
    write_json_atomic(store.path / POINTS_FILE, {"points": [p.to_dict() for p in points]})
    with store.locked():
        store.append(_task_record(points[0], "7", "0"))
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "7")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "0")
    monkeypatch.setattr(worker, "run_point", lambda *a, **k: pytest.fail("a recorded task ran its point again"))
    worker.main([str(store.path), "p000"])
    assert "this task has a record already" in capsys.readouterr().out
    assert not list((store.path / "pending").glob("*.json")) if (store.path / "pending").exists() else True


def test_multinode_argv_uses_torchrun_rendezvous():
    point = _points(**{"parallel.dp": 4, "train.micro_batch_size": 4})[0]
    assert point.valid and point.nproc == 4
    argv = multinode_argv(point, nodes=2, head="node-a", job_id="77")
    assert argv[:2] == ["srun", "--nodes=2"]
    assert "--nproc-per-node=2" in argv and "--rdzv-endpoint=node-a:29577" in argv and "--rdzv-backend=c10d" in argv
    assert "--nproc" not in argv and argv[-1] == "--json"


def test_rendezvous_at_the_first_nodes_address(monkeypatch):
    import moebench.launch.multinode as multinode

    calls = []

    def scontrol(args):
        calls.append(args)
        if args[:2] == ["show", "hostnames"]:
            return "gpu-a017\ngpu-a018\n"
        return "NodeName=gpu-a017 Arch=x86_64 CoresPerSocket=32 NodeAddr=10.1.0.17 NodeHostName=gpu-a017\n"

    monkeypatch.delenv("MOEBENCH_RDZV_HOST", raising=False)
    monkeypatch.setattr(multinode, "_scontrol", scontrol)
    assert multinode.rendezvous_host("gpu-a[017-018]") == "10.1.0.17"
    assert calls[-1] == ["show", "node", "-o", "gpu-a017"]
    monkeypatch.setenv("MOEBENCH_RDZV_HOST", "head-ib0")
    assert multinode.rendezvous_host("gpu-a[017-018]") == "head-ib0"
    # array tasks sharing a node meet at different ports
    assert multinode.rendezvous_port("1000") != multinode.rendezvous_port("1001")


def test_train_in_a_multi_node_allocation_spreads_its_ranks(monkeypatch):
    """``moebench train --nproc 4`` in an salloc shell or sbatch script of 2 nodes: srun torchrun,
    2 ranks a node; inside a job step, or outside Slurm, it stays a local launch (and the batch
    script's SLURM_NTASKS does not make it a rank)."""
    import moebench.launch.multinode as multinode
    from moebench.train.distributed import adopt_launch_env

    alloc = {"SLURM_JOB_ID": "41", "SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS": "2", "SLURM_PROCID": "0"}
    assert multinode.allocation_nodes(alloc) == 2
    assert multinode.allocation_nodes({**alloc, "SLURM_STEP_ID": "0"}) == 1 and multinode.allocation_nodes({}) == 1
    for name, value in {**alloc, "SLURM_JOB_NODELIST": "gpu-a[017-018]", "SLURM_CPUS_ON_NODE": "8"}.items():
        monkeypatch.setenv(name, value)
    for name in ("WORLD_SIZE", "RANK", "SLURM_STEP_ID", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    assert not adopt_launch_env() and "WORLD_SIZE" not in os.environ
    runs = []
    monkeypatch.setattr(multinode, "rendezvous_host", lambda nodelist: f"head-of-{nodelist}")
    monkeypatch.setattr(multinode.subprocess, "run", lambda cmd, env: runs.append((cmd, env)) or
                        subprocess.CompletedProcess(cmd, 0))
    assert multinode.launch_across(2, 4, ["train", "--preset", "tiny", "--json"]) == 0
    (cmd, env), = runs
    assert cmd[:4] == ["srun", "--nodes=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    assert "--nproc-per-node=2" in cmd and "--rdzv-endpoint=head-of-gpu-a[017-018]:29541" in cmd
    assert cmd[-4:] == ["train", "--preset", "tiny", "--json"] and env["OMP_NUM_THREADS"] == "4"
    with pytest.raises(ConfigError, match="--nproc 3: this Slurm allocation has 2 nodes"):
        multinode.launch_across(2, 3, ["train"])
    # an salloc shell has no SLURM_CPUS_ON_NODE: the job's CPUs per node say how many threads a rank gets
    monkeypatch.delenv("SLURM_CPUS_ON_NODE")
    monkeypatch.setenv("SLURM_JOB_CPUS_PER_NODE", "6(x2)")
    assert multinode.rank_threads(2) == {"OMP_NUM_THREADS": "3"}
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert multinode.rank_threads(2) == {}


def test_queue_states_parses_array_ranges(monkeypatch):
    out = subprocess.CompletedProcess([], 0, "12_[2-3] PENDING\n12_0 RUNNING\n12_1 COMPLETING\n", "")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: out)
    assert queue_states("12") == {0: "RUNNING", 1: "COMPLETING", 2: "PENDING", 3: "PENDING"}
    gone = subprocess.CompletedProcess([], 1, "", "slurm_load_jobs error: Invalid job id specified")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: gone)
    assert queue_states("12") == {}


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.skipif(not (shutil.which("sbatch") and idle_nodes()),
                    reason="no Slurm cluster (run scripts/slurm-local.sh to start one)")
def test_real_slurm_two_point_sweep(tmp_path):
    """Two CPU points through sbatch as a job array; both records arrive in the store."""
    suite = tiny_suite("slurm-it", set={"train.warmup_steps": 1, "train.device": "cpu"},
                       grid={"moe.num_experts": [4, 8]}, timeout=150)
    lines: list[str] = []
    out = run_suite(suite, tmp_path / "store", SweepOptions(progress=False, echo=lines.append,
                                                            slurm=SlurmOptions(poll_s=1.0, cpus_per_task=1, time="10")))
    df, meta = load_results(out)
    assert sorted(df["point_id"]) == ["p000", "p001"]
    assert df["status"].tolist() == ["ok", "ok"], df.get("log_tail").tolist()
    assert sorted(df["config.moe.num_experts"]) == [4, 8]
    assert df["slurm_job_id"].tolist() == [meta["slurm"]["jobs"][0]["job_id"]] * 2
    assert (out / "slurm" / "sweep.sbatch").exists() and not list((out / "pending").glob("*.json"))
    assert len(lines) == 3 and lines[0].startswith("run") and "p000 ok" in status_table(out)  # a header, a line a point
    assert "base" not in lines[1] + lines[2]  # the suite's baseline axis is not swept: no ratio to show
    assert sys.executable in (out / "slurm" / "sweep.sbatch").read_text()


def test_an_interrupt_between_sbatch_and_release_leaves_a_held_job_the_store_knows(tmp_path, monkeypatch):
    """The array is submitted held and released only once meta.json records it: a sweep stopped in
    between leaves a job that cannot run unseen, and the next --slurm run follows and releases it."""
    import moebench.sweep.slurm as slurm

    store = Store(tmp_path / "s")
    store.create({"suite": "s", "run_id": "r"})
    points = _points()
    submitted: list[str] = []
    released: list[str] = []

    def interrupted(job_id):
        assert [job["job_id"] for job in store.read_meta()["slurm"]["jobs"]] == [job_id]  # known before release
        raise KeyboardInterrupt

    monkeypatch.setattr(slurm, "submit", lambda script: submitted.append(script.read_text()) or "7")
    monkeypatch.setattr(slurm, "release", interrupted)
    monkeypatch.setattr(slurm.time, "sleep", lambda s: None)
    with store.locked(), pytest.raises(KeyboardInterrupt):
        slurm.submit_and_follow(store, points, SlurmOptions(), _progress([]))
    # the next run: Slurm still holds both tasks; they finish once released
    monkeypatch.setattr(slurm, "release", released.append)

    def queue(job_id):
        if not released:
            return {0: "PENDING", 1: "PENDING"}
        for i, point in enumerate(points):
            write_pending(store, _task_record(point, job_id, str(i)))
        return {0: "COMPLETED", 1: "COMPLETED"}

    monkeypatch.setattr(slurm, "queue_states", queue)
    finished: list[str] = []
    with store.locked():
        slurm.submit_and_follow(store, points, SlurmOptions(), _progress(finished), lambda line: None)
    assert len(submitted) == 1 and released == ["7"] and sorted(finished) == ["p000", "p001"]


@pytest.mark.slow
def test_submit_holds_the_array(tmp_path, monkeypatch):
    import moebench.sweep.slurm as slurm

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text('#!/bin/sh\necho "$@" > "$0.args"\necho "42;cluster"\n')
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    assert slurm.submit(tmp_path / "x.sbatch") == "42"
    assert (bin_dir / "sbatch.args").read_text().split()[:2] == ["--parsable", "--hold"]
