"""Process faults of multi-rank points: no process outlives its point whatever kills the sweep, a
failed point names the failing rank's own error, OOM kills are ``oom``, a closed stdout stops nothing.

The points run through the real leader (torchrun's agent in-process,
``moebench.launch.leader.launch_ranks``) and the real rank wrapper, with a scripted rank program
instead of the trainer so that each test takes seconds; each rank also starts a helper in a session
of its own, which only the leader's subreaper clean-up can find.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from moebench.launch.procs import alive, processes_with_env
from moebench.results.load import load_results
from moebench.sweep.launch import STORE_MARKER_ENV
from moebench.sweep.runner import SweepOptions, run_suite
from moebench.sweep.suite import parse_suite

# train.seed picks the fate: 0 ok, 1 every rank hangs, 2 rank 1 raises, 3 rank 1 runs out of address
# space, 4 rank 1 is SIGKILLed (the kernel OOM killer, simulated); in 2-4 rank 0 waits as in a collective.
FAKE_RANK = textwrap.dedent("""
    import json, os, resource, signal, subprocess, sys, time
    rank = int(os.environ["RANK"])
    fate = int(dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a).get("train.seed", 0))
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
    with open(os.path.join(os.environ["FAKE_PIDS"], f"rank{rank}"), "w") as f:
        f.write(f"{os.getpid()} {helper.pid}")
    print(f"rank {rank} up", file=sys.stderr)
    if fate == 1:
        time.sleep(300)
    if rank == 1 and fate == 2:
        raise RuntimeError("expert shard 3 is missing on rank 1")
    if rank == 1 and fate == 3:
        size = int(next(l.split()[1] for l in open("/proc/self/status") if l.startswith("VmSize:"))) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (size + 2**28, resource.getrlimit(resource.RLIMIT_AS)[1]))
        buffer = bytearray(2**34)
    if rank == 1 and fate == 4:
        buffer = bytearray(2**26)
        os.kill(os.getpid(), signal.SIGKILL)
    if fate:
        time.sleep(300)
    if rank == 0:
        print(json.dumps({"schema_version": 1, "status": "ok", "tokens_per_s": 10.0, "step_times_s": [0.1]}))
""")
LEADER = "import sys; from moebench.launch.leader import launch_ranks; sys.exit(launch_ranks(2, sys.argv[1:]))"


@pytest.fixture
def ranks(tmp_path, monkeypatch):
    """(launcher, pid folder): the point's command runs the real leader on 2 scripted ranks."""
    script = tmp_path / "fake_rank.py"
    script.write_text(FAKE_RANK)
    pids = tmp_path / "pids"
    pids.mkdir()
    monkeypatch.setenv("FAKE_PIDS", str(pids))
    return (lambda point: [sys.executable, "-c", LEADER, str(script), *point.train_args()]), pids


def _suite(fates, timeout=60):
    return {"name": "f", "base": {"preset": "tiny", "set": {"parallel.dp": 2}}, "zip": {"train.seed": list(fates)},
            "timeout": timeout}


def _rank_pids(pids: Path) -> list[int]:
    """Every rank's pid and its helper's, from the files the ranks wrote."""
    return [int(pid) for path in pids.glob("rank*") for pid in path.read_text().split()]


def _survivors(store: Path, pids: Path, within_s: float = 10.0) -> list[int]:
    """Processes of the store's points still alive after ``within_s``: marked ones, ranks, helpers."""
    deadline = time.time() + within_s
    while True:
        left = sorted(set(processes_with_env(STORE_MARKER_ENV, str(store.resolve())))
                      | {pid for pid in _rank_pids(pids) if alive(pid)})
        if not left or time.time() > deadline:
            return left
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGHUP, signal.SIGTERM])
def test_killing_the_sweep_leaves_no_process_of_its_point(tmp_path, ranks, sig):
    _, pids = ranks
    store = tmp_path / "s"
    code = textwrap.dedent(f"""
        import sys
        from moebench.sweep.runner import SweepOptions, run_suite
        from moebench.sweep.suite import parse_suite
        launcher = lambda p: [sys.executable, "-c", {LEADER!r}, {str(tmp_path / 'fake_rank.py')!r}, *p.train_args()]
        run_suite(parse_suite({_suite([1])!r}), {str(store)!r}, SweepOptions(progress=False, launcher=launcher))
    """)
    sweep = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while len(list(pids.glob("rank*"))) < 2 and time.time() < deadline:
        time.sleep(0.05)
    assert len(_rank_pids(pids)) == 4, "the ranks never started"
    time.sleep(0.2)  # the ranks' pid files are written before they run on: let them
    sweep.send_signal(sig)
    sweep.wait(timeout=30)
    assert _survivors(store, pids) == []


@pytest.mark.slow
def test_failed_ranks_record_their_own_error_and_oom_kills_are_oom(tmp_path, ranks):
    launcher, pids = ranks
    out = run_suite(parse_suite(_suite([2, 3, 4])), tmp_path / "s", SweepOptions(progress=False, echo=lambda _: None,
                                                                                 launcher=launcher))
    rows = load_results(out)[0].set_index("point.train.seed")
    assert rows.loc[2, "status"] == "failed"
    assert rows.loc[2, "error"] == "rank 1: RuntimeError: expert shard 3 is missing on rank 1"
    assert rows.loc[3, "status"] == "oom" and rows.loc[3, "error"] == "rank 1: MemoryError"
    assert rows.loc[4, "status"] == "oom" and rows.loc[4, "error"].startswith("rank 1: killed by SIGKILL")
    records = {r["point"]["train.seed"]: r for r in map(json.loads, (out / "records.jsonl").read_text().splitlines())}
    for fate in (2, 3, 4):
        tails = records[fate]["rank_tails"]
        assert sorted(tails) == ["0", "1"] and all(f"rank {r} up" in tails[r] for r in tails)
    assert "RuntimeError: expert shard 3" in records[2]["rank_tails"]["1"]  # the traceback, in rank 1's own tail
    assert _survivors(out, pids, within_s=5) == []


@pytest.mark.slow
def test_a_continued_store_stops_what_an_earlier_run_left(tmp_path):
    record = json.dumps({"schema_version": 1, "status": "ok", "tokens_per_s": 10.0})
    launcher = lambda point: [sys.executable, "-c", f"print({record!r})"]  # noqa: E731
    suite = parse_suite(_suite([0, 5]))
    store = tmp_path / "s"
    run_suite(suite, store, SweepOptions(progress=False, echo=lambda _: None, launcher=launcher, point_ids={"p000"}))
    # a rank of an earlier run that outlived its sweep: it carries the store's marker
    stray = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True,
                             env={**os.environ, STORE_MARKER_ENV: str(store.resolve())})
    time.sleep(0.2)  # exec'd, so /proc shows its environment
    warnings = []
    run_suite(suite, store, SweepOptions(resume=True, progress=False, echo=lambda _: None, launcher=launcher,
                                         warn=warnings.append))
    assert stray.wait(timeout=10) == -signal.SIGTERM
    assert warnings[0] == (f"1 process(es) of an earlier run of {store} were still running (pid {stray.pid}); "
                           "stopped them before running any point")
    assert load_results(store)[0]["status"].tolist() == ["ok", "ok"]


@pytest.mark.slow
def test_a_closed_stdout_keeps_the_sweep_going(tmp_path):
    """``moebench run ... | head -1``: every point still runs and is recorded, and the exit code is the sweep's."""
    code = textwrap.dedent("""
        import time
        from moebench.sweep import runner
        from moebench.sweep.launch import point_record
        def quick(point, log, **_):
            time.sleep(0.3)  # head has exited by the next point's line
            return point_record(point, "ok", None)
        runner.run_point = quick
        from moebench.cli import main
        main()
    """)
    suite = tmp_path / "s.yaml"
    suite.write_text(yaml.safe_dump({"name": "h", "base": {"preset": "tiny"}, "grid": {"moe.num_experts": [4, 8, 16]}}))
    store = tmp_path / "st"
    argv = shlex.join([sys.executable, "-c", code, "run", str(suite), "--out", str(store)])
    done = subprocess.run(["bash", "-c", f"{argv} | head -2; exit ${{PIPESTATUS[0]}}"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()  # the column header, then p000's line
    assert len(lines) == 2 and lines[0].startswith("run     status") and lines[1].startswith("p000    ok")
    assert "stdout was closed: the sweep goes on" in done.stderr and "Traceback" not in done.stderr
    assert load_results(store)[0]["point_id"].tolist() == ["p000", "p001", "p002"]


def test_the_first_failure_is_the_cause_not_its_consequences(tmp_path):
    from moebench.launch.failure import first_failure, rank_error_file, rank_log

    def raised(rank: int, error: str, time_ns: int) -> None:
        rank_error_file(tmp_path, rank).write_text(json.dumps({"error": error, "time_ns": time_ns}))

    raised(0, "RuntimeError: Connection closed by peer", 2)
    raised(1, "ValueError: bad shard", 1)
    assert first_failure(tmp_path, {0: 1, 1: 1})["error"] == "rank 1: ValueError: bad shard"
    # a rank killed from outside comes before the errors of the peers it left waiting
    killed = first_failure(tmp_path, {0: 1, 1: 1, 2: -signal.SIGKILL}, oom_kills=1)
    assert killed["rank"] == 2 and killed["oom"] and "1 OOM kill(s) in the memory cgroup" in killed["error"]
    # torchrun's own SIGTERM to the other ranks is never the cause while anything else failed
    rank_log(tmp_path, 3).write_text("step 1\nerror: moe.top_k=9 exceeds moe.num_experts=8\n")
    stopped = first_failure(tmp_path, {3: 2, 4: -signal.SIGTERM})
    assert stopped == {"rank": 3, "error": "rank 3: error: moe.top_k=9 exceeds moe.num_experts=8", "exitcode": 2,
                       "signal": None, "oom": False}
    assert first_failure(tmp_path, {4: -signal.SIGTERM})["error"] == "rank 4: killed by SIGTERM"


def test_a_moebench_folder_in_the_working_directory_does_not_shadow_the_package(tmp_path):
    """Points, ranks and srun steps start ``python -m moebench...`` in the user's folder; one that holds a
    ``moebench`` folder (a checkout's parent) made an editable install import that folder as a namespace
    package, and every point failed at import. ``SAFE_PATH_ENV`` keeps the folder off the import path,
    and every launcher passes it on."""
    import os
    import subprocess
    import sys

    from moebench.launch.procs import SAFE_PATH_ENV
    from moebench.results.store import Store
    from moebench.sweep.against import side_env
    from moebench.sweep.launch import point_env

    (tmp_path / "moebench").mkdir()
    (tmp_path / "moebench" / "notes.txt").write_text("not the package\n")
    probe = "import sys, moebench; sys.exit(0 if moebench.__file__ else 3)"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    safe = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env={**env, **SAFE_PATH_ENV})
    assert safe.returncode == 0
    assert SAFE_PATH_ENV.items() <= point_env(Store(tmp_path / "store")).items()
    assert SAFE_PATH_ENV.items() <= side_env(tmp_path).items()
