"""Sweep runner: isolated points, failure classes, no orphans, resume and rerun-failed.

A scripted stand-in for ``moebench train`` (written to tmp_path) keeps these tests fast and
lets each point choose its fate from its ``--set`` values; one test runs the real trainer.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from report_helpers import run_cli
from sweep_helpers import tiny_suite

from moebench.cli import cli
from moebench.errors import ConfigError, StoreError
from moebench.launch.procs import alive
from moebench.launch.tree import Outcome, run_process
from moebench.results.load import load_results
from moebench.results.store import Store
from moebench.sweep.launch import classify
from moebench.sweep.progress import SUMMARY_HEADER, PointTicker, latest_step
from moebench.sweep.runner import SweepOptions, run_suite
from moebench.sweep.status import failed_points, status_table
from moebench.sweep.suite import parse_suite

FAKE_TRAIN = textwrap.dedent("""
    import json, os, subprocess, sys, time
    args = dict(a.split("=", 1) for a in sys.argv[sys.argv.index("--set") :] if "=" in a)
    seed = int(args.get("train.seed", 0))
    experts = int(args.get("moe.num_experts", 8))
    print("step 1 loss 5.0")
    if seed == 1:
        print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", file=sys.stderr)
        sys.exit(1)
    if seed == 2:  # hang, with a grandchild in the same group that must die too
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
        open(os.environ["FAKE_PIDFILE"], "w").write(str(child.pid))
        time.sleep(300)
    if seed == 3:
        print("Traceback (most recent call last):\\nRuntimeError: boom", file=sys.stderr)
        sys.exit(3)
    flag = os.environ.get("FAKE_FAIL_ONCE")
    if seed == 4 and flag and not os.path.exists(flag):
        open(flag, "w").close()
        sys.exit(5)
    if seed == 5:
        open(os.environ["FAKE_PIDFILE"] + ".sleeper", "w").write(str(os.getpid()))
        time.sleep(float(os.environ.get("FAKE_SLEEP", "0")))
    print(json.dumps({"schema_version": 1, "status": "ok", "tokens_per_s": 100.0 * experts,
                      "tokens_per_s_per_device": 50.0 * experts, "peak_mem_bytes": 2**20, "step_times_s": [0.1, 0.1]}),
          flush=True)
    if seed == 7:  # finished and reported, but slow to exit (a long teardown)
        open(os.environ["FAKE_PIDFILE"] + ".finished", "w").write(str(os.getpid()))
        time.sleep(300)
""")


@pytest.fixture
def fake(tmp_path, fake_trainer):
    return fake_trainer(FAKE_TRAIN, FAKE_PIDFILE=str(tmp_path / "grandchild.pid"))


def _suite(seeds, experts=(8,), timeout=60.0, **extra):
    fields = {"grid": {"moe.num_experts": list(experts)}, "zip": {"train.seed": list(seeds)}, "timeout": timeout}
    return tiny_suite(**{**fields, **extra})  # a zip in extra replaces the seeds


@pytest.mark.slow
def test_statuses_and_sweep_continues(tmp_path, fake):
    suite = _suite(seeds=[0, 1, 2, 3], timeout=3)
    lines = []
    out = run_suite(suite, tmp_path / "store", SweepOptions(progress=False, echo=lines.append, launcher=fake))
    df, meta = load_results(out)
    status = dict(zip(df["point.train.seed"], df["status"], strict=True))
    assert status == {0: "ok", 1: "oom", 2: "timeout", 3: "failed"}
    rows = df.set_index("point.train.seed")
    assert rows.loc[0, "tokens_per_s"] == 800.0 and not isinstance(rows.loc[0, "log_tail"], str)
    assert "CUDA out of memory" in rows.loc[1, "error"] and "CUDA out of memory" in rows.loc[1, "log_tail"]
    assert "time limit of 3 s of a fair share of the machine" in rows.loc[2, "error"]
    assert "the suite's `timeout` key, or --timeout" in rows.loc[2, "error"]
    assert rows.loc[2, "time_limit_s"] == 3 and rows.loc[2, "cores"] >= 1 and rows.loc[2, "load_start"] is not None
    assert "exit code 3" in rows.loc[3, "error"] and "RuntimeError: boom" in rows.loc[3, "error"]
    # failed points still carry their config, layout and cost model for the report
    assert rows.loc[3, "config.moe.num_experts"] == 8 and rows.loc[3, "layout.strategy"] == "ddp"
    assert rows.loc[3, "total_params"] > 0
    assert meta["suite"] == "t" and meta["baseline"] == {"parallel.strategy": "fsdp"}
    assert meta["git"]["commit"] and "torch" in meta["versions"] and meta["host"]["hostname"]
    # the rate per device, named as the report names it, not the total under a look-alike name
    # the timed-out run is tried once more at the end: its line comes twice
    assert len(lines) == 6 and lines[0].split()[:3] == ["run", "status", "tokens/s/dev"]
    assert [line.split()[:2] for line in lines[3:]] == [["p002", "timeout"], ["p003", "failed"], ["p002", "timeout"]]
    assert lines[1].split()[:3] == ["p000", "ok", "400"]
    assert "tok/s" not in lines[0] and "  400 tokens/s/dev  " in status_table(out).splitlines()[2]
    assert "step 1 loss" in (out / "logs" / "p003.log").read_text()
    # the hung point's grandchild was killed with its group: no orphans
    pid = int((tmp_path / "grandchild.pid").read_text())
    deadline = time.time() + 10
    while alive(pid) and time.time() < deadline:
        time.sleep(0.1)
    assert not alive(pid)
    assert failed_points(out) == ["p001", "p002", "p003"]


@pytest.mark.slow
def test_mllog_writes_each_run_beside_its_log(tmp_path, fake):
    from mllog_helpers import check, lines

    out = run_suite(_suite(seeds=[0, 1]), tmp_path / "store", SweepOptions(progress=False, echo=lambda _: None,
                                                                          launcher=fake, mllog=True))
    ok, oom = out / "logs" / "p000.mllog", out / "logs" / "p001.mllog"
    assert check(ok) == (True, []) and check(oom) == (True, [])
    assert lines(ok)["tracked_stats"][0]["value"]["throughput"] == 800.0
    assert lines(ok)["submission_benchmark"][0]["value"] == "moebench_tiny"
    assert lines(oom)["run_stop"][0]["metadata"] == {**lines(oom)["run_stop"][0]["metadata"], "status": "aborted",
                                                     "moebench_status": "oom"}
    with pytest.raises(ConfigError, match=r"--mllog .* not with --slurm"):
        run_suite(_suite(seeds=[0]), tmp_path / "s2", SweepOptions(slurm=object(), mllog=True))
    assert not (tmp_path / "s2").exists()


@pytest.mark.slow
def test_unstartable_command_is_an_environment_failure_that_resume_reruns(tmp_path, fake):
    suite = _suite(seeds=[0])
    out = run_suite(suite, tmp_path / "s", SweepOptions(progress=False, echo=lambda _: None,
                                                        launcher=lambda p: [str(tmp_path / "no-such-binary")]))
    df, _ = load_results(out)
    assert df["status"].tolist() == ["env_failed"] and "could not start" in df["error"].iloc[0]
    run_suite(suite, out, SweepOptions(resume=True, progress=False, echo=lambda _: None, launcher=fake))
    df, _ = load_results(out)
    assert df["status"].tolist() == ["ok"]


@pytest.mark.slow
def test_default_store_location_and_latest_link(tmp_path, fake):
    out = run_suite(_suite(seeds=[0]), options=SweepOptions(results_dir=tmp_path / "results", progress=False,
                                                            echo=lambda _: None, launcher=fake))
    assert out.parent == tmp_path / "results" / "t" and out.name.count("-") == 2
    assert (tmp_path / "results" / "t" / "latest").resolve() == out.resolve()


@pytest.mark.slow
def test_latest_link_follows_every_new_store_of_the_results_tree(tmp_path, fake):
    results = tmp_path / "results"
    runs = results / "t"
    for name in ("r1", "r2"):
        run_suite(_suite(seeds=[0]), runs / name, SweepOptions(results_dir=results, progress=False,
                                                               echo=lambda _: None, launcher=fake))
        assert os.readlink(runs / "latest") == name
    run_suite(_suite(seeds=[0]), runs / "r1", SweepOptions(resume=True, results_dir=results, progress=False,
                                                           echo=lambda _: None, launcher=fake))
    assert os.readlink(runs / "latest") == "r2"  # continuing an older run does not make it the newest
    # a store named latest is not replaced by a link to itself
    other = tmp_path / "other"
    run_suite(_suite(seeds=[0]), other / "t" / "latest", SweepOptions(results_dir=other, progress=False,
                                                                      echo=lambda _: None, launcher=fake))
    assert (other / "t" / "latest" / "meta.json").is_file()
    # a store outside <results-dir>/<suite>/ writes nothing into its parent folder
    run_suite(_suite(seeds=[0]), tmp_path / "elsewhere" / "r1", SweepOptions(results_dir=results, progress=False,
                                                                             echo=lambda _: None, launcher=fake))
    assert sorted(p.name for p in (tmp_path / "elsewhere").iterdir()) == ["r1"]


@pytest.mark.slow
def test_second_sweep_on_a_locked_fresh_store_writes_nothing(tmp_path, fake):
    from moebench.results.store import Store

    out = tmp_path / "st"
    with Store(out).locked(), pytest.raises(StoreError, match="locked by another sweep"):
        run_suite(_suite(seeds=[0]), out, SweepOptions(progress=False, echo=lambda _: None, launcher=fake))
    assert not (out / "meta.json").exists()


@pytest.mark.slow
def test_duplicate_point_does_not_overwrite_its_twin(tmp_path, fake):
    suite = _suite(seeds=[0], experts=(8, 8))
    warnings = []
    out = run_suite(suite, tmp_path / "s", SweepOptions(progress=False, echo=lambda _: None, launcher=fake,
                                                        warn=warnings.append))
    assert warnings == ["p001 resolves to the same config as p000: not run, it shares that point's record"]
    assert len(load_results(out, latest_only=False)[0]) == 1
    assert "p000 ok" in status_table(out) and "p001 ok" in status_table(out) and failed_points(out) == []


@pytest.mark.slow
def test_invalid_points_recorded_without_running(tmp_path, fake):
    suite = _suite(seeds=[0, 0], zip={"parallel.dp": [1, 2], "parallel.ep": [1, 3]})
    out = run_suite(suite, tmp_path / "s", SweepOptions(progress=False, echo=lambda _: None, launcher=fake))
    df, _ = load_results(out)
    assert df["status"].tolist() == ["ok", "invalid"]
    assert "parallel.ep=3" in df["error"].iloc[1]
    assert not (out / "logs" / "p001.log").exists()


@pytest.mark.slow
def test_resume_and_rerun_failed(tmp_path, fake, monkeypatch):
    monkeypatch.setenv("FAKE_FAIL_ONCE", str(tmp_path / "failed-once"))
    suite = _suite(seeds=[0, 4])
    store = tmp_path / "s"
    run_suite(suite, store, SweepOptions(progress=False, echo=lambda _: None, launcher=fake))
    assert failed_points(store) == ["p001"]
    with pytest.raises(StoreError, match="already holds a results store"):
        run_suite(suite, store, SweepOptions(progress=False, launcher=fake))
    ran = []
    run_suite(suite, store, SweepOptions(resume=True, progress=False, echo=ran.append, launcher=fake))
    assert ran == []  # every point has a record
    run_suite(suite, store, SweepOptions(rerun_failed=True, progress=False, echo=ran.append, launcher=fake))
    assert len(ran) == 2 and ran[0] == SUMMARY_HEADER and ran[1].startswith("p001    ok")
    assert failed_points(store) == []
    df, _ = load_results(store)
    assert df["status"].tolist() == ["ok", "ok"]
    assert len(load_results(store, latest_only=False)[0]) == 3
    with pytest.raises(StoreError, match="holds suite 't', not 'other'"):
        run_suite(parse_suite({"name": "other"}), store, SweepOptions(resume=True, launcher=fake))


@pytest.mark.slow
def test_sigkill_sweep_then_resume(tmp_path, fake):
    """SIGKILL the sweep mid-run: whole lines only, finished points kept, resume completes."""
    spec = {"name": "t", "base": {"preset": "tiny"}, "zip": {"train.seed": [0, 5, 6]}}
    store = tmp_path / "s"
    code = textwrap.dedent(f"""
        import sys
        from moebench.sweep.runner import SweepOptions, run_suite
        from moebench.sweep.suite import parse_suite
        launcher = lambda p: [sys.executable, {str(tmp_path / 'fake_train.py')!r}, *p.train_args()]
        run_suite(parse_suite({spec!r}), {str(store)!r}, SweepOptions(progress=False, launcher=launcher))
    """)
    env = {**os.environ, "FAKE_SLEEP": "300"}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.DEVNULL)
    records = store / "records.jsonl"
    deadline = time.time() + 60
    pidfile = tmp_path / "grandchild.pid.sleeper"
    while not (pidfile.exists() and pidfile.read_text()) and time.time() < deadline:
        time.sleep(0.1)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    lines = records.read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["status"] == "ok"
    # the running point got SIGTERM when its sweep died (PR_SET_PDEATHSIG): no orphan
    sleeper = int(pidfile.read_text())
    deadline = time.time() + 10
    while alive(sleeper) and time.time() < deadline:
        time.sleep(0.1)
    assert not alive(sleeper)
    ran = []
    run_suite(parse_suite(spec), store, SweepOptions(resume=True, progress=False, echo=ran.append, launcher=fake))
    assert [line[:4] for line in ran] == ["run ", "p001", "p002"]  # the column header first
    df, _ = load_results(store)
    assert df["status"].tolist() == ["ok", "ok", "ok"]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_an_interrupt_keeps_a_point_that_had_finished(tmp_path, fake, sig):
    """The run printed its record, then the sweep was interrupted while it exited: the record is kept."""
    spec = {"name": "t", "base": {"preset": "tiny"}, "zip": {"train.seed": [0, 7, 0]}}
    store = tmp_path / "s"
    code = textwrap.dedent(f"""
        import sys
        from moebench.sweep.runner import SweepOptions, run_suite
        from moebench.sweep.suite import parse_suite
        launcher = lambda p: [sys.executable, {str(tmp_path / 'fake_train.py')!r}, *p.train_args()]
        run_suite(parse_suite({spec!r}), {str(store)!r}, SweepOptions(progress=False, launcher=launcher))
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    finished = tmp_path / "grandchild.pid.finished"
    deadline = time.time() + 60
    while not (finished.exists() and finished.read_text()) and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert b"SweepInterrupted" in err
    assert [json.loads(line)["status"] for line in (store / "records.jsonl").read_text().splitlines()] == ["ok", "ok"]
    assert not alive(int(finished.read_text()))


@pytest.mark.slow
def test_run_process_kills_group_on_timeout(tmp_path):
    code = ("import subprocess, sys, time; "
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); "
            f"open({str(tmp_path / 'pid')!r}, 'w').write(str(c.pid)); print('started', flush=True); time.sleep(300)")
    outcome = run_process([sys.executable, "-c", code], tmp_path / "log", timeout_s=2, grace_s=1)
    assert outcome.timed_out
    pid = int((tmp_path / "pid").read_text())
    time.sleep(0.5)
    assert not alive(pid)
    log = (tmp_path / "log").read_text()
    assert "started" in log and "killed after its time limit of 2 s of a fair share of the machine" in log
    assert log.splitlines()[0] == f"$ {shlex.join([sys.executable, '-c', code])}"  # the command, quoted


def test_latest_step_of_this_attempt():
    log = ("$ train --seed 0\nstep    3/12  loss 5.0  0.100s  80 tokens/s/dev\n[moebench] killed\n"
           "$ train --seed 0\nW0101 a warning\nstep    1/12  loss 5.1  0.120s  1,234 tokens/s/dev\n"
           "step    2/12  loss 5.0  0.110s  1,300 tokens/s/dev\n  ")
    assert latest_step(log) == "step 2/12 1,300 tokens/s/dev"
    assert latest_step(log.rpartition("$ ")[0] + "$ train --seed 0\n") is None  # not the earlier attempt's step
    assert latest_step("step 4/5  loss 1.0  0.1s\n") == "step 4/5"


@pytest.mark.slow
def test_the_bar_follows_a_running_point_through_its_log(tmp_path):
    """Step lines reach the log as the point prints them, and the ticker shows the latest with the time."""
    code = "import sys, time; print('step    1/3  loss 5.0  0.100s  100 tokens/s/dev', file=sys.stderr); time.sleep(60)"
    log = tmp_path / "p000.log"
    worker = threading.Thread(target=run_process, args=([sys.executable, "-c", code], log, 4.0), daemon=True)
    worker.start()
    shown: list[str] = []
    ticker = PointTicker(shown.append, "p000", log, interval_s=0.05)
    deadline = time.time() + 30
    while not any("step" in s for s in shown) and time.time() < deadline:
        time.sleep(0.05)
    ticker.stop()
    assert worker.is_alive()  # shown while the point still runs, not when it ends
    assert shown[0] == "p000 00:00" or shown[0].startswith("p000 step")
    assert re.fullmatch(r"p000 step 1/3 100 tokens/s/dev 00:0\d", next(s for s in shown if "step" in s))
    worker.join()


@pytest.mark.parametrize("outcome, record, tail, status, error", [
    (Outcome(0, False, None, 1), {"status": "ok"}, "", "ok", None),
    (Outcome(1, False, None, 1), {"status": "oom", "error": "CUDA OOM"}, "", "oom", "CUDA OOM"),
    (Outcome(1, False, None, 1), None, "x\nMemoryError\n", "oom", "MemoryError"),
    (Outcome(-9, False, None, 1), None, "", "oom", "kernel OOM killer"),
    (Outcome(None, True, None, 1), None, "CUDA out of memory", "timeout", "time limit of 5 s"),
    (Outcome(2, False, None, 1), None, "Error: No such option '--nproc'.", "failed", "exit code 2: Error: No such"),
    (Outcome(0, False, "not json", 1), None, "", "failed", "without a JSON run record"),
    (Outcome(-11, False, None, 1), None, "", "failed", "killed by signal 11"),
    # a loss that went NaN (NaN in the printed line, null once through the store) is no ok run
    (Outcome(0, False, None, 1), {"status": "ok", "losses": [5.0, float("nan")]}, "", "diverged", "at step 2 of 2"),
    (Outcome(0, False, None, 1), {"status": "ok", "losses": [5.0, None]}, "", "diverged", "missing at step 2"),
    (Outcome(0, False, None, 1), {"status": "ok", "losses": [5.0], "loss_last": float("inf")}, "", "diverged",
     "loss_last is inf"),
    (Outcome(0, False, None, 1), {"status": "ok", "losses": [5.0, 4.0], "loss_last": 4.0}, "", "ok", None),
])
def test_classify(outcome, record, tail, status, error):
    got_status, got_error = classify(outcome, record, tail, timeout_s=5)
    assert got_status == status
    assert (got_error is None) if error is None else (error in got_error)


def test_cli_exit_codes_and_status(tmp_path, monkeypatch):
    """CLI wiring (exit codes, --allow-failures, status): one point fails at once, one is invalid."""
    from moebench.sweep import runner as sweep_runner
    from moebench.sweep.launch import point_record

    monkeypatch.setattr(sweep_runner, "run_point", lambda point, log, **_: point_record(point, "failed", "boom"))
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"name": "c", "base": {"preset": "tiny"},
                                    "zip": {"parallel.dp": [1, 2], "parallel.ep": [1, 3]}}))
    runner = CliRunner()
    result = runner.invoke(cli, ["run", str(path), "--out", str(tmp_path / "st"), "--no-progress"])
    # the rerun hint lists only what a rerun can fix; the invalid point comes with its reason
    reason = load_results(tmp_path / "st")[0].set_index("point_id").loc["p001", "error"]
    assert "ep" in reason
    assert f"render it: moebench report {tmp_path / 'st'}" in result.stdout
    assert result.exit_code == 1 and result.stderr.splitlines()[-2:] == [
        f"1 point(s) not ok: p000 (rerun them with --out {tmp_path / 'st'} --rerun-failed)",
        f"p001 invalid (a rerun cannot fix it; change the suite): {reason}",
    ]
    result = runner.invoke(cli, ["run", str(path), "--out", str(tmp_path / "st"), "--rerun-failed",
                                 "--allow-failures", "--no-progress"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(cli, ["status", str(tmp_path / "st")])
    assert result.exit_code == 0 and "p001 invalid" in result.output and "1 failed, 1 invalid" in result.output
    assert "p000" in status_table(tmp_path / "st")
    (tmp_path / "other").mkdir()
    result = runner.invoke(cli, ["status", str(tmp_path / "other")])
    assert isinstance(result.exception, StoreError) and "no results store here" in str(result.exception)
    assert not (tmp_path / "other" / ".lock").exists()
    # once the failed point is ok, nothing is left to rerun: no hint, but the invalid point still fails the run
    monkeypatch.setattr(sweep_runner, "run_point", lambda point, log, **_: point_record(point, "ok", None))
    result = runner.invoke(cli, ["run", str(path), "--out", str(tmp_path / "st"), "--rerun-failed", "--no-progress"])
    assert result.exit_code == 1 and "--rerun-failed" not in result.stderr
    assert result.stderr.splitlines()[-1] == f"p001 invalid (a rerun cannot fix it; change the suite): {reason}"


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_an_interrupted_run_says_how_to_continue(tmp_path, sig):
    """Ctrl-C, SIGTERM or SIGHUP while a point runs: the store path and the exact command that continues it."""
    started = tmp_path / "started"
    code = textwrap.dedent(f"""
        import sys, time
        from moebench.sweep import runner
        def slow(point, log, stop, **_):
            open({str(started)!r}, "w").close()
            stop.wait(120)  # as run_point does: the interrupt stops the point's tree
        runner.run_point = slow
        from moebench.cli import main
        main()
    """)
    suite = tmp_path / "s.yaml"
    suite.write_text(yaml.safe_dump({"name": "i", "base": {"preset": "tiny"}, "grid": {"moe.num_experts": [4, 8]}}))
    store = tmp_path / "my store"
    argv = [sys.executable, "-c", code, "run", str(suite), "--out", str(store), "--no-progress", "--allow-failures"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not started.exists() and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err
    assert err.splitlines()[-2:] == [
        f"interrupted by {signal.Signals(sig).name}; finished points are kept in the store: {store}",
        f"continue with: moebench run {suite} --out '{store}' --resume --allow-failures --no-progress",
    ]


@pytest.fixture
def quick_cli(tmp_path, monkeypatch, capsys):
    """``moebench ARGS`` in-process on a two-point suite file whose points finish at once."""
    from moebench.sweep import runner as sweep_runner
    from moebench.sweep.launch import point_record

    monkeypatch.setattr(sweep_runner, "run_point", lambda point, log, **_: point_record(point, "ok", None))
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"name": "q", "base": {"preset": "tiny"}, "grid": {"moe.num_experts": [4, 8]}}))
    return path, lambda *args: run_cli(list(args), monkeypatch, capsys)


def test_resume_names_unreadable_lines_and_keeps_every_byte(tmp_path, quick_cli):
    suite, moebench = quick_cli
    store = tmp_path / "st"
    assert moebench("run", str(suite), "--out", str(store), "--no-progress")[0] == 0
    records = store / "records.jsonl"
    first, second = records.read_bytes().splitlines(keepends=True)
    records.write_bytes(first + b"garbage\n" + second[:40])  # p001's record cut short by a crash
    before = records.read_bytes()
    code, out, err = moebench("run", str(suite), "--out", str(store), "--resume", "--no-progress")
    assert code == 0, err
    assert f"warning: {records}:2: corrupt line" in err and f"warning: {records}:3: truncated line" in err
    assert "Traceback" not in err and "p001    ok" in out and "p000" not in out  # only the unreadable point reran
    after = records.read_bytes()
    assert after.startswith(before) and len(after.splitlines()) == 4


def test_status_shows_a_damaged_store_without_a_traceback(tmp_path, quick_cli):
    suite, moebench = quick_cli
    store = tmp_path / "st"
    moebench("run", str(suite), "--out", str(store), "--no-progress")
    records = store / "records.jsonl"
    p000 = json.loads(records.read_text().splitlines()[0])
    with open(records, "a") as f:
        f.write(json.dumps({**p000, "key": [1]}) + "\n")
        f.write(json.dumps({**p000, "tokens_per_s": "fast", "peak_mem_bytes": [1], "point_wall_s": "x"}) + "\n")
    code, out, err = moebench("status", str(store))
    assert code == 0 and "Traceback" not in err
    assert err.strip() == f"warning: {records}:3: field 'key' must be a non-empty string, got [1] (not read)"
    assert "p000 ok" in out and "p001 ok" in out
    meta = json.loads((store / "meta.json").read_text())
    (store / "meta.json").write_text(json.dumps({**meta, "slurm": {"job": 1}}))
    code, _, err = moebench("status", str(store))
    assert code == 2 and "meta.json: field 'slurm' must list its jobs as" in err


def _snapshot(folder: Path) -> dict[str, tuple[bytes | None, int]]:
    """Every entry below ``folder``: its bytes (None for a folder) and its mtime."""
    return {str(p.relative_to(folder)): (None if p.is_dir() else p.read_bytes(), p.stat().st_mtime_ns)
            for p in [folder, *folder.rglob("*")]}


def test_status_is_read_only(tmp_path, quick_cli):
    """A half-written last line is reported, not repaired; a pending Slurm record is shown, not merged."""
    from moebench.sweep.slurm import write_pending

    suite, moebench = quick_cli
    store = tmp_path / "st"
    moebench("run", str(suite), "--out", str(store), "--no-progress")
    records = store / "records.jsonl"
    first, second = records.read_bytes().splitlines(keepends=True)
    records.write_bytes(first + second[:40])
    p001 = json.loads(second)  # as Slurm task 7_1 of the store wrote it
    task = {"point_id": "p001", "key": p001["key"]}
    Store(store).update_meta(slurm={"jobs": [{"job_id": "7", "tasks": {"1": task}}]})
    write_pending(Store(store), {**p001, "slurm_job_id": "7", "slurm_task_id": "1"})
    assert (store / ".lock").read_text() == ""  # the finished sweep emptied its holder line
    (store / ".lock").write_text("pid 1 on elsewhere since then")  # status must not rewrite a lock either
    before = _snapshot(store)
    time.sleep(0.01)  # a rewrite within the same clock tick would keep the mtime
    code, out, err = moebench("status", str(store))
    assert code == 0, err
    assert f"warning: {records}:2: truncated line" in err
    assert "p000 ok" in out and "p001 ok" in out  # p001's record waits in pending/
    assert _snapshot(store) == before


def test_status_reads_what_report_reads(tmp_path, quick_cli):
    """A folder of stores (``results/<suite>``, its ``latest`` link counted once) or a records.jsonl."""
    suite, moebench = quick_cli
    runs = tmp_path / "results" / "q"
    for name in ("r1", "r2"):
        moebench("run", str(suite), "--out", str(runs / name), "--results-dir", str(tmp_path / "results"),
                 "--no-progress")
    assert os.readlink(runs / "latest") == "r2"
    code, out, err = moebench("status", str(runs))
    assert code == 0, err
    assert [line for line in out.splitlines() if line.startswith("store: ")] == [f"store: {runs / 'r1'}",
                                                                                 f"store: {runs / 'r2'}"]
    assert out.count("p001 ok") == 2
    code, out, err = moebench("status", str(runs / "r1" / "records.jsonl"))
    assert code == 0 and "store:" not in out and "p000 ok" in out and "2 ok" in out


def test_corrupt_plan_is_a_store_error_naming_the_file(tmp_path, capsys):
    from moebench.sweep.worker import main as worker_main

    store = tmp_path / "st"
    store.mkdir()
    (store / "points.json").write_text('{"points": [')
    with pytest.raises(StoreError, match=r"points\.json: corrupt JSON \(Expecting value"):
        status_table(store)
    with pytest.raises(SystemExit) as exit_info:
        worker_main([str(store), "p000"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "points.json" in err and "Traceback" not in err
    (store / "points.json").write_text('{"points": {"p000": 1}}')
    with pytest.raises(StoreError, match="expected a list of points"):
        status_table(store)
    (store / "points.json").write_text('{"points": [{"point_id": "p000", "key": "k"}]}')
    with pytest.raises(StoreError, match=r"points\.json: points\[0\]\.values: missing or of the wrong type"):
        status_table(store)


@pytest.mark.slow
def test_real_trainer_two_ranks(tmp_path):
    """One DDP + expert-parallel point on 2 ranks through the real ``moebench train --nproc 2``."""
    suite = parse_suite({"name": "real", "base": {"preset": "tiny", "set": {
        "train.steps": 3, "train.warmup_steps": 1, "train.device": "cpu", "parallel.strategy": "ddp",
        "parallel.dp": 2, "parallel.ep": 2, "parallel.dispatcher": "rowwise"}}, "timeout": 170})
    out = run_suite(suite, tmp_path / "s", SweepOptions(progress=False, echo=lambda _: None))
    df, _ = load_results(out)
    row = df.iloc[0]
    assert row["status"] == "ok", row.get("log_tail")
    assert row["nproc"] == 2 and row["world_size"] == 2 and row["layout.ep"] == 2
    assert row["tokens_per_s"] > 0 and row["config.train.steps"] == 3 and len(row["step_times_s"]) == 2
    # one line per step from rank 0 reached the log before the record: what the bar reads
    log = (out / "logs" / "p000.log").read_text()
    steps = [line for line in log.splitlines() if line.startswith(("step ", "warmup "))]
    assert [line.split()[:2] for line in steps] == [["warmup", "1/1"], ["step", "1/2"], ["step", "2/2"]]
    assert all(re.fullmatch(r"(warmup|step) +\d/\d  loss \d+\.\d+  \d+\.\d+s  [\d,]+ tokens/s/dev", line)
               for line in steps)
    assert re.fullmatch(r"step 2/2 [\d,]+ tokens/s/dev", latest_step(log))


def test_set_overrides_every_point_and_resume_applies_it_again(tmp_path, quick_cli):
    suite, moebench = quick_cli
    store = tmp_path / "st"
    code, out, err = moebench("run", str(suite), "--out", str(store), "--set", "train.steps=5", "--only", "p000",
                              "--no-progress")
    assert code == 0, err  # p001 was not asked for: not a failure of this run
    assert json.loads((store / "meta.json").read_text())["set"] == {"train.steps": 5}
    code, out, err = moebench("run", str(suite), "--out", str(store), "--resume", "--no-progress")
    assert code == 0, err
    assert "p001    ok" in out and "p000" not in out  # same keys: p000's record still counts
    df, _ = load_results(store)
    assert df["config.train.steps"].tolist() == [5, 5] and df["point_id"].tolist() == ["p000", "p001"]
    code, _, err = moebench("run", str(suite), "--out", str(store), "--resume", "--set", "train.steps=6")
    assert code == 2 and err == (f"error: {store} was started with --set train.steps=5 (field 'set' of "
                                 f"{store / 'meta.json'}); drop --set to continue it with those, "
                                 "or start a new store\n")


def test_filter_runs_the_matching_points_only(tmp_path, quick_cli):
    suite, moebench = quick_cli
    code, out, err = moebench("run", str(suite), "--out", str(tmp_path / "st"), "--filter", "moe.num_experts=8",
                              "--no-progress")
    assert code == 0, err
    assert load_results(tmp_path / "st")[0]["point_id"].tolist() == ["p001"]
    code, out, _ = moebench("run", str(suite), "--dry-run", "--only", "p000", "--set", "train.steps=5")
    assert code == 0 and "p000" in out and "p001" not in out


@pytest.mark.parametrize("args, message", [
    (["--set", "moe.nope=1"], "--set moe.nope=1: unknown key 'moe.nope'; moe fields are: "),
    (["--set", "moe.top_k=four"], "--set moe.top_k=four: bad value 'four' for moe.top_k; expected an integer"),
    (["--set", "moe.num_experts=16"], "--set moe.num_experts=16: moe.num_experts is an axis of "),
    (["--set", "train.steps"], "--set train.steps: expected KEY=VALUE"),
    (["--only", "p000,p009"], "--only p009: no such point; the suite has p000, p001"),
    (["--filter", "moe.top_k=2"], "--filter moe.top_k=2: moe.top_k is not an axis of the suite; axes: moe.num_experts"),
    (["--filter", "moe.num_experts=many"], "--filter moe.num_experts=many: bad value 'many' for moe.num_experts"),
    # a value no point has lists the values there are
    (["--filter", "moe.num_experts=16"], "--filter moe.num_experts=16: no point has it; moe.num_experts takes 4, 8\n"),
    (["--only", "p000", "--filter", "moe.num_experts=8"], "--only p000 --filter moe.num_experts=8: no point of the "
                                                          "suite matches"),
])
def test_bad_set_or_selection_is_one_line_before_any_store(tmp_path, quick_cli, args, message):
    suite, moebench = quick_cli
    code, _, err = moebench("run", str(suite), "--out", str(tmp_path / "st"), *args)
    assert code == 2 and err.startswith(f"error: {message}") and len(err.splitlines()) == 1, err
    assert not (tmp_path / "st").exists()


def test_status_has_a_header_and_tells_interrupted_from_running(tmp_path, quick_cli):
    from moebench.results.store import Store, commit_label

    suite, moebench = quick_cli
    store = tmp_path / "st"
    assert moebench("run", str(suite), "--out", str(store), "--only", "p000", "--no-progress")[0] == 0
    code, out, _ = moebench("status", str(store))
    lines = out.splitlines()
    meta = Store(store).read_meta()
    created = meta["created_at"]
    # the store's header: which suite, run and commit, when it started, and whether a sweep holds it
    assert lines[0] == (f"suite {meta['suite']}, run {meta['run_id']}, commit {commit_label(meta)}, "
                        f"started {created[:10]} {created[11:16]} UTC: no sweep holds the store; 1 run not started")
    assert code == 0 and lines[1].split()[:2] == ["run", "state"] and lines[3].startswith("p001 pending")
    Store(store).log_path("p001").write_text("$ train\nstep    1/3  loss 5.0  0.100s  100 tokens/s/dev\n")
    code, out, _ = moebench("status", str(store))  # a log, no record, no sweep: it was cut short
    lines = out.splitlines()
    assert lines[3].startswith("p001 interrupted") and "1 interrupted, 1 ok" in out
    assert lines[0].endswith(": interrupted (no sweep holds the store; 1 run cut short)"), lines[0]
    with Store(store).locked():  # a sweep holds the store: its newest log is the running point
        code, out, _ = moebench("status", str(store))
    lines = out.splitlines()
    assert lines[3].startswith("p001 running ") and lines[0].endswith(": a sweep holds the store now"), lines[0]
